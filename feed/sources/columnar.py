"""Debezium input parsed by pyarrow in Spark's tasks, where that reads it exactly as
Spark's JSON reader does (:mod:`feed.sources.debezium_arrow`).

:func:`read_debezium_columnar` gives the columns of
:func:`feed.sources.debezium.read_debezium` from a task per file (``mapInArrow`` over the
list of files): the task reads the whole file and parses it with
:func:`~feed.sources.debezium_arrow.parse_flat`, so the rows reach Spark once, already in
their columns. Where it applies (:func:`why_not_columnar`, decided before any job):
local, uncompressed files whose first line is a flat event, in a feed whose record has
only integers, text, booleans and doubles, none encoded by Connect. A file the parse
declines gives one row saying so instead (:data:`~feed.sources.debezium_arrow.DECLINED_OP`),
which :func:`declined` finds in the job that builds the cache; the caller then reads the
input with Spark's reader.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pyarrow as pa

from feed.sources.connect_json import Declined
from feed.sources.debezium_arrow import DECLINED_OP, NOT_NULL, OUT, declined_batch, parse_flat
from feed.sources.file_text import codec_of
from feed.sources.inputs import spark_metadata_path
from feed.sources.stores import is_remote

__all__ = ["MAX_FILE_BYTES", "declined", "read_debezium_columnar", "why_not_columnar"]

_BATCH = 65_536  # rows per Arrow batch handed to Spark
#: a larger file is read by Spark's reader, which streams it: a task here holds its file
#: and the parse of it in memory
MAX_FILE_BYTES = 256 << 20


def why_not_columnar(files: Sequence[str], record: Any, encodings: dict[str, str]) -> str | None:
    """Why ``files`` of a feed of Spark ``record`` are read by Spark's own parse, or None."""
    from pyspark.sql import types as T

    plain = (T.LongType, T.IntegerType, T.StringType, T.BooleanType, T.DoubleType)
    for f in record.fields:
        if not isinstance(f.dataType, plain):
            return f"column {f.name!r} of type {f.dataType.simpleString()}"
        if f.name in encodings:
            return f"column {f.name!r} encoded by Connect ({encodings[f.name]})"
    for path in files:
        if is_remote(path):
            return f"input in a store ({path})"
        if codec_of(path) is not None:
            return f"a compressed file ({path})"
        if os.path.getsize(path) > MAX_FILE_BYTES:  # (a task holds its file whole)
            return f"a file over {MAX_FILE_BYTES >> 20} MiB ({path})"
        if _wrapped(path):  # (the parse would decline it: not worth a job)
            return f"wrapped lines, a Connect schema with each event ({path})"
    return None


def _wrapped(path: str) -> bool:
    """Whether the first line of ``path`` is a wrapped event (``{"schema", "payload"}``)."""
    import orjson

    with open(path, "rb") as f:
        line = f.readline(1 << 20)
    try:
        first = orjson.loads(line)
    except orjson.JSONDecodeError:
        return False  # (a bad first line: the parse in the tasks says what it is)
    return isinstance(first, dict) and ("payload" in first or "schema" in first)


def declined(changes: Any) -> str | None:
    """Why a file of a columnar read declined, or None when none did: one job over every
    row of ``changes`` (cached, it is built by this job)."""
    from pyspark.sql import functions as F

    why = F.max(F.when(F.col("op") == DECLINED_OP, F.col("_error")))
    found: str | None = changes.agg(why.alias("why")).collect()[0]["why"]
    return found


def read_debezium_columnar(
    spark: Any, files: Sequence[str], record: Any, key: Sequence[str], table: str | None
) -> Any:
    """The canonical columns of Debezium ``files`` (as :func:`read_debezium` gives them),
    parsed in Spark's tasks by :func:`parse_flat`; a file that declines gives one row of
    :data:`DECLINED_OP` instead (see the module docstring)."""
    from pyspark.sql import types as T
    from pyspark.sql.pandas.types import to_arrow_type

    # (every field of an image may be null, as Spark's casts give them)
    image = T.StructType([T.StructField(f.name, f.dataType) for f in record.fields])
    # (the names and types of read_debezium's columns, never null where its are not)
    types = {"op": T.StringType(), "before": image, "after": image, "txn": T.StringType()}
    types.update(tx_meta=T.BooleanType(), _shape=T.LongType())
    out = T.StructType(
        [
            T.StructField(
                n, types.get(n, T.StringType() if n[0] == "_" else T.LongType()), n not in NOT_NULL
            )
            for n in OUT
        ]
    )
    arrow_record = to_arrow_type(image, timezone="UTC")
    rows = [(p, spark_metadata_path(p), i) for i, p in enumerate(files)]
    listing = spark.sparkContext.parallelize(rows, max(1, len(rows))).toDF(
        "path string, name string, i long"
    )
    return listing.mapInArrow(_task(arrow_record, tuple(key), table), out)


def _task(record: pa.StructType, key: tuple[str, ...], table: str | None) -> Callable[..., Any]:
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for path, name, i in zip(*(batch.column(c).to_pylist() for c in range(3)), strict=True):
                with open(path, "rb") as f:
                    data = f.read()
                try:
                    t = parse_flat(data, record, key, table, i, name)
                except Declined as e:  # (a row that says so; the caller reads with Spark)
                    yield declined_batch(record, f"{name}: {e}")
                    return
                yield from t.to_batches(max_chunksize=_BATCH)

    return run
