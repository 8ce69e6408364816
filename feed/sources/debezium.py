"""Debezium JSON lines -> canonical change rows (see :mod:`feed.sources.kinds`).

Wrapped (``{"schema", "payload"}``) or bare events; tombstones, heartbeats, transaction
metadata and other tables' events are skipped and counted; END records of transaction
metadata carry each transaction's size; decimals and times are decoded from their
Kafka Connect encodings (:mod:`feed.sources.connect`). The position of an event is its commit LSN
(``source.sequence[0]``), else its own LSN, as for a snapshot read (docs/sources.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from feed.sources.connect import (
    TOAST_PLACEHOLDER,
    as_strings,
    connect_names,
    connect_scales,
    typed_record,
)
from feed.sources.debezium_schema import WRAPPER_SCHEMA, shape_of
from feed.sources.events import debezium_event
from feed.sources.rows import (
    CORRUPT,
    PARSE_OPTIONS,
    canonical,
    first_error,
    mismatch_error,
    read_text,
)

__all__ = [
    "SKIP_HEARTBEAT",
    "SKIP_OTHER_TABLE",
    "SKIP_TOMBSTONE",
    "SKIP_TX_METADATA",
    "debezium_event",
    "read_debezium",
]

#: what a Debezium line that is not a change event of the feed's table is: skipped, counted
SKIP_TOMBSTONE = "tombstone"
SKIP_HEARTBEAT = "heartbeat"
SKIP_TX_METADATA = "transaction metadata"
SKIP_OTHER_TABLE = "other table"


def read_debezium(
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
    df = _envelopes(spark, files, record, options.get("schema") or {})
    before, after = F.col("t_before"), F.col("t_after")
    lsn = F.col("src.lsn").try_cast("long")
    seq = F.from_json(F.col("src.sequence"), T.ArrayType(T.StringType()))
    op = F.col("op")
    skip = _skip_reason(table)
    is_end = (F.col("status") == "END") & skip.isNull()
    # the transaction: the xid part of transaction.id ("<xid>:<lsn>", whose LSN part
    # differs from event to event), else source.txId
    tx_xid = F.substring_index(F.col("tx.id"), ":", 1)
    end_xid = F.substring_index(F.col("tx_id"), ":", 1)
    end_lsn = F.substring_index(F.col("tx_id"), ":", -1).try_cast("long")
    # (never null on a good row: an event without source.lsn is bad, and so is an END
    # record without an id: every source transaction held back or released has a name)
    txn = F.coalesce(tx_xid, F.col("src.txId"), F.concat(F.lit("lsn:"), F.col("src.lsn")))
    # Debezium/Postgres puts ["<last commit LSN>", "<LSN>"] in source.sequence; the commit
    # LSN orders changes across concurrent transactions, so it is the major position.
    # Without a last commit LSN (a snapshot read; the first transaction streamed after a
    # start) the event's own LSN takes its place: a snapshot's LSN is its consistent
    # point, after every transaction it holds and before every one streamed after it, so
    # a second snapshot falls in order among the streamed transactions; a first streamed
    # event's LSN is below its commit, which the next transaction's events carry.
    pos_hi = F.coalesce(seq.getItem(0).try_cast("long"), lsn, F.lit(0).cast("long"))
    # a whole-table snapshot's read is at its snapshot's LSN, whatever its sequence says
    whole_read = (op == "r") & (F.coalesce(F.col("src.snapshot"), F.lit("")) != "incremental")
    pos_hi = F.when(whole_read & lsn.isNotNull(), lsn).otherwise(pos_hi)
    return canonical(
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
        tx_count=F.when(is_end, _end_count(table)),
        ord_file=F.col("ord_file"),
        ord_row=F.col("ord_row"),
        error=_event_error(skip, is_end, lsn, key),
        skip=skip,
        toast=_toast_columns(after, record),
        # "first", "true", "last", "last_in_data_collection", "incremental", … : where a
        # snapshot ends (feed/sources/transactions.py), also on the reads of other tables
        snap=F.col("src.snapshot"),
        # the table's shape as this event's Connect schema gives it (feed/sources/shapes.py)
        shape=F.when(skip.isNull() & op.isin("c", "u", "d", "r"), shape_of(F.col("p.schema"))),
    )


def _line_type(record: T.StructType) -> T.StructType:
    """What one input line may hold, parsed in one pass: an event or a transaction
    metadata record, wrapped (``{"schema", "payload": {…}}``) or bare."""
    raw_record = as_strings(record)
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
    return T.StructType(
        [
            T.StructField("schema", WRAPPER_SCHEMA),
            T.StructField("payload", T.StructType(envelope)),
            *envelope,
            T.StructField(CORRUPT, T.StringType()),
        ]
    )


def _envelopes(
    spark: SparkSession, files: Sequence[str], record: T.StructType, schema: dict[str, Any]
) -> DataFrame:
    """The lines of ``files`` parsed (``p``), their envelope's fields as columns whether
    wrapped or not (``raw_before``, ``src``, ``op``, ``tx``, ``status``, ``tx_id``, …), and
    the images typed as ``record`` (``t_before``, ``t_after``; ``t_mism`` lists the values
    that do not fit). ``schema``, the feed's Avro schema, says how Connect encoded each
    column."""
    encodings, scales = connect_names(schema), connect_scales(schema)
    parsed = F.from_json("_raw", _line_type(record), PARSE_OPTIONS)
    df = read_text(spark, files).select("*", parsed.alias("p"))
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
    typed_before, mism_b = typed_record(F.col("raw_before"), record, "before.", encodings, scales)
    typed_after, mism_a = typed_record(F.col("raw_after"), record, "after.", encodings, scales)
    # typed once, in their own projection: the checks refer to them many times
    return df.select(
        "*",
        typed_before.alias("t_before"),
        typed_after.alias("t_after"),
        F.concat_ws(", ", *mism_b, *mism_a).alias("t_mism"),
    )


def _malformed() -> Column:
    return F.col("p").isNull() | F.col(f"p.{CORRUPT}").isNotNull()


def _skip_reason(table: str | None) -> Column:
    """Why a line carries no change of the feed's table (null: it does, or it is bad)."""
    op, status = F.col("op"), F.col("status")
    skip = (
        F.when(F.trim(F.col("_raw")) == "null", F.lit(SKIP_TOMBSTONE))
        .when(_malformed(), F.lit(None))
        .when(status.isNotNull() & (status != "END"), F.lit(SKIP_TX_METADATA))
        .when(
            op.isNull() & status.isNull() & F.col("raw_after").isNull(),
            F.lit(SKIP_HEARTBEAT),
        )
    )
    if table:
        event_table = F.concat_ws(".", F.col("src.schema"), F.col("src.table"))
        skip = skip.when(
            op.isNotNull() & F.col("src.table").isNotNull() & (event_table != table),
            F.lit(SKIP_OTHER_TABLE),
        )
    return skip


def _event_error(skip: Column, is_end: Column, lsn: Column, key: Sequence[str]) -> Column:
    """Why an event is bad (null: it is good, or skipped, or an END record)."""
    op = F.col("op")
    key_cols = list(key)
    image = F.when(op == "d", F.col("t_before")).otherwise(F.col("t_after"))
    missing_key = (
        F.concat_ws(", ", *[F.when(image[k].isNull(), F.lit(k)) for k in key_cols])
        if key_cols
        else F.lit("")
    )
    return first_error(
        (skip.isNotNull(), F.lit(None).cast("string")),
        (F.col("ord_file").isNull(), "input file could not be placed in order"),
        (_malformed(), "malformed JSON"),
        (is_end & F.col("tx_id").isNull(), "transaction END record without an 'id'"),
        (is_end, F.lit(None).cast("string")),
        (op.isNull(), "missing 'op'"),
        (
            op == "t",
            "truncate events are not supported: re-snapshot the table into a new feed",
        ),
        (~op.isin("c", "u", "d", "r"), F.concat(F.lit("unknown op '"), op, F.lit("'"))),
        mismatch_error(F.col("t_mism")),
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


def _end_count(table: str | None) -> Column:
    """On an END record: how many of the feed table's events its transaction has."""
    if not table:
        return F.col("tx_events")
    ours = F.filter(F.col("tx_tables"), lambda c: c["data_collection"] == table)
    return F.coalesce(
        F.aggregate(ours, F.lit(0).cast("long"), lambda acc, c: acc + c["event_count"]),
        F.lit(0).cast("long"),
    )


#: the part of a wrapped event's Connect schema that gives the table's columns: the
#: ``fields`` of its ``after`` (or ``before``) field, kept as its JSON text
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
