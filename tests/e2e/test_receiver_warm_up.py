"""``tidefeed receive`` warms up before it listens (protocol/_warm.py): a made-up time is
applied in memory, and nothing of it reaches the database or any feed."""

from __future__ import annotations

import signal
import sqlite3

import pytest

from .helpers import free_port, receiver_frontier, start, wait_up


@pytest.mark.parametrize("flag", ["", "--no-warm-up"])
def test_the_receiver_warms_up_before_listening_and_keeps_nothing_of_it(tmp_path, flag):
    port, db, log = free_port(), tmp_path / "r.db", tmp_path / "r.log"
    args = ["receive", "--db", str(db), "--port", str(port), "--log-level", "debug"]
    proc = start(*args, *([flag] if flag else []), log=log)
    try:
        wait_up(port)
        text = log.read_text()
        warmed = "warmed up: 400000 updates applied" in text
        assert warmed == (not flag), text[-2000:]
        if warmed:  # before the server listened
            assert text.index("warmed up") < text.index("Running on")
        assert receiver_frontier(port) is None
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT count(*) FROM feeds").fetchone() == (0,)
        assert c.execute("SELECT count(*) FROM parts").fetchone() == (0,)
