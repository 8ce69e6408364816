"""Sources: input files of a given kind -> one canonical change shape (a Spark DataFrame).

Every input row becomes one row of :data:`CHANGE_COLUMNS`:

========== ================================================================================
column     meaning
========== ================================================================================
op         ``c`` insert, ``u`` update, ``d`` delete, ``r`` snapshot read, ``w`` weighted,
           ``s`` a row of a full snapshot, ``p`` a Delta update pre-image
before     the row before the change (a record struct), or null
after      the row after the change, or null
weight     the multiplicity of the change (1, or a weighted row's delta)
pos_hi     position in the source, major part (Debezium: commit LSN of ``source.sequence``)
pos_lo     position in the source, minor part (Debezium: ``source.lsn``)
txn        the source transaction the change belongs to (as a string)
ord_file   index of the input file in name order  } together: delivery order, which is
ord_row    increasing row id within the file      } the source's commit order
_file      the input file
_raw       the raw input text of the row
_error     why the row is bad, or null
========== ================================================================================

Bad rows are kept with a reason so the transaction driver can quarantine them (DESIGN §10):
nothing is silently dropped. Spark's native expressions do all the parsing and checking.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    "infer_record_schema",
    "read_changes",
    "spark_record_type",
]

SOURCE_KINDS = ("debezium", "cdf", "upsert", "snapshot", "weighted")
CHANGE_COLUMNS = (
    "op",
    "before",
    "after",
    "weight",
    "pos_hi",
    "pos_lo",
    "txn",
    "ord_file",
    "ord_row",
    "_file",
    "_raw",
    "_error",
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


def spark_record_type(avro_schema: dict[str, Any]) -> T.StructType:
    """The Spark struct type of a feed's record schema."""
    t = from_arrow_type(avro_to_arrow(avro_schema))
    assert isinstance(t, T.StructType)
    return t


def _connect_to_avro(fields: list[dict[str, Any]], name: str) -> dict[str, Any]:
    out = []
    for f in fields:
        kind = f.get("type")
        if kind == "struct":
            avro: Any = _connect_to_avro(f.get("fields", []), f"{name}_{f['field']}")
        elif kind == "array":
            items = f.get("items", {}).get("type", "string")
            avro = {"type": "array", "items": _CONNECT_TYPES.get(items, "string")}
        else:
            avro = _CONNECT_TYPES.get(str(kind), "string")
        entry: dict[str, Any] = {"name": f["field"], "type": avro}
        if f.get("optional"):
            entry = {"name": f["field"], "type": ["null", avro], "default": None}
        out.append(entry)
    return {"type": "record", "name": name, "fields": out}


_META_COLUMNS = ("_change_type", "_commit_version", "_commit_timestamp")


def infer_record_schema(
    spark: SparkSession, kind: str, files: Sequence[str], exclude: Sequence[str] = ()
) -> dict[str, Any]:
    """The record schema of a new feed, read from its first input.

    Debezium: the Kafka Connect schema of the first wrapped event, else Spark's JSON
    inference over the before/after images. Weighted: JSON inference over ``record``.
    Table-shaped kinds (cdf, upsert, snapshot): the columns of the input (Parquet's own
    schema, or JSON inference), less Delta's metadata columns and ``exclude``.
    """
    from pyspark.sql.pandas.types import to_arrow_type

    from protocol import arrow_to_avro

    if not files:
        raise SourceError(f"no input files to infer the {kind} record schema from")
    if kind == "debezium":
        found = _connect_schema(files)
        if found is not None:
            return found
        images = ["payload.after", "after", "payload.before", "before"]
    elif kind == "weighted":
        images = ["record"]
    else:
        parquet = [f for f in files if f.endswith(".parquet")]
        df = spark.read.parquet(*parquet) if parquet else spark.read.json(list(files))
        drop = set(_META_COLUMNS) | set(exclude) | {"_corrupt_record"}
        fields = [f for f in df.schema.fields if f.name not in drop]
        if not fields:
            raise SourceError(f"no record columns in {kind} input {files[0]}")
        schema: dict[str, Any] = arrow_to_avro(to_arrow_type(T.StructType(fields)), name="record")
        return schema
    df = spark.read.json(list(files))
    for path in images:
        head, _, rest = path.partition(".")
        if head not in df.columns:
            continue
        t = df.schema[head].dataType
        if rest:
            if not isinstance(t, T.StructType) or rest not in t.fieldNames():
                continue
            t = t[rest].dataType
        if isinstance(t, T.StructType):
            schema = arrow_to_avro(to_arrow_type(t), name="record")
            return schema
    raise SourceError(
        f"cannot infer a record schema from {kind} input {files[0]}: "
        "give --schema FILE (an Avro record schema)"
    )


def _connect_schema(files: Sequence[str]) -> dict[str, Any] | None:
    """The record schema from the Kafka Connect schema of a wrapped Debezium event, if any."""
    for path in files[:5]:
        with open(path, "rb") as f:
            for n, line in enumerate(f):
                if n > 1000:
                    break
                try:
                    e = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue
                if isinstance(e, dict) and isinstance(e.get("schema"), dict):
                    for fld in e["schema"].get("fields", []):
                        if fld.get("field") in ("after", "before") and fld.get("fields"):
                            return _connect_to_avro(fld["fields"], "record")
    return None


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


def _typed(raw: Column, record: T.StructType, label: str) -> tuple[Column, list[Column]]:
    """``raw`` (a struct of strings) cast to ``record``, and one column per field naming it
    (``label`` + name) when its raw value does not fit the field's type."""
    values, mismatches = [], []
    for f in record.fields:
        r = raw[f.name]
        t = f.dataType
        if isinstance(t, T.StringType):
            v = r
        elif isinstance(t, T.StructType | T.ArrayType | T.MapType):
            v = F.from_json(r, t)
        elif isinstance(t, T.BinaryType):
            v = F.try_to_binary(r, F.lit("base64"))
        else:
            v = r.try_cast(t)
        values.append(v.alias(f.name))
        mismatches.append(F.when(r.isNotNull() & v.isNull(), F.lit(label + f.name)))
    typed = F.when(raw.isNull(), F.lit(None).cast(record)).otherwise(F.struct(*values))
    return typed, mismatches


def _read_debezium(
    spark: SparkSession, files: Sequence[str], record: T.StructType, key: Sequence[str]
) -> DataFrame:
    raw_record = _as_strings(record)
    source = T.StructType(
        [T.StructField(n, T.StringType()) for n in ("lsn", "txId", "ts_ms", "sequence")]
    )
    envelope = [
        T.StructField("before", raw_record),
        T.StructField("after", raw_record),
        T.StructField("source", source),
        T.StructField("op", T.StringType()),
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
    )
    before, mism_b = _typed(F.col("raw_before"), record, "before.")
    after, mism_a = _typed(F.col("raw_after"), record, "after.")
    lsn = F.col("src.lsn").try_cast("long")
    seq = F.from_json(F.col("src.sequence"), T.ArrayType(T.StringType()))
    op = F.col("op")
    mism_list = F.concat_ws(", ", *mism_b, *mism_a)
    key_cols = list(key)
    image = F.when(op == "d", before).otherwise(after)
    missing_key = (
        F.concat_ws(", ", *[F.when(image[k].isNull(), F.lit(k)) for k in key_cols])
        if key_cols
        else F.lit("")
    )
    error = _first_error(
        (F.col("ord_file").isNull(), "input file could not be placed in order"),
        (F.col("p").isNull() | F.col(f"p.{CORRUPT}").isNotNull(), "malformed JSON"),
        (op.isNull(), "missing 'op'"),
        (op == "t", "truncate events are not supported: re-snapshot the table into a new feed"),
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
    # Debezium/Postgres puts ["<last commit LSN>", "<LSN>"] in source.sequence; the commit
    # LSN orders changes across concurrent transactions, so it is the major position.
    pos_hi = F.coalesce(seq.getItem(0).try_cast("long"), F.lit(0).cast("long"))
    return df.select(
        op.alias("op"),
        before.alias("before"),
        after.alias("after"),
        F.lit(1).cast("long").alias("weight"),
        pos_hi.alias("pos_hi"),
        lsn.alias("pos_lo"),
        F.coalesce(F.col("src.txId"), F.concat(F.lit("lsn:"), F.col("src.lsn"))).alias("txn"),
        "ord_file",
        "ord_row",
        "_file",
        "_raw",
        error.alias("_error"),
    )


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
    return df.select(
        F.lit("w").alias("op"),
        F.lit(None).cast(record).alias("before"),
        rec.alias("after"),
        delta.alias("weight"),
        F.lit(0).cast("long").alias("pos_hi"),
        F.lit(0).cast("long").alias("pos_lo"),
        F.concat(F.lit("file:"), F.col("ord_file").cast("string")).alias("txn"),
        "ord_file",
        "ord_row",
        "_file",
        "_raw",
        error.alias("_error"),
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
    return df.select(
        c["op"].alias("op"),
        c["before"].alias("before"),
        c["after"].alias("after"),
        c["weight"].cast("long").alias("weight"),
        c["pos_hi"].cast("long").alias("pos_hi"),
        c["pos_lo"].cast("long").alias("pos_lo"),
        c["txn"].cast("string").alias("txn"),
        c["ord_file"].cast("long").alias("ord_file"),
        c["ord_row"].cast("long").alias("ord_row"),
        "_file",
        "_raw",
        c["error"].alias("_error"),
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
        # a Delta version is one transaction: versions order the feed, whatever the files
        ord_file=F.col("r._commit_version"),
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
    options: dict[str, str] | None = None,
) -> DataFrame:
    """Read ``files`` of source ``kind`` into the canonical change shape (bad rows marked)."""
    if kind == "debezium":
        return _read_debezium(spark, files, record, key)
    if kind == "weighted":
        return _read_weighted(spark, files, record)
    if kind == "cdf":
        return _read_cdf(spark, files, record, key)
    if kind == "upsert":
        return _read_upsert(spark, files, record, key, options or {})
    if kind == "snapshot":
        return _read_snapshot(spark, files, record, key)
    raise SourceError(f"unknown source kind {kind!r}; known kinds: {', '.join(SOURCE_KINDS)}")
