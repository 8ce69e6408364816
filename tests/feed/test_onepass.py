"""Plain unkeyed transactions computed in one pass give the feed the Spark path gives.

Each history runs through an emitter offered the one-pass engine first (feed/txn/onepass.py)
and through one with the Spark engine alone (feed/txn/spark.py); the feeds must agree time
by time, in their progress and figures, and with the ground truth, and the one-pass engine
must really have taken (and declined) the transactions the case says. The figures of one
file and the partial sums are checked without Spark first.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from feed.demo.data import ACCOUNTS_SCHEMA, generate_bank
from feed.log.reader import FeedReader
from feed.sources.debezium_arrow import parse_flat
from feed.txn.engine import ONEPASS, SPARK
from feed.txn.onepass_figures import _highest, file_figures, highest, plain_figures
from feed.txn.onepass_keyed import last_per_key
from feed.txn.onepass_sums import partial_sums
from protocol.messages import record_key

from ..e2e.helpers import write_parts
from .model import MEASURES, as_multiset, collection_of, emit_bank, with_metadata

TOAST = "__debezium_unavailable_value"
RECORD = pa.struct([("id", pa.int64()), ("x", pa.float64()), ("s", pa.string())])


def _e(op: str, before: dict | None, after: dict | None, lsn: int, **source) -> bytes:
    src = {"lsn": lsn, "txId": lsn, "schema": "public", "table": "m", **source}
    return orjson.dumps({"before": before, "after": after, "op": op, "source": src})


def _parsed(lines: list[bytes], ord_file: int = 0) -> pa.Table:
    data = b"".join(line + b"\n" for line in lines)
    return parse_flat(data, RECORD, (), "public.m", ord_file, f"file:/in/part-{ord_file}.json")


def test_partial_sums_cancel_within_a_file_and_keep_nulls():
    a = {"id": 1, "x": 1.5, "s": None}
    b = {"id": 1, "x": 2.5, "s": None}
    t = _parsed([_e("c", None, a, 10), _e("u", a, b, 11), _e("c", None, {**a, "id": 2}, 12)])
    figures, kept = file_figures(t, (0, 0, 0), 1, 0)
    assert figures.why is None and figures.data == figures.kept == 3
    assert figures.last == (12, 12, 0)  # (a flat event's position: its LSN twice)
    sums = partial_sums(kept, RECORD).to_pylist()
    assert sorted(sums, key=lambda r: r["data"]["id"]) == [
        {"data": b, "diff": 1},
        {"data": {**a, "id": 2}, "diff": 1},
    ]


def test_events_at_or_below_the_committed_position_are_dropped():
    rows = [_e("c", None, {"id": i, "x": None, "s": "a"}, 100 + i) for i in range(4)]
    t = _parsed(rows)
    top = file_figures(t, (0, 0, 0), 1, 0)[0].last
    assert top is not None
    below = (top[0] - 2, top[1] - 2, 0)  # (the position of the third event)
    figures, kept = file_figures(t, below, 1, 0)
    assert (figures.data, figures.kept, figures.last) == (4, 2, top)
    assert [r["data"]["id"] for r in partial_sums(kept, RECORD).to_pylist()] == [2, 3]


@pytest.mark.parametrize(
    "line,why",
    [
        (_e("r", None, {"id": 9, "x": None, "s": None}, 50, snapshot="true"), "snapshot"),
        (
            _e("u", {"id": 9, "x": 1.0, "s": None}, {"id": 9, "x": 1.0, "s": TOAST}, 60),
            "placeholder",
        ),
    ],
)
def test_a_file_that_is_not_plain_says_why(line, why):
    t = _parsed([_e("c", None, {"id": 1, "x": None, "s": None}, 40), line])
    figures, _ = file_figures(t, (0, 0, 0), 1, 0)
    assert figures.why is not None and why in figures.why
    assert plain_figures([figures], 1) == figures.why


def _tx(op: str, before: dict | None, after: dict | None, lsn: int, xid: int, n: int) -> bytes:
    """An event of source transaction ``xid`` with its transaction block (``n``: its place)."""
    e = orjson.loads(_e(op, before, after, lsn, txId=xid))
    e["transaction"] = {"id": f"{xid}:{lsn}", "total_order": n}
    return orjson.dumps(e)


def _end(xid: int, commit: int, count: int) -> bytes:
    counts = [{"data_collection": "public.m", "event_count": count}]
    end = {"status": "END", "id": f"{xid}:{commit}", "event_count": count}
    return orjson.dumps({**end, "data_collections": counts})


def test_source_transactions_straddling_files_are_judged_once_added_up():
    """Transaction 7 whole in the first file (its events at its commit LSN, 12);
    transaction 8 with one event in each file and its END in the second: each file leaves
    it open, and the two together are complete. Without the second file, or with an END
    that counts more, they are not; at a committed position past 7's commit, 7 is done."""
    r = [{"id": i, "x": None, "s": None} for i in range(4)]
    first = [
        _tx("c", None, r[0], 10, 7, 1),
        _tx("c", None, r[1], 11, 7, 2),
        _end(7, 12, 2),
        _tx("c", None, r[2], 13, 8, 1),
    ]
    f0, kept = file_figures(_parsed(first, 0), (0, 0, 0), 1, 0)
    assert f0.why is None and f0.kept == 3 and f0.last == (12, 11, 2)
    assert kept["pos_hi"].to_pylist() == [12, 12, None]  # (8's END is not in the file)
    assert [tuple(o) for o in f0.opened] == [("8", 1, None, None, (13, 1))]
    last = _tx("c", None, r[3], 14, 8, 2)
    f1, _ = file_figures(_parsed([last, _end(8, 15, 2)], 1), (0, 0, 0), 1, 1)
    assert [tuple(o) for o in f1.opened] == [("8", 1, 2, 15, (14, 2))]
    assert plain_figures([f0, f1], 2) is None
    assert highest([f0, f1]) == (15, 14, 2)
    assert "8 without its END record" in (plain_figures([f0], 1) or "")
    more, _ = file_figures(_parsed([last, _end(8, 15, 3)], 1), (0, 0, 0), 1, 1)
    assert "2 events read, its END counts 3" in (plain_figures([f0, more], 2) or "")
    done, _ = file_figures(_parsed(first, 0), (12, 11, 2), 1, 0)
    assert (done.data, done.kept) == (3, 1)  # (7's two events redelivered)
    assert [tuple(o)[:2] for o in done.opened] == [("8", 1)]


def test_an_end_record_twice_or_too_many_open_transactions_decline_the_file(monkeypatch):
    from feed.txn import onepass_txns

    r = {"id": 1, "x": None, "s": None}
    lines = [_tx("c", None, r, 10, 7, 1), _end(7, 11, 1), _end(7, 11, 1)]
    twice, _ = file_figures(_parsed(lines), (0, 0, 0), 1, 0)
    assert "END record read twice" in (twice.why or "")
    monkeypatch.setattr(onepass_txns, "MAX_OPEN", 1)
    rows = [_tx("c", None, {**r, "id": i}, 10 + i, 7 + i, 1) for i in range(2)]
    many, _ = file_figures(_parsed(rows), (0, 0, 0), 1, 0)
    assert "more than 1 source transactions open" in (many.why or "")


def test_files_whose_positions_meet_are_not_plain():
    line = _e("c", None, {"id": 1, "x": None, "s": None}, 40)
    one = file_figures(_parsed([line], 0), (0, 0, 0), 1, 0)
    two = file_figures(_parsed([line], 1), (0, 0, 0), 1, 1)  # (the same position again)
    assert plain_figures([one[0]], 1) is None
    assert "share a position" in (plain_figures([one[0], two[0]], 2) or "")
    assert plain_figures([one[0]], 2) == "a file's task gave no figures"


def test_the_text_of_large_input_is_looked_through_at_each_files_head(tmp_path, monkeypatch):
    from feed.sources.inputs import input_bytes
    from feed.txn import onepass

    plain = [_e("c", None, {"id": i, "x": None, "s": "a"}, 100 + i) for i in range(20)]
    read = _e("r", None, {"id": 99, "x": None, "s": None}, 50, snapshot="true")
    early = write_parts(tmp_path / "early", [plain[0], read, *plain[1:]], 1)
    late = write_parts(tmp_path / "late", [*plain, read], 1)

    def refuses(paths: list[Path]) -> str | None:
        files = [str(p) for p in paths]
        return onepass._text_refuses(files, input_bytes(files))

    assert 'holds \'"op":"r"\'' in (refuses(early) or "")
    assert 'holds \'"op":"r"\'' in (refuses(late) or "")
    monkeypatch.setattr(onepass, "_SCAN_BYTES", 100)  # (both are larger: heads only)
    monkeypatch.setattr(onepass, "_HEAD_BYTES", 3 * len(plain[0]))
    assert 'holds \'"op":"r"\'' in (refuses(early) or "")
    assert refuses(late) is None  # (the tasks will see it)


def test_input_whose_last_line_is_an_event_of_a_source_transaction_is_declined_at_once(
    tmp_path,
):
    """Debezium writes a transaction's END record after its events: input whose last line
    is an event with a transaction block ends inside one, which the Spark path holds back.
    No job parses it to find that out. A last END record, or an event without a
    transaction block, is no such sign."""
    from feed.txn import onepass

    r = {"id": 1, "x": None, "s": None}
    event = _tx("c", None, r, 10, 7, 1)
    plain = _e("c", None, {**r, "id": 2}, 12)
    inside = write_parts(tmp_path / "a", [plain, event], 1)[0]
    ended = write_parts(tmp_path / "b", [event, _end(7, 11, 1)], 1)[0]
    without = write_parts(tmp_path / "c", [event, _end(7, 11, 1), plain], 1)[0]
    assert "ends inside a source transaction" in (onepass._ends_inside(str(inside)) or "")
    assert onepass._ends_inside(str(ended)) is None
    assert onepass._ends_inside(str(without)) is None


def _run(
    spark, src: Path, log: Path, *, one_pass: bool, schema=ACCOUNTS_SCHEMA, key=(), **kw
) -> list:
    e, reports = emit_bank(
        spark,
        src,
        log,
        feed="bank",
        key=key,
        schema=schema,
        granularity="batch",
        driver_txn_bytes=0,  # (the driver engine would take these small transactions)
        engines=(ONEPASS, SPARK) if one_pass else (SPARK,),
        **kw,
    )
    e.close()
    return reports


def _times(log: Path) -> tuple[int, dict[int, Counter]]:
    reader = FeedReader(str(log), "bank")
    times = {
        t: Counter(
            (record_key({k: v for k, v in r.items() if k != "diff"}), r["diff"])
            for r in reader.table(t).to_pylist()
        )
        for t in reader.times()
    }
    return reader.frontier, times


def test_a_history_gives_the_feed_the_spark_path_gives(spark, tmp_path):
    """Plain files, two to a transaction (one redelivering the tail of a committed one,
    with a line of another table skipped), then a file with an incremental snapshot read,
    which the one-pass engine declines: the same feed, progress and figures either way."""
    bank = generate_bank(transactions=24, seed=21, wrapped_every=0)
    events = bank.events
    src = tmp_path / "in"
    third = len(events) // 3
    write_parts(src, events[:third], 2)  # transaction 1: two files
    other = orjson.loads(events[third])
    other["source"] = {**other["source"], "table": "audit"}  # skipped: another table
    tail = events[third - 3 : third]  # redelivered: committed already
    write_parts(src, [*tail, orjson.dumps(other), *events[third : 2 * third]], 2, start=2)
    # transaction 3 reads a file with an incremental snapshot read, whose text the one-pass
    # engine declines before any job: the Spark path takes that one
    snap = orjson.loads(events[2 * third])
    read = {"op": "r", "before": None, "after": snap["after"] or snap["before"]}
    read["source"] = {**snap["source"], "snapshot": "incremental"}
    write_parts(src, [orjson.dumps(read), *events[2 * third + 1 :]], 1, start=4)
    persisted = spark.sparkContext._jsc.getPersistentRDDs().size()
    on = _run(spark, src, tmp_path / "one", one_pass=True, max_files_per_txn=2)
    off = _run(spark, src, tmp_path / "spark", one_pass=False, max_files_per_txn=2)
    assert spark.sparkContext._jsc.getPersistentRDDs().size() == persisted

    assert [r.progress for r in on] == [r.progress for r in off]
    figures = [(r.input_rows, r.redelivered, r.skipped, r.held) for r in on]
    assert figures == [(r.input_rows, r.redelivered, r.skipped, r.held) for r in off]
    assert sum(r.redelivered for r in on) == 3 and any(r.skipped for r in on)
    assert ["one_pass" in r.seconds for r in on] == [True, True, False]
    assert _times(tmp_path / "one") == _times(tmp_path / "spark")
    assert collection_of(FeedReader(str(tmp_path / "one"), "bank")) == as_multiset(
        bank.final.values()
    )


def test_input_found_not_plain_by_its_tasks_goes_to_the_spark_path(
    spark, tmp_path, caplog, monkeypatch
):
    """A snapshot read among the lines, the text not looked through first (as past the
    head of a large file): the tasks' figures decline it, nothing is written, the Spark
    path computes it, and the feed equals the table."""
    import logging

    from feed.txn import onepass

    monkeypatch.setattr(onepass, "_SCAN_BYTES", -1)
    monkeypatch.setattr(onepass, "_HEAD_BYTES", 0)
    caplog.set_level(logging.DEBUG, logger="tidefeed.emit")
    bank = generate_bank(transactions=8, seed=5, wrapped_every=0)
    src = tmp_path / "in"
    first = orjson.loads(bank.events[0])
    first["op"] = "r"
    first["source"] = {**first["source"], "snapshot": "last"}
    write_parts(src, [orjson.dumps(first), *bank.events[1:]], 1)
    persisted = spark.sparkContext._jsc.getPersistentRDDs().size()
    on = _run(spark, src, tmp_path / "one", one_pass=True)
    assert spark.sparkContext._jsc.getPersistentRDDs().size() == persisted
    assert ["one_pass" in r.seconds for r in on] == [False]
    assert "not a one-pass transaction: file:" in caplog.text
    assert "a snapshot read or a snapshot's end" in caplog.text
    assert collection_of(FeedReader(str(tmp_path / "one"), "bank")) == as_multiset(
        bank.final.values()
    )


def test_floating_point_records_consolidate_across_files_as_in_spark(spark, tmp_path):
    """-0.0 and 0.0 are one value when Spark groups updates: a record inserted as -0.0 in
    one file and as 0.0 in another is one record of diff 2, written as 0.0, though each
    file's task sums apart; a no-op update cancels. (A NaN, given as the text "NaN", is
    declined by the columnar parse: tests/feed/test_driver_txn.py has it.)"""

    def m(op: str, i: int, before: str | None, after: str | None, lsn: int) -> bytes:
        row = "null" if before is None else f'{{"id":{i},"x":{before}}}'
        new = "null" if after is None else f'{{"id":{i},"x":{after}}}'
        source = f'{{"lsn":{lsn},"txId":{lsn},"schema":"public","table":"m"}}'
        return f'{{"before":{row},"after":{new},"op":"{op}","source":{source}}}'.encode()

    src = tmp_path / "in"
    write_parts(src, [m("c", 1, None, "-0.0", 10), m("c", 2, None, "2.5", 11)], 1)
    write_parts(src, [m("c", 1, None, "0.0", 20), m("u", 2, "2.5", "2.5", 21)], 1, start=1)
    write_parts(src, [m("c", 3, None, "1.5", 30), m("u", 3, "1.5", "-0.0", 31)], 1, start=2)
    on = _run(spark, src, tmp_path / "one", one_pass=True, schema=MEASURES)
    off = _run(spark, src, tmp_path / "spark", one_pass=False, schema=MEASURES)
    assert ["one_pass" in r.seconds for r in on] == [True]
    assert [r.progress for r in on] == [r.progress for r in off]

    def updates(log: Path) -> list[tuple[str, int, int]]:
        reader = FeedReader(str(log), "bank")
        rows = [r for t in reader.times() for r in reader.table(t).to_pylist()]
        return sorted((repr(r["x"]), r["id"], r["diff"]) for r in rows)

    assert updates(tmp_path / "one") == updates(tmp_path / "spark")
    assert ("0.0", 1, 2) in updates(tmp_path / "one")


def test_after_the_parse_declines_a_feed_small_input_goes_to_the_spark_path_at_once(
    spark, tmp_path, caplog
):
    """Lines the columnar parse declines (a key given as text, which Spark's reader casts):
    the first transaction is parsed, declined and computed by the Spark path; the next,
    small, is not parsed in one pass again (a job lost in every small transaction of a
    follower otherwise). The feed is the Spark path's either way."""
    import logging

    caplog.set_level(logging.DEBUG, logger="tidefeed.emit")

    def m(i: int, lsn: int) -> bytes:
        row = {"id": str(i), "x": 1.5}
        return orjson.dumps({"before": None, "after": row, "op": "c", "source": {"lsn": lsn}})

    src = tmp_path / "in"
    write_parts(src, [m(1, 10), m(2, 11)], 1)
    write_parts(src, [m(3, 20)], 1, start=1)
    on = _run(spark, src, tmp_path / "one", one_pass=True, schema=MEASURES, max_files_per_txn=1)
    off = _run(spark, src, tmp_path / "spark", one_pass=False, schema=MEASURES, max_files_per_txn=1)
    assert ["one_pass" in r.seconds for r in on] == [False, False]
    assert "JSON pyarrow does not read as Spark does" in caplog.text
    assert "declined this feed's input before" in caplog.text
    assert [r.progress for r in on] == [r.progress for r in off]
    assert _times(tmp_path / "one") == _times(tmp_path / "spark")


def test_input_gone_before_the_engine_looks_is_declined_for_the_spark_path_to_name(tmp_path):
    """A listed file removed before the engine looks at it: declined with why, no
    exception (the Spark path then says what is wrong, as without this engine)."""
    from types import SimpleNamespace

    from feed.sources.registry import source_kind
    from feed.sources.rows import spark_record_type
    from feed.txn import onepass
    from feed.txn.engine import Job

    here = write_parts(tmp_path / "in", [_e("c", None, {"id": 1, "x": None, "s": None}, 40)], 1)
    config = SimpleNamespace(
        kind=source_kind("debezium"), parse="auto", granularity="batch", tx_metadata=None
    )
    ctx = SimpleNamespace(
        config=config,
        info=SimpleNamespace(key=(), schema=MEASURES),
        record_type=spark_record_type(MEASURES),
        feedlog=SimpleNamespace(root=str(tmp_path / "log")),
    )
    assert onepass._settings_refuse(ctx, Job(seq=1, files=[str(here[0])])) is None
    here[0].unlink()
    why = onepass._settings_refuse(ctx, Job(seq=1, files=[str(here[0])]))
    assert why is not None and "input that cannot be read" in why and "part-0000" in why


def test_each_keys_last_event_in_a_file_and_whether_it_was_upserted():
    """A file's task keeps each key's last event by position, whatever the line order,
    and whether any event of the key upserted it (a key only deleted has not)."""
    from pyspark.sql.pandas.types import from_arrow_type, to_arrow_schema

    from feed.txn.onepass_keyed import task_output

    a = {"id": 1, "x": 1.5, "s": "a"}
    b = {"id": 1, "x": 2.5, "s": "b"}
    c = {"id": 2, "x": None, "s": None}
    lines = [
        _e("u", a, b, 12),  # (written before the insert it follows)
        _e("c", None, a, 11),
        _e("d", c, None, 13),
        _e("c", None, {"id": 3, "x": 0.5, "s": None}, 14),
        _e("d", {"id": 3, "x": None, "s": None}, None, 15),
    ]
    t = _parsed(lines)
    image = from_arrow_type(RECORD)  # (the Spark form of the lines' record)
    schema = to_arrow_schema(task_output(image, ("id",)), timezone="UTC")
    rows = last_per_key(t, ("id",), schema).to_pylist()
    got = {r["k"]["id"]: (r["op"], r["after"], r["up"], r["o"]["pos_lo"]) for r in rows}
    assert got == {1: ("u", b, 1, 12), 2: ("d", None, 0, 13), 3: ("d", None, 1, 15)}


def test_a_key_changed_by_a_transaction_open_across_files_waits_for_its_commit_lsn():
    """Key 1 changed by transaction 7 (whole in file 0), then by 8, whose END is in file 1
    and whose events in file 0 have no commit LSN there; key 2 only by 7. Across files,
    key 2 is settled at once, key 1 is pending with its rows; once 8's commit LSN is
    known, 8's image wins, as it would by commit order on the Spark path."""
    from pyspark.sql.pandas.types import from_arrow_type, to_arrow_schema

    from feed.txn.onepass_keyed import _lasts, _settle, last_output, task_output

    a, b, c = ({"id": 1, "x": v, "s": None} for v in (1.5, 2.5, 3.5))
    two = {"id": 2, "x": 0.5, "s": None}
    first = [
        _tx("c", None, a, 10, 7, 1),
        _tx("c", None, two, 11, 7, 2),
        _end(7, 12, 2),
        _tx("u", a, b, 13, 8, 1),
        _tx("u", b, c, 14, 8, 2),
    ]
    image = from_arrow_type(RECORD)
    out = task_output(image, ("id",))
    schema = to_arrow_schema(out, timezone="UTC")
    t = _parsed(first, 0)
    _, kept = file_figures(t, (0, 0, 0), 1, 0)
    rows = last_per_key(kept, ("id",), schema)
    got = sorted(
        (r["k"]["id"], r["txn"] or "", r["o"]["pos_hi"], r["after"]) for r in rows.to_pylist()
    )
    assert got == [(1, "", 12, a), (1, "8", None, c), (2, "", 12, two)]

    across = to_arrow_schema(last_output(out), timezone="UTC")
    merged = pa.Table.from_batches(list(_lasts(iter(rows.to_batches()), across)))
    by_key = sorted((r["k"]["id"], r["pending"], r["txn"] or "") for r in merged.to_pylist())
    assert by_key == [(1, True, ""), (1, True, "8"), (2, False, "")]
    settled_schema = pa.schema(list(across)[:5])  # (last_images' columns)
    waiting = merged.filter(merged["pending"]).to_batches()
    settled = pa.Table.from_batches(list(_settle(iter(waiting), settled_schema, {"8": 15})))
    assert [(r["k"]["id"], r["img"], r["p"]["pos_hi"]) for r in settled.to_pylist()] == [(1, c, 15)]


def test_a_tasks_files_merged_before_the_shuffle_give_what_they_give_apart():
    """A task of two files merges their rows before the shuffle: key 1 changed by
    transaction 7 and by 8, whose END is in the second file; key 2 by 7 and then by 9 in
    the second file. What the job takes across tasks from the merged rows is what it
    takes from each file's rows; the unkeyed partial sums merged are the sums of both
    files' events."""
    from pyspark.sql.pandas.types import from_arrow_type, to_arrow_schema

    from feed.txn.onepass_keyed import _lasts, last_output, merge, task_output
    from feed.txn.onepass_sums import merge_sums

    a, b, c = ({"id": 1, "x": v, "s": None} for v in (1.5, 2.5, 3.5))
    two, later = {"id": 2, "x": 0.5, "s": None}, {"id": 2, "x": 0.75, "s": "z"}
    files = [
        [
            *(_tx("c", None, a, 10, 7, 1), _tx("c", None, two, 11, 7, 2), _end(7, 12, 2)),
            *(_tx("u", a, b, 13, 8, 1), _tx("u", b, c, 14, 8, 2)),
        ],
        [_end(8, 15, 2), _tx("u", two, later, 16, 9, 1), _end(9, 17, 1)],
    ]
    kept = [file_figures(_parsed(f, i), (0, 0, 0), 1, i)[1] for i, f in enumerate(files)]
    out = task_output(from_arrow_type(RECORD), ("id",))
    schema = to_arrow_schema(out, timezone="UTC")
    rows = [last_per_key(k, ("id",), schema) for k in kept]
    merged = merge(rows)
    assert merged.schema == schema and merged.num_rows == 3
    across = to_arrow_schema(last_output(out), timezone="UTC")

    def taken(parts: list[pa.Table]) -> list[tuple]:
        batches = [b for p in parts for b in p.to_batches()]
        got = pa.Table.from_batches(list(_lasts(iter(batches), across))).to_pylist()
        return sorted((r["k"]["id"], r["txn"] or "", r["pending"], r["img"]) for r in got)

    assert (
        taken([merged])
        == taken(rows)
        == [(1, "", True, a), (1, "8", True, c), (2, "", False, later)]
    )
    sums = [partial_sums(k, RECORD) for k in kept]
    both = partial_sums(pa.concat_tables(kept), RECORD)
    assert Counter(map(str, merge_sums(sums, RECORD).to_pylist())) == Counter(
        map(str, both.to_pylist())
    )
    assert sorted(r["data"]["id"] for r in both.to_pylist()) == [1, 2]


def test_files_are_spread_over_tasks_by_their_bytes(tmp_path):
    from feed.txn.onepass import FILES_PER_TASK, task_files

    sizes = [900, 100, 500, 400, 300, 200]
    paths = []
    for i, n in enumerate(sizes):
        paths.append(str(tmp_path / f"part-{i}"))
        Path(paths[-1]).write_bytes(b"x" * n)
    groups = task_files(paths, 2)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert sorted(sum(sizes[i] for i in g) for g in groups) == [1200, 1200]
    assert task_files(paths, 8) == [[i] for i in (0, 2, 3, 4, 5, 1)]
    assert task_files([*paths, str(tmp_path / "gone")], 1) == [list(range(7))]
    many = [*paths, *paths, *paths]  # (eighteen files: no task reads more than eight)
    groups = task_files(many, 2)
    assert len(groups) == 3 and all(len(g) <= FILES_PER_TASK for g in groups)
    assert sorted(i for g in groups for i in g) == list(range(18))


def test_a_keyed_history_gives_the_feed_the_spark_path_gives(spark, tmp_path):
    """A keyed feed, two files a transaction, accounts opened, changed, closed and
    reopened across transactions (each later one diffed against the state the earlier
    ones left): the one-pass engine takes every transaction, and the feed, its progress
    and figures are the Spark path's, and the collection is the table."""
    bank = generate_bank(transactions=40, seed=33, wrapped_every=0)
    src = tmp_path / "in"
    write_parts(src, bank.events, 8)
    on = _run(spark, src, tmp_path / "one", one_pass=True, key=("id",), max_files_per_txn=2)
    off = _run(spark, src, tmp_path / "spark", one_pass=False, key=("id",), max_files_per_txn=2)
    assert len(on) == 4 and all("one_pass" in r.seconds for r in on)
    assert [r.progress for r in on] == [r.progress for r in off]
    figures = [(r.input_rows, r.redelivered, r.skipped, r.bad_rows) for r in on]
    assert figures == [(r.input_rows, r.redelivered, r.skipped, r.bad_rows) for r in off]
    assert _times(tmp_path / "one") == _times(tmp_path / "spark")
    assert collection_of(FeedReader(str(tmp_path / "one"), "bank")) == as_multiset(
        bank.final.values()
    )


def test_a_delete_of_a_key_not_present_goes_to_the_spark_path(spark, tmp_path, caplog):
    """A keyed transaction deleting a key that has no row: the one-pass engine declines
    it, nothing written, and the Spark path quarantines the delete; the feed is the Spark
    path's either way."""
    import logging

    caplog.set_level(logging.DEBUG, logger="tidefeed.emit")
    row = {"id": 1, "x": 1.5}
    src = tmp_path / "in"
    write_parts(src, [_e("c", None, row, 10), _e("c", None, {"id": 2, "x": 2.5}, 11)], 1)
    write_parts(
        src,
        [_e("d", {"id": 7, "x": None}, None, 20), _e("u", row, row | {"x": 3.0}, 21)],
        1,
        start=1,
    )
    kw = dict(schema=MEASURES, key=("id",), max_files_per_txn=1)
    on = _run(spark, src, tmp_path / "one", one_pass=True, **kw)
    off = _run(spark, src, tmp_path / "spark", one_pass=False, **kw)
    assert ["one_pass" in r.seconds for r in on] == [True, False]
    assert "1 delete(s) of a key that is not present" in caplog.text
    assert [r.bad_rows for r in on] == [r.bad_rows for r in off] == [0, 1]
    assert [r.progress for r in on] == [r.progress for r in off]
    assert _times(tmp_path / "one") == _times(tmp_path / "spark")


def test_a_key_changed_in_several_files_of_one_transaction_ends_as_its_last_event(spark, tmp_path):
    """One transaction of three files, the lines of each out of position order: key 1
    inserted, updated, deleted in the next file and inserted again in the third; key 2
    inserted and deleted in one file. Each file's task keeps its own last event, and the
    last across files wins, as on the Spark path. A double-valued key goes to the Spark
    path (Spark groups -0.0 with 0.0, pyarrow may not)."""
    a, b, c = ({"id": 1, "x": v} for v in (1.5, 2.5, 3.5))
    two = {"id": 2, "x": 0.5}
    src = tmp_path / "in"
    write_parts(src, [_e("u", a, b, 11), _e("c", None, a, 10), _e("c", None, two, 12)], 1)
    write_parts(src, [_e("d", two, None, 21), _e("d", b, None, 20)], 1, start=1)
    write_parts(src, [_e("c", None, c, 30)], 1, start=2)
    kw = dict(schema=MEASURES, key=("id",), max_files_per_txn=3)
    on = _run(spark, src, tmp_path / "one", one_pass=True, **kw)
    off = _run(spark, src, tmp_path / "spark", one_pass=False, **kw)
    assert ["one_pass" in r.seconds for r in on] == [True]
    assert [r.progress for r in on] == [r.progress for r in off]
    assert _times(tmp_path / "one") == _times(tmp_path / "spark")
    assert collection_of(FeedReader(str(tmp_path / "one"), "bank")) == as_multiset([c])
    by_x = _run(spark, src, tmp_path / "x", one_pass=True, **{**kw, "key": ("x",)})
    assert ["one_pass" in r.seconds for r in by_x] == [False]


def _metadata_history(src: Path, seed: int) -> list[bytes]:
    """A bank history with transaction metadata in five files, each of the first four
    ending inside a source transaction but the second, which ends at an END record."""
    lines = with_metadata(generate_bank(transactions=24, seed=seed, wrapped_every=0).events)
    ends = [i + 1 for i, line in enumerate(lines) if b'"status":"END"' in line]

    def inside(j: int) -> int:  # before the last event of a source transaction of two or more
        while b'"BEGIN"' in lines[ends[j] - 3]:
            j += 1
        return ends[j] - 2

    q = len(ends) // 4
    cuts = [0, inside(q), ends[2 * q], inside(3 * q), inside(3 * q + 2), len(lines)]
    for i in range(5):
        write_parts(src, lines[cuts[i] : cuts[i + 1]], 1, start=i)
    return lines


@pytest.mark.parametrize(
    ("key", "settled_in"), [((), None), (("id",), "driver"), (("id",), "tasks")]
)
def test_a_history_with_transaction_metadata_gives_the_feed_the_spark_path_gives(
    spark, tmp_path, monkeypatch, key, settled_in
):
    """Source transactions straddling files, two files a transaction: the one pass takes
    a transaction whose source transactions are all complete (adding up each one's
    events and its END across files), declines one that ends inside a source transaction
    (nothing written: the Spark path holds it back and reads its file again), and takes
    the next, which completes it. Feed, progress and figures are the Spark path's. Keyed,
    the keys that waited for a commit LSN are settled on the driver, or (more of them
    than it takes) in Spark's tasks."""
    from feed.txn import onepass_keyed

    waiting: list[int | None] = []
    settle = onepass_keyed.settle

    def counted(last, commits, pending=None):
        waiting.append(pending)
        return settle(last, commits, pending)

    monkeypatch.setattr(onepass_keyed, "settle", counted)
    if settled_in == "tasks":
        monkeypatch.setattr(onepass_keyed, "DRIVER_PENDING", 0)
    src = tmp_path / "in"
    _metadata_history(src, seed=41)
    bank = generate_bank(transactions=24, seed=41, wrapped_every=0)
    on = _run(spark, src, tmp_path / "one", one_pass=True, key=key, max_files_per_txn=2)
    off = _run(spark, src, tmp_path / "spark", one_pass=False, key=key, max_files_per_txn=2)
    assert ["one_pass" in r.seconds for r in on] == [True, False, True]
    assert [r.held for r in on] == [r.held for r in off] == [0, 1, 0]
    assert [r.progress for r in on] == [r.progress for r in off]
    figures = [(r.input_rows, r.redelivered, r.skipped) for r in on]
    assert figures == [(r.input_rows, r.redelivered, r.skipped) for r in off]
    assert _times(tmp_path / "one") == _times(tmp_path / "spark")
    assert collection_of(FeedReader(str(tmp_path / "one"), "bank")) == as_multiset(
        bank.final.values()
    )
    if key:  # (the history has keys that wait: the settling was put to the test)
        assert any(n for n in waiting), waiting


_position = st.tuples(st.one_of(st.none(), st.integers(0, 3)), st.integers(0, 3), st.integers(0, 3))


@given(st.lists(_position, max_size=20))
def test_a_files_highest_position_is_the_greatest_placed_one(positions):
    """A file's highest position (the commit's) is the greatest of its kept events that
    have a commit LSN, those without one aside; None when none has."""
    cols = list(zip(*positions, strict=True)) if positions else [(), (), ()]
    kept = pa.table(
        {
            c: pa.array(v, pa.int64())
            for c, v in zip(("pos_hi", "pos_lo", "pos_n"), cols, strict=True)
        }
    )
    placed = [p for p in positions if p[0] is not None]
    assert _highest(kept) == (max(placed) if placed else None)
