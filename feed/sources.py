"""Sources: input files of a given kind -> one canonical change shape (a Spark DataFrame).

Every input row becomes one row of :data:`CHANGE_COLUMNS`:

========== ================================================================================
column     meaning
========== ================================================================================
op         ``c`` insert, ``u`` update, ``d`` delete, ``r`` snapshot read, ``w`` weighted,
           ``s`` a row of a full snapshot, ``p`` a Delta update pre-image; ``E`` the END
           record of a source transaction, ``x`` a line skipped (see ``_skip``)
before     the row before the change (a record struct), or null
after      the row after the change, or null
weight     the multiplicity of the change (1, or a weighted row's delta)
pos_hi     position in the source, major part (Debezium: the commit LSN, else the
           event's own LSN, as for a snapshot read)
pos_lo     position in the source, minor part (Debezium: ``source.lsn``)
pos_n      position in the source, last part (Debezium: ``transaction.total_order``)
txn        the source transaction the change belongs to (as a string)
tx_meta    the source announces the transaction's end and size (Debezium metadata)
tx_count   on an END record: how many of the feed table's events the transaction has
ord_file   index of the input file in name order  } together: delivery order
ord_row    increasing row id within the file      }
_file      the input file
_raw       the raw input text of the row
_error     why the row is bad, or null
_skip      why the line carries no change for this feed (tombstone, heartbeat, …), or null
_toast     the columns holding Debezium's unavailable-value placeholder, or null
_snap      Debezium's ``source.snapshot`` (``first``, ``last``, ``incremental``, …), or null
========== ================================================================================

Bad rows are kept with a reason so the transaction driver can quarantine them (DESIGN §10):
nothing is silently dropped. Spark's native expressions do all the parsing and checking.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import orjson
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.pandas.types import from_arrow_type

from protocol import SourceError, avro_to_arrow

__all__ = [
    "CHANGE_COLUMNS",
    "SOURCE_KINDS",
    "debezium_event",
    "infer_record_schema",
    "read_changes",
    "spark_record_type",
]

#: ``delta`` is read through :mod:`feed.delta` and then as ``cdf`` rows
SOURCE_KINDS = ("debezium", "cdf", "upsert", "snapshot", "weighted", "delta")
CHANGE_COLUMNS = (
    "op",
    "before",
    "after",
    "weight",
    "pos_hi",
    "pos_lo",
    "pos_n",
    "txn",
    "tx_meta",
    "tx_count",
    "ord_file",
    "ord_row",
    "_file",
    "_raw",
    "_error",
    "_skip",
    "_toast",
    "_snap",
)

_CONNECT_TYPES = {
    "int8": "int",
    "int16": "int",
    "int32": "int",
    "int64": "long",
    "float32": "float",
    "float64": "double",
    "boolean": "boolean",
    "string": "string",
    "bytes": "bytes",
}

#: the ``connect.name`` attribute a record field keeps: how its JSON value is encoded
CONNECT_NAME = "connect.name"
DECIMAL = "org.apache.kafka.connect.data.Decimal"
VARIABLE_DECIMAL = "io.debezium.data.VariableScaleDecimal"
#: PostgreSQL ``numeric`` without a declared precision has no fixed scale: tidefeed holds it
#: as decimal(38, 18) (20 integer digits, 18 after the point); a value with more digits is
#: a type mismatch, quarantined, never rounded
VARIABLE_DECIMAL_TYPE = (38, 18)
#: Debezium's marker for an unchanged TOASTed column (REPLICA IDENTITY DEFAULT)
TOAST_PLACEHOLDER = "__debezium_unavailable_value"

# Kafka Connect / Debezium logical types -> Avro logical types
_CONNECT_LOGICAL: dict[str, dict[str, Any]] = {
    "io.debezium.time.ZonedTimestamp": {"type": "long", "logicalType": "timestamp-micros"},
    "io.debezium.time.MicroTimestamp": {"type": "long", "logicalType": "local-timestamp-micros"},
    "io.debezium.time.Timestamp": {"type": "long", "logicalType": "local-timestamp-micros"},
    "io.debezium.time.NanoTimestamp": {"type": "long", "logicalType": "local-timestamp-micros"},
    "org.apache.kafka.connect.data.Timestamp": {
        "type": "long",
        "logicalType": "local-timestamp-micros",
    },
    "io.debezium.time.Date": {"type": "int", "logicalType": "date"},
    "org.apache.kafka.connect.data.Date": {"type": "int", "logicalType": "date"},
    # Spark 4 cannot hold TIME columns yet: a time of day is its microseconds since midnight
    "io.debezium.time.MicroTime": {"type": "long"},
    "io.debezium.time.Time": {"type": "long"},
    "io.debezium.time.NanoTime": {"type": "long"},
    "org.apache.kafka.connect.data.Time": {"type": "long"},
    "io.debezium.data.Uuid": {"type": "string", "logicalType": "uuid"},
    "io.debezium.data.Json": {"type": "string"},
    "io.debezium.data.Xml": {"type": "string"},
    "io.debezium.data.Enum": {"type": "string"},
    "io.debezium.time.ZonedTime": {"type": "string"},
    "io.debezium.time.MicroDuration": {"type": "long"},
}


def _connect_field_type(f: dict[str, Any], name: str) -> Any:
    """The Avro type of one Kafka Connect schema field, logical types decoded."""
    kind = f.get("type")
    logical = f.get("name")
    if logical == DECIMAL:
        params = f.get("parameters") or {}
        scale = int(params.get("scale", 0))
        precision = int(params.get("connect.decimal.precision", 38))
        if precision > 38:
            # wider than Spark's decimals: keep the exact digits as text
            return {"type": "string", CONNECT_NAME: DECIMAL}
        return {
            "type": "bytes",
            "logicalType": "decimal",
            "precision": precision,
            "scale": scale,
            CONNECT_NAME: DECIMAL,
        }
    if logical == VARIABLE_DECIMAL:
        precision, scale = VARIABLE_DECIMAL_TYPE
        return {
            "type": "bytes",
            "logicalType": "decimal",
            "precision": precision,
            "scale": scale,
            CONNECT_NAME: VARIABLE_DECIMAL,
        }
    if isinstance(logical, str) and logical in _CONNECT_LOGICAL:
        return {**_CONNECT_LOGICAL[logical], CONNECT_NAME: logical}
    if kind == "struct":
        return _connect_to_avro(f.get("fields", []), name)
    if kind == "array":
        items = f.get("items") or {}
        return {"type": "array", "items": _connect_field_type(items, f"{name}_item")}
    if kind == "map":
        values = f.get("values") or {}
        return {"type": "map", "values": _connect_field_type(values, f"{name}_value")}
    return _CONNECT_TYPES.get(str(kind), "string")


def _connect_to_avro(fields: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """An Avro record schema from Kafka Connect struct fields, in their column order."""
    out = []
    for f in fields:
        avro = _connect_field_type(f, f"{name}_{f['field']}")
        entry: dict[str, Any] = {"name": f["field"], "type": avro}
        if f.get("optional"):
            entry = {"name": f["field"], "type": ["null", avro], "default": None}
        out.append(entry)
    return {"type": "record", "name": name, "fields": out}


def connect_names(schema: dict[str, Any]) -> dict[str, str]:
    """Each top-level field's ``connect.name`` (how Debezium encodes its value), if any."""
    out = {}
    for f in schema.get("fields", []):
        t = f.get("type")
        if isinstance(t, list):
            t = next((b for b in t if b != "null"), None)
        if isinstance(t, dict) and isinstance(t.get(CONNECT_NAME), str):
            out[f["name"]] = t[CONNECT_NAME]
    return out


def spark_record_type(avro_schema: dict[str, Any]) -> T.StructType:
    """The Spark struct type of a feed's record schema."""
    t = from_arrow_type(avro_to_arrow(avro_schema))
    assert isinstance(t, T.StructType)
    return t


_META_COLUMNS = ("_change_type", "_commit_version", "_commit_timestamp")
#: how far schema inference looks for a Debezium event of the feed's table
_SAMPLE_LINES = 100_000


def _debezium_events(files: Sequence[str]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(wrapper, payload) of the first Debezium data events of ``files`` (tombstones,
    transaction metadata and heartbeats left out), within the first lines."""
    seen = 0
    for path in files:
        with open(path, "rb") as f:
            for line in f:
                seen += 1
                if seen > _SAMPLE_LINES:
                    return
                found = debezium_event(line)
                if found is not None:
                    yield found


def debezium_event(line: bytes) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(wrapper, payload) of one JSON line if it is a Debezium change event, with or
    without the ``{"schema","payload"}`` wrapper; None for anything else (tombstones,
    heartbeats, transaction metadata, malformed lines)."""
    try:
        e = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(e, dict):
        return None
    payload = e.get("payload", e)
    if isinstance(payload, dict) and payload.get("op") is not None:
        return e, payload
    return None


def _table_of(payload: dict[str, Any]) -> str | None:
    src = payload.get("source")
    if not isinstance(src, dict) or not src.get("table"):
        return None
    return f"{src['schema']}.{src['table']}" if src.get("schema") else str(src["table"])


def debezium_table(files: Sequence[str]) -> str | None:
    """The ``schema.table`` of the first Debezium data event in ``files``, if any."""
    for _, payload in _debezium_events(files):
        return _table_of(payload)
    return None


def infer_record_schema(
    spark: SparkSession,
    kind: str,
    files: Sequence[str],
    exclude: Sequence[str] = (),
    table: str | None = None,
) -> dict[str, Any]:
    """The record schema of a new feed, read from its first input.

    Debezium: the Kafka Connect schema of the first wrapped event of ``table`` (logical
    types decoded, columns in table order), else Spark's JSON inference over the images of
    that table's events, in the column order of the first image. Weighted: JSON inference
    over ``record``. Table-shaped kinds (cdf, upsert, snapshot): the columns of the input
    (Parquet's own schema, or JSON inference), less Delta's metadata columns and ``exclude``.
    """
    from pyspark.sql.pandas.types import to_arrow_type

    from protocol import arrow_to_avro

    if not files:
        raise SourceError(f"no input files to infer the {kind} record schema from")
    if kind == "debezium":
        return _debezium_schema(spark, files, table)
    if kind == "weighted":
        t = spark.read.json(list(files)).schema["record"].dataType
        if not isinstance(t, T.StructType):
            raise SourceError(f"no 'record' objects in weighted input {files[0]}")
        schema: dict[str, Any] = arrow_to_avro(to_arrow_type(t, timezone="UTC"), name="record")
        return schema
    parquet = [f for f in files if f.endswith(".parquet")]
    df = spark.read.parquet(*parquet) if parquet else spark.read.json(list(files))
    drop = set(_META_COLUMNS) | set(exclude) | {"_corrupt_record"}
    fields = [f for f in df.schema.fields if f.name not in drop]
    if not parquet:
        fields = _in_first_row_order(fields, files)
    if not fields:
        raise SourceError(f"no record columns in {kind} input {files[0]}")
    schema = arrow_to_avro(to_arrow_type(T.StructType(fields), timezone="UTC"), name="record")
    return schema


def _in_first_row_order(fields: list[T.StructField], files: Sequence[str]) -> list[T.StructField]:
    """``fields`` (sorted by name, as Spark infers JSON) in the key order of the first row."""
    with open(files[0], "rb") as f:
        for line in f:
            with contextlib.suppress(orjson.JSONDecodeError):
                row = orjson.loads(line)
                if isinstance(row, dict):
                    return _ordered(fields, list(row))
    return fields


def _ordered(fields: list[T.StructField], order: list[str]) -> list[T.StructField]:
    rank = {n: i for i, n in enumerate(order)}
    return sorted(fields, key=lambda f: rank.get(f.name, len(rank)))


def _debezium_schema(
    spark: SparkSession, files: Sequence[str], table: str | None
) -> dict[str, Any]:
    from pyspark.sql.pandas.types import to_arrow_type

    from protocol import arrow_to_avro

    images: list[str] = []
    first_image: dict[str, Any] | None = None
    for wrapper, payload in _debezium_events(files):
        if table is not None and _table_of(payload) not in (table, None):
            continue
        schema = wrapper.get("schema")
        if isinstance(schema, dict):
            for fld in schema.get("fields", []):
                if fld.get("field") in ("after", "before") and fld.get("fields"):
                    return _connect_to_avro(fld["fields"], "record")
        image = payload.get("after") or payload.get("before")
        if isinstance(image, dict):
            first_image = first_image or image
            images.append(orjson.dumps(image).decode())
            if len(images) >= 1000:  # enough for Spark to type the columns
                break
    if first_image is None:
        where = f" of table {table}" if table else ""
        raise SourceError(
            f"cannot infer a record schema: no Debezium change event{where} in the first "
            f"input files ({files[0]} …); give --schema FILE (an Avro record schema)"
        )
    # no Connect schema: let Spark type the images, then restore the table's column order
    inferred = spark.read.json(spark.sparkContext.parallelize(images))
    fields = _ordered(list(inferred.schema.fields), list(first_image))
    return dict(arrow_to_avro(to_arrow_type(T.StructType(fields), timezone="UTC"), name="record"))


def _read_text(spark: SparkSession, files: Sequence[str]) -> DataFrame:
    """Lines of ``files`` with their file, the file's index in ``files`` and a row id that
    grows with the line within each file (files are never split: see feed/session.py)."""
    index = F.create_map(*[x for i, p in enumerate(files) for x in (F.lit(_local(p)), F.lit(i))])
    df = spark.read.text(list(files)).select(
        F.col("value").alias("_raw"), F.col("_metadata.file_path").alias("_file")
    )
    local = F.regexp_replace(F.col("_file"), r"^file:(//)?", "")
    df = df.select(
        "*",
        index[local].cast("long").alias("ord_file"),
        F.monotonically_increasing_id().alias("ord_row"),
    ).where(F.length(F.trim("_raw")) > 0)
    return df


def _local(path: str) -> str:
    """A local path as Spark's ``file_path`` shows it without its ``file:`` scheme."""
    import urllib.parse

    if "://" in path:
        return path
    return urllib.parse.quote(path, safe="/")


def _mismatch_error(mismatched: Column) -> tuple[Column, Column]:
    """The error check for columns whose values do not fit their type (a list of names)."""
    return (
        mismatched != "",
        F.concat(
            F.lit("type mismatch in "), mismatched, F.lit(" (does not fit the record schema)")
        ),
    )


def _first_error(*checks: tuple[Column, Column | str]) -> Column:
    expr: Column = F.lit(None).cast("string")
    for cond, msg in reversed(checks):
        expr = F.when(cond, msg if isinstance(msg, Column) else F.lit(msg)).otherwise(expr)
    return expr


CORRUPT = "_corrupt"
_PARSE_OPTIONS = {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": CORRUPT}


def _as_strings(t: T.StructType) -> T.StructType:
    """The same fields, all as strings: Spark's JSON reader then keeps each value's raw text
    (objects and arrays as JSON), so a line is parsed once and typed by casts."""
    return T.StructType([T.StructField(f.name, T.StringType()) for f in t.fields])


def _be_integer(b: Column) -> Column:
    """A big-endian two's-complement byte string as decimal(38, 0) (null past 38 digits)."""

    def value(h: Column) -> Column:
        pairs = F.filter(F.split(F.regexp_replace(h, "(..)", "$1,"), ","), lambda x: x != "")
        negative = F.conv(F.substring(h, 1, 2), 16, 10).cast("int") >= 128
        start = F.when(negative, F.lit(-1)).otherwise(F.lit(0)).cast(_UNSCALED)
        return F.aggregate(
            pairs,
            start,
            lambda acc, x: F.try_add(
                F.try_multiply(acc, F.lit(256)), F.conv(x, 16, 10).cast("int")
            ).cast(_UNSCALED),
        )

    return F.transform(F.array(F.hex(b)), value)[0]


_UNSCALED = T.DecimalType(38, 0)


def _scaled_text(unscaled: Column, scale: Column) -> Column:
    """The exact decimal text of ``unscaled * 10^-scale``. (Each input is bound once, as
    a lambda variable: the expression stays small however often it is used.)"""

    def text(u: Column, s: Column) -> Column:
        t = F.abs(u).cast("string")
        # lpad also cuts longer strings: pad only the short ones
        digits = F.when(F.length(t) <= s, F.lpad(t, s + 1, "0")).otherwise(t)
        whole = F.substring(digits, F.lit(1), F.length(digits) - s)
        frac = F.substring(digits, F.length(digits) - s + 1, s)
        sign = F.when(u < 0, F.lit("-")).otherwise(F.lit(""))
        return F.when(s > 0, F.concat(sign, whole, F.lit("."), frac)).otherwise(
            F.concat(sign, whole)
        )

    pair = F.array(F.struct(unscaled.alias("u"), scale.alias("s")))
    return F.transform(pair, lambda p: text(p["u"], p["s"]))[0]


_TIME_UNITS = {  # Debezium/Connect numeric time encodings -> factor to microseconds
    "io.debezium.time.MicroTimestamp": 1,
    "io.debezium.time.Timestamp": 1000,
    "org.apache.kafka.connect.data.Timestamp": 1000,
    "io.debezium.time.MicroTime": 1,
    "io.debezium.time.Time": 1000,
    "org.apache.kafka.connect.data.Time": 1000,
}
_NANOS = ("io.debezium.time.NanoTimestamp", "io.debezium.time.NanoTime")


def _micros(r: Column, enc: str) -> Column:
    n = r.try_cast("long")
    return F.floor(n / 1000).cast("long") if enc in _NANOS else n * _TIME_UNITS[enc]


def _decode(r: Column, t: T.DataType, enc: str | None) -> Column:
    """A raw JSON value (as text) read as type ``t``; ``enc`` is the field's Connect logical
    type when the value is encoded (base64 decimals, epoch numbers), else plain text."""
    if isinstance(t, T.StringType):
        if enc == DECIMAL:  # wider than 38 digits: keep the exact text
            raw = F.unbase64(r)
            return _scaled_text(_be_integer(raw), F.lit(0))
        return r
    if isinstance(t, T.DecimalType):
        if enc == DECIMAL:
            text = _scaled_text(_be_integer(F.unbase64(r)), F.lit(t.scale))
            return text.try_cast(t)
        if enc == VARIABLE_DECIMAL:
            v = F.from_json(r, "scale int, value string")
            text = _scaled_text(_be_integer(F.unbase64(v["value"])), v["scale"])
            # more fractional digits than the column holds would be rounded: a mismatch
            return F.when(v["scale"] <= t.scale, text.try_cast(t))
        return r.try_cast(t)
    if isinstance(t, T.TimestampType | T.TimestampNTZType) and enc in (*_TIME_UNITS, *_NANOS):
        ts = F.timestamp_micros(_micros(r, enc))
        return ts.cast(t) if isinstance(t, T.TimestampNTZType) else ts
    if isinstance(t, T.DateType) and enc in (
        "io.debezium.time.Date",
        "org.apache.kafka.connect.data.Date",
    ):
        return F.date_from_unix_date(r.try_cast("int"))
    if isinstance(t, T.LongType) and enc in (*_TIME_UNITS, *_NANOS):
        return _micros(r, enc)
    if isinstance(t, T.StructType | T.ArrayType | T.MapType):
        return F.from_json(r, t)
    if isinstance(t, T.BinaryType):
        return F.try_to_binary(r, F.lit("base64"))
    return r.try_cast(t)


def _typed(
    raw: Column, record: T.StructType, label: str, encodings: dict[str, str] | None = None
) -> tuple[Column, list[Column]]:
    """``raw`` (a struct of strings) cast to ``record``, and one column per field naming it
    (``label`` + name) when its raw value does not fit the field's type. ``encodings`` maps
    a field to its Kafka Connect logical type (see :func:`connect_names`)."""
    values, mismatches = [], []
    for f in record.fields:
        r = raw[f.name]
        v = _decode(r, f.dataType, (encodings or {}).get(f.name))
        values.append(v.alias(f.name))
        mismatches.append(F.when(r.isNotNull() & v.isNull(), F.lit(label + f.name)))
    typed = F.when(raw.isNull(), F.lit(None).cast(record)).otherwise(F.struct(*values))
    return typed, mismatches


#: what a Debezium line that is not a change event of the feed's table is: skipped, counted
SKIP_TOMBSTONE = "tombstone"
SKIP_HEARTBEAT = "heartbeat"
SKIP_TX_METADATA = "transaction metadata"
SKIP_OTHER_TABLE = "other table"


def _read_debezium(
    spark: SparkSession,
    files: Sequence[str],
    record: T.StructType,
    key: Sequence[str],
    options: dict[str, Any],
) -> DataFrame:
    """Debezium change events, with or without the ``{"schema","payload"}`` wrapper.

    Besides change events (ops c/u/r/d, and t for truncate) a Debezium topic directory holds
    lines that carry no row change: Kafka tombstones (``null`` after a delete), heartbeats,
    transaction metadata (BEGIN/END) and other tables' events. Those are skipped and
    counted (``_skip``), except END records, which come out as op ``E`` with the number of
    the feed table's events in the transaction (``tx_count``) and the transaction's commit
    LSN (``pos_hi``): the emitter uses them to tell complete transactions.

    Positions: ``pos_hi`` is the commit LSN of ``source.sequence`` (the event's own LSN
    when absent),
    ``pos_lo`` the event's own LSN, ``pos_n`` its ``transaction.total_order`` (0 without
    transaction metadata). A primary-key update's delete and create share an LSN but not
    a total order; a snapshot's rows share everything but their row.
    """
    table = options.get("table")
    encodings = connect_names(options.get("schema") or {})
    raw_record = _as_strings(record)
    source = T.StructType(
        [
            T.StructField(n, T.StringType())
            for n in ("lsn", "txId", "ts_ms", "sequence", "schema", "table", "snapshot")
        ]
    )
    transaction = T.StructType(
        [T.StructField("id", T.StringType()), T.StructField("total_order", T.LongType())]
    )
    collections = T.ArrayType(
        T.StructType(
            [
                T.StructField("data_collection", T.StringType()),
                T.StructField("event_count", T.LongType()),
            ]
        )
    )
    envelope = [
        T.StructField("before", raw_record),
        T.StructField("after", raw_record),
        T.StructField("source", source),
        T.StructField("op", T.StringType()),
        T.StructField("transaction", transaction),
        # transaction metadata records (BEGIN/END)
        T.StructField("status", T.StringType()),
        T.StructField("id", T.StringType()),
        T.StructField("event_count", T.LongType()),
        T.StructField("data_collections", collections),
    ]
    # one parse reads both shapes: {"schema", "payload": {…}} and the bare envelope
    line = T.StructType(
        [
            T.StructField("payload", T.StructType(envelope)),
            *envelope,
            T.StructField(CORRUPT, T.StringType()),
        ]
    )
    text = _read_text(spark, files)
    parsed = F.from_json("_raw", line, _PARSE_OPTIONS)
    df = text.select("*", parsed.alias("p"))
    wrapped = F.col("p.payload").isNotNull()

    def field(name: str) -> Column:
        return F.when(wrapped, F.col(f"p.payload.{name}")).otherwise(F.col(f"p.{name}"))

    df = df.select(
        "*",
        field("before").alias("raw_before"),
        field("after").alias("raw_after"),
        field("source").alias("src"),
        field("op").alias("op"),
        field("transaction").alias("tx"),
        field("status").alias("status"),
        field("id").alias("tx_id"),
        field("event_count").alias("tx_events"),
        field("data_collections").alias("tx_tables"),
    )
    typed_before, mism_b = _typed(F.col("raw_before"), record, "before.", encodings)
    typed_after, mism_a = _typed(F.col("raw_after"), record, "after.", encodings)
    # typed once, in their own projection: the checks below refer to them many times
    df = df.select(
        "*",
        typed_before.alias("t_before"),
        typed_after.alias("t_after"),
        F.concat_ws(", ", *mism_b, *mism_a).alias("t_mism"),
    )
    before, after = F.col("t_before"), F.col("t_after")
    lsn = F.col("src.lsn").try_cast("long")
    seq = F.from_json(F.col("src.sequence"), T.ArrayType(T.StringType()))
    op = F.col("op")
    status = F.col("status")
    event_table = F.concat_ws(".", F.col("src.schema"), F.col("src.table"))
    malformed = F.col("p").isNull() | F.col(f"p.{CORRUPT}").isNotNull()
    skip = (
        F.when(F.trim(F.col("_raw")) == "null", F.lit(SKIP_TOMBSTONE))
        .when(malformed, F.lit(None))
        .when(status.isNotNull() & (status != "END"), F.lit(SKIP_TX_METADATA))
        .when(
            op.isNull() & status.isNull() & F.col("raw_after").isNull(),
            F.lit(SKIP_HEARTBEAT),
        )
    )
    if table:
        skip = skip.when(
            op.isNotNull() & F.col("src.table").isNotNull() & (event_table != table),
            F.lit(SKIP_OTHER_TABLE),
        )
    is_end = (status == "END") & skip.isNull()
    mism_list = F.col("t_mism")
    key_cols = list(key)
    image = F.when(op == "d", before).otherwise(after)
    missing_key = (
        F.concat_ws(", ", *[F.when(image[k].isNull(), F.lit(k)) for k in key_cols])
        if key_cols
        else F.lit("")
    )
    error = _first_error(
        (skip.isNotNull(), F.lit(None).cast("string")),
        (F.col("ord_file").isNull(), "input file could not be placed in order"),
        (malformed, "malformed JSON"),
        (is_end & F.col("tx_id").isNull(), "transaction END record without an 'id'"),
        (is_end, F.lit(None).cast("string")),
        (op.isNull(), "missing 'op'"),
        (
            op == "t",
            "truncate events are not supported: re-snapshot the table into a new feed",
        ),
        (~op.isin("c", "u", "d", "r"), F.concat(F.lit("unknown op '"), op, F.lit("'"))),
        _mismatch_error(mism_list),
        (lsn.isNull(), "missing source.lsn"),
        (
            op.isin("c", "u", "r") & F.col("raw_after").isNull(),
            F.concat(F.lit("op '"), op, F.lit("' without an after-image")),
        ),
        ((op == "d") & F.col("raw_before").isNull(), "delete without a before-image"),
        (missing_key != "", F.concat(F.lit("missing key column(s) "), missing_key)),
        (
            (op == "u") & F.col("raw_before").isNull() & F.lit(not key_cols),
            "update without a before-image: give --key so the emitter keeps state",
        ),
    )
    # the transaction: the xid part of transaction.id ("<xid>:<lsn>", whose LSN part
    # differs from event to event), else source.txId
    tx_xid = F.substring_index(F.col("tx.id"), ":", 1)
    end_xid = F.substring_index(F.col("tx_id"), ":", 1)
    end_lsn = F.substring_index(F.col("tx_id"), ":", -1).try_cast("long")
    if table:
        ours = F.filter(F.col("tx_tables"), lambda c: c["data_collection"] == table)
        end_count = F.coalesce(
            F.aggregate(ours, F.lit(0).cast("long"), lambda acc, c: acc + c["event_count"]),
            F.lit(0).cast("long"),
        )
    else:
        end_count = F.col("tx_events")
    txn = F.coalesce(tx_xid, F.col("src.txId"), F.concat(F.lit("lsn:"), F.col("src.lsn")))
    # Debezium/Postgres puts ["<last commit LSN>", "<LSN>"] in source.sequence; the commit
    # LSN orders changes across concurrent transactions, so it is the major position.
    # Without a last commit LSN (a snapshot read; the first transaction streamed after a
    # start) the event's own LSN takes its place: a snapshot's LSN is its consistent
    # point, after every transaction it holds and before every one streamed after it, so
    # a second snapshot falls in order among the streamed transactions; a first streamed
    # event's LSN is below its commit, which the next transaction's events carry.
    pos_hi = F.coalesce(seq.getItem(0).try_cast("long"), lsn, F.lit(0).cast("long"))
    return _canonical(
        df,
        op=F.when(skip.isNotNull(), F.lit("x")).when(is_end, F.lit("E")).otherwise(op),
        before=before,
        after=after,
        weight=F.lit(1),
        pos_hi=F.when(is_end, end_lsn).otherwise(pos_hi),
        pos_lo=F.when(is_end, end_lsn).otherwise(lsn),
        pos_n=F.coalesce(F.col("tx.total_order"), F.lit(0)),
        txn=F.when(is_end, end_xid).otherwise(txn),
        tx_meta=F.col("tx").isNotNull() | is_end,
        tx_count=F.when(is_end, end_count),
        ord_file=F.col("ord_file"),
        ord_row=F.col("ord_row"),
        error=error,
        skip=skip,
        toast=_toast_columns(after, record),
        # "first", "true", "last", "last_in_data_collection", "incremental", … : where a
        # snapshot ends (feed/transactions.py), also on the reads of other tables
        snap=F.col("src.snapshot"),
    )


def _toast_columns(image: Column, record: T.StructType) -> Column:
    """The names of the columns of ``image`` that hold Debezium's unavailable-value
    placeholder (comma-separated), or null."""
    marks = []
    for f in record.fields:
        if isinstance(f.dataType, T.StringType):
            hit = image[f.name] == F.lit(TOAST_PLACEHOLDER)
        elif isinstance(f.dataType, T.BinaryType):
            hit = image[f.name] == F.lit(TOAST_PLACEHOLDER.encode())
        else:
            continue
        marks.append(F.when(hit, F.lit(f.name)))
    if not marks:
        return F.lit(None).cast("string")
    names = F.concat_ws(",", *marks)
    return F.when(names != "", names)


def _read_weighted(spark: SparkSession, files: Sequence[str], record: T.StructType) -> DataFrame:
    line = T.StructType(
        [
            T.StructField("record", _as_strings(record)),
            T.StructField("delta", T.StringType()),
            T.StructField(CORRUPT, T.StringType()),
        ]
    )
    text = _read_text(spark, files)
    df = text.select("*", F.from_json("_raw", line, _PARSE_OPTIONS).alias("w"))
    rec, mism = _typed(F.col("w.record"), record, "")
    mism_list = F.concat_ws(", ", *mism)
    delta = F.col("w.delta").try_cast("long")
    error = _first_error(
        (F.col("w").isNull() | F.col(f"w.{CORRUPT}").isNotNull(), "malformed JSON"),
        (F.col("w.record").isNull(), "missing 'record'"),
        (F.col("w.delta").isNull(), "missing 'delta'"),
        (delta.isNull(), "'delta' is not a 64-bit integer"),
        (delta == 0, "'delta' is 0"),
        _mismatch_error(mism_list),
    )
    return _canonical(
        df,
        op=F.lit("w"),
        before=F.lit(None).cast(record),
        after=rec,
        weight=delta,
        pos_hi=F.lit(0),
        pos_lo=F.lit(0),
        txn=F.concat(F.lit("file:"), F.col("ord_file").cast("string")),
        ord_file=F.col("ord_file"),
        ord_row=F.col("ord_row"),
        error=error,
    )


def _read_rows(spark: SparkSession, files: Sequence[str], columns: T.StructType) -> DataFrame:
    """Table-shaped input (JSON lines, or Parquet for ``*.parquet``) as a struct column ``r``,
    with ``_mism`` naming the columns whose values do not fit their type."""
    json_files = [f for f in files if not f.endswith(".parquet")]
    parquet_files = [f for f in files if f.endswith(".parquet")]
    parts = []
    if parquet_files:
        index = F.create_map(
            *[x for i, p in enumerate(parquet_files) for x in (F.lit(_local(p)), F.lit(i))]
        )
        raw = spark.read.parquet(*parquet_files)
        present = set(raw.columns)
        cols, checks = [], []
        for f in columns.fields:
            if f.name in present:
                cast = F.col(f.name).try_cast(f.dataType)
                cols.append(cast.alias(f.name))
                checks.append(F.when(F.col(f.name).isNotNull() & cast.isNull(), F.lit(f.name)))
            else:
                cols.append(F.lit(None).cast(f.dataType).alias(f.name))
        local = F.regexp_replace(F.col("_metadata.file_path"), r"^file:(//)?", "")
        parts.append(
            raw.select(
                F.to_json(F.struct(*[F.col(c) for c in raw.columns])).alias("_raw"),
                F.col("_metadata.file_path").alias("_file"),
                index[local].cast("long").alias("ord_file"),
                F.monotonically_increasing_id().alias("ord_row"),
                F.struct(*cols).alias("r"),
                F.lit(False).alias("bad"),
                F.concat_ws(", ", *checks).alias("_mism"),
            )
        )
    if json_files:
        text = _read_text(spark, json_files)
        line = T.StructType([*_as_strings(columns).fields, T.StructField(CORRUPT, T.StringType())])
        df = text.select("*", F.from_json("_raw", line, _PARSE_OPTIONS).alias("p"))
        typed, mism = _typed(F.col("p"), columns, "")
        parts.append(
            df.select(
                "_raw",
                "_file",
                (F.col("ord_file") + F.lit(len(parquet_files))).alias("ord_file"),
                "ord_row",
                typed.alias("r"),
                (F.col("p").isNull() | F.col(f"p.{CORRUPT}").isNotNull()).alias("bad"),
                F.concat_ws(", ", *mism).alias("_mism"),
            )
        )
    out = parts[0]
    for p in parts[1:]:
        out = out.unionByName(p)
    return out


def _record_of(row: Column, record: T.StructType) -> Column:
    return F.struct(*[row[f.name].alias(f.name) for f in record.fields])


def _table_errors(key: Sequence[str], image: Column, *extra: tuple[Column, Column | str]) -> Column:
    missing_key = (
        F.concat_ws(", ", *[F.when(image[k].isNull(), F.lit(k)) for k in key]) if key else F.lit("")
    )
    return _first_error(
        (F.col("ord_file").isNull(), "input file could not be placed in order"),
        (F.col("bad"), "malformed JSON"),
        _mismatch_error(F.col("_mism")),
        *extra,
        (missing_key != "", F.concat(F.lit("missing key column(s) "), missing_key)),
    )


def _canonical(df: DataFrame, **c: Column) -> DataFrame:
    """``df`` as the canonical change columns; ``pos_n``, ``tx_meta``, ``tx_count``,
    ``skip`` and ``toast`` default to "none"."""
    return df.select(
        c["op"].alias("op"),
        c["before"].alias("before"),
        c["after"].alias("after"),
        c["weight"].cast("long").alias("weight"),
        c["pos_hi"].cast("long").alias("pos_hi"),
        c["pos_lo"].cast("long").alias("pos_lo"),
        c.get("pos_n", F.lit(0)).cast("long").alias("pos_n"),
        c["txn"].cast("string").alias("txn"),
        c.get("tx_meta", F.lit(False)).cast("boolean").alias("tx_meta"),
        c.get("tx_count", F.lit(None)).cast("long").alias("tx_count"),
        c["ord_file"].cast("long").alias("ord_file"),
        c["ord_row"].cast("long").alias("ord_row"),
        "_file",
        "_raw",
        c["error"].alias("_error"),
        c.get("skip", F.lit(None)).cast("string").alias("_skip"),
        c.get("toast", F.lit(None)).cast("string").alias("_toast"),
        c.get("snap", F.lit(None)).cast("string").alias("_snap"),
    )


_CDF_TYPES = ("insert", "update_preimage", "update_postimage", "delete")


def _read_cdf(
    spark: SparkSession, files: Sequence[str], record: T.StructType, key: Sequence[str]
) -> DataFrame:
    cols = T.StructType(
        [
            *record.fields,
            T.StructField("_change_type", T.StringType()),
            T.StructField("_commit_version", T.LongType()),
        ]
    )
    df = _read_rows(spark, files, cols)
    ct = F.col("r._change_type")
    rec = _record_of(F.col("r"), record)
    is_before = ct.isin("update_preimage", "delete")
    error = _table_errors(
        key,
        rec,
        (ct.isNull(), "missing '_change_type'"),
        (~ct.isin(*_CDF_TYPES), F.concat(F.lit("unknown _change_type '"), ct, F.lit("'"))),
        (F.col("r._commit_version").isNull(), "missing '_commit_version'"),
    )
    null_rec = F.lit(None).cast(record)
    return _canonical(
        df,
        op=F.when(ct == "insert", "c")
        .when(ct == "delete", "d")
        .when(ct == "update_preimage", "p")
        .otherwise("u"),
        before=F.when(is_before, rec).otherwise(null_rec),
        after=F.when(is_before, null_rec).otherwise(rec),
        weight=F.lit(1),
        pos_hi=F.col("r._commit_version"),
        pos_lo=F.lit(0),
        txn=F.col("r._commit_version"),
        # A Delta version is one transaction: versions (pos_hi) order the feed, whatever
        # the files. Inside a version the rows are a set, not a sequence: what a version
        # removes (deletes, pre-images) comes before what it adds. Delta changes a row once
        # per version; input that changes a key twice in one version is ordered by file
        # name and row, so the result never depends on how Spark happened to place rows.
        ord_file=F.when(is_before, F.lit(0)).otherwise(F.lit(1 << 31)) + F.col("ord_file"),
        ord_row=F.col("ord_row"),
        error=error,
    )


def _read_upsert(
    spark: SparkSession,
    files: Sequence[str],
    record: T.StructType,
    key: Sequence[str],
    options: dict[str, str],
) -> DataFrame:
    order = options.get("order")
    deleted = options.get("deleted")
    if not key:
        raise SourceError("the upsert source needs --key")
    if not order:
        raise SourceError("the upsert source needs --order COLUMN (what orders the upserts)")
    extra = [T.StructField(order, T.StringType())]
    if deleted:
        extra.append(T.StructField(deleted, T.BooleanType()))
    cols = T.StructType([f for f in record.fields if f.name not in (order, deleted)] + extra)
    df = _read_rows(spark, files, cols)
    raw_order = F.col(f"r.{order}")
    # numbers order numerically, timestamps and dates as instants
    as_long = F.coalesce(raw_order.try_cast("long"), F.unix_micros(F.try_to_timestamp(raw_order)))
    is_delete = F.coalesce(F.col(f"r.{deleted}"), F.lit(False)) if deleted else F.lit(False)
    rec = _record_of(F.col("r"), record)
    error = _table_errors(
        key,
        rec,
        (raw_order.isNull(), F.lit(f"missing order column '{order}'")),
        (as_long.isNull(), F.lit(f"order column '{order}' is neither a number nor a time")),
    )
    null_rec = F.lit(None).cast(record)
    return _canonical(
        df,
        op=F.when(is_delete, "d").otherwise("c"),
        before=F.when(is_delete, rec).otherwise(null_rec),
        after=F.when(is_delete, null_rec).otherwise(rec),
        weight=F.lit(1),
        pos_hi=as_long,
        pos_lo=F.lit(0),
        txn=raw_order,
        ord_file=as_long,
        ord_row=F.col("ord_row"),
        error=error,
    )


def _read_snapshot(
    spark: SparkSession, files: Sequence[str], record: T.StructType, key: Sequence[str]
) -> DataFrame:
    df = _read_rows(spark, files, record)
    rec = _record_of(F.col("r"), record)
    return _canonical(
        df,
        op=F.lit("s"),
        before=F.lit(None).cast(record),
        after=rec,
        weight=F.lit(1),
        pos_hi=F.lit(0),
        pos_lo=F.lit(0),
        txn=F.concat(F.lit("snapshot:"), F.col("ord_file").cast("string")),
        ord_file=F.col("ord_file"),
        ord_row=F.col("ord_row"),
        error=_table_errors(key, rec),
    )


def read_changes(
    spark: SparkSession,
    kind: str,
    files: Sequence[str],
    record: T.StructType,
    key: Sequence[str],
    options: dict[str, Any] | None = None,
) -> DataFrame:
    """Read ``files`` of source ``kind`` into the canonical change shape (bad rows marked).

    ``options``: ``order``/``deleted`` (upsert), ``table`` (the ``schema.table`` a Debezium
    feed holds) and ``schema`` (the feed's Avro record schema, whose ``connect.name``
    attributes say how Debezium encoded each column).
    """
    options = options or {}
    if kind == "debezium":
        return _read_debezium(spark, files, record, key, options)
    if kind == "weighted":
        return _read_weighted(spark, files, record)
    if kind == "cdf":
        return _read_cdf(spark, files, record, key)
    if kind == "upsert":
        return _read_upsert(spark, files, record, key, options)
    if kind == "snapshot":
        return _read_snapshot(spark, files, record, key)
    raise SourceError(f"unknown source kind {kind!r}; known kinds: {', '.join(SOURCE_KINDS)}")
