"""The canonical change shape every source reader produces, and what the readers share:
reading lines with their file and order, typing rows against the record schema, and the
first-error rule that turns a bad row into a reason (see :mod:`feed.sources.kinds`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.pandas.types import from_arrow_type

from feed.sources.connect import as_strings, typed_record
from feed.sources.file_text import check_compressed
from feed.sources.inputs import spark_file_path, spark_input
from feed.sources.store_lines import read_store_text
from feed.sources.stores import is_remote
from protocol import avro_to_arrow

__all__ = [
    "CHANGE_COLUMNS",
    "CORRUPT",
    "PARSE_OPTIONS",
    "canonical",
    "first_error",
    "mismatch_error",
    "ordered_fields",
    "read_rows",
    "read_text",
    "record_of",
    "spark_record_type",
    "table_errors",
]

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
    "_shape",
)


def spark_record_type(avro_schema: dict[str, Any]) -> T.StructType:
    """The Spark struct type of a feed's record schema."""
    t = from_arrow_type(avro_to_arrow(avro_schema))
    assert isinstance(t, T.StructType)
    return t


def ordered_fields(fields: list[T.StructField], order: list[str]) -> list[T.StructField]:
    rank = {n: i for i, n in enumerate(order)}
    return sorted(fields, key=lambda f: rank.get(f.name, len(rank)))


def read_text(spark: SparkSession, files: Sequence[str]) -> DataFrame:
    """Lines of ``files`` with their file, the file's index in ``files`` and a row id that
    grows with the line within each file (files are never split: see feed/emit/session.py)."""
    check_compressed(files)
    df: DataFrame
    if any(is_remote(f) for f in files):  # (through pyarrow: s3a:// needs hadoop-aws)
        df = read_store_text(spark, files)
    else:
        index = F.create_map(
            *[x for i, p in enumerate(files) for x in (F.lit(spark_file_path(p)), F.lit(i))]
        )
        df = spark.read.text([spark_input(f) for f in files]).select(
            F.col("value").alias("_raw"), F.col("_metadata.file_path").alias("_file")
        )
        local = F.regexp_replace(F.col("_file"), r"^file:(//)?", "")
        df = df.select(
            "*",
            index[local].cast("long").alias("ord_file"),
            F.monotonically_increasing_id().alias("ord_row"),
        )
    df = df.where(F.trim("_raw") != "")  # (not length(trim(…)): it counts every character)
    return df


def mismatch_error(mismatched: Column) -> tuple[Column, Column]:
    """The error check for columns whose values do not fit their type (a list of names)."""
    return (
        mismatched != "",
        F.concat(
            F.lit("type mismatch in "), mismatched, F.lit(" (does not fit the record schema)")
        ),
    )


def first_error(*checks: tuple[Column, Column | str]) -> Column:
    expr: Column = F.lit(None).cast("string")
    for cond, msg in reversed(checks):
        expr = F.when(cond, msg if isinstance(msg, Column) else F.lit(msg)).otherwise(expr)
    return expr


CORRUPT = "_corrupt"
PARSE_OPTIONS = {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": CORRUPT}


def read_rows(spark: SparkSession, files: Sequence[str], columns: T.StructType) -> DataFrame:
    """Table-shaped input (JSON lines, or Parquet for ``*.parquet``) as a struct column ``r``,
    with ``_mism`` naming the columns whose values do not fit their type."""
    json_files = [f for f in files if not f.endswith(".parquet")]
    check_compressed(json_files)
    parquet_files = [f for f in files if f.endswith(".parquet")]
    parts = []
    if parquet_files:
        index = F.create_map(
            *[x for i, p in enumerate(parquet_files) for x in (F.lit(spark_file_path(p)), F.lit(i))]
        )
        raw = spark.read.parquet(*map(spark_input, parquet_files))
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
        text = read_text(spark, json_files)
        line = T.StructType([*as_strings(columns).fields, T.StructField(CORRUPT, T.StringType())])
        df = text.select("*", F.from_json("_raw", line, PARSE_OPTIONS).alias("p"))
        typed, mism = typed_record(F.col("p"), columns, "")
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


def record_of(row: Column, record: T.StructType) -> Column:
    return F.struct(*[row[f.name].alias(f.name) for f in record.fields])


def table_errors(key: Sequence[str], image: Column, *extra: tuple[Column, Column | str]) -> Column:
    missing_key = (
        F.concat_ws(", ", *[F.when(image[k].isNull(), F.lit(k)) for k in key]) if key else F.lit("")
    )
    return first_error(
        (F.col("ord_file").isNull(), "input file could not be placed in order"),
        (F.col("bad"), "malformed JSON"),
        mismatch_error(F.col("_mism")),
        *extra,
        (missing_key != "", F.concat(F.lit("missing key column(s) "), missing_key)),
    )


def canonical(df: DataFrame, **c: Column) -> DataFrame:
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
        c.get("shape", F.lit(None)).cast("long").alias("_shape"),
    )
