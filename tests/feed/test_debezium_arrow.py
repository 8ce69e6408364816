"""The parse of flat Debezium lines in Spark's tasks (feed/sources/columnar.py and
feed/sources/debezium_arrow.py) against Spark's own (feed/sources/debezium.py), row for
row; what it declines, and a transaction whose file declines read by Spark's reader."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql.pandas.types import to_arrow_type

from feed.demo.data import ACCOUNTS_SCHEMA, generate_bank
from feed.log.reader import FeedReader
from feed.sources.columnar import (
    MAX_FILE_BYTES,
    all_distinct,
    read_debezium_columnar,
    seen_positions,
    why_not_columnar,
)
from feed.sources.connect_json import Declined
from feed.sources.debezium_arrow import parse_flat
from feed.sources.file_text import Lines, mapped
from feed.sources.kinds import read_changes
from feed.sources.rows import spark_record_type
from feed.txn.engine import SPARK

from .model import as_multiset, collection_of, debezium_truth
from .test_debezium import SCHEMA, TOAST, end, event, open_emitter, write
from .test_debezium_lines import every_kind


def _rows(t: pa.Table) -> list[dict]:
    """A parse's rows in file and line order, as the dataflow keeps them: the line's
    number left out (Spark's is an id of its own), a skipped line's images too (null in
    the columnar parse), and the text only of a delete or a row with a placeholder."""
    out = sorted(t.to_pylist(), key=lambda r: (r["ord_file"], r["ord_row"]))
    for r in out:
        del r["ord_row"]
        if r["op"] == "x":
            r.pop("before")
            r.pop("after")
        if r["op"] != "d" and r["_toast"] is None:
            r["_raw"] = None
    return out


def _both(spark, files, schema, key, table):
    files = [str(f) for f in files]
    record = spark_record_type(schema)
    assert why_not_columnar(files, record, {}) is None
    ours = read_debezium_columnar(spark, files, record, key, table).toArrow()
    options = {"table": table, "schema": schema}
    theirs = read_changes(spark, "debezium", files, record, key, options).toArrow()
    assert ours.schema == theirs.schema
    return _rows(ours), _rows(theirs)


def test_flat_lines_of_every_kind_parse_as_spark_parses_them(spark, tmp_path):
    src = tmp_path / "in"
    row = {"id": 1, "owner": "a", "doc": "d"}
    # (and an event whose source names no table: the feed's)
    no_table = {**event("c", {**row, "id": 4}, 310, xid=9), "source": {"lsn": 310}}
    write(src, "a.json", [*every_kind(row), no_table])
    lines = [orjson.dumps(event("c", {**row, "id": i}, 400 + i, xid=9)) for i in (5, 6)]
    spaced = event("c", {**row, "id": 7}, 420, xid=9)  # (a sequence as json.dumps writes it)
    spaced["source"]["sequence"] = '["418", "420"]'
    lines.append(orjson.dumps(spaced))
    (src / "b.json").write_bytes(b"\n".join(lines) + b"\n\n   \n")
    files = sorted(src.glob("*.json"))
    for key, table in ((["id"], "public.accounts"), ([], "public.accounts"), (["id"], None)):
        ours, theirs = _both(spark, files, SCHEMA, key, table)
        assert ours == theirs
        assert len(ours) == 14
        assert 418 in {r["pos_hi"] for r in ours}  # (the spaced sequence's commit LSN)
        assert {r["op"] for r in ours} == {"r", "c", "u", "d", "x", "E"}


def test_tables_named_with_dots_or_without_a_schema_are_told_apart_as_spark_does(spark, tmp_path):
    """The columnar parse compares a line's schema and table with the feed's table
    without joining them: every way of naming, dots inside a name and a missing schema
    included, skips the same lines as Spark's join of the two."""
    names = [
        ("public", "accounts"),
        (None, "accounts"),
        (None, "public.accounts"),
        ("pub.lic", "accounts"),
        ("public", "acc.ounts"),
        ("public.acc", "ounts"),
        ("public", None),
        (None, None),
    ]
    lines = []
    for i, (schema, table) in enumerate(names):
        e = event("c", {"id": i, "owner": "a", "doc": "d"}, 500 + i, xid=3)
        e["source"]["schema"], e["source"]["table"] = schema, table
        lines.append(e)
    write(tmp_path / "in", "a.json", lines)
    files = sorted((tmp_path / "in").glob("*.json"))
    for table in ("public.accounts", "accounts", "pub.lic.accounts", "public.acc.ounts"):
        ours, theirs = _both(spark, files, SCHEMA, ["id"], table)
        assert ours == theirs, table
        kept = sum(r["op"] == "c" for r in ours)
        assert 0 < kept < len(names), table


def test_a_generated_history_with_metadata_parses_as_spark_parses_it(spark, tmp_path):
    """The demo's bank, flat, with a ``transaction`` block on each event and an END
    record after each source transaction, in three files."""
    bank = generate_bank(transactions=60, seed=5, wrapped_every=0)
    lines, txn, n, last = [], None, 0, 0
    for raw in bank.events:
        e = orjson.loads(raw)
        xid, lsn = e["source"]["txId"], e["source"]["lsn"]
        if xid != txn and txn is not None:
            lines.append(end(txn, last, {"accounts": n}))
        n = 1 if xid != txn else n + 1
        txn, last = xid, lsn
        lines.append({**e, "transaction": {"id": f"{xid}:{lsn}", "total_order": n}})
    lines.append(end(txn, last, {"accounts": n}))
    src = tmp_path / "in"
    third = len(lines) // 3
    for i in range(3):
        write(src, f"part-{i}.json", lines[i * third : (i + 1) * third if i < 2 else None])
    files = sorted(src.glob("*.json"))
    ours, theirs = _both(spark, files, ACCOUNTS_SCHEMA, ["id"], "public.accounts")
    assert ours == theirs
    assert sum(r["op"] == "E" for r in ours) == bank.transactions
    assert all(r["tx_meta"] for r in ours)


_RECORD = to_arrow_type(spark_record_type(SCHEMA), timezone="UTC")
_GOOD = orjson.dumps(event("c", {"id": 1, "owner": "a"}, 5, xid=1))


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (_GOOD + b"\r\n", "carriage return"),
        (_GOOD.replace(b'"a"', b'"\xff"'), "UTF-8"),
        (_GOOD.replace(b'"a"', b"'a'"), "pyarrow"),  # (Spark takes single quotes)
        (_GOOD.replace(b'"id":1', b'"id":"1"'), "pyarrow"),  # (Spark casts the text)
        (_GOOD + _GOOD, "more than one"),
        (orjson.dumps({"schema": None, "payload": orjson.loads(_GOOD)}), "wrapped"),
        (_GOOD.replace(b'"op":"c"', b'"op":"t"'), "bad row"),
        (_GOOD.replace(b'"op":"c"', b'"op":null'), "bad row"),
        (_GOOD.replace(b'"lsn":5', b'"lsn":null'), "bad row"),
        (_GOOD.replace(b'"id":1', b'"id":null'), "bad row"),
        (_GOOD.replace(b'\\"5\\"', b'\\" 5\\"'), "sequence"),
        (orjson.dumps({"status": "END", "event_count": 1}), "'id'"),
        # (in a field the feed ignores, nested as deep as Spark's reader refuses)
        (_GOOD[:-1] + b',"x":' + b"[" * 1000 + b"]" * 1000 + b"}", "1000 levels deep"),
        (orjson.dumps({**end(1, 5, {"accounts": 1}), "id": "1:5x"}), "END record's id"),
    ],
)
def test_input_the_parsers_may_read_differently_is_declined(body, why, tmp_path):
    assert parse_flat(_GOOD + b"\n", _RECORD, ["id"], "public.accounts", 0, "f").num_rows == 1
    with pytest.raises(Declined, match=why):
        parse_flat(body + b"\n", _RECORD, ["id"], "public.accounts", 0, "f")
    # (the same from a mapped file, as the tasks read theirs)
    (tmp_path / "good.json").write_bytes(_GOOD + b"\n")
    (tmp_path / "bad.json").write_bytes(body + b"\n")
    good = mapped(str(tmp_path / "good.json"))
    assert parse_flat(good, _RECORD, ["id"], "public.accounts", 0, "f").num_rows == 1
    with pytest.raises(Declined, match=why):
        parse_flat(mapped(str(tmp_path / "bad.json")), _RECORD, ["id"], "public.accounts", 0, "f")


def _quarantined(tmp_path) -> list[dict]:
    return [
        orjson.loads(line)
        for p in (tmp_path / "log/t/quarantine").rglob("*.json")
        for line in p.read_bytes().splitlines()
    ]


def test_a_read_that_declines_is_parsed_by_spark_with_its_bad_rows(spark, tmp_path, caplog):
    """A transaction in Spark over a file the columnar parse reads and one it declines (a
    bad row): Spark's reader reads both, the bad row is quarantined with Spark's reason,
    and the feed holds the rest."""
    src = tmp_path / "in"
    good = [event("c", {"id": i, "owner": "a"}, 100 + i, xid=i) for i in range(1, 4)]
    write(src, "part-0.json", good)
    update = event("u", {"id": 2, "owner": "b"}, 150, xid=5, before={"id": 2, "owner": "a"})
    write(src, "part-1.json", [update, {**event("c", {"id": 9}, 200, xid=9), "op": "t"}])
    e = open_emitter(spark, tmp_path, engines=(SPARK,))
    with caplog.at_level(logging.DEBUG, logger="tidefeed.emit"):
        reports = e.run()
    e.close()
    assert "parsed by Spark's JSON reader: file:" in caplog.text
    assert "part-1.json: a bad row" in caplog.text
    assert sum(r.bad_rows for r in reports) == 1
    reader = FeedReader(str(tmp_path / "log"), "t")
    final, _ = debezium_truth([orjson.dumps(x) for x in [*good, update]])
    assert collection_of(reader) == as_multiset(final.values())
    assert [b["reason"] for b in _quarantined(tmp_path)] == [
        "truncate events are not supported: re-snapshot the table into a new feed"
    ]


def _seen(lines: list, ord_file: int = 0):
    record = to_arrow_type(spark_record_type(SCHEMA), timezone="UTC")
    data = b"\n".join(orjson.dumps(x) for x in lines) + b"\n"
    return seen_positions(7, ord_file, parse_flat(data, record, ["id"], None, ord_file, "f"))


@settings(max_examples=200, deadline=None)
@given(
    lines=st.lists(
        st.sampled_from([b"", b" ", b"null", b'{"a":1}', '{"é":2}'.encode()]), max_size=12
    ),
    final=st.booleans(),
    data=st.data(),
)
def test_the_lines_text_comes_out_at_the_rows_asked_as_split_gives_it(lines, final, data):
    """A file's lines, blank ones and ``null`` included: which hold a JSON value and
    which are tombstones, as a split of the text says; and the text of any of them put
    back at their rows (the columnar ``_raw``), null at the others."""
    text = b"\n".join(lines) + (b"\n" if final and lines else b"")
    found = Lines(text)
    with tempfile.TemporaryDirectory() as tmp:  # (the tasks map their files)
        path = Path(tmp) / "f.json"
        path.write_bytes(text)
        from_file = Lines(mapped(str(path)))
        assert [from_file[i] for i in range(len(from_file))] == list(found)
        assert from_file.objects() == found.objects()
    split = text.split(b"\n")[: len(found)]
    assert [found[i] for i in range(len(found))] == split
    objs, tombs = found.objects()
    assert list(objs) == [i for i, x in enumerate(split) if x.strip(b" ") not in (b"", b"null")]
    assert tombs == [i for i, x in enumerate(split) if x.strip(b" ") == b"null"]
    keep = sorted(data.draw(st.sets(st.integers(0, max(len(split) - 1, 0)))) if split else [])
    at = np.array(keep, np.int64)
    raw = found.texts(at, at, len(split)) if keep else None
    if raw is not None:
        raw.validate(full=True)
        expected = [split[i].decode() if i in keep else None for i in range(len(split))]
        assert raw.to_pylist() == expected


def test_the_tasks_show_positions_distinct_only_where_they_are():
    """A file's entry has its range only where no two of its data events share a
    position; a read is shown distinct only with an entry for every file and ranges apart
    (END records and tombstones are no data events)."""
    a = [event("c", {"id": i}, 100 + i, xid=i) for i in range(3)]
    b = [event("c", {"id": 9}, 200, xid=9), end(9, 200, {"accounts": 1}), None]
    assert _seen(a) == (7, 0, 3, (100, 0), (102, 0))
    assert _seen(b, 1)[2:] == (1, (200, 0), (200, 0))
    assert all_distinct([_seen(a), _seen(b, 1)], 2)
    assert not all_distinct([_seen(a)], 2)  # (a file's task said nothing)
    assert _seen([*a, a[1]])[3:] == (None, None)  # an event twice in one file
    assert not all_distinct([_seen([*a, a[1]]), _seen(b, 1)], 2)
    assert not all_distinct([_seen(a), _seen([a[2], *b], 1)], 2)  # in two files: ranges meet
    assert _seen([end(9, 200, {"accounts": 0})])[2:] == (0, None, None)
    assert all_distinct([_seen([end(9, 200, {"accounts": 0})]), _seen(a, 1)], 2)


def test_an_event_delivered_in_two_files_is_released_once(spark, tmp_path, caplog):
    """Debezium delivering an event again in a later file (after a connector restart):
    the ranges of the files' positions meet, so the figures look for repeats, and the
    feed holds the event once."""
    src = tmp_path / "in"
    first = [event("c", {"id": i, "owner": "a"}, 100 + i, xid=i) for i in range(1, 4)]
    write(src, "part-0.json", first)
    later = [first[2], event("u", {"id": 1, "owner": "b"}, 150, xid=5, before=first[0]["after"])]
    write(src, "part-1.json", later)
    e = open_emitter(spark, tmp_path, engines=(SPARK,))
    with caplog.at_level(logging.DEBUG, logger="tidefeed.emit"):
        reports = e.run()
    e.close()
    assert "events at distinct positions: not shown" in caplog.text
    assert sum(r.bad_rows for r in reports) == 0
    final, _ = debezium_truth([orjson.dumps(x) for x in [*first, later[1]]])
    assert collection_of(FeedReader(str(tmp_path / "log"), "t")) == as_multiset(final.values())


@pytest.mark.parametrize(
    "key,metadata",
    [(("id",), False), ((), False), (("id",), True)],
    ids=["keyed", "unkeyed", "keyed-metadata"],
)
def test_a_spark_transaction_takes_the_columnar_parse_where_it_applies(
    spark, tmp_path, key, metadata, caplog
):
    """The same flat history (deletes among them; with ``metadata``, each transaction's
    END record among them) emitted in Spark with ``parse="auto"`` and ``parse="spark"``
    gives the same feed, the truth; only the first parses in the tasks. (Without END
    records, both reads skip the figures' list of them: feed/sources/transactions.py.)"""
    from .model import with_metadata

    bank = generate_bank(transactions=40, seed=9, wrapped_every=0)
    events = with_metadata(bank.events) if metadata else bank.events
    found = {}
    for parse in ("auto", "spark"):
        work = tmp_path / parse
        (work / "in").mkdir(parents=True)
        (work / "in" / "part-0.json").write_bytes(b"\n".join(events) + b"\n")
        e = open_emitter(
            spark, work, key=key, engines=(SPARK,), schema=ACCOUNTS_SCHEMA, table=None, parse=parse
        )
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="tidefeed.emit"):
            reports = e.run()
        e.close()
        assert sum(r.bad_rows for r in reports) == 0
        assert ("parsed by pyarrow in Spark's tasks" in caplog.text) == (parse == "auto")
        if parse == "auto":  # (so the figures skip the check for repeated events)
            assert "events at distinct positions: yes" in caplog.text
        found[parse] = collection_of(FeedReader(str(work / "log"), "t"))
    assert found["auto"] == found["spark"] == as_multiset(bank.final.values())


_texts = st.one_of(st.none(), st.text(max_size=6), st.just(TOAST))
_rows_of = st.fixed_dictionaries({"id": st.integers(-(2**63), 2**63 - 1), "owner": _texts})


@st.composite
def _lines(draw) -> list:
    """Flat lines a connector could write: events of the feed's table and another's, with
    and without transaction blocks, sequences and snapshot marks; END and BEGIN records,
    heartbeats, tombstones."""
    out: list = []
    for n in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["event"] * 6 + ["end", "begin", "heartbeat", "tombstone"]))
        lsn = draw(st.integers(0, 10**15))
        xid = draw(st.integers(1, 9))
        if kind == "event":
            op = draw(st.sampled_from("cudr"))
            row = draw(_rows_of)
            before = draw(st.one_of(st.none(), _rows_of)) if op == "u" else None
            e = event(
                op,
                row,
                lsn,
                xid=xid,
                order=draw(st.one_of(st.none(), st.integers(1, 5))),
                commit=draw(st.one_of(st.none(), st.integers(0, 10**15))),
                table=draw(st.sampled_from(["accounts", "accounts", "ledger"])),
                before=before if before is not None else (row if op == "u" else None),
                snap=draw(st.sampled_from([None, "first", "last", "incremental", "true"])),
            )
            if draw(st.booleans()):
                del e["source"]["sequence"]
            out.append(e)
        elif kind == "end":
            out.append(end(xid, lsn, {"accounts": n % 3, "ledger": 1}))
        elif kind == "begin":
            out.append({"status": "BEGIN", "id": f"{xid}:{lsn}", "event_count": None})
        elif kind == "heartbeat":
            out.append({"ts_ms": lsn})
        else:
            out.append(None)
    return out


@settings(max_examples=12, deadline=None)
@given(files=st.lists(_lines(), min_size=1, max_size=3), keyed=st.booleans())
def test_generated_flat_lines_parse_as_spark_parses_them(spark, files, keyed):
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp)
        for i, lines in enumerate(files):
            write(src, f"part-{i}.json", lines)
        paths = sorted(src.glob("*.json"))
        ours, theirs = _both(spark, paths, SCHEMA, ["id"] if keyed else [], "public.accounts")
    assert ours == theirs
    assert len(ours) == sum(len(lines) for lines in files)


def test_a_file_too_large_to_hold_whole_goes_to_spark_s_reader(tmp_path):
    big = tmp_path / "part-0.json"
    big.write_bytes(_GOOD + b"\n")
    record = spark_record_type(SCHEMA)
    assert why_not_columnar([str(big)], record, {}) is None
    with open(big, "r+b") as f:  # (sparse: no disk used)
        f.truncate(MAX_FILE_BYTES + 1)
    assert why_not_columnar([str(big)], record, {}) == f"a file over 256 MiB ({big})"


def test_a_read_may_hold_end_records_unless_its_bytes_show_none(tmp_path, monkeypatch):
    """The driver's look for END records before a Spark read (feed/sources/transactions.py)
    says "none" only where it is sure: plain local files that hold neither the text END
    nor an escape that could spell it."""
    import gzip

    import feed.sources.transactions as txns

    plain = tmp_path / "plain.json"
    plain.write_bytes(b'{"op":"c","after":{"id":1,"owner":"ann"}}\n')
    ended = tmp_path / "ended.json"
    ended.write_bytes(orjson.dumps(end(1, 5, {"accounts": 1})) + b"\n")
    escaped = tmp_path / "escaped.json"
    escaped.write_bytes(b'{"status":"\\u0045ND","id":"1:5","event_count":1}\n')
    assert orjson.loads(escaped.read_bytes())["status"] == "END"  # (what the escape spells)
    packed = tmp_path / "plain.json.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))

    assert txns.may_hold_ends([str(plain)]) is False
    assert txns.may_hold_ends([str(plain), str(ended)]) is True
    assert txns.may_hold_ends([str(plain), str(escaped)]) is True
    assert txns.may_hold_ends([str(packed)]) is True  # (not read through a codec for it)
    assert txns.may_hold_ends(["s3://bucket/plain.json"]) is True  # (nor from a store)
    assert txns.may_hold_ends([str(tmp_path / "gone.json")]) is True  # (the read says)
    monkeypatch.setattr(txns, "ENDS_SCAN_BYTES", plain.stat().st_size * 2 - 1)
    assert txns.may_hold_ends([str(plain)]) is False
    assert txns.may_hold_ends([str(plain), str(plain)]) is True  # (too much to read twice)
