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

The tasks also say whether the data events of each file sit at distinct positions
(:class:`Positions`, through an accumulator): when they do, and the files' ranges of
positions do not overlap, no event was read twice, and the figures skip the check that
groups every event to find one (feed/sources/transactions.py).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from feed.sources.connect_json import Declined
from feed.sources.debezium_arrow import DECLINED_OP, NOT_NULL, OUT, declined_batch, parse_flat
from feed.sources.file_text import codec_of, mapped
from feed.sources.inputs import spark_metadata_path
from feed.sources.positions import DATA_OPS
from feed.sources.stores import is_remote

__all__ = [
    "MAX_FILE_BYTES",
    "Positions",
    "all_distinct",
    "declined",
    "read_debezium_columnar",
    "seen_positions",
    "set_union",
    "why_not_columnar",
]

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


def declined(changes: Any) -> tuple[str | None, bool]:
    """Why a file of a columnar read declined (None when none did), and whether any
    transaction END record was read: one job over every row of ``changes`` (cached, it
    is built by this job)."""
    from pyspark.sql import functions as F

    why = F.max(F.when(F.col("op") == DECLINED_OP, F.col("_error")))
    ends = F.max(F.col("op") == "E")
    found = changes.agg(why.alias("why"), ends.alias("ends")).collect()[0]
    return found["why"], bool(found["ends"])


#: a file's data events, seen by its task: (read, file, count, first, last), where first and
#: last are the least and greatest (``pos_lo``, ``pos_n``), or None when two events share
#: one or an event has none
_Seen = tuple[int, int, int, tuple[int, int] | None, tuple[int, int] | None]
_reads = itertools.count(1)
_lock = threading.Lock()


class Positions:
    """What the tasks of one columnar read saw of their data events' positions (each task
    adds one entry for its file once it has parsed it, to a set: a task run again adds the
    same entry). The reads of a process share one accumulator, kept on the SparkContext:
    PySpark never forgets an accumulator, and a follower makes a read per transaction."""

    def __init__(self, spark: Any, n_files: int) -> None:
        sc = spark.sparkContext
        with _lock:
            if getattr(sc, "_tidefeed_positions", None) is None:
                sc._tidefeed_positions = sc.accumulator(frozenset(), set_union())
            self._acc = sc._tidefeed_positions
            self.read = next(_reads)
        self.n_files = n_files

    def distinct(self) -> bool:
        """Whether no two data events of the read share a position (so none was read
        twice): every file's task said its own events do, and the files' ranges of
        positions do not overlap. Taken once the job that builds the cache is done (its
        tasks' entries are in by then); the read's entries are then let go, with those of
        earlier reads (a cache rebuilt after it was evicted adds them again)."""
        with _lock:
            entries = self._acc.value
            mine = {s for s in entries if s[0] == self.read}
            self._acc.value = frozenset(s for s in entries if s[0] > self.read)
        return all_distinct(mine, self.n_files)


def all_distinct(seen: Collection[_Seen], n_files: int) -> bool:
    """Whether the entries of one read (:func:`seen_positions`) show its data events at
    distinct positions: one for every file, each file's own distinct, the files' ranges
    apart."""
    if len({s[1] for s in seen}) != n_files:
        return False
    ranges = []
    for _, _, n, first, last in seen:
        if n and (first is None or last is None):
            return False
        if first is not None and last is not None:
            ranges.append((first, last))
    return all(prev[1] < nxt[0] for prev, nxt in itertools.pairwise(sorted(ranges)))


def set_union() -> Any:
    """An accumulator's rule for sets: their union."""
    from pyspark.accumulators import AccumulatorParam

    class Union(AccumulatorParam):  # type: ignore[type-arg]
        def zero(self, value: Any) -> frozenset[Any]:
            return frozenset()

        def addInPlace(self, a: Any, b: Any) -> frozenset[Any]:
            return frozenset(a) | frozenset(b)

    return Union()


def seen_positions(read: int, ord_file: int, t: pa.Table) -> _Seen:
    """File ``ord_file``'s entry for :class:`Positions`, from its parsed table ``t``."""
    data = t.select(["pos_lo", "pos_n"]).filter(pc.is_in(t["op"], pa.array(DATA_OPS)))
    n = data.num_rows
    if n == 0:
        return (read, ord_file, 0, None, None)
    lo, at = data["pos_lo"], data["pos_n"]
    if lo.null_count or at.null_count:
        return (read, ord_file, n, None, None)
    by = [("pos_lo", "ascending"), ("pos_n", "ascending")]
    order = pc.sort_indices(data.select(["pos_lo", "pos_n"]), by)
    lo, at = lo.take(order).combine_chunks(), at.take(order).combine_chunks()
    same = pc.and_(pc.equal(lo[1:], lo[:-1]), pc.equal(at[1:], at[:-1]))
    if n > 1 and pc.any(same).as_py():
        return (read, ord_file, n, None, None)
    first = (lo[0].as_py(), at[0].as_py())
    return (read, ord_file, n, first, (lo[-1].as_py(), at[-1].as_py()))


def read_debezium_columnar(
    spark: Any,
    files: Sequence[str],
    record: Any,
    key: Sequence[str],
    table: str | None,
    positions: Positions | None = None,
) -> Any:
    """The canonical columns of Debezium ``files`` (as :func:`read_debezium` gives them),
    parsed in Spark's tasks by :func:`parse_flat`; a file that declines gives one row of
    :data:`DECLINED_OP` instead (see the module docstring). With ``positions``, the tasks
    tell it what positions their files' events are at."""
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
    # (a task per file, by its number: the files go with the task's function, so no
    # Python worker serves a listing of them to the tasks)
    listing = spark.range(0, len(rows), 1, max(1, len(rows)))
    seen = None if positions is None else (positions._acc, positions.read)
    threads = parse_threads(spark, len(files))
    return listing.mapInArrow(_task(arrow_record, tuple(key), table, seen, threads, rows), out)


def parse_threads(spark: Any, tasks: int) -> bool:
    """Whether a file's task parses on several threads: only when there are fewer tasks
    than the cores Spark has, so the cores would be idle otherwise (pyarrow's threaded
    reader takes about a third more CPU, measured on a 2-core machine)."""
    return tasks < int(spark.sparkContext.defaultParallelism)


def _task(
    record: pa.StructType,
    key: tuple[str, ...],
    table: str | None,
    seen: tuple[Any, int] | None,
    threads: bool,
    rows: list[tuple[str, str, int]],
) -> Callable[..., Any]:
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for path, name, i in (rows[k] for k in batch.column(0).to_pylist()):
                data = mapped(path)
                try:
                    t = parse_flat(data, record, key, table, i, name, threads)
                except Declined as e:  # (a row that says so; the caller reads with Spark)
                    yield declined_batch(record, f"{name}: {e}")
                    return
                if seen is not None:
                    seen[0].add(frozenset([seen_positions(seen[1], i, t)]))
                yield from t.to_batches(max_chunksize=_BATCH)

    return run
