"""Debezium details that real connectors produce, on hand-written events (no PostgreSQL):
snapshots sharing one LSN, lines without a row change, other tables, the TOAST
placeholder, a second snapshot, and transactions held back until their END arrives.
tests/e2e/test_postgres.py checks the same against the real connector."""

from __future__ import annotations

from collections import Counter

import orjson

from feed.emitter import Emitter, EmitterConfig
from feed.reader import FeedReader
from protocol import check_messages

from .model import as_multiset, collection_of

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


def event(op, row, lsn, *, xid, order=None, commit=None, table="accounts", before=None):
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
            "snapshot": "true" if op == "r" else "false",
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


def open_emitter(spark, tmp_path, *, key=("id",), **kw):
    e = Emitter(
        EmitterConfig(
            source_kind="debezium",
            source_path=str(tmp_path / "in"),
            feed="t",
            log=str(tmp_path / "log"),
            key=key,
            schema=SCHEMA,
            table="public.accounts",
            clock="logical",
            granularity="transaction",
            **kw,
        ),
        spark=spark,
    )
    e.open()
    return e


def rows(*items):
    return as_multiset({"id": i, "owner": o, "doc": d} for i, o, d in items)


def snapshot(n, lsn=100, xid=1):
    return [event("r", {"id": i, "owner": f"o{i}", "doc": f"d{i}"}, lsn, xid=xid) for i in range(n)]


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


def test_a_second_snapshot_behind_the_feed_is_quarantined_not_applied(spark, tmp_path):
    src = tmp_path / "in"
    write(src, "part-0.json", [*snapshot(3), event("d", {"id": 0}, 200, xid=5, commit=150)])
    e = open_emitter(spark, tmp_path)
    e.run()
    # the connector lost its offsets and snapshotted again (new LSN, no commit LSN)
    write(src, "part-1.json", snapshot(3, lsn=400, xid=6) + snapshot(3)[:1])
    reports = e.run()
    e.close()
    assert [r.bad_rows for r in reports] == [3]  # the new snapshot; the old one's row dropped
    reader = FeedReader(str(tmp_path / "log"), "t")
    assert collection_of(reader) == rows((1, "o1", "d1"), (2, "o2", "d2"))
    reasons = {
        orjson.loads(line)["reason"]
        for p in (tmp_path / "log/t/quarantine").rglob("*.json")
        for line in p.read_bytes().splitlines()
    }
    assert len(reasons) == 1 and "new snapshot" in reasons.pop()


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
