"""Crash safety with real processes: SIGKILL the emitter at each step of a transaction.

After a restart the feed must pass the checker, equal the truth, and be byte-for-byte the
feed a clean run makes (logical clock: the redo reuses the same times, no time is committed
twice).
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest

from feed.checkpoint import CheckpointStore
from feed.demo_data import ACCOUNTS_SCHEMA, generate_bank
from feed.log import FeedLog
from feed.reader import FeedReader
from protocol import check_messages, get_codec

from ..feed.model import as_multiset, collection_of
from .helpers import start, tidefeed, write_parts_at_transactions

pytestmark = pytest.mark.slow

BANK = generate_bank(transactions=45, seed=11)


def emit_args(src: Path, log: Path, *extra: str) -> list[str]:
    return [
        "emit",
        "--source",
        f"debezium:{src}",
        "--feed",
        "bank",
        "--log",
        str(log),
        "--key",
        "id",
        "--clock",
        "logical",
        "--granularity",
        "transaction",
        "--max-files-per-txn",
        "1",
        "--schema",
        str(src.parent / "accounts.avsc"),
        *extra,
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The feed a clean run makes, as NDJSON."""
    base = tmp_path_factory.mktemp("ref")
    src = base / "in"
    write_parts_at_transactions(src, BANK.events, 3)
    (base / "accounts.avsc").write_bytes(get_codec("ndjson").encode([]) or b"")
    import orjson

    (base / "accounts.avsc").write_bytes(orjson.dumps(ACCOUNTS_SCHEMA))
    out = tidefeed(*emit_args(src, base / "log"))
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    inspected = tidefeed(
        "inspect", "--log", str(base / "log"), "--feed", "bank", "--format", "ndjson"
    )
    assert inspected.returncode == 0, inspected.stderr
    return inspected.stdout


def verify(log: Path, reference: bytes) -> None:
    inspected = tidefeed("inspect", "--log", str(log), "--feed", "bank", "--format", "ndjson")
    assert inspected.returncode == 0, inspected.stderr
    checked = tidefeed("check", "--key", "id", "-", stdin=inspected.stdout)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert inspected.stdout == reference
    reader = FeedReader(str(log), "bank")
    assert collection_of(reader) == as_multiset(BANK.final.values())


@pytest.mark.parametrize("kill_at", ["after_read:2", "after_write:2", "after_commit:2"])
def test_sigkill_at_each_step_then_restart(tmp_path, reference, kill_at):
    import orjson

    src = tmp_path / "in"
    assert len(write_parts_at_transactions(src, BANK.events, 3)) == 3
    (tmp_path / "accounts.avsc").write_bytes(orjson.dumps(ACCOUNTS_SCHEMA))
    log = tmp_path / "log"
    crashed = tidefeed(*emit_args(src, log), env={"TIDEFEED_TEST_KILL_AT": kill_at})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr.decode()[-2000:]
    store = CheckpointStore(FeedLog(str(log), "bank"))
    before = store.latest()
    assert before is not None
    again = tidefeed(*emit_args(src, log))
    assert again.returncode == 0, again.stderr.decode()[-3000:]
    after = store.latest()
    assert after.epoch == before.epoch + 1
    if kill_at.startswith(("after_read", "after_write")):
        # the killed transaction had not committed: its times were rolled back and redone
        assert b"rolled back uncommitted times" in again.stderr or kill_at.startswith("after_read")
    verify(log, reference)


def test_random_sigkills_in_follow_mode(tmp_path, reference):
    import orjson

    rnd = random.Random(5)
    src = tmp_path / "in"
    src.mkdir()
    (tmp_path / "accounts.avsc").write_bytes(orjson.dumps(ACCOUNTS_SCHEMA))
    log = tmp_path / "log"
    # the same three transaction-aligned files as the reference, arriving one by one
    staged = write_parts_at_transactions(tmp_path / "staged", BANK.events, 3)
    args = emit_args(src, log, "--follow", "--trigger", "0.2")
    proc = start(*args, log=tmp_path / "emit.log")
    kills = 0
    try:
        for part in staged:
            part.rename(src / part.name)
            time.sleep(rnd.uniform(2.0, 8.0))
            if kills < 2:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=60)
                kills += 1
                proc = start(*args, log=tmp_path / "emit.log")
        store = CheckpointStore(FeedLog(str(log), "bank"))
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            cp = store.latest()
            if cp is not None and len(cp.source.get("files", [])) == 3:
                break
            time.sleep(0.5)
        else:
            pytest.fail(
                "the follower did not consume every file:\n"
                + (tmp_path / "emit.log").read_text()[-3000:]
            )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, (tmp_path / "emit.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert kills == 2
    verify(log, reference)
    reader = FeedReader(str(log), "bank")
    assert check_messages(reader.messages(), key=["id"]) == []
