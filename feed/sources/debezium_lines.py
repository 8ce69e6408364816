"""Debezium JSON lines parsed on the driver, without Spark, for small transactions.

The driver engine (:mod:`feed.txn.driver`) computes a small Debezium transaction with
pyarrow; this parses its input into the same rows :func:`feed.sources.debezium.read_debezium`
gives (``toArrow`` of its canonical columns, without the weight and the raw line), so a
process whose transactions are all small never starts Spark. It follows that function rule
by rule, for the input a connector writes: JSON objects, wrapped or bare; tombstones,
heartbeats, transaction metadata and other tables' events; columns of integers, text,
booleans, doubles, Connect decimals, dates, timestamps in Connect's numeric encodings and
PostgreSQL's ``timestamptz`` (ISO text with an offset); the values are typed by
:mod:`feed.sources.connect_json`.

Anything else it declines, naming why, and the caller parses with Spark as before: a line
that is not a JSON object (or ``null``), a value whose JSON type is not the plain one for
its column (Spark would cast text, or quarantine), a bad row of any kind (Spark's error
text is the one users see), a file compressed by a Hadoop codec (gzip, bzip2 and zstd
are read), a column of another type. Declining is
never wrong, only slower.

Two columns differ on purpose: a skipped line's images are null here (Spark types an
other table's images by the feed's record; nothing reads them), and so is its bucket's
input. tests/feed/test_debezium_lines.py compares both parses line for line.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import orjson
import pyarrow as pa

from feed.sources.connect_json import (
    Declined,
    RecordDecoder,
    json_long,
    json_number,
    json_object,
    json_text,
)
from feed.sources.debezium import (
    SKIP_HEARTBEAT,
    SKIP_OTHER_TABLE,
    SKIP_TOMBSTONE,
    SKIP_TX_METADATA,
)
from feed.sources.file_text import input_lines
from feed.sources.inputs import spark_metadata_path
from feed.sources.sparkhash import SEED, hashable, signed, spark_xxhash64, xxh64
from protocol import SourceError

__all__ = ["Declined", "parse_lines", "shape_sample"]


_DATA_OPS = ("c", "u", "d", "r")


def _columns(wrapper: Any) -> list[Any] | None:
    """The table's columns in a line's top-level ``schema`` (a Connect schema's ``after``
    or ``before`` fields), as :func:`feed.sources.debezium_schema.columns_text` finds them."""
    if not isinstance(wrapper, dict):
        return None
    for f in _items(wrapper.get("fields"), "schema.fields"):
        if json_text(f.get("field"), "schema.fields") in ("after", "before"):
            cols = f.get("fields")
            if cols is not None and not isinstance(cols, list):
                raise Declined("schema: columns that are not a list")
            return cols
    return None


def _shape(wrapper: Any) -> int | None:
    """:func:`feed.sources.debezium_schema.shape_of` of a line's top-level ``schema``."""
    cols = _columns(wrapper)
    if cols is None:
        return None
    # (Spark keeps a nested value's text as compact JSON, in its order)
    return signed(xxh64(orjson.dumps(cols), SEED))


def shape_sample(files: Sequence[str], shape: int) -> list[dict[str, Any]]:
    """:func:`feed.sources.debezium_schema.shape_sample` without Spark: the columns of the
    first event in ``files`` whose shape is ``shape``; [] when none is. Raises
    :class:`Declined` when none is among the lines read but a line this parse cannot read
    (JSON orjson refuses, such as a number past a double's range) may be it: Spark's
    sample reads that line, and an empty sample would pass the shape as fitting."""
    unread = 0
    for path in files:
        for line in input_lines(path):
            if b'"schema"' not in line:
                continue
            try:
                obj = orjson.loads(line)
                found = _shape(obj.get("schema")) if isinstance(obj, dict) else None
            except (orjson.JSONDecodeError, Declined):
                unread += 1
                continue
            if found == shape:
                cols = _columns(obj["schema"]) or []
                return [c for c in cols if isinstance(c, dict)]
    if unread:
        raise Declined(f"the columns of a table shape, in one of {unread} line(s) not read here")
    return []


def _sequence(v: Any) -> int | None:
    """The commit LSN of ``source.sequence`` (its first element), if any."""
    if v is None:
        return None
    if isinstance(v, str):
        try:
            v = orjson.loads(v)
        except orjson.JSONDecodeError:
            return None
    if not isinstance(v, list) or not v:
        return None
    return json_long(json_text(v[0], "source.sequence"), "source.sequence")


_COLUMNS = (
    ("op", pa.string()),
    ("pos_hi", pa.int64()),
    ("pos_lo", pa.int64()),
    ("pos_n", pa.int64()),
    ("txn", pa.string()),
    ("tx_meta", pa.bool_()),
    ("tx_count", pa.int64()),
    ("ord_file", pa.int64()),
    ("ord_row", pa.int64()),
    ("_file", pa.string()),
    ("_error", pa.string()),
    ("_skip", pa.string()),
    ("_toast", pa.string()),
    ("_snap", pa.string()),
    ("_shape", pa.int64()),
)


def _is_int(v: Any) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool))


def _items(v: Any, what: str) -> list[dict[str, Any]]:
    """The objects of a JSON array (null: none), or declined."""
    if v is None:
        return []
    if not isinstance(v, list) or not all(x is None or isinstance(x, dict) for x in v):
        raise Declined(f"{what}: not a list of objects")
    return [x for x in v if x is not None]


def _check(env: dict[str, Any], top: bool) -> None:
    """Decline a line Spark's reader finds malformed: a field whose JSON type does not
    fit :func:`feed.sources.debezium._line_type` (a text field takes any value; Spark
    checks the envelope's fields at the top of a wrapped line too)."""
    for name in (
        "before",
        "after",
        "source",
        "transaction",
        *(("payload", "schema") if top else ()),
    ):
        json_object(env.get(name), name)
    tx = env.get("transaction") or {}
    if not _is_int(tx.get("total_order")) or not _is_int(env.get("event_count")):
        raise Declined("a count or order that is not an integer")
    if not all(
        _is_int(c.get("event_count"))
        for c in _items(env.get("data_collections"), "data_collections")
    ):
        raise Declined("data_collections: a count that is not an integer")
    if top:
        _items((env.get("schema") or {}).get("fields"), "schema.fields")


def _lines(path: str, left: int | None) -> Iterator[bytes]:
    """``path``'s lines, declined past ``left`` bytes of text, for a line too long or a
    Hadoop codec (:func:`~feed.sources.file_text.input_lines` refuses them)."""
    try:
        yield from input_lines(path, limit=left)
    except SourceError as e:
        raise Declined(str(e)) from None


#: the columns Spark's parse says are never null
_NOT_NULL = ("pos_n", "ord_row", "_file")


def _row(
    obj: dict[str, Any], rec: RecordDecoder, key: Sequence[str], table: str | None
) -> dict[str, Any]:
    """One parsed line's canonical columns (see :func:`feed.sources.debezium.read_debezium`)."""
    _check(obj, top=True)
    payload = obj.get("payload")
    if isinstance(payload, dict):
        _check(payload, top=False)
    env = json_object(payload, "payload") or obj
    src = json_object(env.get("source"), "source") or {}
    tx = json_object(env.get("transaction"), "transaction")
    op = json_text(env.get("op"), "op")
    status = json_text(env.get("status"), "status")
    raw_before, raw_after = env.get("before"), env.get("after")
    lsn = json_long(json_text(src.get("lsn"), "source.lsn"), "source.lsn")
    snap = json_text(src.get("snapshot"), "source.snapshot")
    skip = None
    if status is not None and status != "END":
        skip = SKIP_TX_METADATA
    elif op is None and status is None and raw_after is None:
        skip = SKIP_HEARTBEAT
    elif table and op is not None and src.get("table") is not None:
        parts = [json_text(src.get(n), f"source.{n}") for n in ("schema", "table")]
        if ".".join(p for p in parts if p is not None) != table:
            skip = SKIP_OTHER_TABLE
    out: dict[str, Any] = {"_skip": skip, "_snap": snap, "_error": None, "_shape": None}
    out["_toast"] = rec.toast(raw_after)
    if skip is None and status == "END":
        tx_id = json_text(env.get("id"), "id")
        if tx_id is None:
            raise Declined("a transaction END record without an 'id'")
        end = json_long(tx_id.rsplit(":", 1)[-1], "the END record's id")
        out.update(op="E", before=None, after=None, pos_hi=end, pos_lo=end, pos_n=0)
        out.update(txn=tx_id.split(":", 1)[0], tx_meta=True, tx_count=_end_count(env, table))
        return out
    seq = _sequence(src.get("sequence"))
    pos_hi = seq if seq is not None else lsn if lsn is not None else 0
    if op == "r" and (snap or "") != "incremental" and lsn is not None:
        pos_hi = lsn  # (a whole-table snapshot's read is at its LSN)
    tx_id = None if tx is None else json_text(tx.get("id"), "transaction.id")
    tx_xid = None if tx_id is None else tx_id.split(":", 1)[0]
    src_lsn = json_text(src.get("lsn"), "source.lsn")
    txn = tx_xid or json_text(src.get("txId"), "source.txId")
    if txn is None and src_lsn is not None:
        txn = "lsn:" + src_lsn
    order = None if tx is None else json_number(tx.get("total_order"), "transaction.total_order")
    # (Spark's "transaction is not null or this is an END record", with SQL's nulls: no
    # transaction block and no status on an event that is not skipped is null)
    meta = True if tx is not None else None if status is None and skip is None else False
    out.update(pos_hi=pos_hi, pos_lo=lsn, pos_n=order or 0, txn=txn, tx_meta=meta)
    out["tx_count"] = None
    if skip is not None:
        out.update(op="x", before=None, after=None)
        return out
    if op not in _DATA_OPS:
        raise Declined(f"op {op!r}")
    before, after = rec.typed(raw_before, "before"), rec.typed(raw_after, "after")
    if lsn is None:
        raise Declined("an event without source.lsn")
    image = before if op == "d" else after
    if image is None or any(image[k] is None for k in key):
        raise Declined(f"op {op!r} without its image or its key")
    if op == "u" and before is None and not key:
        raise Declined("an update without a before-image in an unkeyed feed")
    out.update(op=op, before=before, after=after, _shape=_shape(obj.get("schema")))
    return out


def _end_count(env: dict[str, Any], table: str | None) -> int | None:
    """On an END record: how many of the feed table's events its transaction has."""
    if not table:
        return json_number(env.get("event_count"), "event_count")
    tables = env.get("data_collections")
    if tables is None:
        return 0
    if not isinstance(tables, list):
        raise Declined("data_collections: not a list")
    total = 0
    for c in tables:
        c = json_object(c, "data_collections") or {}
        if json_text(c.get("data_collection"), "data_collection") == table:
            n = json_number(c.get("event_count"), "event_count")
            if n is None:
                raise Declined("an END record's count without a number")
            total += n
    return total


def parse_lines(
    files: Sequence[str],
    record: pa.StructType,
    encodings: dict[str, str],
    key: Sequence[str],
    table: str | None,
    buckets: int | None = None,
    budget: int | None = None,
) -> pa.Table:
    """The canonical change rows of Debezium ``files``, as the driver engine reads them
    from Spark (:data:`feed.txn.driver._COLUMNS`; with ``buckets``, each event's state
    bucket in ``_bucket``, as :func:`feed.txn.state.bucket_of` gives it). Raises
    :class:`Declined` for input Spark must parse (see the module docstring), and for
    more than ``budget`` bytes of text (a compressed file may hold far more than its size)."""
    rec = RecordDecoder(record, encodings)
    if buckets is not None and not all(hashable(rec.kinds[k]) for k in key):
        raise Declined("a key column of a type hashed by Spark only")
    rows: list[dict[str, Any]] = []
    used = 0  # bytes of text read
    for i, path in enumerate(files):
        name = spark_metadata_path(path)
        left = None if budget is None else budget - used
        for n, raw in enumerate(_lines(path, left)):
            used += len(raw) + 1
            line = raw[:-1] if raw.endswith(b"\r") else raw
            if b"\r" in line:
                raise Declined(f"{path}: a line broken by a carriage return")
            if not line.strip(b" "):
                continue
            if line.strip(b" ") == b"null":
                row: dict[str, Any] = {
                    "op": "x", "before": None, "after": None, "pos_hi": 0, "pos_lo": None,
                    "pos_n": 0, "txn": None, "tx_meta": False, "tx_count": None,
                    "_error": None, "_skip": SKIP_TOMBSTONE, "_toast": None, "_snap": None,
                    "_shape": None,
                }  # fmt: skip
            else:
                try:
                    obj = orjson.loads(line)
                except orjson.JSONDecodeError:
                    raise Declined(f"{path}:{n + 1}: not JSON") from None
                if not isinstance(obj, dict):
                    raise Declined(f"{path}:{n + 1}: not a JSON object")
                try:
                    row = _row(obj, rec, key, table)
                except Declined as e:
                    raise Declined(f"{path}:{n + 1}: {e}") from None
            row.update(ord_file=i, ord_row=n, _file=name)
            rows.append(row)
    image = pa.struct([f.with_nullable(True) for f in record])  # (as Spark's casts give)
    fields = [pa.field("op", pa.string()), pa.field("before", image), pa.field("after", image)]
    fields += [pa.field(n, t, nullable=n not in _NOT_NULL) for n, t in _COLUMNS[1:]]
    out = pa.Table.from_pylist(rows, pa.schema(fields))
    if buckets is None:
        return out
    kinds = [rec.kinds[k] for k in key]
    bucket = []
    for r in rows:
        img = r["before"] if r["op"] == "d" else r["after"]
        vals = [(None if img is None else img[k], kind) for k, kind in zip(key, kinds, strict=True)]
        bucket.append(spark_xxhash64(vals) % buckets)
    return out.append_column("_bucket", pa.array(bucket, pa.int32()))
