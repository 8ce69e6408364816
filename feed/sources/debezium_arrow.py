"""Flat Debezium JSON lines parsed by pyarrow, in a Spark task (:mod:`feed.sources.columnar`).

Spark's JSON reader parses a line at a time; pyarrow's is C++ over whole blocks.
:func:`parse_flat` gives one file's lines as the canonical columns of
:func:`feed.sources.debezium.read_debezium`, built with ``pyarrow.compute``, rule by rule,
for the input where the two parsers agree exactly. Anything else it declines
(:class:`~feed.sources.connect_json.Declined`), naming why: a line broken by a carriage
return or holding a tab, bytes that are not UTF-8, anything pyarrow's strict JSON refuses
(Spark's reader is more lenient: single quotes, a number given as text), a line of more
than one JSON value, a wrapped line (``{"schema", "payload"}``, whose table shape only
Spark's parse computes), a ``source.sequence`` or END id that is not plain digits, and
any bad row (Spark's error texts are the ones users see). Declining is never wrong, only
slower: Spark's reader parses the input instead.

Two columns differ from Spark's on purpose, as in :mod:`feed.sources.debezium_lines`:
``ord_row`` is the line's number in its file (Spark's grows with it, with gaps), and a
skipped line's images are null.
"""

from __future__ import annotations

import functools
import mmap
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from feed.sources.connect import TOAST_PLACEHOLDER
from feed.sources.connect_json import Declined
from feed.sources.debezium import (
    SKIP_HEARTBEAT,
    SKIP_OTHER_TABLE,
    SKIP_TOMBSTONE,
    SKIP_TX_METADATA,
)
from feed.sources.file_text import Lines, is_ascii

__all__ = ["DECLINED_OP", "MAX_DEPTH", "NOT_NULL", "OUT", "declined_batch", "parse_flat"]

#: the ``op`` of the one row a task gives for a file that declines, with why in ``_error``
DECLINED_OP = "!"
#: the columns, in read_debezium's order, and those its parse says are never null
OUT = (
    "op", "before", "after", "weight", "pos_hi", "pos_lo", "pos_n", "txn", "tx_meta",
    "tx_count", "ord_file", "ord_row", "_file", "_raw", "_error", "_skip", "_toast", "_snap",
    "_shape",
)  # fmt: skip
NOT_NULL = ("weight", "pos_n", "ord_row", "_file")
#: nesting Spark's JSON reader finds malformed (Jackson's limit; 999 levels read, 1 001
#: are malformed): a line with this many brackets declines
MAX_DEPTH = 1000
_BLOCK = 1 << 24  # pyarrow's JSON block: a longer line declines
_LONG = r"-?[0-9]{1,18}"  # a number text every reader takes as a long alike


def declined_batch(record: pa.StructType, why: str) -> pa.RecordBatch:
    """The one row a task gives for a file that declines: :data:`DECLINED_OP`, ``why`` in
    ``_error``."""
    t = _tombstones(record, [0], -1, "", None)
    t = t.set_column(0, "op", pa.array([DECLINED_OP])).set_column(14, "_error", pa.array([why]))
    return t.to_batches()[0]


def _line_type(record: pa.StructType) -> pa.Schema:
    """What a flat line may hold, in the types both parsers read alike (every value may
    be missing: Spark's checks, not the parse, find a missing key)."""
    record = pa.struct([f.with_nullable(True) for f in record])
    source = pa.struct(
        [
            ("lsn", pa.int64()),
            ("txId", pa.int64()),
            ("sequence", pa.string()),
            ("schema", pa.string()),
            ("table", pa.string()),
            ("snapshot", pa.string()),
        ]
    )
    collections = pa.list_(
        pa.struct([("data_collection", pa.string()), ("event_count", pa.int64())])
    )
    return pa.schema(
        [
            ("before", record),
            ("after", record),
            ("source", source),
            ("op", pa.string()),
            ("transaction", pa.struct([("id", pa.string()), ("total_order", pa.int64())])),
            ("status", pa.string()),
            ("id", pa.string()),
            ("event_count", pa.int64()),
            ("data_collections", collections),
            # (present only on wrapped lines, which decline)
            ("schema", pa.struct([("type", pa.string())])),
            ("payload", pa.struct([("op", pa.string())])),
        ]
    )


def parse_flat(
    data: bytes | mmap.mmap,
    record: pa.StructType,
    key: Sequence[str],
    table: str | None,
    ord_file: int,
    name: str,
    threads: bool = True,
) -> pa.Table:
    """One file's flat Debezium lines (``data``) as the canonical columns of
    :func:`feed.sources.debezium.read_debezium`; raises :class:`Declined` for a file
    Spark must parse (see the module docstring). ``threads``: pyarrow's reader parses
    blocks on several threads, a third more CPU for a shorter wall: only for a task
    that has cores to itself."""
    import pyarrow.json as pj

    if data.find(b"\r") >= 0:
        raise Declined("a line broken by a carriage return")
    if data.find(b"\t") >= 0:  # (JSON's other blank: a line of a tab and null crash pyarrow)
        raise Declined("a tab between JSON's tokens")
    if not is_ascii(data):  # (pyarrow's parse does not check the text: this does)
        offsets = pa.array([0, len(data)], pa.int64()).buffers()[1]
        try:
            text = pa.Array.from_buffers(pa.large_string(), 1, [None, offsets, pa.py_buffer(data)])
            text.validate(full=True)
        except pa.ArrowInvalid:
            raise Declined("bytes that are not UTF-8") from None
    lines = Lines(data)
    if any(
        lines[n].count(b"{") + lines[n].count(b"[") >= MAX_DEPTH
        for n in lines.longer(2 * MAX_DEPTH)
    ):  # (Spark finds a line nested that deep malformed; pyarrow reads it)
        raise Declined(f"a line that may nest {MAX_DEPTH} levels deep or more")
    objs, tombs = lines.objects()
    text = data if len(objs) == len(lines) else b"\n".join(lines[n] for n in objs)
    options = pj.ParseOptions(
        explicit_schema=_line_type(record), unexpected_field_behavior="ignore"
    )
    read = pj.ReadOptions(block_size=_BLOCK, use_threads=threads)
    try:
        t = (
            pj.read_json(pa.BufferReader(text), read_options=read, parse_options=options)
            if objs
            else _line_type(record).empty_table()
        )
    except pa.ArrowInvalid as e:
        raise Declined(f"JSON pyarrow does not read as Spark does ({e})") from None
    if t.num_rows != len(objs):
        raise Declined("a line of more than one JSON value")
    if t.column("payload").null_count != t.num_rows or t.column("schema").null_count != t.num_rows:
        raise Declined("wrapped lines (a Connect schema and payload)")
    numbers = np.arange(len(objs)) if isinstance(objs, range) else np.asarray(objs, np.int64)
    out = _columns(t, record, key, table, lambda at, n: lines.texts(numbers[at], at, n))
    out = out.append_column("ord_row", pa.array(numbers))
    cols = _order(out, ord_file, name)
    if not tombs:
        return cols
    return pa.concat_tables([cols, _tombstones(record, tombs, ord_file, name, cols.schema)])


def _order(t: pa.Table, ord_file: int, name: str) -> pa.Table:
    n = t.num_rows
    t = t.append_column("ord_file", pa.array(np.full(n, ord_file, np.int64)))
    t = t.append_column("_file", pa.repeat(pa.scalar(name, pa.string()), n))
    t = t.append_column("weight", pa.array(np.ones(n, np.int64)))
    t = t.append_column("_error", pa.nulls(n, pa.string()))
    t = t.append_column("_shape", pa.nulls(n, pa.int64()))
    return t.select(list(OUT))


def _tombstones(
    record: pa.StructType, at: list[int], ord_file: int, name: str, schema: pa.Schema | None
) -> pa.Table:
    n = len(at)
    cols = {
        "op": pa.array(["x"] * n, pa.string()),
        "before": pa.nulls(n, record),
        "after": pa.nulls(n, record),
        "weight": pa.array([1] * n, pa.int64()),
        "pos_hi": pa.array([0] * n, pa.int64()),
        "pos_lo": pa.nulls(n, pa.int64()),
        "pos_n": pa.array([0] * n, pa.int64()),
        "txn": pa.nulls(n, pa.string()),
        "tx_meta": pa.array([False] * n, pa.bool_()),
        "tx_count": pa.nulls(n, pa.int64()),
        "ord_file": pa.array([ord_file] * n, pa.int64()),
        "ord_row": pa.array(at, pa.int64()),
        "_file": pa.array([name] * n, pa.string()),
        "_raw": pa.nulls(n, pa.string()),
        "_error": pa.nulls(n, pa.string()),
        "_skip": pa.array([SKIP_TOMBSTONE] * n, pa.string()),
        "_toast": pa.nulls(n, pa.string()),
        "_snap": pa.nulls(n, pa.string()),
        "_shape": pa.nulls(n, pa.int64()),
    }
    t = pa.table(cols)
    return t if schema is None else t.cast(schema)


def _false(mask: pa.Array) -> pa.Array:
    return pc.fill_null(mask, False)


def _long_text(text: pa.Array, what: str, pattern: str = _LONG) -> pa.Array:
    """``text`` as longs where it matches ``pattern``; declined where a value does not."""
    ok = pc.match_substring_regex(text, f"^(?:{pattern})$")
    if pc.any(pc.invert(_false(pc.or_kleene(ok, pc.is_null(text))))).as_py():
        raise Declined(f"{what} that is not a plain number")
    return pc.cast(pc.if_else(ok, text, None), pa.int64())


def _before_first(text: pa.Array, sep: str) -> pa.Array:
    """Spark's ``substring_index(text, sep, 1)``: what comes before the first ``sep``."""
    return pc.struct_field(pc.extract_regex(text, f"^(?P<v>[^{sep}]*)"), "v")


def _after_last(text: pa.Array, sep: str) -> pa.Array:
    """Spark's ``substring_index(text, sep, -1)``: what comes after the last ``sep``."""
    return pc.struct_field(pc.extract_regex(text, f"(?P<v>[^{sep}]*)$"), "v")


def _sequence_hi(seq: pa.Array) -> pa.Array:
    """The commit LSN of ``source.sequence`` (its first item), where it has one; declined
    where the text is not a list of numbers as text (Spark's ``from_json`` takes more).
    Items may be apart by spaces after the comma (Debezium's Jackson writes none; Python's
    ``json.dumps`` writes one)."""
    item = r'(?:null|"[0-9]*")'
    whole = pc.match_substring_regex(seq, rf'^\[(?:(?:null|"{_LONG}")(?:, *{item})*)?\]$')
    if pc.any(pc.invert(_false(pc.or_kleene(whole, pc.is_null(seq))))).as_py():
        raise Declined("a source.sequence other than a list of numbers as text")
    first = pc.struct_field(pc.extract_regex(seq, rf'^\[(?:"(?P<v>{_LONG})")?'), "v")
    return pc.cast(pc.if_else(pc.equal(first, ""), None, first), pa.int64())


def _columns(
    t: pa.Table,
    record: pa.StructType,
    key: Sequence[str],
    table: str | None,
    lines: Callable[[Any, int], pa.Array],
) -> pa.Table:
    """The canonical columns of the parsed lines ``t`` but their place in the input
    (:func:`feed.sources.debezium.read_debezium`, rule by rule); ``lines(at, n)`` gives
    the text of the lines of ``t``'s rows ``at`` (numpy, ascending) as :meth:`~feed.sources.
    file_text.Lines.texts` does."""
    n = t.num_rows
    op, status = t.column("op").combine_chunks(), t.column("status").combine_chunks()
    before, after = t.column("before").combine_chunks(), t.column("after").combine_chunks()
    src, tx = t.column("source").combine_chunks(), t.column("transaction").combine_chunks()
    tx_id = t.column("id").combine_chunks()
    lsn = pc.struct_field(src, "lsn")
    skip = _skips(op, status, after, src, table)
    skipped = pc.is_valid(skip)
    is_end = pc.and_kleene(pc.equal(status, "END"), pc.is_null(skip))
    end = _false(is_end)
    data = pc.invert(pc.or_(skipped, end))
    ends = pc.any(end).as_py()  # (a file without END records skips their columns' work)
    _check(data, end, op, before, after, lsn, tx_id, key)
    # positions (read_debezium's docstring)
    seq_hi = _sequence_hi(pc.struct_field(src, "sequence"))
    pos_hi = pc.coalesce(seq_hi, lsn, pa.scalar(0, pa.int64()))
    snap = pc.struct_field(src, "snapshot")
    whole_read = pc.and_(
        _false(pc.equal(op, "r")), pc.not_equal(pc.coalesce(snap, ""), "incremental")
    )
    pos_hi = pc.if_else(pc.and_(whole_read, pc.is_valid(lsn)), lsn, pos_hi)
    pos_lo = lsn
    if ends:
        end_text = pc.if_else(end, _after_last(tx_id, ":"), None)
        end_lsn = _long_text(end_text, "an END record's id")
        pos_hi = pc.if_else(end, end_lsn, pos_hi)
        pos_lo = pc.if_else(end, end_lsn, lsn)
    pos_n = pc.coalesce(pc.struct_field(tx, "total_order"), pa.scalar(0, pa.int64()))
    txn = _transaction(tx, src, lsn, pc.if_else(end, tx_id, None) if ends else None)
    tx_meta = pc.or_kleene(pc.is_valid(tx), is_end)
    tx_count = pc.if_else(end, _end_count(t, table), None)
    toast = _toast(after, record)
    out_op = pc.if_else(skipped, "x", pc.if_else(end, "E", op))
    # the line's text where a bad row found later may need it (as feed.txn.dataflow keeps it)
    keep_raw = pc.or_(_false(pc.equal(out_op, "d")), pc.is_valid(toast))
    keep = pc.indices_nonzero(keep_raw).to_numpy()
    raw = lines(keep, n) if len(keep) else pa.nulls(n, pa.string())
    if pc.any(skipped).as_py():  # (else as they are: a choice copies every field)
        before = pc.if_else(skipped, pa.nulls(n, before.type), before)
        after = pc.if_else(skipped, pa.nulls(n, after.type), after)
    return pa.table(
        {
            "op": out_op,
            "before": before,
            "after": after,
            "pos_hi": pos_hi,
            "pos_lo": pos_lo,
            "pos_n": pos_n,
            "txn": txn,
            "tx_meta": tx_meta,
            "tx_count": pc.cast(tx_count, pa.int64()),
            "_raw": raw,
            "_skip": skip,
            "_toast": toast,
            "_snap": snap,
        }
    )


def _transaction(tx: pa.Array, src: pa.Array, lsn: pa.Array, end_id: pa.Array | None) -> pa.Array:
    """Each line's source transaction: an END record's (``end_id``, its id where the line
    is one, else null; None: no END record) before the ``:``; an event's transaction
    block id before the ``:``, else its ``source.txId``, else ``lsn:`` and its LSN (each
    only worked out where the ones before leave it null)."""
    tx_ids = pc.struct_field(tx, "id")
    txn = _before_first(tx_ids if end_id is None else pc.coalesce(end_id, tx_ids), ":")
    if txn.null_count:
        txn = pc.coalesce(txn, pc.cast(pc.struct_field(src, "txId"), pa.string()))
    if txn.null_count:
        by_lsn = pc.binary_join_element_wise("lsn:", pc.cast(lsn, pa.string()), "")
        txn = pc.coalesce(txn, by_lsn)
    return txn


def _skips(
    op: pa.Array, status: pa.Array, after: pa.Array, src: pa.Array, table: str | None
) -> pa.Array:
    """Why a line carries no change of the table, or null (Spark's ``_skip_reason``, in
    its order: the first that applies)."""
    n = len(op)
    skip = pa.nulls(n, pa.string())
    if table:
        schema, name = pc.struct_field(src, "schema"), pc.struct_field(src, "table")
        # Spark joins schema and table with a dot (a null schema left out) and compares
        # that with ``table``; here each way of cutting ``table`` at a dot is compared
        # with the two columns, which joins no text
        same = pc.and_(pc.is_null(schema), _false(pc.equal(name, table)))
        for i in (i for i, c in enumerate(table) if c == "."):
            cut = pc.and_(
                _false(pc.equal(schema, table[:i])), _false(pc.equal(name, table[i + 1 :]))
            )
            same = pc.or_(same, cut)
        other = pc.and_(pc.and_(pc.is_valid(op), pc.is_valid(name)), pc.invert(same))
        skip = pc.if_else(_false(other), SKIP_OTHER_TABLE, skip)
    heartbeat = pc.and_(pc.and_(pc.is_null(op), pc.is_null(status)), pc.is_null(after))
    skip = pc.if_else(heartbeat, SKIP_HEARTBEAT, skip)
    metadata = _false(pc.not_equal(status, "END"))
    skip = pc.if_else(metadata, SKIP_TX_METADATA, skip)
    return skip


def _check(
    data: pa.Array,
    end: pa.Array,
    op: pa.Array,
    before: pa.Array,
    after: pa.Array,
    lsn: pa.Array,
    tx_id: pa.Array,
    key: Sequence[str],
) -> None:
    """Decline where Spark finds a bad row (``_event_error``'s checks)."""
    if pc.any(pc.and_(end, pc.is_null(tx_id))).as_py():
        raise Declined("a transaction END record without an 'id'")
    known = _false(pc.is_in(op, pa.array(["c", "u", "d", "r"])))
    # (the image a row keys by, field by field: a choice between two struct arrays
    # copies every field of both)
    deleted = _false(pc.equal(op, "d"))
    bad = pc.or_(pc.invert(known), pc.is_null(lsn))
    bad = pc.or_(bad, pc.if_else(deleted, pc.is_null(before), pc.is_null(after)))
    for k in key:
        missing = pc.if_else(
            deleted,
            pc.is_null(pc.struct_field(before, k)),
            pc.is_null(pc.struct_field(after, k)),
        )
        bad = pc.or_(bad, missing)
    if not key:
        bad = pc.or_(bad, pc.and_(_false(pc.equal(op, "u")), pc.is_null(before)))
    if pc.any(pc.and_(data, bad)).as_py():
        raise Declined("a bad row (Spark names what is wrong with it)")


def _end_count(t: pa.Table, table: str | None) -> pa.Array:
    """On an END record: how many of the feed table's events its transaction has."""
    if not table:
        return t.column("event_count").combine_chunks()
    tables = t.column("data_collections").combine_chunks()
    flat = pc.list_flatten(tables)
    parents = pc.list_parent_indices(tables)
    ours = _false(pc.equal(pc.struct_field(flat, "data_collection"), table))
    counts = pc.struct_field(flat, "event_count")
    if pc.any(pc.and_(ours, pc.is_null(counts))).as_py():
        raise Declined("an END record's count without a number")
    total = np.zeros(t.num_rows, np.int64)
    np.add.at(total, pc.filter(parents, ours).to_numpy(), pc.filter(counts, ours).to_numpy())
    return pa.array(total, pa.int64())


def _toast(after: pa.Array, record: pa.StructType) -> pa.Array:
    """The names of ``after``'s text columns holding Debezium's unavailable-value
    placeholder (comma-separated), or null."""
    marks = {
        f.name: _false(pc.equal(pc.struct_field(after, f.name), TOAST_PLACEHOLDER))
        for f in record
        if pa.types.is_string(f.type)
    }
    if not marks:
        return pa.nulls(len(after), pa.string())
    hit = functools.reduce(pc.or_, marks.values())
    if not pc.any(hit).as_py():
        return pa.nulls(len(after), pa.string())
    out: list[str | None] = [None] * len(after)
    for i in pc.indices_nonzero(hit).to_pylist():  # (few: a row with a placeholder)
        out[i] = ",".join(name for name, m in marks.items() if m[i].as_py())
    return pa.array(out, pa.string())
