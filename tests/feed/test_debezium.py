"""Debezium details that real connectors produce, on hand-written events (no PostgreSQL):
snapshots sharing one LSN, lines without a row change, other tables, the TOAST
placeholder, a new snapshot after a lost offset, and transactions held back until their END arrives.
tests/e2e/test_postgres.py checks the same against the real connector."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import orjson
import pytest

from feed.emit.emitter import Emitter, EmitterConfig
from feed.log.reader import FeedReader
from feed.txn.engine import ENGINES, SPARK
from protocol import SourceError, check_messages, record_key

from .model import as_multiset, collection_of, debezium_truth

SCHEMA = {
    "type": "record",
    "name": "record",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "owner", "type": ["null", "string"], "default": None},
        {"name": "doc", "type": ["null", "string"], "default": None},
    ],
}
TOAST = "__debezium_unavailable_value"


def event(op, row, lsn, *, xid, order=None, commit=None, table="accounts", before=None, snap=None):
    """One change event as the PostgreSQL connector writes it (bare envelope)."""
    return {
        "before": before if op != "d" else row,
        "after": None if op == "d" else row,
        "source": {
            "lsn": lsn,
            "txId": xid,
            "sequence": orjson.dumps([None if commit is None else str(commit), str(lsn)]).decode(),
            "schema": "public",
            "table": table,
            "snapshot": snap or ("true" if op == "r" else "false"),
        },
        "op": op,
        "transaction": None if order is None else {"id": f"{xid}:{lsn}", "total_order": order},
    }


def end(xid, commit_lsn, counts):
    return {
        "status": "END",
        "id": f"{xid}:{commit_lsn}",
        "event_count": sum(counts.values()),
        "data_collections": [
            {"data_collection": f"public.{t}", "event_count": n} for t, n in counts.items()
        ],
    }


def write(folder, name, lines):
    folder.mkdir(exist_ok=True)
    body = b"\n".join(b"null" if x is None else orjson.dumps(x) for x in lines)
    (folder / name).write_bytes(body + b"\n")


def open_emitter(
    spark, tmp_path, *, key=("id",), engines=ENGINES, schema=SCHEMA, table="public.accounts", **kw
):
    e = Emitter(
        EmitterConfig(
            source_kind="debezium",
            source_path=str(tmp_path / "in"),
            feed="t",
            log=str(tmp_path / "log"),
            key=key,
            schema=schema,
            table=table,
            clock="logical",
            granularity="transaction",
            **kw,
        ),
        spark=spark,
        engines=engines,
    )
    e.open()
    return e


def rows(*items):
    return as_multiset({"id": i, "owner": o, "doc": d} for i, o, d in items)


def snapshot(n, lsn=100, xid=1):
    return [event("r", {"id": i, "owner": f"o{i}", "doc": f"d{i}"}, lsn, xid=xid) for i in range(n)]


def resnapshot(items, lsn, xid, *, last="last"):
    """A snapshot Debezium took again: ``items`` (id, owner), the last read marked
    ``last`` (None: no end marker among these reads)."""
    out = [event("r", {"id": i, "owner": o, "doc": None}, lsn, xid=xid) for i, o in items]
    if last and out:
        out[-1]["source"]["snapshot"] = last
    return out


def test_snapshot_rows_share_an_lsn_and_lines_without_changes_are_skipped(spark, tmp_path):
    src = tmp_path / "in"
    lines = snapshot(43)
    lines += snapshot(43)[:5]  # part of the snapshot delivered twice
    lines += [
        {"status": "BEGIN", "id": "7:200", "event_count": None, "data_collections": None},
        event("d", {"id": 3, "owner": None, "doc": None}, 210, xid=7, order=1),
        None,  # the tombstone after the delete
        event("c", {"id": 1, "what": "x"}, 220, xid=7, order=2, table="ledger"),
        end(7, 230, {"accounts": 1, "ledger": 1}),
        {"ts_ms": 1700000000000},  # a heartbeat
    ]
    write(src, "part-0.json", lines)
    e = open_emitter(spark, tmp_path)
    reports = e.run()
    e.close()
    assert sum(r.bad_rows for r in reports) == 0
    skipped = Counter()
    for r in reports:
        skipped.update(r.skipped)
    assert skipped == {"tombstone": 1, "heartbeat": 1, "transaction metadata": 1, "other table": 1}
    reader = FeedReader(str(tmp_path / "log"), "t")
    assert check_messages(reader.messages(), non_negative=True, key=["id"]) == []
    full = rows(*((i, f"o{i}", f"d{i}") for i in range(43)))
    assert collection_of(reader, at=1) == full  # the snapshot: one time, all 43 rows
    assert collection_of(reader, at=2) == full - rows((3, "o3", "d3"))
    assert reader.frontier == 3
    info = orjson.loads((tmp_path / "log/t/feed.json").read_bytes())
    assert info["table"] == "public.accounts"


@pytest.mark.parametrize("engines", [ENGINES, (SPARK,)], ids=["driver", "spark"])
def test_reads_of_one_snapshot_transaction_at_several_lsns_are_one_snapshot(
    spark, tmp_path, caplog, engines
):
    """A snapshot is its transaction: reads of one at several LSNs (hand-made input, the
    shared samples' among them) are one snapshot at the lowest, also when its reads
    straddle emitter transactions; the feed records its transaction, and the user is
    told what was made of the input."""
    caplog.set_level(logging.INFO, logger="tidefeed.emit")
    src = tmp_path / "in"
    read = [
        event("r", {"id": i, "owner": f"o{i}", "doc": None}, 100 + 8 * i, xid=1) for i in range(5)
    ]
    # (the reads carry a sequence as the samples do: [LSN - 1, LSN])
    for r in read:
        r["source"]["sequence"] = orjson.dumps(
            [str(r["source"]["lsn"] - 1), str(r["source"]["lsn"])]
        ).decode()
    write(src, "part-0.json", read[:3])
    e = open_emitter(spark, tmp_path, engines=engines)
    assert len(e.run()) == 1  # (the rest of the snapshot comes later, as in --follow)
    later = [
        event("u", {"id": 1, "owner": "new", "doc": None}, 200, xid=2, commit=190),
        event("c", {"id": 9, "owner": "o9", "doc": None}, 210, xid=3, commit=205),
    ]
    write(src, "part-1.json", read[3:] + later)
    assert len(e.run()) == 1
    e.close()
    assert (e.cp.source["snapshot_lsn"], e.cp.source["snapshot_txn"]) == (100, "1")
    reader = FeedReader(str(tmp_path / "log"), "t")
    assert check_messages(reader.messages(), non_negative=True, key=["id"]) == []
    assert collection_of(reader, at=1) == rows(*((i, f"o{i}", None) for i in range(3)))
    snap = {(i, f"o{i}", None) for i in range(5)}
    assert collection_of(reader, at=2) == rows(*snap)
    assert collection_of(reader) == rows(
        *(snap - {(1, "o1", None)}), (1, "new", None), (9, "o9", None)
    )
    said = [r.getMessage() for r in caplog.records if "taken for one snapshot" in r.getMessage()]
    assert any("source transaction 1 carry 3 LSNs (100, 108, 116)" in m for m in said), said
    assert any("carry 2 LSNs (124, 132): taken for one snapshot at LSN 100" in m for m in said)


SAMPLES = Path(__file__).resolve().parents[3] / "shared" / "samples" / "debezium"


def copy_samples(folder: Path) -> list[bytes]:
    """The shipped samples copied into ``folder``; their lines (the test is skipped
    where the samples are not beside the project)."""
    if not SAMPLES.is_dir():
        pytest.skip(f"no samples at {SAMPLES}")
    folder.mkdir()
    lines = []
    for f in sorted(SAMPLES.glob("part-*.json")):
        (folder / f.name).write_bytes(f.read_bytes())
        lines += [x for x in f.read_bytes().splitlines() if x.strip()]
    return lines


@pytest.mark.parametrize("engines", [ENGINES, (SPARK,)], ids=["driver", "spark"])
def test_the_shipped_samples_give_the_table_after_every_source_transaction(
    spark, tmp_path, engines
):
    """What a new user tries first: the samples beside the project (wrapped and bare
    lines, snapshot reads one LSN apart in one transaction) give a feed whose collection
    at each time is the table after that source transaction."""
    _, states = debezium_truth(copy_samples(tmp_path / "in"))
    # (the schema from the samples' Connect schema, the table from their first event)
    e = open_emitter(spark, tmp_path, engines=engines, schema=None, table=None)
    e.run()
    e.close()
    reader = FeedReader(str(tmp_path / "log"), "t")
    assert check_messages(reader.messages(), non_negative=True, key=["id"]) == []
    assert reader.frontier == len(states) + 1
    for t, table in enumerate(states, start=1):
        assert collection_of(reader, at=t) == as_multiset(table.values()), f"time {t}"


def test_toast_placeholder_is_filled_from_the_keyed_state(spark, tmp_path):
    src = tmp_path / "in"
    write(src, "part-0.json", snapshot(3))
    e = open_emitter(spark, tmp_path)
    e.run()
    write(
        src,
        "part-1.json",
        [
            event("u", {"id": 1, "owner": "new1", "doc": TOAST}, 300, xid=8),
            # twice in one transaction: the second takes the value the state gave the first
            event("u", {"id": 2, "owner": "x", "doc": TOAST}, 310, xid=9),
            event("u", {"id": 2, "owner": "y", "doc": TOAST}, 320, xid=9),
            # a key with no earlier row: nothing to fill from
            event("u", {"id": 77, "owner": "z", "doc": TOAST}, 330, xid=10),
        ],
    )
    reports = e.run()
    e.close()
    assert sum(r.bad_rows for r in reports) == 1
    reader = FeedReader(str(tmp_path / "log"), "t")
    assert collection_of(reader) == rows((0, "o0", "d0"), (1, "new1", "d1"), (2, "y", "d2"))
    bad = [
        orjson.loads(line)
        for p in (tmp_path / "log/t/quarantine").rglob("*.json")
        for line in p.read_bytes().splitlines()
    ]
    assert len(bad) == 1 and "doc" in bad[0]["reason"] and "77" in bad[0]["reason"]


def test_toast_placeholder_in_an_unkeyed_feed_is_quarantined(spark, tmp_path):
    src = tmp_path / "in"
    before = {"id": 1, "owner": "o1", "doc": "d1"}
    write(
        src,
        "part-0.json",
        [
            *snapshot(2),
            event("u", {"id": 1, "owner": "n", "doc": TOAST}, 300, xid=8, before=before),
        ],
    )
    e = open_emitter(spark, tmp_path, key=())
    reports = e.run()
    e.close()
    assert sum(r.bad_rows for r in reports) == 1
    reader = FeedReader(str(tmp_path / "log"), "t")
    assert collection_of(reader) == rows((0, "o0", "d0"), (1, "o1", "d1"))


def test_a_new_snapshot_replaces_the_collection_in_one_time(spark, tmp_path):
    """Debezium lost its offsets and snapshotted again: the feed moves to the new snapshot
    in one time (rows it no longer holds retracted), a transaction cut off before it is
    dropped instead of holding everything back, and streaming goes on after it."""
    src = tmp_path / "in"
    write(
        src,
        "part-0.json",
        [
            *snapshot(3),
            event("d", {"id": 0}, 200, xid=5, order=1),
            end(5, 210, {"accounts": 1}),
            event("c", {"id": 5, "owner": "five", "doc": None}, 220, xid=6, order=1),
            end(6, 230, {"accounts": 1}),
        ],
    )
    e = open_emitter(spark, tmp_path)
    e.run()
    cut = [  # two of its three events came before the crash; never delivered whole again
        event("u", {"id": 1, "owner": "lost", "doc": None}, 300 + i, xid=7, order=1 + i)
        for i in range(2)
    ]
    write(src, "part-1.json", cut)
    # the restarted connector snapshots at LSN 400 (the other table's read ends it), then
    # streams on
    write(
        src,
        "part-2.json",
        [
            *resnapshot([(1, "one"), (2, "o2"), (7, "seven")], 400, 8, last=None),
            event("r", {"id": 1}, 400, xid=8, table="ledger", snap="last"),
            event("u", {"id": 7, "owner": "SEVEN", "doc": None}, 450, xid=9, order=1),
            end(9, 460, {"accounts": 1}),
        ],
    )
    reports = e.run()
    e.close()
    assert sum(r.bad_rows for r in reports) == 0
    reader = FeedReader(str(tmp_path / "log"), "t")
    assert check_messages(reader.messages(), non_negative=True, key=["id"]) == []
    assert reader.frontier == 6  # snapshot, delete, insert, new snapshot, update
    assert collection_of(reader, at=3) == rows((1, "o1", "d1"), (2, "o2", "d2"), (5, "five", None))
    new = rows((1, "one", None), (2, "o2", None), (7, "seven", None))
    assert collection_of(reader, at=4) == new  # 5 retracted: the new snapshot lacks it
    assert collection_of(reader, at=5) == new - rows((7, "seven", None)) + rows((7, "SEVEN", None))
    checkpoint = orjson.loads(sorted((tmp_path / "log/t/_commits").glob("*.json"))[-1].read_bytes())
    assert checkpoint["source"]["snapshot_lsn"] == 400


def test_a_new_snapshot_waits_for_its_end_and_goes_after_what_came_before(spark, tmp_path):
    src = tmp_path / "in"
    write(src, "part-0.json", snapshot(2))
    e = open_emitter(spark, tmp_path)
    e.run()
    again = resnapshot([(0, "zero"), (1, "one"), (2, "two")], 400, 8)
    write(
        src,
        "part-1.json",
        [
            event("c", {"id": 3, "owner": "three", "doc": None}, 300, xid=7, order=1),
            end(7, 310, {"accounts": 1}),
            *again[:2],
        ],
    )
    report = e.step()  # the transaction before the snapshot goes first
    assert report is not None and report.progress.upper == 3
    assert e.step() is None  # the snapshot's end is not in: nothing more
    write(src, "part-2.json", again[2:])
    reports = e.run()
    e.close()
    assert sum(r.bad_rows for r in reports) == 0
    reader = FeedReader(str(tmp_path / "log"), "t")
    assert check_messages(reader.messages(), non_negative=True, key=["id"]) == []
    assert reader.frontier == 4
    assert collection_of(reader, at=2) == rows((0, "o0", "d0"), (1, "o1", "d1"), (3, "three", None))
    assert collection_of(reader, at=3) == rows(
        (0, "zero", None), (1, "one", None), (2, "two", None)
    )


def test_a_new_snapshot_on_an_unkeyed_feed_fails_and_commits_nothing(spark, tmp_path):
    src = tmp_path / "in"
    write(src, "part-0.json", snapshot(2))
    e = open_emitter(spark, tmp_path, key=())
    e.run()
    commits = sorted(p.name for p in (tmp_path / "log/t/_commits").iterdir())
    write(src, "part-1.json", resnapshot([(0, "zero")], 400, 8))
    with pytest.raises(SourceError, match=r"snapshotted public\.accounts again"):
        e.run()
    e.close()
    assert sorted(p.name for p in (tmp_path / "log/t/_commits").iterdir()) == commits
    assert collection_of(FeedReader(str(tmp_path / "log"), "t")) == rows(
        (0, "o0", "d0"), (1, "o1", "d1")
    )


def test_an_older_snapshot_behind_the_feed_is_quarantined_not_applied(spark, tmp_path):
    src = tmp_path / "in"
    write(
        src,
        "part-0.json",
        [
            *snapshot(3, lsn=300),
            event("d", {"id": 0}, 350, xid=5, order=1),
            end(5, 360, {"accounts": 1}),
        ],
    )
    e = open_emitter(spark, tmp_path)
    e.run()
    # a snapshot from before the feed's own (its LSN is behind the committed position),
    # and part of the feed's own snapshot again
    write(src, "part-1.json", snapshot(3, lsn=100, xid=6) + snapshot(3, lsn=300)[:1])
    reports = e.run()
    e.close()
    assert [r.bad_rows for r in reports] == [3]  # the older snapshot; the own one's row dropped
    reader = FeedReader(str(tmp_path / "log"), "t")
    assert collection_of(reader) == rows((1, "o1", "d1"), (2, "o2", "d2"))
    reasons = {
        orjson.loads(line)["reason"]
        for p in (tmp_path / "log/t/quarantine").rglob("*.json")
        for line in p.read_bytes().splitlines()
    }
    assert len(reasons) == 1 and "older than the feed's committed position" in reasons.pop()


def test_a_transaction_is_held_back_until_its_end_and_all_its_events_arrive(spark, tmp_path):
    src = tmp_path / "in"
    write(src, "part-0.json", snapshot(2))
    e = open_emitter(spark, tmp_path)
    e.run()
    big = [
        event("c", {"id": 10 + i, "owner": "b", "doc": None}, 500 + i, xid=11, order=1 + i)
        for i in range(6)
    ]
    # half the transaction, then the connector crashed; the rest after it restarted,
    # delivered again from the start, with its END record
    write(src, "part-1.json", big[:3])
    assert e.step() is None  # incomplete: nothing committed, the file stays pending
    assert e.pending_files() == [str(src / "part-1.json")]
    write(src, "part-2.json", [*big, end(11, 600, {"accounts": 6})])
    write(
        src,
        "part-3.json",
        [event("d", {"id": 10}, 700, xid=12, order=1), end(12, 710, {"accounts": 1})],
    )
    reports = e.run()
    e.close()
    assert sum(r.bad_rows for r in reports) == 0
    assert sum(r.redelivered for r in reports) == 3
    reader = FeedReader(str(tmp_path / "log"), "t")
    assert check_messages(reader.messages(), non_negative=True, key=["id"]) == []
    base = rows((0, "o0", "d0"), (1, "o1", "d1"))
    added = rows(*((10 + i, "b", None) for i in range(6)))
    assert reader.frontier == 4  # snapshot, the big transaction, the delete: one time each
    assert collection_of(reader, at=2) == base + added
    assert collection_of(reader, at=3) == base + added - rows((10, "b", None))


def test_a_file_read_again_for_a_held_transaction_is_consumed_once_that_one_completes(
    spark, tmp_path
):
    """A file holding a finished transaction and the start of an unfinished one is read
    again; the finished one, all redelivered by then, must not be waited for."""
    src = tmp_path / "in"
    write(src, "part-0.json", snapshot(1))
    e = open_emitter(spark, tmp_path)
    e.run()
    b = [
        event("c", {"id": 20 + i, "owner": "b", "doc": None}, 400 + i, xid=8, order=1 + i)
        for i in range(2)
    ]
    write(
        src,
        "part-1.json",
        [
            event("c", {"id": 10, "owner": "a", "doc": None}, 300, xid=7, order=1),
            end(7, 310, {"accounts": 1}),
            b[0],
        ],
    )
    e.run()
    write(src, "part-2.json", [b[1], end(8, 410, {"accounts": 2})])
    e.run()
    assert e.pending_files() == []
    e.close()
    reader = FeedReader(str(tmp_path / "log"), "t")
    assert reader.frontier == 4
    assert collection_of(reader) == rows(
        (0, "o0", "d0"), (10, "a", None), (20, "b", None), (21, "b", None)
    )


def test_a_new_snapshot_without_rows_of_the_table_empties_it(spark, tmp_path):
    """The table was emptied while the capture was down: the new snapshot has no read of
    it, only the other table's end marker at the new LSN."""
    src = tmp_path / "in"
    write(src, "part-0.json", snapshot(2))
    e = open_emitter(spark, tmp_path)
    e.run()
    write(src, "part-1.json", [event("r", {"id": 1}, 400, xid=8, table="ledger", snap="last")])
    reports = e.run()
    e.close()
    assert sum(r.bad_rows for r in reports) == 0
    reader = FeedReader(str(tmp_path / "log"), "t")
    assert check_messages(reader.messages(), non_negative=True, key=["id"]) == []
    assert reader.frontier == 3
    assert collection_of(reader, at=2) == Counter()


@pytest.mark.parametrize("meta", [True, False], ids=["metadata", "no-metadata"])
@pytest.mark.parametrize("key", [("id",), ()], ids=["keyed", "unkeyed"])
def test_an_event_delivered_twice_in_one_read_counts_once(spark, tmp_path, key, meta):
    """Kafka delivers at least once: a streamed event repeated in the input (same
    transaction, LSN, order and op) is one change, keyed or not, with transaction metadata
    or without (where no figure per transaction is computed unless a repeat is found).
    Computed in Spark (the driver's own path has its own test)."""
    src = tmp_path / "in"
    order = (lambda n: n) if meta else (lambda n: None)
    first = event("c", {"id": 1, "owner": "a", "doc": "x"}, 300, xid=9, order=order(1))
    second = event("c", {"id": 2, "owner": "b", "doc": "y"}, 302, xid=9, order=order(2))
    update = event(
        "u",
        {"id": 1, "owner": "a2", "doc": "x"},
        310,
        xid=10,
        order=order(1),
        before={"id": 1, "owner": "a", "doc": "x"},
    )
    ends = [end(9, 302, {"accounts": 2}), end(10, 310, {"accounts": 1})] if meta else [None, None]
    lines = [first, second, first, ends[0], update, update, ends[1]]
    write(src, "part-0.json", [x for x in lines if x is not None])
    e = open_emitter(spark, tmp_path, key=key, driver_txn_bytes=0)
    reports = e.run()
    e.close()
    assert sum(r.redelivered for r in reports) == 2
    reader = FeedReader(str(tmp_path / "log"), "t")
    assert check_messages(reader.messages(), non_negative=True) == []
    assert collection_of(reader) == rows((1, "a2", "x"), (2, "b", "y"))
    assert reader.frontier == 3  # times 1 and 2: one per source transaction


@pytest.mark.parametrize("key", [("id",), ()])
def test_incremental_snapshot_reads_redelivered_are_dropped_not_quarantined(spark, tmp_path, key):
    # incremental snapshot reads (op r, source.snapshot "incremental") are changes like
    # the others: read again after their commit, they are redeliveries, not an older
    # snapshot of the table to quarantine
    src = tmp_path / "in"
    chunk = [
        event("r", {"id": i, "owner": f"o{i}", "doc": None}, 250, xid=4, snap="incremental")
        for i in (2, 3)
    ]
    c = [
        event("c", {"id": i, "owner": o, "doc": None}, lsn, xid=x)
        for i, o, lsn, x in ((1, "a", 200, 3), (5, "e", 260, 5), (4, "d", 300, 6))
    ]
    write(src, "part-0.json", [c[0], *chunk, c[1]])
    e = open_emitter(spark, tmp_path, key=key, driver_txn_bytes=0)
    reports = e.run()
    write(src, "part-1.json", [*chunk, c[2]])  # the chunk delivered again, then a change
    again = e.run()
    e.close()
    assert [r.bad_rows for r in reports + again] == [0] * len(reports + again)
    assert sum(r.redelivered for r in again) == 2
    quarantine = tmp_path / "log/t/quarantine"
    assert not quarantine.exists() or not any(quarantine.rglob("*.json"))
    reader = FeedReader(str(tmp_path / "log"), "t")
    assert collection_of(reader) == rows(
        (1, "a", None), (2, "o2", None), (3, "o3", None), (4, "d", None), (5, "e", None)
    )


def _three_open_transactions():
    """Two source transactions with transaction blocks and no END record anywhere."""
    return [
        event("c", {"id": 10, "owner": "a", "doc": None}, 300, xid=7, order=1),
        event("c", {"id": 11, "owner": "b", "doc": None}, 400, xid=8, order=1),
        event("u", {"id": 10, "owner": "c", "doc": None}, 500, xid=9, order=1),
    ]


def test_transaction_blocks_without_any_end_record_fail_at_once_naming_tx_metadata(spark, tmp_path):
    src = tmp_path / "in"
    write(src, "part-0.json", snapshot(1))
    e = open_emitter(spark, tmp_path)
    e.run()
    before = e.cp
    write(src, "part-1.json", _three_open_transactions())
    with pytest.raises(SourceError, match="--tx-metadata PATH") as err:
        e.step()
    assert "3 source transactions" in str(err.value)
    assert e.cp == before  # nothing committed
    assert e.pending_files() == [str(src / "part-1.json")]
    e.close()
    # told where the END records are (an empty folder so far): the emitter waits for them
    (tmp_path / "tx").mkdir()
    e = open_emitter(spark, tmp_path, tx_metadata=str(tmp_path / "tx"))
    assert e.step() is None
    write(tmp_path / "tx", "tx-0.json", [end(x, 100 * x - 390, {"accounts": 1}) for x in (7, 8, 9)])
    reports = e.run()
    assert e.held_back() == []
    e.close()
    assert sum(r.updates for r in reports) == 4
    reader = FeedReader(str(tmp_path / "log"), "t")
    assert reader.frontier == 5
    assert collection_of(reader) == rows((0, "o0", "d0"), (10, "c", None), (11, "b", None))


@pytest.mark.process  # a tidefeed process with its own JVM
def test_a_batch_run_that_ends_inside_a_transaction_says_so_and_exits_3(tmp_path):
    from feed.cli.options import EXIT_INCOMPLETE
    from tests.e2e.helpers import tidefeed

    src = tmp_path / "in"
    write(src, "part-0.json", [*snapshot(1), event("c", {"id": 5}, 300, xid=7, order=1)])
    (tmp_path / "schema.json").write_bytes(orjson.dumps(SCHEMA))
    args = ["emit", "--source", f"debezium:{src}", "--feed", "t", "--log", str(tmp_path / "log")]
    args += ["--key", "id", "--schema", str(tmp_path / "schema.json"), "--clock", "logical"]
    out = tidefeed(*args, "--granularity", "transaction")
    err = out.stderr.decode()
    assert out.returncode == EXIT_INCOMPLETE == 3, err
    assert "the input ended inside source transactions" in err
    assert "part-0.json held back" in err and "--tx-metadata" in err
    # the snapshot before it is committed; the file is read again at the next run
    assert FeedReader(str(tmp_path / "log"), "t").frontier == 2


def test_follow_warns_when_input_stays_held_back(spark, tmp_path, caplog):
    import time

    src = tmp_path / "in"
    write(src, "part-0.json", [*snapshot(1), event("c", {"id": 5}, 300, xid=7, order=1)])
    e = open_emitter(spark, tmp_path, follow=True, trigger=0.1, held_warning=0.5)
    deadline = time.monotonic() + 20
    caplog.set_level(logging.WARNING, logger="tidefeed.emit")

    def stop() -> bool:
        warned = any("held back for" in r.getMessage() for r in caplog.records)
        return warned or time.monotonic() > deadline

    e.run(stop=stop)
    e.close()
    warnings = [r for r in caplog.records if "held back for" in r.getMessage()]
    assert warnings and warnings[0].levelno == logging.WARNING
    assert "part-0.json" in warnings[0].getMessage()
    assert "--tx-metadata" in warnings[0].getMessage()


CONNECT_COLUMNS = [
    {"field": "id", "type": "int64", "optional": False},
    {"field": "owner", "type": "string", "optional": True},
    {"field": "doc", "type": "string", "optional": True},
]


def wrapped(ev, columns=CONNECT_COLUMNS):
    """An event with the JSON converter's schema wrapper (the table's columns in it)."""
    image = {"type": "struct", "fields": columns, "optional": True}
    schema = {
        "type": "struct",
        "fields": [{**image, "field": "before"}, {**image, "field": "after"}],
    }
    return {"schema": schema, "payload": ev}


def write_new_column(src) -> None:
    """A snapshot, a transaction, then an event of a new shape (a column ``qty`` more, a
    64-bit value in it) whose END is in the next file."""
    more = [*CONNECT_COLUMNS, {"field": "qty", "type": "int64", "optional": True}]
    write(
        src,
        "part-0.json",
        [
            *[wrapped(e) for e in snapshot(1)],
            wrapped(event("c", {"id": 10, "owner": "a", "doc": None}, 300, xid=7, order=1)),
            end(7, 310, {"accounts": 1}),
            wrapped(
                event(
                    "c", {"id": 20, "owner": "b", "doc": None, "qty": 2**40}, 400, xid=8, order=1
                ),
                more,
            ),
        ],
    )
    write(src, "part-1.json", [end(8, 410, {"accounts": 1})])


@pytest.mark.parametrize("driver", [True, False], ids=["driver", "spark"])
def test_a_new_column_is_a_new_schema_version_at_a_time_of_its_own(spark, tmp_path, driver):
    """The first event of the new shape and its END in different files, the event not
    fitting the old record: what came before is committed, then the new version at a
    time of its own, then the transaction through it; nothing quarantined. The same
    through the driver engine (it cuts the transaction at the change as Spark does) and
    through Spark alone."""
    write_new_column(tmp_path / "in")
    e = open_emitter(spark, tmp_path, engines=ENGINES if driver else (SPARK,))
    reports = e.run()
    # the transactions around the version's time: on the driver when it is offered
    txns = [r for r in reports if r.files]
    assert len(txns) == 2 and all(("driver" in r.seconds) == driver for r in txns), reports
    assert e.pending_files() == []
    e.close()
    reader = FeedReader(str(tmp_path / "log"), "t")
    # the snapshot (1), transaction 7 (2), the new version (3), transaction 8 (4)
    assert reader.frontier == 5
    assert [(v.start, v.added) for v in reader.info.history()] == [(0, ()), (3, ("qty",))]
    assert reader.counts() == {1: 1, 2: 1, 4: 1}  # a nullable column rewrites no row
    got = {r["id"]: r for r in reader.snapshot().to_pylist()}
    assert got[20]["qty"] == 2**40 and got[0]["qty"] is None and got[10]["qty"] is None
    at2 = {r["id"]: r["owner"] for r in reader.snapshot(2).to_pylist()}
    assert at2 == {0: "o0", 10: "a"}
    quarantine = tmp_path / "log" / "t" / "quarantine"
    assert not quarantine.exists() or not any(quarantine.rglob("*.json"))
    # a new run of the feed carries on from the version committed
    again = open_emitter(spark, tmp_path)
    assert again.info.version == 3 and "qty" in again.info.schema["fields"][-1]["name"]
    again.close()


def write_default_then_drop(src) -> None:
    """A snapshot and a transaction, then a column ``qty`` added with a default (the rows
    then in the table take it), then ``doc`` dropped (the rows that held one lose it)."""
    with_qty = [
        *CONNECT_COLUMNS,
        {"field": "qty", "type": "int64", "optional": False, "default": 7},
    ]
    no_doc = [c for c in with_qty if c["field"] != "doc"]
    write(
        src,
        "part-0.json",
        [
            *[wrapped(e) for e in snapshot(3)],
            wrapped(event("c", {"id": 10, "owner": "a", "doc": None}, 300, xid=7, order=1)),
            end(7, 310, {"accounts": 1}),
        ],
    )
    row = {"id": 20, "owner": "b", "doc": "d", "qty": 5}
    write(
        src,
        "part-1.json",
        [wrapped(event("c", row, 400, xid=8, order=1), with_qty), end(8, 410, {"accounts": 1})],
    )
    before = {"id": 1, "owner": "o1", "qty": 7}
    after = {"id": 1, "owner": "z", "qty": 9}
    write(
        src,
        "part-2.json",
        [
            wrapped(event("u", after, 500, xid=9, order=1, before=before), no_doc),
            end(9, 510, {"accounts": 1}),
        ],
    )


def test_versions_that_change_rows_rewrite_the_state_alike_on_the_driver_and_in_spark(
    spark, tmp_path
):
    """Two versions that change rows (a default filled into every row, then a column
    dropped from the rows that held one): the driver rewrites the keyed state itself,
    without Spark, and the feed equals the one Spark alone makes, time by time, and the
    table."""
    feeds = []
    for name, engines in (("driver", ENGINES), ("spark", (SPARK,))):
        (tmp_path / name).mkdir()
        write_default_then_drop(tmp_path / name / "in")
        e = open_emitter(spark, tmp_path / name, engines=engines, max_files_per_txn=1)
        reports = e.run()
        e.close()
        versions = [r for r in reports if not r.files and r.updates]
        assert len(versions) == 2, reports
        assert all(("driver" in r.seconds) == (name == "driver") for r in versions), versions
        reader = FeedReader(str(tmp_path / name / "log"), "t")
        feeds.append(
            (
                [(v.start, v.added, v.dropped) for v in reader.info.history()],
                {t: Counter(map(record_key, reader.table(t).to_pylist())) for t in reader.times()},
            )
        )
    assert feeds[0] == feeds[1]
    history, times = feeds[0]
    assert [h[1:] for h in history] == [((), ()), (("qty",), ()), ((), ("doc",))]
    # every row then in the table takes the default: -old +new for each of the four
    assert sum(times[history[1][0]].values()) == 8
    # the four rows with a doc lose it (id 10 had none)
    assert sum(times[history[2][0]].values()) == 8
    got = {
        r["id"]: r for r in FeedReader(str(tmp_path / "driver" / "log"), "t").snapshot().to_pylist()
    }
    assert {i: (r["owner"], r["doc"], r["qty"]) for i, r in got.items()} == {
        0: ("o0", None, 7),
        1: ("z", None, 9),
        2: ("o2", None, 7),
        10: ("a", None, 7),
        20: ("b", None, 5),
    }


def test_a_new_shape_on_a_line_the_drivers_parse_cannot_read_still_takes_its_version(
    spark, tmp_path
):
    """The line of the new shape holds a number past a double's range (a default of
    ``1e400``), which orjson refuses and Spark reads: the driver engine must not pass
    that shape as fitting and drop its column; the version is committed and ``qty`` kept,
    as Spark alone has it."""
    write_default_then_drop(tmp_path / "in")
    (tmp_path / "in" / "part-2.json").unlink()
    part = tmp_path / "in" / "part-1.json"
    part.write_bytes(part.read_bytes().replace(b'"default":7', b'"default":1e400'))
    e = open_emitter(spark, tmp_path, max_files_per_txn=1)
    e.run()
    e.close()
    reader = FeedReader(str(tmp_path / "log"), "t")
    assert [v.added for v in reader.info.history()] == [(), ("qty",)]
    assert {r["id"]: r["qty"] for r in reader.snapshot().to_pylist()}[20] == 5


def _in_one_transaction(src) -> None:
    """:func:`write_default_then_drop` with its two changes of shape inside one source
    transaction: the insert of the ``qty`` shape, then the update of the shape without
    ``doc``, under one END."""
    write_default_then_drop(src)
    a = orjson.loads((src / "part-1.json").read_bytes().splitlines()[0])
    b = orjson.loads((src / "part-2.json").read_bytes().splitlines()[0])
    b["payload"]["source"].update(txId=8, lsn=405)
    b["payload"]["transaction"] = {"id": "8:405", "total_order": 2}
    write(src, "part-1.json", [a, b, end(8, 410, {"accounts": 2})])
    (src / "part-2.json").unlink()


@pytest.mark.parametrize("layout", ["two transactions", "one transaction"])
def test_two_changes_of_shape_in_one_read_take_a_version_each_in_delivery_order(
    spark, tmp_path, layout
):
    """A column added, then another dropped, both read at once (in two source
    transactions, or in one): the read is cut at the first change (the shape delivered
    first), not at whichever hash sorts first. Cut at the drop, the add's events were
    committed under the old record (``qty`` 5 lost) and the drop, compared with the feed's
    schema, looked like a rename and stopped the feed. Both engines, the same feed."""
    feeds = []
    for name, engines in (("driver", ENGINES), ("spark", (SPARK,))):
        (tmp_path / name).mkdir()
        make = write_default_then_drop if layout == "two transactions" else _in_one_transaction
        make(tmp_path / name / "in")
        e = open_emitter(spark, tmp_path / name, engines=engines)
        e.run()
        e.close()
        reader = FeedReader(str(tmp_path / name / "log"), "t")
        history = [(v.start, v.added, v.dropped) for v in reader.info.history()]
        assert [h[1:] for h in history] == [((), ()), (("qty",), ()), ((), ("doc",))], name
        got = {r["id"]: (r["owner"], r["qty"]) for r in reader.snapshot().to_pylist()}
        assert got == {0: ("o0", 7), 1: ("z", 9), 2: ("o2", 7), 10: ("a", 7), 20: ("b", 5)}
        times = {t: Counter(map(record_key, reader.table(t).to_pylist())) for t in reader.times()}
        feeds.append((history, times))
    assert feeds[0] == feeds[1]


def test_an_emitter_restarted_between_two_versions_and_their_transaction_adds_none(spark, tmp_path):
    """The two changes of shape in one source transaction: both versions committed, then
    the emitter stops (a new process) before the transaction is. The new emitter knows the
    shapes found to fit before (each version's file lists them), so it takes the
    transaction through the last version. Before, it judged the shape from before the
    ``DROP COLUMN`` again, read it as adding ``doc`` back and committed a third version."""
    _in_one_transaction(tmp_path / "in")
    e = open_emitter(spark, tmp_path)
    while len(FeedReader(str(tmp_path / "log"), "t").info.history()) < 3:
        assert e.step() is not None
    e.close()
    reader = FeedReader(str(tmp_path / "log"), "t")
    assert reader.info.versions[-1].shapes  # (what the new emitter reads)
    stopped_at = reader.frontier
    e = open_emitter(spark, tmp_path)
    e.run()
    e.close()
    reader = FeedReader(str(tmp_path / "log"), "t")
    assert reader.frontier > stopped_at  # the transaction, taken by the new emitter
    history = [(v.added, v.dropped) for v in reader.info.history()]
    assert history == [((), ()), (("qty",), ()), ((), ("doc",))]
    got = {r["id"]: (r["owner"], r["qty"]) for r in reader.snapshot().to_pylist()}
    assert got == {0: ("o0", 7), 1: ("z", 9), 2: ("o2", 7), 10: ("a", 7), 20: ("b", 5)}


@pytest.mark.parametrize("how", ["removed", "rewritten"])
@pytest.mark.parametrize("engines", [ENGINES, (SPARK,)], ids=["driver", "spark"])
def test_a_file_changed_while_its_new_shape_is_checked_stops_the_feed_unchanged(
    spark, tmp_path, monkeypatch, engines, how
):
    """The file of a new table shape removed, or rewritten without that shape's event,
    between the read of its events and the sample of that shape's columns (a retention
    job or a producer racing the emitter): the feed stops with an error naming the file,
    nothing of it committed and no schema version taken. Before, a rewritten file let the
    shape pass as fitting: its events, read already, were committed with the old record
    (``qty`` lost without a word); a removed one raised Spark's or pyarrow's own error."""
    import feed.sources.debezium_schema as on_spark
    import feed.txn.driver as on_driver

    write_default_then_drop(tmp_path / "in")
    (tmp_path / "in" / "part-2.json").unlink()
    part = tmp_path / "in" / "part-1.json"
    ends = part.read_bytes().splitlines(keepends=True)[-1]
    for module in (on_spark, on_driver):

        def removed_first(*args, _real=module.shape_sample):
            if str(part) in args[-2] and part.read_bytes() != ends:  # (part-1's read)
                part.unlink()
                if how == "rewritten":  # its END record alone
                    part.write_bytes(ends)
            return _real(*args)

        monkeypatch.setattr(module, "shape_sample", removed_first)
    persisted = spark.sparkContext._jsc.getPersistentRDDs().size()
    e = open_emitter(spark, tmp_path, engines=engines, max_files_per_txn=1)
    with pytest.raises(SourceError, match=r"changed while it was read.*part-1\.json") as err:
        e.run()
    e.close()
    assert "nothing was committed" in str(err.value)
    assert part.exists() == (how == "rewritten")  # (the sample ran, after the read)
    reader = FeedReader(str(tmp_path / "log"), "t")
    assert len(reader.info.history()) == 1  # no version
    # part-0 alone: the snapshot and transaction 7
    assert collection_of(reader) == rows(
        *[(i, f"o{i}", f"d{i}") for i in range(3)], (10, "a", None)
    )
    assert spark.sparkContext._jsc.getPersistentRDDs().size() == persisted


@pytest.mark.slow
def test_a_sigkill_before_a_new_version_commits_leaves_it_unread_then_redone(tmp_path):
    """A real emit killed after writing the version file and the rewritten state, before
    its commit: no reader takes the version; the next run commits it at the same time.
    Both runs are the driver's, the version's rewrite too: JAVA_HOME names nothing, so a
    start of Spark would fail them."""
    import os
    import subprocess

    from ..e2e.helpers import TIDEFEED

    write_new_column(tmp_path / "in")
    (tmp_path / "schema.avsc").write_bytes(orjson.dumps(SCHEMA))
    log = tmp_path / "log"
    cmd = [
        *TIDEFEED,
        "emit",
        "--source",
        f"debezium:{tmp_path / 'in'}",
        "--log",
        str(log),
        "--feed",
        "t",
        "--table",
        "public.accounts",
        "--key",
        "id",
        "--clock",
        "logical",
        "--schema",
        str(tmp_path / "schema.avsc"),
    ]
    no_java = {**os.environ, "JAVA_HOME": str(tmp_path / "no-java")}
    env = {**no_java, "TIDEFEED_TEST_KILL_AT": "before_version_commit:1"}
    killed = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr[-2000:]
    written = sorted((log / "t" / "schemas").glob("*.json"))
    assert written, "the version file was written"
    reader = FeedReader(str(log), "t")
    at = reader.frontier  # everything before the change is committed
    assert int(written[0].stem) == at and len(reader.info.history()) == 1
    assert "qty" not in {f.name for f in reader.record_type}
    env.pop("TIDEFEED_TEST_KILL_AT")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "spark 4" not in killed.stderr + done.stderr
    reader = FeedReader(str(log), "t")
    assert reader.frontier == at + 2  # the version's time, then the transaction
    assert [v.start for v in reader.info.history()] == [0, at]
    assert check_messages(reader.messages(), non_negative=True, key=["id"]) == []
    got = {r["id"]: r["qty"] for r in reader.snapshot().to_pylist()}
    assert got == {0: None, 10: None, 20: 2**40}
