"""Sources: input files of a given kind -> one canonical change shape (a Spark DataFrame).

Every input row becomes one row of :data:`feed.sources.rows.CHANGE_COLUMNS`:

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

This module holds the table-shaped readers (``cdf``, ``upsert``, ``snapshot``) and the
``weighted`` one, schema inference and :func:`read_changes`, which picks the reader;
Debezium's reader is :mod:`feed.sources.debezium`, the Kafka Connect value decoding
:mod:`feed.sources.connect`, and what the readers share :mod:`feed.sources.rows`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import orjson
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from feed.sources.connect import as_strings, typed_record
from feed.sources.debezium import read_debezium
from feed.sources.debezium_schema import debezium_schema
from feed.sources.file_text import HADOOP_ONLY, input_lines
from feed.sources.inputs import spark_input
from feed.sources.rows import (
    CORRUPT,
    PARSE_OPTIONS,
    canonical,
    first_error,
    mismatch_error,
    ordered_fields,
    read_rows,
    read_text,
    record_of,
    table_errors,
)
from protocol import SourceError

__all__ = [
    "infer_record_schema",
    "read_changes",
]


_META_COLUMNS = ("_change_type", "_commit_version", "_commit_timestamp")


def infer_record_schema(
    spark: Callable[[], SparkSession],
    kind: str,
    files: Sequence[str],
    exclude: Sequence[str] = (),
    table: str | None = None,
) -> dict[str, Any]:
    """The record schema of a new feed, read from its first input.

    Debezium: the Kafka Connect schema of the first wrapped event of ``table`` (logical
    types decoded, columns in table order), else Spark's JSON inference over the images of
    that table's events, in the column order of the first image. ``spark`` gives the
    session, called only where Spark is needed (not for a Connect schema). Weighted: JSON inference
    over ``record``. Table-shaped kinds (cdf, upsert, snapshot): the columns of the input
    (Parquet's own schema, or JSON inference), less Delta's metadata columns and ``exclude``.
    """
    from pyspark.sql.pandas.types import to_arrow_type

    from protocol import arrow_to_avro

    if not files:
        raise SourceError(f"no input files to infer the {kind} record schema from")
    if kind == "debezium":
        return debezium_schema(spark, files, table)
    session = spark()
    if kind == "weighted":
        t = session.read.json([spark_input(f) for f in files]).schema["record"].dataType
        if not isinstance(t, T.StructType):
            raise SourceError(f"no 'record' objects in weighted input {files[0]}")
        schema: dict[str, Any] = arrow_to_avro(to_arrow_type(t, timezone="UTC"), name="record")
        return schema
    parquet = [f for f in files if f.endswith(".parquet")]
    df = (
        session.read.parquet(*map(spark_input, parquet))
        if parquet
        else session.read.json([spark_input(f) for f in files])
    )
    drop = set(_META_COLUMNS) | set(exclude) | {"_corrupt_record"}
    fields = [f for f in df.schema.fields if f.name not in drop]
    if not parquet:
        fields = _in_first_row_order(fields, files)
    if not fields:
        raise SourceError(f"no record columns in {kind} input {files[0]}")
    _not_change_events(kind, files[0], [f.name for f in fields])
    schema = arrow_to_avro(to_arrow_type(T.StructType(fields), timezone="UTC"), name="record")
    return schema


def _not_change_events(kind: str, first: str, names: Sequence[str]) -> None:
    """Refuse a table-shaped kind's first input when its columns are those of Debezium's
    change events (``op`` and ``source`` beside ``before`` or ``after``, or Kafka Connect's
    ``schema`` and ``payload``): read as rows, each event would become a row of the feed."""
    have = set(names)
    if {"op", "source"} <= have and have & {"before", "after"}:
        what = "Debezium change events (columns " + ", ".join(sorted(have)) + ")"
    elif have == {"schema", "payload"}:
        what = "Kafka Connect's wrapped events (columns payload, schema)"
    else:
        return
    raise SourceError(
        f"the {kind} input {first} holds {what}, not rows of a table: read them with "
        f"--source debezium:PATH (for a table that has these columns, give its --schema)"
    )


def _in_first_row_order(fields: list[T.StructField], files: Sequence[str]) -> list[T.StructField]:
    """``fields`` (sorted by name, as Spark infers JSON) in the key order of the first row."""
    if files[0].endswith(HADOOP_ONLY):  # (text only Spark reads: its order)
        return fields
    for line in input_lines(files[0]):
        with contextlib.suppress(orjson.JSONDecodeError):
            row = orjson.loads(line)
            if isinstance(row, dict):
                return ordered_fields(fields, list(row))
    return fields


def _read_weighted(
    spark: SparkSession,
    files: Sequence[str],
    record: T.StructType,
    key: Sequence[str],
    options: dict[str, Any],
) -> DataFrame:
    line = T.StructType(
        [
            T.StructField("record", as_strings(record)),
            T.StructField("delta", T.StringType()),
            T.StructField(CORRUPT, T.StringType()),
        ]
    )
    text = read_text(spark, files)
    df = text.select("*", F.from_json("_raw", line, PARSE_OPTIONS).alias("w"))
    rec, mism = typed_record(F.col("w.record"), record, "")
    mism_list = F.concat_ws(", ", *mism)
    delta = F.col("w.delta").try_cast("long")
    error = first_error(
        (F.col("w").isNull() | F.col(f"w.{CORRUPT}").isNotNull(), "malformed JSON"),
        (F.col("w.record").isNull(), "missing 'record'"),
        (F.col("w.delta").isNull(), "missing 'delta'"),
        (delta.isNull(), "'delta' is not a 64-bit integer"),
        (delta == 0, "'delta' is 0"),
        mismatch_error(mism_list),
    )
    return canonical(
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


_CDF_TYPES = ("insert", "update_preimage", "update_postimage", "delete")


def _read_cdf(
    spark: SparkSession,
    files: Sequence[str],
    record: T.StructType,
    key: Sequence[str],
    options: dict[str, Any],
) -> DataFrame:
    cols = T.StructType(
        [
            *record.fields,
            T.StructField("_change_type", T.StringType()),
            T.StructField("_commit_version", T.LongType()),
        ]
    )
    df = read_rows(spark, files, cols)
    ct = F.col("r._change_type")
    rec = record_of(F.col("r"), record)
    is_before = ct.isin("update_preimage", "delete")
    error = table_errors(
        key,
        rec,
        (ct.isNull(), "missing '_change_type'"),
        (~ct.isin(*_CDF_TYPES), F.concat(F.lit("unknown _change_type '"), ct, F.lit("'"))),
        (F.col("r._commit_version").isNull(), "missing '_commit_version'"),
    )
    null_rec = F.lit(None).cast(record)
    return canonical(
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
    options: dict[str, Any],
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
    df = read_rows(spark, files, cols)
    raw_order = F.col(f"r.{order}")
    # numbers order numerically, timestamps and dates as instants
    as_long = F.coalesce(raw_order.try_cast("long"), F.unix_micros(F.try_to_timestamp(raw_order)))
    is_delete = F.coalesce(F.col(f"r.{deleted}"), F.lit(False)) if deleted else F.lit(False)
    rec = record_of(F.col("r"), record)
    error = table_errors(
        key,
        rec,
        (raw_order.isNull(), F.lit(f"missing order column '{order}'")),
        (as_long.isNull(), F.lit(f"order column '{order}' is neither a number nor a time")),
    )
    null_rec = F.lit(None).cast(record)
    return canonical(
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
    spark: SparkSession,
    files: Sequence[str],
    record: T.StructType,
    key: Sequence[str],
    options: dict[str, Any],
) -> DataFrame:
    df = read_rows(spark, files, record)
    rec = record_of(F.col("r"), record)
    return canonical(
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
        error=table_errors(key, rec),
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
    reader = _READERS.get(kind)
    if reader is None:  # (a kind names its reader: feed/sources/registry.py)
        raise SourceError(f"no reader {kind!r}; the readers: {', '.join(_READERS)}")
    return reader(spark, files, record, key, options)


#: the reader of each ``SourceKind.reader`` name (feed/sources/registry.py); each takes
#: the same arguments, and the key and options it has no use for
_READERS: dict[str, Callable[..., DataFrame]] = {
    "debezium": read_debezium,
    "weighted": _read_weighted,
    "cdf": _read_cdf,
    "upsert": _read_upsert,
    "snapshot": _read_snapshot,
}
