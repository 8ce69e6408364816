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

from feed.demo.data import ACCOUNTS_SCHEMA, generate_bank
from feed.log.checkpoint import CheckpointStore
from feed.log.reader import FeedReader
from feed.log.store import FeedLog
from protocol import check_messages, get_codec

from ..feed.model import as_multiset, collection_of, with_metadata
from .helpers import bank_emit_args, start, tidefeed, write_parts, write_parts_at_transactions

pytestmark = pytest.mark.slow

BANK = generate_bank(transactions=45, seed=11)


def emit_args(src: Path, log: Path, *extra: str) -> list[str]:
    return bank_emit_args(src, log, "--granularity", "transaction", *extra)


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


#: One feed, one run after another, each SIGKILLed at a step of the 2nd transaction until it
#: commits; then a clean run finishes. ``before_link:<folder>:N`` stops the N-th whole-file
#: publication into that folder after its temporary file is written and fsynced, before it
#: is linked to its name (each run's first commit is its epoch claim).
CHAIN = [
    ("after_write:2", 1),  # 1st transaction committed, the 2nd's segments written
    ("before_link:parts:1", 1),  # its manifest part cut before publication (state written)
    ("before_link:_manifests:1", 1),  # its manifest cut before publication
    ("before_commit:1", 1),  # manifest published, no commit
    ("before_link:_commits:2", 1),  # its commit file cut before publication
    ("after_commit:1", 2),  # committed, killed before anything else
]


def test_a_chain_of_sigkills_at_every_step_then_a_clean_run(tmp_path, reference):
    import orjson

    src = tmp_path / "in"
    assert len(write_parts_at_transactions(src, BANK.events, 3)) == 3
    (tmp_path / "accounts.avsc").write_bytes(orjson.dumps(ACCOUNTS_SCHEMA))
    log = tmp_path / "log"
    store = CheckpointStore(FeedLog(str(log), "bank"))
    epoch = 0
    for kill_at, files_committed in CHAIN:
        crashed = tidefeed(*emit_args(src, log), env={"TIDEFEED_TEST_KILL_AT": kill_at})
        assert crashed.returncode == -signal.SIGKILL, (kill_at, crashed.stderr.decode()[-2000:])
        cp = store.latest()
        assert cp is not None and cp.epoch == epoch + 1
        epoch = cp.epoch
        # what was committed is exactly the files the transactions before the kill read
        assert cp.source["file"] == f"part-{files_committed - 1:04d}.json", kill_at
        reader = FeedReader(str(log), "bank")  # the committed feed reads whole at every stop
        assert check_messages(reader.messages(), key=["id"]) == []
    again = tidefeed(*emit_args(src, log))
    assert again.returncode == 0, again.stderr.decode()[-3000:]
    # the transactions after the first are small and plain: computed on the driver
    # (feed/txn/driver.py), the path the kills above stopped at each step
    assert b" driver=" in again.stderr, again.stderr.decode()[-3000:]
    assert store.latest().epoch == epoch + 1
    verify(log, reference)


def test_sigkills_in_a_feed_of_packs_then_a_clean_run(tmp_path, reference):
    """The packs layout (feed/txn/packs.py) writes no folder per time: a transaction killed
    after its packs are written, or before its commit, leaves packs no commit names; the
    next start deletes them and the feed ends as a clean run's of folders."""
    import orjson

    src = tmp_path / "in"
    write_parts_at_transactions(src, BANK.events, 3)
    (tmp_path / "accounts.avsc").write_bytes(orjson.dumps(ACCOUNTS_SCHEMA))
    log = tmp_path / "log"
    packs = log / "bank" / "packs"
    for kill_at in ("after_write:2", "before_commit:1"):
        args = emit_args(src, log, "--layout", "packs")
        crashed = tidefeed(*args, env={"TIDEFEED_TEST_KILL_AT": kill_at})
        assert crashed.returncode == -signal.SIGKILL, (kill_at, crashed.stderr.decode()[-2000:])
        reader = FeedReader(str(log), "bank")
        assert reader.checkpoint.source["file"] == "part-0000.json", kill_at
        assert {f"packs/{p.name}" for p in packs.iterdir()} > reader.packs()  # uncommitted
    again = tidefeed(*emit_args(src, log))  # (the feed's layout: packs)
    assert again.returncode == 0, again.stderr.decode()[-3000:]
    assert b"rolled back 1 pack(s)" in again.stderr, again.stderr.decode()[-3000:]
    reader = FeedReader(str(log), "bank")
    assert {f"packs/{p.name}" for p in packs.iterdir()} == reader.packs()
    assert not (log / "bank" / "times").exists()
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
            if cp is not None and cp.source.get("file") == "part-0002.json":
                break
            time.sleep(0.5)
        else:
            pytest.fail(
                "the follower did not consume every file:\n"
                + (tmp_path / "emit.log").read_text()[-3000:]
            )
        proc.send_signal(signal.SIGTERM)
        # a clean stop on SIGTERM: 128 + 15
        assert proc.wait(timeout=120) == 143, (tmp_path / "emit.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert kills == 2
    verify(log, reference)
    reader = FeedReader(str(log), "bank")
    assert check_messages(reader.messages(), key=["id"]) == []


def test_a_keyed_one_pass_transaction_sigkilled_after_its_writes_is_redone(tmp_path):
    """Keyed transactions of one time computed by the one-pass engine
    (feed/txn/onepass.py; ``--driver-txn-bytes 0`` keeps them off the driver), over
    input with transaction metadata (its events placed at their END records' commit
    LSNs, the committed position one of those): the 2nd one is killed after its segments
    and state buckets are written, before its commit. The restart redoes it from the
    committed state, and the feed is the table. (Without metadata the engine writes the
    same way.)"""
    import orjson

    bank = generate_bank(transactions=45, seed=11, wrapped_every=0)
    src = tmp_path / "in"
    lines = with_metadata(bank.events)
    ends = [i + 1 for i, line in enumerate(lines) if b'"status":"END"' in line]
    cuts = [0, ends[len(ends) // 3], ends[2 * len(ends) // 3], len(lines)]
    for i in range(3):  # (each file ends at an END record)
        write_parts(src, lines[cuts[i] : cuts[i + 1]], 1, start=i)
    (tmp_path / "accounts.avsc").write_bytes(orjson.dumps(ACCOUNTS_SCHEMA))
    log = tmp_path / "log"
    args = bank_emit_args(src, log, "--granularity", "batch", "--driver-txn-bytes", "0")
    crashed = tidefeed(*args, env={"TIDEFEED_TEST_KILL_AT": "after_write:2"})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr.decode()[-2000:]
    assert crashed.stderr.count(b" one_pass=") == 1, crashed.stderr.decode()[-2000:]
    reader = FeedReader(str(log), "bank")
    assert reader.checkpoint.source["file"] == "part-0000.json"
    assert check_messages(reader.messages(), key=["id"]) == []
    again = tidefeed(*args)
    assert again.returncode == 0, again.stderr.decode()[-3000:]
    assert again.stderr.count(b" one_pass=") == 2, again.stderr.decode()[-3000:]
    reader = FeedReader(str(log), "bank")
    assert check_messages(reader.messages(), key=["id"]) == []
    assert collection_of(reader) == as_multiset(bank.final.values())
