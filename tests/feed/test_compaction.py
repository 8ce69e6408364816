"""Compaction and retention (DESIGN §8): what stays readable, 410s, ACK guards, crashes."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter

import aiohttp
import orjson
import pytest

from feed.demo.data import ACCOUNTS_SCHEMA, generate_bank
from feed.log.compaction import compact, retention_target
from feed.log.reader import FeedReader
from feed.log.subscriptions import PushHold, Subscription, SubscriptionStore
from feed.serve.server import ServerConfig, make_server_app
from protocol import (
    CheckpointError,
    CommitConflict,
    Compacted,
    Updates,
    check_messages,
    get_codec,
    record_key,
)
from protocol.receiver import ReceiverConfig, make_receiver_app

from .model import DDReader, as_multiset, collection_of, debezium_truth, run_emitter
from .test_server import accumulate, serve

BANK = generate_bank(transactions=30, seed=77)
TRUTH, _ = debezium_truth(BANK.events)


@pytest.fixture(scope="module")
def bank_log(spark, tmp_path_factory):
    """A committed feed with one time per source transaction (logical clock)."""
    root = tmp_path_factory.mktemp("compaction")
    src = root / "in"
    src.mkdir()
    (src / "part-0000.json").write_bytes(b"".join(x + b"\n" for x in BANK.events))
    run_emitter(
        spark,
        source_kind="debezium",
        source_path=str(src),
        feed="bank",
        log=str(root / "log"),
        key=("id",),
        schema=ACCOUNTS_SCHEMA,
        clock="logical",
        granularity="transaction",
    )
    return root / "log"


@pytest.fixture
def log_copy(bank_log, tmp_path):
    """A private copy of the committed feed, to compact."""
    dst = tmp_path / "log"
    shutil.copytree(bank_log, dst)
    return dst


def rows_of(messages):
    return [m.rows() if isinstance(m, Updates) else m for m in messages]


def truth_multiset() -> Counter:
    return as_multiset(TRUTH.values())


def test_compaction_keeps_every_later_snapshot_and_resume_point(log_copy):
    before = FeedReader(str(log_copy), "bank")
    times = before.times()
    assert len(times) > 10
    cut = times[len(times) // 2]
    kept = [t for t in range(cut, before.frontier)]
    snapshots = {t: collection_of(before, t) for t in kept[:: max(1, len(kept) // 6)]}
    resumes = {t: rows_of(before.messages(after=t)) for t in (cut, cut + 1, times[-1])}

    res = compact(str(log_copy), "bank", cut)

    after = FeedReader(str(log_copy), "bank")
    assert (res.since_before, res.since, after.since) == (0, cut, cut)
    assert after.log.time_dirs() == [t for t in times if t >= cut]  # older segments gone
    assert after.frontier == before.frontier
    for t, expected in snapshots.items():
        assert collection_of(after, t) == expected
    for t, expected in resumes.items():
        assert rows_of(after.messages(after=t)) == expected
    with pytest.raises(Compacted) as e:
        list(after.messages(after=cut - 1))
    assert e.value.since == cut
    with pytest.raises(CheckpointError, match="not a kept complete time"):
        after.snapshot(cut - 1)
    # a new consumer starts with the collection at since, then the tail: a valid feed
    fresh = list(after.messages())
    assert check_messages(fresh, key=["id"]) == []
    assert accumulate(fresh) == truth_multiset()


def test_compacting_twice_folds_the_old_snapshot_in(log_copy):
    r = FeedReader(str(log_copy), "bank")
    times = r.times()
    final = collection_of(r)
    compact(str(log_copy), "bank", times[3])
    res = compact(str(log_copy), "bank", times[-2])
    r = FeedReader(str(log_copy), "bank")
    assert r.since == times[-2] and r.log.numbered_dirs("compacted") == [times[-2]]
    assert collection_of(r) == final == truth_multiset()
    assert "compacted" in res.summary()
    # the same point again does nothing; below it or at the frontier is refused
    assert "nothing to do" in compact(str(log_copy), "bank", times[-2]).summary()
    with pytest.raises(CheckpointError, match="already compacted"):
        compact(str(log_copy), "bank", times[1])
    with pytest.raises(CheckpointError, match="not complete"):
        compact(str(log_copy), "bank", r.frontier)


def test_compaction_never_passes_a_subscription_ack(log_copy):
    r = FeedReader(str(log_copy), "bank")
    times = r.times()
    store = SubscriptionStore(r.log)
    store.put(Subscription(name="slow", feed="bank", url="http://127.0.0.1:9/x", acked=times[4]))
    store.put(Subscription(name="quick", feed="bank", acked=times[-1]))
    before = r.log.time_dirs()
    with pytest.raises(CheckpointError, match=rf"slow \(acked {times[4]}\)"):
        compact(str(log_copy), "bank", times[5])
    # refused: nothing changed
    r = FeedReader(str(log_copy), "bank")
    assert r.since == 0 and r.log.time_dirs() == before and not r.log.numbered_dirs("compacted")
    assert compact(str(log_copy), "bank", times[4]).since == times[4]


def test_an_emitter_start_racing_a_compaction_claims_on_top_of_it(log_copy):
    """An emitter reads the latest commit; a compaction (the server's ``--retain``, say)
    commits the next seq; then the emitter claims its epoch. It claims on top of the
    compaction, keeping its ``since``, instead of failing to start; the feed reads whole.
    A claim over another emitter's epoch is still refused: that start is stale."""
    import logging

    from feed.log.commits import Committer
    from feed.log.store import FeedLog
    from feed.sources.rows import spark_record_type
    from feed.txn.state import BucketedState

    flog = FeedLog(str(log_copy), "bank")
    committer = Committer(flog, feed="bank", logger=logging.getLogger("test"))
    read = committer.store.latest()
    before = FeedReader(str(log_copy), "bank")
    to = before.frontier - 3
    compact(str(log_copy), "bank", to)
    record = spark_record_type(ACCOUNTS_SCHEMA)
    state = BucketedState(lambda: None, flog, record, ("id",), str)
    claimed, gone = committer.claim(read, state)
    assert (claimed.seq, claimed.epoch, claimed.since) == (read.seq + 2, read.epoch + 1, to)
    assert gone == []
    after = FeedReader(str(log_copy), "bank")
    assert (after.since, after.frontier) == (to, before.frontier)
    assert collection_of(after) == truth_multiset()
    assert check_messages(after.messages(), key=["id"]) == []
    with pytest.raises(CommitConflict):
        committer.claim(read, state)
    assert committer.store.latest() == claimed


def test_quarantined_rows_of_a_commit_that_lost_its_seq_to_a_compaction_stay_exact(log_copy):
    """A transaction quarantines its bad rows under the seq it means to commit at. When a
    compaction commits that seq first, the transaction commits at the next one and its
    rows move with it; when it dies instead, the next start deletes its rows (the
    compaction's seq never has any), where they were kept and then quarantined again by
    the redo. Rows of committed transactions stay."""
    import logging

    from feed.log.commits import Committer
    from feed.log.store import FeedLog
    from feed.sources.rows import spark_record_type
    from feed.txn.state import BucketedState

    flog = FeedLog(str(log_copy), "bank")
    committer = Committer(flog, feed="bank", logger=logging.getLogger("test"))
    state = BucketedState(lambda: None, flog, spark_record_type(ACCOUNTS_SCHEMA), ("id",), str)

    def quarantine(seq: int) -> None:
        flog.write_bytes(flog.path("quarantine", str(seq), "part-00000.json"), b"{}\n")

    def held() -> list[int]:
        return flog.numbered_dirs("quarantine")

    base = committer.store.latest()
    quarantine(base.seq)  # a committed transaction's rows
    quarantine(base.seq + 1)  # this transaction's, before its commit
    frontier = FeedReader(str(log_copy), "bank").frontier
    compact(str(log_copy), "bank", frontier - 6)  # takes seq + 1
    done = committer.commit(base, lambda b: b.successor(), [])
    assert done.seq == base.seq + 2
    assert held() == [base.seq, base.seq + 2]  # moved with the commit
    # a transaction dies after quarantining; a compaction takes its seq; the next start
    quarantine(done.seq + 1)
    compact(str(log_copy), "bank", frontier - 3)
    read = committer.store.latest()
    assert read.seq == done.seq + 1
    committer.claim(read, state)
    assert held() == [base.seq, base.seq + 2]
    assert collection_of(FeedReader(str(log_copy), "bank")) == truth_multiset()


def test_retention_target():
    assert retention_target(frontier=100, since=0, retain=10, lowest_ack=None) == 89
    assert retention_target(frontier=100, since=0, retain=10, lowest_ack=50) == 50
    assert retention_target(frontier=100, since=89, retain=10, lowest_ack=None) is None
    assert retention_target(frontier=5, since=0, retain=10, lowest_ack=None) is None


@pytest.mark.parametrize("step", ["compact_before_commit", "compact_after_commit"])
def test_compaction_killed_by_sigkill_leaves_a_consistent_feed(log_copy, step):
    r = FeedReader(str(log_copy), "bank")
    times = r.times()
    cut = times[len(times) // 2]
    expected_tail = rows_of(r.messages(after=cut))
    final = collection_of(r)
    cmd = [sys.executable, "-m", "feed.cli.main", "compact", "--log", str(log_copy)]
    cmd += ["--feed", "bank", "--to", str(cut)]
    env = {**os.environ, "TIDEFEED_TEST_KILL_AT": step}
    p = subprocess.run(cmd, env=env, capture_output=True, timeout=120)
    assert p.returncode == -signal.SIGKILL
    r = FeedReader(str(log_copy), "bank")
    # before the commit: as if nothing happened; after it: compacted, old segments ignored
    assert r.since == (0 if step == "compact_before_commit" else cut)
    assert rows_of(r.messages(after=cut)) == expected_tail
    assert collection_of(r) == final
    assert accumulate(r.messages()) == truth_multiset()
    # run again without the fault: it completes and cleans up
    p = subprocess.run(cmd, capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()
    r = FeedReader(str(log_copy), "bank")
    assert r.since == cut and min(r.log.time_dirs()) == cut
    assert collection_of(r) == final


async def test_server_410_below_since_and_new_consumers_get_the_snapshot(log_copy, tmp_path):
    r = FeedReader(str(log_copy), "bank")
    times = r.times()
    cut = times[len(times) // 2]
    compact(str(log_copy), "bank", cut)
    base, runner = await serve(make_server_app(ServerConfig(log=str(log_copy))))
    rbase, rrunner = await serve(make_receiver_app(ReceiverConfig(db=str(tmp_path / "r.db"))))
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{base}/v1/feeds/bank/changes?after={cut - 1}") as resp:
                assert resp.status == 410
                body = await resp.json()
                assert body["error"] == "compacted" and body["since"] == cut
            async with s.get(f"{base}/v1/feeds/bank/changes?after={cut}") as resp:
                assert resp.status == 200
                got = get_codec("ndjson").decode(await resp.read())
                assert rows_of(got) == rows_of(r.messages(after=cut))
            async with s.get(f"{base}/v1/feeds/bank") as resp:
                assert (await resp.json())["since"] == cut
            for fmt in ("ndjson", "arrow"):
                async with s.get(f"{base}/v1/feeds/bank/changes?format={fmt}") as resp:
                    fresh = get_codec(fmt).decode(await resp.read())
                assert check_messages(fresh, key=["id"]) == []
                assert accumulate(fresh) == truth_multiset()
                dd = DDReader().read(fresh)  # a complete history from time 0
                assert (dd.frontier, dd.collection()) == (r.frontier, truth_multiset())
            # a new receiver subscribes: it gets the snapshot at since, then the tail
            sub = {"url": f"{rbase}/v1/push/bank", "format": "avro"}
            async with s.put(f"{base}/v1/feeds/bank/subscriptions/new", json=sub) as resp:
                assert resp.status in (200, 201)
            for _ in range(200):
                async with s.get(f"{rbase}/v1/push/bank") as resp:
                    if (await resp.json())["frontier"] == r.frontier:
                        break
                await asyncio.sleep(0.05)
            async with s.get(f"{rbase}/v1/collections/bank") as resp:
                rows = [orjson.loads(x) for x in (await resp.read()).splitlines()]
            got = Counter()
            for row in rows:
                got[record_key(row["data"])] += row["count"]
            assert got == truth_multiset()
    finally:
        await runner.cleanup()
        await rrunner.cleanup()


async def retain_until_compacted(log, feed: str, then: float = 0.0) -> None:
    """Serve ``log`` with ``--retain 1`` until ``feed`` is compacted (10 s at most), and
    ``then`` seconds more."""
    config = ServerConfig(log=str(log), retain=1, compact_seconds=0.05)
    _, runner = await serve(make_server_app(config))
    try:
        for _ in range(200):
            if FeedReader(str(log), feed).since:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(then)
    finally:
        await runner.cleanup()


async def test_serve_retain_compacts_automatically_up_to_the_lowest_ack(log_copy):
    r = FeedReader(str(log_copy), "bank")
    times = r.times()
    store = SubscriptionStore(r.log)
    store.put(Subscription(name="puller", feed="bank", acked=times[-3]))
    await retain_until_compacted(log_copy, "bank")
    r = FeedReader(str(log_copy), "bank")
    assert r.since == min(r.frontier - 2, times[-3]) == times[-3]
    assert collection_of(r) == truth_multiset()


async def test_serve_retain_goes_on_with_the_other_feeds_when_one_cannot_be_compacted(
    log_copy, caplog
):
    """One feed of the log has lost a segment file (its times cannot be read): retention
    says so for that feed, leaves it as it was, and compacts the other feed."""
    shutil.copytree(log_copy / "bank", log_copy / "other")
    r = FeedReader(str(log_copy), "bank")
    damaged = sorted((log_copy / "bank" / "times").rglob("*.parquet"))[0]
    damaged.unlink()
    await retain_until_compacted(log_copy, "other", then=0.3)  # more passes over "bank"
    other = FeedReader(str(log_copy), "other")
    assert other.since == other.frontier - 2
    assert collection_of(other) == truth_multiset()
    bank = FeedReader(str(log_copy), "bank")
    assert (bank.since, bank.frontier) == (0, r.frontier)  # left as it was
    assert not (log_copy / "bank" / "compacted").exists()
    warned = [m for m in caplog.messages if m.startswith("retention: feed bank:")]
    assert warned, caplog.messages
    assert not any("retention pass failed" in m for m in caplog.messages)


async def test_serve_retain_keeps_what_the_emitters_push_receiver_has_not_acked(log_copy):
    """The emitter's --push hold is written by the emitter, after the server started: the
    server's retention still stops at its ACK (it reads the ACKs back from the log)."""
    r = FeedReader(str(log_copy), "bank")
    times = r.times()
    SubscriptionStore(r.log).put(Subscription(name="puller", feed="bank", acked=times[1]))
    config = ServerConfig(log=str(log_copy), retain=1, compact_seconds=0.05)
    base, runner = await serve(make_server_app(config))
    try:
        while FeedReader(str(log_copy), "bank").since != times[1]:
            await asyncio.sleep(0.05)
        hold = PushHold(r.log, "http://127.0.0.1:9/v1/push/bank")  # an emitter starts
        hold.ack(times[3])
        hold.flush()
        async with aiohttp.ClientSession() as s:  # the puller moves on, past the hold
            ack = {"frontier": r.frontier - 1}
            async with s.post(f"{base}/v1/feeds/bank/subscriptions/puller/ack", json=ack) as a:
                assert a.status == 200, await a.text()
        for _ in range(400):
            if FeedReader(str(log_copy), "bank").since == times[3]:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # ten more passes
    finally:
        await runner.cleanup()
    r = FeedReader(str(log_copy), "bank")
    assert r.since == times[3]
    assert collection_of(r) == truth_multiset()
    with pytest.raises(CheckpointError, match=r"emit-push \(acked"):
        compact(str(log_copy), "bank", times[4])
    assert FeedReader(str(log_copy), "bank").since == times[3]  # the refusal changed nothing


@pytest.mark.parametrize(
    "damage",
    [b'{"name": "emit-push", "feed": "ba', b"[1, 2]", b'{"name": "../x", "feed": "bank"}'],
    ids=["truncated", "not-an-object", "another-name"],
)
def test_a_damaged_hold_file_is_named_and_nothing_is_compacted_past_it(log_copy, damage):
    """A subscription file that is not one (cut short, edited by hand) stops what reads
    it with one error naming the file: the emitter's --push, compact and the server's
    retention hold everything rather than guess what its receiver has."""
    r = FeedReader(str(log_copy), "bank")
    since = r.since
    hold = PushHold(r.log, "http://127.0.0.1:9/v1/push/bank")
    hold.ack(r.times()[1])
    hold.flush()
    with open(hold.path, "wb") as f:
        f.write(damage)
    for reading in (
        lambda: SubscriptionStore(r.log),
        lambda: PushHold(r.log, "http://127.0.0.1:9/v1/push/bank"),
        lambda: compact(str(log_copy), "bank", r.times()[4]),
    ):
        with pytest.raises(
            CheckpointError, match=r"subscription file .*emit-push\.json is damaged"
        ):
            reading()
    assert FeedReader(str(log_copy), "bank").since == since  # nothing was folded
    with open(hold.path, "rb") as f:
        assert f.read() == damage  # nor the file rewritten


async def test_the_emitters_publisher_waits_out_a_dead_receiver_then_delivers_all(
    log_copy, tmp_path
):
    """emit --push's background publisher (feed/serve/background.py) against a receiver
    that is not there yet: it retries without ever blocking its caller, then delivers the
    whole feed once the receiver listens, and its ACK is the hold on retention."""
    from feed.serve.background import BackgroundPublisher
    from tests.e2e.helpers import free_port

    r = FeedReader(str(log_copy), "bank")
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/push/bank"
    push = BackgroundPublisher(str(log_copy), "bank", url, fmt="arrow", token=None)
    push.start(r.frontier)
    try:
        for _ in range(400):
            if push.hold.sub.retrying_since is not None:
                break
            await asyncio.sleep(0.05)
        assert push.hold.sub.last_error  # it tried, and failed: nothing listens
        assert not await asyncio.to_thread(push.finish, 0.2, lambda: False)
        rbase, rrunner = await serve(
            make_receiver_app(ReceiverConfig(db=str(tmp_path / "r.db"))), port
        )
        try:
            assert await asyncio.to_thread(push.finish, 60, lambda: False)
            async with (
                aiohttp.ClientSession() as s,
                s.get(f"{rbase}/v1/collections/bank") as resp,
            ):
                rows = [orjson.loads(x) for x in (await resp.read()).splitlines()]
        finally:
            await rrunner.cleanup()
    finally:
        await asyncio.to_thread(push.close)
    got: Counter = Counter()
    for row in rows:
        got[record_key(row["data"])] += row["count"]
    assert got == truth_multiset()
    held = SubscriptionStore(r.log).subs["emit-push"]
    assert (held.acked, held.held_by, held.kind) == (r.frontier, url, "emitter push")
    assert "Cannot connect" in held.last_error  # kept for operators after the recovery
    from feed.cli.status import log_status

    (status,) = log_status(str(log_copy))
    assert [(s["name"], s["kind"], s["url"], s["lag_times"]) for s in status["subscriptions"]] == [
        ("emit-push", "emitter push", url, 0)
    ]


def test_cli_compact_reports_and_refuses_with_exit_1(log_copy, capsys):
    from feed.cli.main import main

    r = FeedReader(str(log_copy), "bank")
    args = ["compact", "--log", str(log_copy), "--feed", "bank", "--to"]
    assert main([*args, str(r.frontier)]) == 1
    assert "is not complete" in capsys.readouterr().err
    cut = r.times()[2]
    assert main([*args, str(cut)]) == 0
    assert f"since = {cut}" in capsys.readouterr().err


async def test_a_stream_overtaken_by_compaction_ends_with_a_clear_last_line(log_copy, monkeypatch):
    """A pull stream whose next time is folded away under it never sends an empty or a
    partial time: it ends after its last whole message, NDJSON with a last line that the
    protocol decoder turns into :class:`Compacted`."""
    import threading

    entered, gate = threading.Event(), threading.Event()
    read = FeedReader._batches  # what the committed loop reads a time's files with

    def held_once(self, seg, rows, skip):
        if not entered.is_set():  # the stream's first read waits for the compaction
            entered.set()
            gate.wait(60)
        yield from read(self, seg, rows, skip)

    monkeypatch.setattr(FeedReader, "_batches", held_once)
    times = FeedReader(str(log_copy), "bank").times()
    cut = times[len(times) // 2]
    base, runner = await serve(make_server_app(ServerConfig(log=str(log_copy))))
    try:
        async with aiohttp.ClientSession() as s:
            url = f"{base}/v1/feeds/bank/changes?after={times[0]}&format=ndjson"
            async with s.get(url) as resp:
                body = asyncio.ensure_future(resp.read())
                await asyncio.to_thread(entered.wait, 60)
                await asyncio.to_thread(compact, str(log_copy), "bank", cut)
                gate.set()
                raw = await body
    finally:
        gate.set()
        await runner.cleanup()
    lines = raw.splitlines()
    last = orjson.loads(lines[-1])
    assert (last["error"], last["since"]) == ("compacted", cut)
    assert "resume from a snapshot" in last["detail"]
    with pytest.raises(Compacted) as e:
        get_codec("ndjson").decode(raw)
    assert e.value.since == cut
    sent = get_codec("ndjson").decode(b"\n".join(lines[:-1]))
    assert check_messages(sent, key=["id"]) == []
    assert not [m for m in sent if isinstance(m, Updates)]  # the folded time was not sent
