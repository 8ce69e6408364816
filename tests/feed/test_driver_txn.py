"""Small Debezium transactions computed on the driver give the feed Spark gives.

Each case runs one history through the two engines behind feed/txn/engine.py: an emitter
that offers each transaction to the driver engine first (feed/txn/driver.py), as emitters
do, and one that has the Spark engine alone (feed/txn/spark.py);
the feeds must agree time by time (updates, progress), in their keyed state (keyed feeds)
and with the ground truth, and the driver must really have computed some of the transactions.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from feed.demo.data import ACCOUNTS_SCHEMA, generate_bank
from feed.emit.emitter import Emitter, EmitterConfig
from feed.log.reader import FeedReader
from feed.sources.connect import TOAST_PLACEHOLDER
from feed.txn.engine import DECLINED, DRIVER, ENGINES, SPARK, Job, run_job
from protocol.messages import record_key

from ..e2e.helpers import write_parts
from .model import MEASURES, as_multiset, collection_of, with_metadata


def _run(
    spark,
    src: Path,
    log: Path,
    *,
    driver: bool,
    granularity: str,
    schema=ACCOUNTS_SCHEMA,
    key=("id",),
) -> list:
    cfg = EmitterConfig(
        source_kind="debezium",
        source_path=str(src),
        feed="bank",
        log=str(log),
        key=key,
        schema=schema,
        clock="logical",
        granularity=granularity,
        max_files_per_txn=1,
        driver_txn_bytes=1 << 20,
    )
    e = Emitter(cfg, spark=spark, engines=ENGINES if driver else (SPARK,))
    e.open()
    reports = e.run()
    e.close()
    return reports


def _feed(log: Path) -> tuple[int, dict[int, Counter], Counter, set]:
    """The feed's frontier, each time's updates (record, diff), its keyed state's rows and
    the Arrow schemas of its segment and state files."""
    reader = FeedReader(str(log), "bank")
    times = {}
    schemas = set()
    for t in reader.times():
        rows = reader.table(t).to_pylist()
        times[t] = Counter(
            (record_key({k: v for k, v in r.items() if k != "diff"}), r["diff"]) for r in rows
        )
    for f in sorted((log / "bank" / "times").rglob("*.parquet")):
        schemas.add(pq.read_schema(f).remove_metadata())
    state: Counter = Counter()
    if reader.checkpoint.state is None:  # an unkeyed feed
        return reader.frontier, times, state, schemas
    manifest = orjson.loads((log / "bank" / reader.checkpoint.state).read_bytes())
    for folder in manifest["files"].values():
        for f in (log / "bank" / folder).glob("*.parquet"):
            state.update(record_key(r) for r in pq.read_table(f).to_pylist())
            schemas.add(pq.read_schema(f).remove_metadata())
    return reader.frontier, times, state, schemas


def _history(
    src: Path,
    events: list[bytes],
    *,
    redeliver: bool,
    absent_delete: bool,
    metadata: bool,
    cut: bool = False,
    load: int | None = None,
) -> None:
    """A first file with the first ``load`` events (by default a third), then files of a
    few events each; with ``redeliver`` some files start with the tail of the one before (a
    connector restarting), with ``absent_delete`` one file deletes a key the table never
    had; with ``metadata`` the files end at END records, unless ``cut``: then a file may
    end inside a source transaction, which is held back until its END and every event it
    counts are read."""
    load = len(events) // 3 if load is None else load
    write_parts(src, events[:load], 1)
    rest, n, i = events[load:], 1, 0
    while i < len(rest):
        step = 7
        while metadata and not cut and i + step < len(rest) and b'"END"' not in rest[i + step - 1]:
            step += 1  # a file ends with a transaction's END record
        chunk = rest[i : i + step]
        if redeliver and n % 3 == 0:
            chunk = rest[max(0, i - 4) : i] + chunk
        if absent_delete and n == 4:
            gone = {"id": 999_999, "owner": "nobody", "balance": 0, "active": None, "note": None}
            last = orjson.loads(chunk[-1])
            source = last.get("payload", last)["source"]  # in the last event's transaction
            chunk = [
                *chunk,
                orjson.dumps({"before": gone, "after": None, "op": "d", "source": source}),
            ]
        write_parts(src, chunk, 1, start=n)
        i += step
        n += 1


def _with_toast(events: list[bytes]) -> list[bytes]:
    """The events with an unchanged ``note`` of an update sent as Debezium's
    unavailable-value placeholder (a TOASTed column under ``REPLICA IDENTITY DEFAULT``)."""
    out = []
    for line in events:
        e = orjson.loads(line)
        p = e.get("payload", e)
        unchanged = p["op"] == "u" and p["after"]["note"] == p["before"]["note"]
        if unchanged and p["before"]["note"] is not None:
            p["after"]["note"] = TOAST_PLACEHOLDER
            p["before"]["note"] = None  # the old value is not sent either
        out.append(orjson.dumps(e))
    return out


def _snapshot_first(events: list[bytes], *, end: bool, again: int) -> tuple[list[bytes], int]:
    """The first third of the events replaced by Debezium's initial snapshot of the table
    they leave: reads sharing the LSN of the last of them, ``again`` of them delivered
    twice (a connector restarting mid-snapshot), the last one marked ``last`` when ``end``
    (else only the events after it say it was whole). Returns the events and how many
    reads lead them."""
    load = len(events) // 3
    while any(b'"END"' in e for e in events) and b'"END"' not in events[load - 1]:
        load += 1  # (with transaction metadata, the snapshot ends with a transaction)
    table: dict[int, dict] = {}
    source: dict = {}
    for line in events[:load]:
        p = orjson.loads(line)
        p = p.get("payload", p)
        if "status" in p:  # a BEGIN or END record
            continue
        row = p["after"] or p["before"]
        if p["op"] == "d":
            table.pop(row["id"])
        else:
            table[row["id"]] = p["after"]
        source = p["source"]
    reads = []
    for i, row in enumerate(sorted(table.values(), key=lambda r: r["id"])):
        last = i == len(table) - 1
        snap = "first" if i == 0 else "last" if last and end else "true"
        s = {**source, "snapshot": snap, "txId": 1}
        reads.append(orjson.dumps({"before": None, "after": row, "op": "r", "source": s}))
    half = len(reads) // 2
    reads = [*reads[:half], *reads[half - again : half], *reads[half:]]
    return [*reads, *events[load:]], len(reads)


# Each case's reference run in Spark costs 15-45 s here (a Spark transaction of a few
# events takes seconds), so the cases combine what the driver must get right: every
# feature below is in at least one case, with and without a key, per transaction and per
# batch, with and without transaction metadata. A history of 20 source transactions
# gives each case 4-9 files, so 4-9 transactions in each engine, and every feature its
# case names (the test checks that each one happened).
@pytest.mark.parametrize(
    "granularity,redeliver,absent_delete,metadata,toast,snapshot,seed,key",
    [
        ("batch", True, False, False, False, "end", 12, ("id",)),
        ("transaction", True, True, False, True, None, 13, ("id",)),
        ("transaction", True, False, True, False, "end", 14, ("id",)),
        ("transaction", True, False, False, False, "no end", 16, ()),
        ("batch", False, False, "cut", False, None, 17, ()),
    ],
)
def test_the_driver_gives_the_feed_spark_gives(
    spark, tmp_path, granularity, redeliver, absent_delete, metadata, toast, snapshot, seed, key
):
    bank = generate_bank(transactions=20, seed=seed)
    src = tmp_path / "in"
    events = with_metadata(bank.events) if metadata else bank.events
    events = _with_toast(events) if toast else events
    load = None
    if snapshot:  # a keyed feed's snapshot straddles files, some reads delivered twice
        events, n = _snapshot_first(events, end=snapshot == "end", again=3 if key else 0)
        load = n // 2 if key else n
    _history(
        src,
        events,
        redeliver=redeliver,
        absent_delete=absent_delete,
        metadata=bool(metadata),
        cut=metadata == "cut",
        load=load,
    )
    persisted = spark.sparkContext._jsc.getPersistentRDDs().size()
    on = _run(spark, src, tmp_path / "driver", driver=True, granularity=granularity, key=key)
    off = _run(spark, src, tmp_path / "spark", driver=False, granularity=granularity, key=key)
    # every cache the transactions made was released with them (feed/sources/cached.py)
    assert spark.sparkContext._jsc.getPersistentRDDs().size() == persisted

    assert [r.progress for r in on] == [r.progress for r in off]
    assert [(r.input_rows, r.redelivered, r.skipped, r.held) for r in on] == [
        (r.input_rows, r.redelivered, r.skipped, r.held) for r in off
    ]
    if metadata == "cut":  # transactions held back, on the driver too
        assert any(r.held and "driver" in r.seconds for r in on)
    if redeliver:  # a file began with the tail of the one before
        assert sum(r.redelivered for r in on) > 0
    by_driver = [r for r in on if "driver" in r.seconds]
    assert len(by_driver) >= len(on) // 2, "the driver computed too few transactions"
    assert not any("driver" in r.seconds for r in off)
    if snapshot or not (metadata or toast):  # a plain first file: the feed made there
        assert "driver" in on[0].seconds, "the driver did not take the feed's first transaction"
    frontier, times, state, schemas = _feed(tmp_path / "driver")
    assert (frontier, times, state) == _feed(tmp_path / "spark")[:3]
    # one shape for every segment file and one for every state file, whoever wrote them
    assert len(schemas) == (2 if key else 1), f"files of different shapes: {schemas}"
    # and both equal the table itself
    reader = FeedReader(str(tmp_path / "driver"), "bank")
    assert collection_of(reader) == as_multiset(bank.final.values())
    assert state == (as_multiset(bank.final.values()) if key else Counter())
    if toast:  # placeholders were there to fill, on the driver too
        assert any(TOAST_PLACEHOLDER.encode() in f.read_bytes() for f in src.glob("*.json"))
    if absent_delete:  # the delete of an absent key went to Spark and was quarantined
        assert sum(r.bad_rows for r in on) == sum(r.bad_rows for r in off) == 1


def _m(op: str, i: int, before: str | None, after: str | None, lsn: int) -> bytes:
    """A Debezium event of MEASURES; ``x`` as JSON text (NaN as the string ``"NaN"``, as
    Kafka Connect's JSON converter writes it)."""
    row = "null" if before is None else f'{{"id":{i},"x":{before}}}'
    new = "null" if after is None else f'{{"id":{i},"x":{after}}}'
    source = f'{{"lsn":{lsn},"txId":{lsn},"schema":"public","table":"m"}}'
    return f'{{"before":{row},"after":{new},"op":"{op}","source":{source}}}'.encode()


def test_floating_point_columns_consolidate_as_in_spark(spark, tmp_path):
    """NaN is one value and -0.0 is 0.0 when Spark groups updates: a no-op update of a NaN
    cancels, and -0.0 is written as 0.0. The driver must do the same."""
    src = tmp_path / "in"
    load = [_m("c", i, None, f"{i}.5", 100 + i) for i in range(1, 11)]
    load += [_m("c", 11, None, '"NaN"', 111), _m("c", 12, None, "-0.0", 112)]
    load += [_m("c", 13, None, "0.0", 113)]
    files = [
        load,
        [_m("u", 11, '"NaN"', '"NaN"', 200), _m("u", 12, "-0.0", "0.0", 201)],
        [_m("u", 1, "1.5", "-0.0", 300), _m("u", 13, "0.0", '"NaN"', 301)],
        [_m("u", 1, "-0.0", "0.0", 400), _m("d", 12, "0.0", None, 401)],
        [_m("c", 30, None, '"NaN"', 500), _m("u", 30, '"NaN"', "-0.0", 501)],
    ]
    for n, lines in enumerate(files):
        write_parts(src, lines, 1, start=n)
    on = _run(
        spark, src, tmp_path / "driver", driver=True, granularity="transaction", schema=MEASURES
    )
    off = _run(
        spark, src, tmp_path / "spark", driver=False, granularity="transaction", schema=MEASURES
    )
    assert [r.progress for r in on] == [r.progress for r in off]
    # (the first transaction too: it creates the feed and its keyed state)
    assert ["driver" in r.seconds for r in on] == [True, True, True, True, True]

    def updates(log: Path) -> dict[int, list[tuple[str, int]]]:
        reader = FeedReader(str(log), "bank")
        return {
            t: sorted((repr(r["x"]), r["id"], r["diff"]) for r in reader.table(t).to_pylist())
            for t in reader.times()
        }

    assert updates(tmp_path / "driver") == updates(tmp_path / "spark")


def test_a_job_no_engine_takes_is_an_error_naming_the_engines():
    """The driver engine declines an eagerly pushed transaction (only Spark's executors
    push); with no other engine offered, the job is refused by name, not dropped."""
    job = Job(seq=7, files=["a.json"], eager=object())
    assert DRIVER.run(None, job, {}, lambda step, **_: None) is DECLINED  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"transaction 7: no engine of \(driver\) takes it"):
        run_job(None, job, {}, lambda step, **_: None, engines=(DRIVER,))  # type: ignore[arg-type]
