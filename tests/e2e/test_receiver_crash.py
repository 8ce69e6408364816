"""A ``tidefeed receive`` process SIGKILLed while a time's updates are pending: the ones it
wrote ahead of their commit are never counted, and the time resent counts once."""

from __future__ import annotations

import signal
import sqlite3
import time
import urllib.request

import orjson

from .helpers import free_port, start, wait_up


def _post(port: int, *lines: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/push/f",
        data=b"".join(orjson.dumps(x) + b"\n" for x in lines),
        method="POST",
        headers={"Content-Type": "application/x-ndjson", "Tidefeed-Epoch": "1"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return orjson.loads(r.read())


def _updates(ids: range, time_: int) -> dict:
    return {
        "updates": [{"data": {"id": i, "name": f"n{i}"}, "time": time_, "diff": 1} for i in ids]
    }


def _progress(lower: int, upper: int, counts: dict[int, int]) -> dict:
    counts_ = [{"time": t, "count": n} for t, n in counts.items()]
    return {"progress": {"lower": [lower], "upper": [upper], "counts": counts_}}


def _pending_parts(db: str) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return int(
            conn.execute(
                "SELECT count(*) FROM parts WHERE feed = 'f' AND NOT coalesce("
                "time < (SELECT frontier FROM feeds WHERE feed = 'f'), 0)"
            ).fetchone()[0]
        )


def test_updates_written_ahead_by_a_killed_receiver_are_never_counted(tmp_path):
    db = str(tmp_path / "r.db")
    port = free_port()
    receiver = start("receive", "--db", db, "--port", str(port), log=tmp_path / "r.log")
    try:
        wait_up(port)
        _post(port, _progress(0, 0, {}))
        assert _post(port, _updates(range(0, 3), 0), _progress(0, 1, {0: 3}))["frontier"] == 1
        assert _post(port, _updates(range(3, 8), 1))["pending"] == 5
        assert _post(port, _updates(range(8, 10), 1))["pending"] == 7
        deadline = time.monotonic() + 30
        while _pending_parts(db) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # both bodies written ahead of their commit
        assert _pending_parts(db) == 2
        receiver.send_signal(signal.SIGKILL)
        assert receiver.wait(timeout=30) == -signal.SIGKILL
        receiver = start("receive", "--db", db, "--port", str(port), log=tmp_path / "r.log")
        wait_up(port)
        # the next session: announcement, then time 1 again, with other records
        assert _post(port, _progress(1, 1, {}))["pending"] == 0
        assert _post(port, _updates(range(20, 24), 1), _progress(1, 2, {1: 4}))["frontier"] == 2
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/collections/f") as r:
            rows = [orjson.loads(x) for x in r.read().splitlines()]
        got = sorted((row["data"]["id"], row["count"]) for row in rows)
        assert got == [(i, 1) for i in [0, 1, 2, 20, 21, 22, 23]]
        assert _pending_parts(db) == 0
    finally:
        receiver.kill()
        receiver.wait()
