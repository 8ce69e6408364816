"""Debezium JSON lines parsed on the driver, without Spark, for small transactions.

The driver engine (:mod:`feed.txn.driver`) computes a small Debezium transaction with
pyarrow; this parses its input into the same rows :func:`feed.sources.debezium.read_debezium`
gives (``toArrow`` of its canonical columns, without the weight and the raw line), so a
process whose transactions are all small never starts Spark. It follows that function rule
by rule, for the input a connector writes: JSON objects, wrapped or bare; tombstones,
heartbeats, transaction metadata and other tables' events; columns of integers, text,
booleans, doubles, Connect decimals, dates, timestamps in Connect's numeric encodings and
PostgreSQL's ``timestamptz`` (ISO text with an offset).

Anything else it declines, naming why, and the caller parses with Spark as before: a line
that is not a JSON object (or ``null``), a value whose JSON type is not the plain one for
its column (Spark would cast text, or quarantine), a bad row of any kind (Spark's error
text is the one users see), a compressed file, a column of another type. Declining is
never wrong, only slower.

Two columns differ on purpose: a skipped line's images are null here (Spark types an
other table's images by the feed's record; nothing reads them), and so is its bucket's
input. tests/feed/test_debezium_lines.py compares both parses line for line.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from base64 import b64decode
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any

import orjson
import pyarrow as pa

from feed.sources.connect import (
    DECIMAL,
    NANO_UNITS,
    TIME_UNITS,
    TOAST_PLACEHOLDER,
    VARIABLE_DECIMAL,
)
from feed.sources.debezium import (
    SKIP_HEARTBEAT,
    SKIP_OTHER_TABLE,
    SKIP_TOMBSTONE,
    SKIP_TX_METADATA,
)
from feed.sources.inputs import _is_remote, input_lines, spark_file_path
from feed.sources.sparkhash import hashable, spark_xxhash64, xxh64

__all__ = ["Declined", "parse_lines", "shape_sample"]


class Declined(Exception):
    """The input is not one this parse gives exactly as Spark does: the reason."""


_INT = re.compile(r"-?\d+")
_LONG_RANGE = (-(1 << 63), (1 << 63) - 1)
_INT_RANGES = {
    "int8": (-(1 << 7), (1 << 7) - 1),
    "int16": (-(1 << 15), (1 << 15) - 1),
    "int32": (-(1 << 31), (1 << 31) - 1),
    "int64": _LONG_RANGE,
}
_DATES = ("io.debezium.time.Date", "org.apache.kafka.connect.data.Date")
_DATA_OPS = ("c", "u", "d", "r")
#: PostgreSQL's timestamptz as Debezium writes it: ISO 8601 text with its offset (Spark's
#: cast of the text reads it; other shapes of text are declined)
_ZONED = "io.debezium.time.ZonedTimestamp"
_ISO_ZONED = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,6})?(Z|[+-]\d\d:\d\d)")
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
#: the days and microseconds since 1970 of years 1 to 9999, all Python's dates hold
_DAYS = (-719_162, 2_932_896)
_MICROS = (-62_135_596_800_000_000, 253_402_300_799_999_999)


def _text(v: Any, what: str) -> str | None:
    """A JSON value as Spark's reader keeps it in a string field (its raw text)."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    raise Declined(f"{what}: a {type(v).__name__} where text is read")


def _long(text: str | None, what: str) -> int | None:
    """Spark's ``try_cast(text as long)`` for the text of a plain integer."""
    if text is None:
        return None
    if not _INT.fullmatch(text) or not _LONG_RANGE[0] <= int(text) <= _LONG_RANGE[1]:
        raise Declined(f"{what}: {text[:40]!r} is not a plain 64-bit integer")
    return int(text)


def _number(v: Any, what: str) -> int | None:
    """A JSON number in a long field (Spark's reader refuses other types there)."""
    if v is None or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    raise Declined(f"{what}: not an integer")


def _obj(v: Any, what: str) -> dict[str, Any] | None:
    if v is None or isinstance(v, dict):
        return v
    raise Declined(f"{what}: not an object")


def _unscaled(b64: Any, what: str) -> int:
    """A base64 big-endian two's-complement integer (Connect's decimal encoding)."""
    if not isinstance(b64, str):
        raise Declined(f"{what}: a decimal that is not base64 text")
    try:
        raw = b64decode(b64, validate=True)
    except ValueError as e:
        raise Declined(f"{what}: {e}") from None
    return int.from_bytes(raw, "big", signed=True)


def _fits(u: int, precision: int) -> int:
    if len(str(abs(u))) > precision:
        raise Declined("a decimal wider than its column")
    return u


def _decoder(kind: pa.DataType, enc: str | None, name: str) -> Callable[[Any], Any]:
    """How a raw JSON value of column ``name`` becomes its typed value, as
    :func:`feed.sources.connect._decode` has it; declines a type it does not handle."""
    what = f"column {name}"
    if pa.types.is_string(kind) and enc != DECIMAL:
        return lambda v: _text(v, what)
    if pa.types.is_integer(kind) and str(kind) in _INT_RANGES:
        lo, hi = _INT_RANGES[str(kind)]
        factor = TIME_UNITS.get(enc or "") if str(kind) == "int64" else None
        nanos = str(kind) == "int64" and enc in NANO_UNITS

        def integer(v: Any) -> Any:
            n = _number(v, what)
            if n is None:
                return None
            if nanos:
                return math.floor(float(n) / 1000.0)  # (Spark divides in doubles)
            if factor is not None:
                n *= factor
            if not lo <= n <= hi:
                raise Declined(f"{what}: {n} out of range")
            return n

        return integer
    if pa.types.is_boolean(kind):

        def boolean(v: Any) -> Any:
            if v is None or isinstance(v, bool):
                return v
            raise Declined(f"{what}: not true or false")

        return boolean
    if pa.types.is_float64(kind):

        def double(v: Any) -> Any:
            if v is None or (isinstance(v, int | float) and not isinstance(v, bool)):
                return None if v is None else float(v)
            raise Declined(f"{what}: not a number")

        return double
    if pa.types.is_decimal(kind) and enc in (DECIMAL, VARIABLE_DECIMAL):
        precision, scale = kind.precision, kind.scale

        def dec(v: Any) -> Any:
            if v is None:
                return None
            if enc == DECIMAL:
                return Decimal(_fits(_unscaled(v, what), precision)).scaleb(-scale)
            v = _obj(v, what) or {}
            s = v.get("scale")
            if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s <= scale:
                raise Declined(f"{what}: a variable-scale decimal's scale")
            u = _unscaled(v.get("value"), what) * 10 ** (scale - s)
            return Decimal(_fits(u, precision)).scaleb(-scale)

        return dec
    if pa.types.is_date32(kind) and enc in _DATES:

        def date(v: Any) -> Any:
            n = _number(v, what)
            if n is None:
                return None
            if not _DAYS[0] <= n <= _DAYS[1]:
                raise Declined(f"{what}: a date Python does not hold")
            return pa.scalar(n, pa.date32()).as_py()

        return date
    timed = enc in TIME_UNITS or enc in NANO_UNITS
    if pa.types.is_timestamp(kind) and kind.unit == "us" and timed:
        factor = TIME_UNITS.get(enc or "", 1)

        def timestamp(v: Any) -> Any:
            n = _number(v, what)
            if n is None:
                return None
            us = math.floor(float(n) / 1000.0) if enc in NANO_UNITS else n * factor
            if not _MICROS[0] <= us <= _MICROS[1]:
                raise Declined(f"{what}: a timestamp Python does not hold")
            return pa.scalar(us, kind).as_py()

        return timestamp
    if pa.types.is_timestamp(kind) and kind.unit == "us" and kind.tz and enc == _ZONED:

        def zoned(v: Any) -> Any:
            if v is None:
                return None
            if not isinstance(v, str) or not _ISO_ZONED.fullmatch(v):
                raise Declined(f"{what}: not an ISO timestamp with its offset")
            at = dt.datetime.fromisoformat(v).astimezone(dt.UTC)
            us = (at - _EPOCH) // dt.timedelta(microseconds=1)
            return pa.scalar(us, kind).as_py()

        return zoned
    raise Declined(f"{what}: its type {kind} (encoded {enc}) is parsed by Spark")


class _Record:
    """How the images of one record type are typed: a decoder per column."""

    def __init__(self, record: pa.StructType, encodings: dict[str, str]) -> None:
        self.type = record
        self.fields = [(f.name, _decoder(f.type, encodings.get(f.name), f.name)) for f in record]
        self.text = [f.name for f in record if pa.types.is_string(f.type)]
        self.kinds = {f.name: str(f.type) for f in record}

    def typed(self, image: Any, what: str) -> dict[str, Any] | None:
        image = _obj(image, what)
        if image is None:
            return None
        return {name: decode(image.get(name)) for name, decode in self.fields}

    def toast(self, after: Any) -> str | None:
        """The text columns of the raw after-image holding the unavailable-value marker."""
        if not isinstance(after, dict):
            return None
        names = [n for n in self.text if after.get(n) == TOAST_PLACEHOLDER]
        return ",".join(names) if names else None


def _columns(wrapper: Any) -> list[Any] | None:
    """The table's columns in a line's top-level ``schema`` (a Connect schema's ``after``
    or ``before`` fields), as :func:`feed.sources.debezium_schema.columns_text` finds them."""
    if not isinstance(wrapper, dict):
        return None
    for f in _items(wrapper.get("fields"), "schema.fields"):
        if _text(f.get("field"), "schema.fields") in ("after", "before"):
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
    h = xxh64(orjson.dumps(cols), 42)
    return h - (1 << 64) if h >= 1 << 63 else h


def shape_sample(files: Sequence[str], shape: int) -> list[dict[str, Any]]:
    """:func:`feed.sources.debezium_schema.shape_sample` without Spark: the columns of the
    first event in ``files`` whose shape is ``shape``; [] when none is."""
    for path in files:
        for line in input_lines(path):
            if b'"schema"' not in line:
                continue
            try:
                obj = orjson.loads(line)
                found = _shape(obj.get("schema")) if isinstance(obj, dict) else None
            except (orjson.JSONDecodeError, Declined):
                continue
            if found == shape:
                cols = _columns(obj["schema"]) or []
                return [c for c in cols if isinstance(c, dict)]
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
    return _long(_text(v[0], "source.sequence"), "source.sequence")


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
        _obj(env.get(name), name)
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


#: the columns Spark's parse says are never null
_NOT_NULL = ("pos_n", "ord_row", "_file")


def _row(
    obj: dict[str, Any], rec: _Record, key: Sequence[str], table: str | None
) -> dict[str, Any]:
    """One parsed line's canonical columns (see :func:`feed.sources.debezium.read_debezium`)."""
    _check(obj, top=True)
    payload = obj.get("payload")
    if isinstance(payload, dict):
        _check(payload, top=False)
    env = _obj(payload, "payload") or obj
    src = _obj(env.get("source"), "source") or {}
    tx = _obj(env.get("transaction"), "transaction")
    op = _text(env.get("op"), "op")
    status = _text(env.get("status"), "status")
    raw_before, raw_after = env.get("before"), env.get("after")
    lsn = _long(_text(src.get("lsn"), "source.lsn"), "source.lsn")
    snap = _text(src.get("snapshot"), "source.snapshot")
    skip = None
    if status is not None and status != "END":
        skip = SKIP_TX_METADATA
    elif op is None and status is None and raw_after is None:
        skip = SKIP_HEARTBEAT
    elif table and op is not None and src.get("table") is not None:
        parts = [_text(src.get("schema"), "source.schema"), _text(src["table"], "source.table")]
        if ".".join(p for p in parts if p is not None) != table:
            skip = SKIP_OTHER_TABLE
    out: dict[str, Any] = {"_skip": skip, "_snap": snap, "_error": None, "_shape": None}
    out["_toast"] = rec.toast(raw_after)
    if skip is None and status == "END":
        tx_id = _text(env.get("id"), "id")
        if tx_id is None:
            raise Declined("a transaction END record without an 'id'")
        end = _long(tx_id.rsplit(":", 1)[-1], "the END record's id")
        out.update(op="E", before=None, after=None, pos_hi=end, pos_lo=end, pos_n=0)
        out.update(txn=tx_id.split(":", 1)[0], tx_meta=True, tx_count=_end_count(env, table))
        return out
    seq = _sequence(src.get("sequence"))
    pos_hi = seq if seq is not None else lsn if lsn is not None else 0
    if op == "r" and (snap or "") != "incremental" and lsn is not None:
        pos_hi = lsn  # (a whole-table snapshot's read is at its LSN)
    tx_id = None if tx is None else _text(tx.get("id"), "transaction.id")
    tx_xid = None if tx_id is None else tx_id.split(":", 1)[0]
    src_lsn = _text(src.get("lsn"), "source.lsn")
    txn = tx_xid or _text(src.get("txId"), "source.txId")
    if txn is None and src_lsn is not None:
        txn = "lsn:" + src_lsn
    order = None if tx is None else _number(tx.get("total_order"), "transaction.total_order")
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
        return _number(env.get("event_count"), "event_count")
    tables = env.get("data_collections")
    if tables is None:
        return 0
    if not isinstance(tables, list):
        raise Declined("data_collections: not a list")
    total = 0
    for c in tables:
        c = _obj(c, "data_collections") or {}
        if _text(c.get("data_collection"), "data_collection") == table:
            n = _number(c.get("event_count"), "event_count")
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
) -> pa.Table:
    """The canonical change rows of Debezium ``files``, as the driver engine reads them
    from Spark (:data:`feed.txn.driver._COLUMNS`; with ``buckets``, each event's state
    bucket in ``_bucket``, as :func:`feed.txn.state.bucket_of` gives it). Raises
    :class:`Declined` for input Spark must parse (see the module docstring)."""
    rec = _Record(record, encodings)
    if buckets is not None and not all(hashable(rec.kinds[k]) for k in key):
        raise Declined("a key column of a type hashed by Spark only")
    rows: list[dict[str, Any]] = []
    for i, path in enumerate(files):
        if path.endswith((".gz", ".bz2", ".deflate", ".lz4", ".snappy", ".zst")):
            raise Declined(f"{path}: compressed")
        uri = spark_file_path(path)
        name = uri if _is_remote(path) else "file:" + uri
        for n, raw in enumerate(input_lines(path)):
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
