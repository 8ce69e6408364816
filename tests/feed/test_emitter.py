"""The emitter end to end in-process: each source kind against a plain model of the truth."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from feed.demo.data import ACCOUNTS_SCHEMA, generate_bank
from feed.emit.emitter import Emitter, EmitterConfig
from feed.log.checkpoint import CheckpointStore
from feed.log.reader import FeedReader
from feed.log.store import FeedLog
from protocol import CommitConflict, SourceError, check_messages

from ..e2e.helpers import write_parts
from .model import as_multiset, collection_of, debezium_truth, run_emitter


def emit(spark, tmp_path, src, **kw) -> Emitter:
    e, _ = run_emitter(
        spark,
        source_kind=kw.pop("kind", "debezium"),
        source_path=str(src),
        feed=kw.pop("feed", "bank"),
        log=str(tmp_path / "log"),
        **kw,
    )
    e.close()
    return e


def bank_config(tmp_path, src, **kw) -> EmitterConfig:
    """The keyed Debezium feed ``bank`` of the generated bank, as the tests here emit it."""
    return EmitterConfig(
        source_kind="debezium",
        source_path=str(src),
        feed="bank",
        log=str(tmp_path / "log"),
        key=("id",),
        schema=ACCOUNTS_SCHEMA,
        **kw,
    )


def assert_valid(tmp_path, feed="bank", key=("id",)):
    reader = FeedReader(str(tmp_path / "log"), feed)
    assert check_messages(reader.messages(), non_negative=bool(key), key=list(key) or None) == []
    return reader


def test_debezium_keyed_batch_equals_the_final_table(spark, tmp_path):
    bank = generate_bank(transactions=60, seed=1)
    write_parts(tmp_path / "in", bank.events, 3)
    e = emit(spark, tmp_path, tmp_path / "in", key=("id",), clock="logical")
    reader = assert_valid(tmp_path)
    assert collection_of(reader) == as_multiset(bank.final.values())
    # the input position is a high-water file name, not a list of every file
    assert (e.cp.source["file"], e.cp.source["file_beyond"]) == ("part-0002.json", [])


def test_transaction_granularity_gives_each_source_transaction_its_own_time(spark, tmp_path):
    bank = generate_bank(transactions=25, seed=2)
    write_parts(tmp_path / "in", bank.events, 2)
    emit(spark, tmp_path, tmp_path / "in", key=("id",), clock="logical", granularity="transaction")
    reader = assert_valid(tmp_path)
    _, states = debezium_truth(bank.events)
    assert reader.frontier == 1 + len(states) + 0  # times 1..n, frontier n+1
    for i, state in enumerate(states):
        assert collection_of(reader, at=1 + i) == as_multiset(state.values()), f"after txn {i}"


def test_unkeyed_feed_trusts_full_before_images(spark, tmp_path):
    bank = generate_bank(transactions=40, seed=3)
    write_parts(tmp_path / "in", bank.events, 1)
    emit(spark, tmp_path, tmp_path / "in", clock="logical")
    reader = assert_valid(tmp_path, key=())
    assert collection_of(reader) == as_multiset(bank.final.values())


def test_incremental_runs_skip_consumed_files_and_redelivered_events(spark, tmp_path):
    bank = generate_bank(transactions=50, seed=4)
    half = len(bank.events) // 2
    src = tmp_path / "in"
    write_parts(src, bank.events[:half], 1)
    emit(spark, tmp_path, src, key=("id",))
    # the connector restarts and redelivers the last 10 events before going on
    (src / "part-0001.json").write_bytes(b"".join(x + b"\n" for x in bank.events[half - 10 :]))
    e = emit(spark, tmp_path, src, key=("id",))
    reader = assert_valid(tmp_path)
    assert collection_of(reader) == as_multiset(bank.final.values())
    assert e.cp.epoch == 2
    # a third run with nothing new commits nothing new and changes nothing
    before = collection_of(reader)
    e3 = emit(spark, tmp_path, src, key=("id",))
    assert e3.cp.progress == e.cp.progress
    assert collection_of(FeedReader(str(tmp_path / "log"), "bank")) == before


def test_wallclock_times_are_near_now_and_grow(spark, tmp_path):
    import time

    bank = generate_bank(transactions=10, seed=5)
    src = tmp_path / "in"
    write_parts(src, bank.events[:10], 1)
    before = time.time_ns() // 1_000_000
    e1 = emit(spark, tmp_path, src, key=("id",))
    write_parts(tmp_path / "in2", bank.events[10:], 1)
    (src / "part-0001.json").write_bytes((tmp_path / "in2" / "part-0000.json").read_bytes())
    e2 = emit(spark, tmp_path, src, key=("id",))
    t1 = [t for t, _ in e1.cp.progress.counts]
    t2 = [t for t, _ in e2.cp.progress.counts]
    assert t1 and t2 and before <= t1[0] < t2[0] <= time.time_ns() // 1_000_000
    assert_valid(tmp_path)


def test_a_wall_clock_stepping_backwards_never_moves_times_back(spark, tmp_path):
    """NTP steps the clock back an hour between transactions (and across a restart): the
    times keep growing (next = max(now, last + 1)) and the feed stays valid."""
    bank = generate_bank(transactions=12, seed=9)
    src = tmp_path / "in"
    parts = write_parts(tmp_path / "staged", bank.events, 3)
    src.mkdir()
    readings = iter([5_000_000, 5_000_010, 1_400_000, 1_400_005, 1_400_009, 900_000, 900_001])
    clock = lambda: next(readings, 900_002)  # noqa: E731
    cfg = bank_config(tmp_path, src)
    uppers = []
    for p in parts:  # a new process for each file, each with a clock further back
        p.rename(src / p.name)
        e = Emitter(cfg, spark=spark, clock=clock)
        e.open()
        e.run()
        e.close()
        uppers.append(e.cp.frontier)
    times = sorted(FeedReader(str(tmp_path / "log"), "bank").counts())
    # three times, none below the first reading (the clock went back to 1.4M and 0.9M)
    assert len(times) == 3 and min(times) == 5_000_000
    assert uppers[0] < uppers[1] < uppers[2] and uppers[2] > times[-1]
    assert collection_of(assert_valid(tmp_path)) == as_multiset(bank.final.values())


BAD_LINES = [
    b"{not json",
    b'{"op": "x", "after": {"id": 1, "owner": "a", "balance": 1}, "source": {"lsn": 1}}',
    b'{"op": "c", "after": {"id": "one", "owner": "a", "balance": 1}, "source": {"lsn": 2}}',
    b'{"op": "c", "after": {"owner": "a", "balance": 1}, "source": {"lsn": 3, "txId": 1}}',
    b'{"op": "d", "before": {"id": 999999, "owner": "a", "balance": 1}, '
    b'"source": {"lsn": 4, "txId": 1}}',
    b'{"op": "t", "source": {"lsn": 5, "txId": 1}}',
]
REASONS = [
    "malformed JSON",
    "unknown op 'x'",
    "type mismatch in after.id",
    "missing key column(s) id",
    'delete of key {"id":999999} that is not present',
    "truncate events are not supported",
]


def test_bad_rows_are_quarantined_with_reasons_and_the_rest_goes_on(spark, tmp_path):
    bank = generate_bank(transactions=30, seed=6)
    src = tmp_path / "in"
    write_parts(src, bank.events, 1)
    (src / "part-0001.json").write_bytes(b"\n".join(BAD_LINES) + b"\n")
    schema = ACCOUNTS_SCHEMA
    emit(spark, tmp_path, src, key=("id",), schema=schema)
    reader = assert_valid(tmp_path)
    assert collection_of(reader) == as_multiset(bank.final.values())
    q = FeedLog(str(tmp_path / "log"), "bank").path("quarantine")
    rows = [
        orjson.loads(line) for f in Path(q).rglob("*.json") for line in f.read_bytes().splitlines()
    ]
    assert sorted(r["raw"] for r in rows) == sorted(x.decode() for x in BAD_LINES)
    reasons = sorted(r["reason"] for r in rows)
    for want in REASONS:
        assert any(want in r for r in reasons), (want, reasons)
    assert all(r["file"].endswith("part-0001.json") for r in rows)


def test_fail_mode_commits_nothing(spark, tmp_path):
    bank = generate_bank(transactions=10, seed=7)
    src = tmp_path / "in"
    write_parts(src, bank.events, 1)
    (src / "part-0001.json").write_bytes(BAD_LINES[1] + b"\n")
    cfg = bank_config(tmp_path, src, on_bad_record="fail")
    e = Emitter(cfg, spark=spark)
    claimed = e.open()
    with pytest.raises(SourceError, match=r"1 bad input row\(s\), e.g. part-0001.json: unknown op"):
        e.run()
    store = CheckpointStore(e.feedlog)
    assert store.latest() == claimed  # no commit after the epoch claim
    assert e.feedlog.time_dirs() == []
    assert FeedLog(str(tmp_path / "log"), "bank").numbered_dirs("quarantine") == []


def test_a_first_run_whose_every_row_is_bad_fixes_nothing(spark, tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    (src / "part-0000.json").write_bytes(b"\n".join(BAD_LINES) + b"\n")
    log = FeedLog(str(tmp_path / "log"), "bank")
    cfg = bank_config(tmp_path, src, clock="logical")
    e = Emitter(cfg, spark=spark)
    e.open()
    with pytest.raises(SourceError, match=r"every one of the 6 input row\(s\) is bad, e.g. "):
        e.run()
    # no settings, no consumed file, no time, no quarantine
    assert log.info() is None
    cp = CheckpointStore(log).latest()
    assert cp.frontier == 0 and cp.source.get("file") is None
    assert log.time_dirs() == [] and log.numbered_dirs("quarantine") == []
    # the right input and other settings: this run decides them (wallclock, its own schema)
    bank = generate_bank(transactions=12, seed=8)
    (src / "part-0000.json").unlink()
    write_parts(src, bank.events, 1, start=1)
    emit(spark, tmp_path, src, key=("id",), clock="wallclock")
    assert log.info().clock == "wallclock"
    assert collection_of(assert_valid(tmp_path)) == as_multiset(bank.final.values())


def test_weighted_source(spark, tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    rows = [
        {"record": {"sku": "a", "qty": 1}, "delta": 2},
        {"record": {"sku": "b", "qty": 1}, "delta": 1},
        {"record": {"sku": "a", "qty": 1}, "delta": -2},
        {"record": {"sku": "c", "qty": None}, "delta": -1},
        {"record": {"sku": "b", "qty": 1}, "delta": 3},
    ]
    (src / "w.json").write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n{bad\n")
    emit(spark, tmp_path, src, kind="weighted", feed="stock")
    reader = FeedReader(str(tmp_path / "log"), "stock")
    assert check_messages(reader.messages()) == []
    snap = {(r["sku"], r["qty"]): r["count"] for r in reader.snapshot().to_pylist()}
    assert snap == {("b", 1): 4, ("c", None): -1}


def test_a_second_emitter_fences_out_the_first(spark, tmp_path):
    bank = generate_bank(transactions=20, seed=8)
    src = tmp_path / "in"
    write_parts(src, bank.events[:20], 1)
    cfg = EmitterConfig(
        source_kind="debezium",
        source_path=str(src),
        feed="bank",
        log=str(tmp_path / "log"),
        key=("id",),
    )
    first = Emitter(cfg, spark=spark)
    first.open()
    second = Emitter(cfg, spark=spark)
    second.open()  # claims a newer epoch
    with pytest.raises(CommitConflict, match=r"another emitter .* has taken over"):
        first.run()
    second.run()
    reader = assert_valid(tmp_path)
    truth, _ = debezium_truth(bank.events[:20])
    assert collection_of(reader) == as_multiset(truth.values())
    # the stale writer's files for its time were never installed under the new epoch
    assert reader.checkpoint.epoch == 2


def test_bad_feed_names_and_reserved_columns_are_refused(spark, tmp_path):
    with pytest.raises(Exception, match="invalid feed name"):
        FeedLog(str(tmp_path), "../etc")
    src = tmp_path / "in"
    src.mkdir()
    (src / "w.json").write_bytes(b'{"record": {"time": 1}, "delta": 1}\n')
    with pytest.raises(SourceError, match="clash"):
        emit(spark, tmp_path, src, kind="weighted", feed="w")


def test_a_source_transaction_split_across_files_stays_one_time(spark, tmp_path):
    bank = generate_bank(transactions=30, seed=12)
    lines = bank.events
    # find a transaction with several events and cut the files in its middle
    txids = [orjson.loads(x).get("payload", orjson.loads(x))["source"]["txId"] for x in lines]
    cut = next(i for i in range(1, len(lines)) if txids[i] == txids[i - 1])
    src = tmp_path / "in"
    src.mkdir()
    (src / "part-0000.json").write_bytes(b"".join(x + b"\n" for x in lines[:cut]))
    (src / "part-0001.json").write_bytes(b"".join(x + b"\n" for x in lines[cut:]))
    emit(
        spark,
        tmp_path,
        src,
        key=("id",),
        clock="logical",
        granularity="transaction",
        max_files_per_txn=1,
    )
    reader = assert_valid(tmp_path)
    _, states = debezium_truth(lines)
    assert reader.frontier == 1 + len(states)
    for i, state in enumerate(states):
        assert collection_of(reader, at=1 + i) == as_multiset(state.values()), i


def test_a_later_run_takes_the_feeds_settings_or_is_refused(spark, tmp_path):
    bank = generate_bank(transactions=40, seed=13)
    half = len(bank.events) // 2
    src = tmp_path / "in"
    write_parts(src, bank.events[:half], 1)
    first = emit(spark, tmp_path, src, key=("id",), clock="logical", granularity="transaction")
    info = FeedLog(str(tmp_path / "log"), "bank").info()
    assert (info.source, info.key, info.clock, info.granularity) == (
        "debezium",
        ("id",),
        "logical",
        "transaction",
    )
    # flags left out: the feed's values (logical times go on from where they were)
    write_parts(src, bank.events[half:], 1, start=1)
    second = emit(spark, tmp_path, src)
    assert (second.config.clock, second.config.granularity, second.config.key) == (
        "logical",
        "transaction",
        ("id",),
    )
    assert second.cp.frontier < 1_000 and second.cp.frontier > first.cp.frontier
    assert collection_of(assert_valid(tmp_path)) == as_multiset(bank.final.values())
    store = CheckpointStore(FeedLog(str(tmp_path / "log"), "bank"))
    before = store.latest()
    # a flag that differs is refused before anything is read or committed
    for kw, flag in [
        ({"clock": "wallclock"}, "--clock logical"),
        ({"granularity": "batch"}, "--granularity transaction"),
        ({"key": ("owner",)}, "--key id"),
        ({"kind": "upsert", "order": "id"}, "--source KIND debezium"),
    ]:
        with pytest.raises(SourceError, match=f"created with {flag}; this run gives"):
            emit(spark, tmp_path, src, **kw)
        assert store.latest() == before


def test_each_transaction_reports_its_stages_in_order(spark, tmp_path):
    import io

    from feed.emit.progress import STAGES, TxnProgress

    class Recorded(TxnProgress):
        def __init__(self) -> None:
            super().__init__("bank", live=False)
            self.seen: list[tuple[int, str, dict]] = []

        def stage(self, name, **facts):
            super().stage(name, **facts)
            self.seen.append((self.seq, name, dict(self.facts)))

    bank = generate_bank(transactions=20, seed=12)
    src = tmp_path / "in"
    write_parts(src, bank.events, 2)
    progress = Recorded()
    cfg = bank_config(tmp_path, src, max_files_per_txn=1)
    e = Emitter(cfg, spark=spark, progress=progress)
    e.open()
    reports = e.run()
    assert len(reports) == 2
    for report in reports:
        stages = [(name, facts) for seq, name, facts in progress.seen if seq == report.seq]
        assert [name for name, _ in stages] == list(STAGES)
        assert stages[-1][1]["rows_read"] == report.input_rows
        assert stages[-1][1]["updates"] == report.updates
    # on a terminal the same line is drawn live (and removed when the transaction ends)
    screen = io.StringIO()
    live = TxnProgress("bank", live=True, stream=screen)
    live.start(7, files=3)
    live.stage("computing diffs", rows_read=12_345)
    assert live.line().startswith("txn 7: computing diffs… 3 files, 12,345 rows read, ")
    live.done()
    import re

    drawn = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())
    assert "bank txn 7: computing diffs… 3 files, 12,345 rows read" in drawn
    assert screen.getvalue().endswith("\x1b[2K")  # the line is erased when the transaction ends
