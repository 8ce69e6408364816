"""A committed feed as a Spark data source, batch and streaming (``format("tidefeed")``).

    import feed
    feed.register_spark(spark)          # or found by PySpark itself: see pyspark_tidefeed.py

    ups = (spark.read.format("tidefeed").option("log", "demo-output/latest/log")
           .option("startingTime", 100).option("endingTime", 200).load("accounts"))
    now = spark.read.format("tidefeed").option("log", LOG).option("at", "latest").load("accounts")
    q = (spark.readStream.format("tidefeed").option("log", LOG).load("accounts")
         .writeStream.format("parquet").option("checkpointLocation", CK).start(OUT))

Updates have the columns ``time``, ``diff`` and the record's; with ``at`` the read is the
collection at that complete time (the record's columns and ``count``). ``startingTime`` is the
first time read and ``endingTime`` the first time not read (default: the frontier when the
query is planned), the half-open ranges CDCv2 progress uses.

The stream's offset is the feed's frontier, ``{"time": F}``: a micro-batch reads the times
in ``[previous frontier, new frontier)``, which are complete and never change once
committed, so a batch replayed after a restart reads the same updates, and Spark's offset log
and a checkpointed sink give exactly-once. A feed compacted past a batch's start fails that
batch with :class:`protocol.Compacted` (the times it needs are folded), never reads it short.

Reading goes through :mod:`feed.log.read` (the feed's manifests; no Spark inside), in tasks of at
most :data:`PARTITION_UPDATES` updates.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.types import StructType

from feed.log.read import Feed, open_feed
from protocol import Compacted

__all__ = ["PARTITION_UPDATES", "TidefeedDataSource", "register_spark"]

#: updates per Spark task (whole times: a larger time is one task of its own)
PARTITION_UPDATES = 1_000_000
_BATCH_ROWS = 65_536  # rows per Arrow record batch handed to Spark


def register_spark(spark: Any) -> None:
    """Make ``format("tidefeed")`` readable on this SparkSession. On a local master, also
    check that Spark's Python workers can import tidefeed (a warning says how to fix it
    when they cannot)."""
    spark.dataSource.register(TidefeedDataSource)
    problem = worker_python_problem(spark)
    if problem:
        warnings.warn(problem, RuntimeWarning, stacklevel=3)


def worker_python_problem(spark: Any) -> str | None:
    """Why Spark's Python workers on this machine cannot import tidefeed, or ``None``.

    Spark starts them with ``spark.pyspark.python``, else ``$PYSPARK_PYTHON``, else
    ``python3`` from the PATH: in a virtual environment that is not activated, that is
    another Python, and every read of a feed fails in the workers with
    ``No module named 'feed'``. Checked on a local master only (a cluster's workers are
    other machines)."""
    if not str(spark.sparkContext.master).startswith("local"):
        return None
    python = (
        spark.conf.get("spark.pyspark.python", None)
        or os.environ.get("PYSPARK_PYTHON")
        or shutil.which("python3")
    )
    if python is None:
        return "Spark's Python workers: no python3 on the PATH; set PYSPARK_PYTHON"
    # (from "/": a probe run in the checkout would find feed/ in its folder, the workers not)
    probe = subprocess.run(
        [python, "-c", "import feed, pyarrow"], capture_output=True, timeout=60, cwd="/"
    )
    if probe.returncode == 0:
        return None
    return (
        f"Spark's Python workers run {python}, which cannot import tidefeed, so reading a "
        f"feed will fail in them. Start the session with PYSPARK_PYTHON={sys.executable} "
        f"in the environment (or .config('spark.pyspark.python', {sys.executable!r})), "
        "or activate the virtual environment tidefeed is installed in"
    )


@dataclass(frozen=True)
class _Options:
    log: str
    feed: str
    starting: int | None
    ending: int | None
    at: int | str | None

    @classmethod
    def parse(cls, options: dict[str, str]) -> _Options:
        opts = {k.lower(): v for k, v in options.items()}
        log, feed = opts.get("log"), opts.get("path") or opts.get("feed")
        if not log:
            raise ValueError('tidefeed: give the feed log: .option("log", PATH_OR_URI)')
        if not feed:
            raise ValueError('tidefeed: give the feed\'s name: .load("accounts")')
        if "://" not in log and not log.startswith("/"):
            # Spark's Python workers run in a folder of their own: a relative path would be
            # read from there, not from where the query was written
            raise ValueError(
                f"tidefeed: option log={log!r} is a relative path; give an absolute path "
                "or a URI (os.path.abspath(...))"
            )

        def time(name: str) -> int | None:
            value = opts.get(name.lower())
            if value is None:
                return None
            try:
                t = int(value)
            except ValueError:
                raise ValueError(f"tidefeed: option {name}={value!r} is not a time") from None
            if t < 0:
                raise ValueError(f"tidefeed: option {name}={value!r} is negative")
            return t

        at_raw = opts.get("at")
        at: int | str | None = at_raw if at_raw == "latest" else time("at")
        starting, ending = time("startingTime"), time("endingTime")
        if at is not None and (starting is not None or ending is not None):
            raise ValueError("tidefeed: option at reads a collection: drop startingTime/endingTime")
        return cls(log, feed, starting, ending, at)

    def open(self) -> Feed:
        return open_feed(self.log, self.feed)


class TidefeedDataSource(DataSource):
    """``format("tidefeed")``: see the module docstring."""

    @classmethod
    def name(cls) -> str:
        return "tidefeed"

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        self.opts = _Options.parse(dict(options))

    def schema(self) -> StructType:
        f = self.opts.open()
        if self.opts.at is None:
            return from_arrow_schema(f.schema)
        return from_arrow_schema(f.collection_schema)

    def reader(self, schema: StructType) -> DataSourceReader:
        if self.opts.at is not None:
            return _CollectionReader(self.opts)
        return _UpdatesReader(self.opts)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        if self.opts.at is not None:
            raise ValueError("tidefeed: option at is for batch reads (spark.read)")
        return _UpdatesStreamReader(self.opts)


@dataclass(frozen=True)
class _Span(InputPartition):
    """Times ``[after, upto)`` of one task."""

    after: int
    upto: int


def _spans(f: Feed, after: int, upto: int) -> list[_Span]:
    """Tasks covering times ``[after, upto)`` of ``f``, each of at most
    :data:`PARTITION_UPDATES` updates unless one time alone is larger."""
    if after >= upto:
        return []
    counts = f.counts()
    if 0 < after < f.since:
        raise Compacted(
            f"tidefeed: feed {f.name!r} is compacted up to time {f.since}; a read from time "
            f"{after} needs folded times (read from 0 for the collection at {f.since}, or "
            f"from {f.since})",
            since=f.since,
        )
    spans: list[_Span] = []
    lo, size = after, 0
    for t in sorted(t for t in counts if after <= t < upto):
        if size and size + counts[t] > PARTITION_UPDATES:
            spans.append(_Span(lo, t))
            lo, size = t, 0
        size += counts[t]
    spans.append(_Span(lo, upto))
    return spans


def _read_span(opts: _Options, span: _Span) -> Iterator[Any]:
    # a feed compacted past the span since it was planned raises Compacted here
    for table in opts.open().batches(after=span.after, upto=span.upto):
        yield from table.to_batches(max_chunksize=_BATCH_ROWS)


class _UpdatesReader(DataSourceReader):
    def __init__(self, opts: _Options) -> None:
        self.opts = opts

    def partitions(self) -> Sequence[InputPartition]:
        f = self.opts.open()
        after = self.opts.starting or 0
        upto = f.frontier if self.opts.ending is None else min(self.opts.ending, f.frontier)
        return _spans(f, after, upto) or [_Span(0, 0)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, _Span)
        if partition.after < partition.upto:
            yield from _read_span(self.opts, partition)


class _CollectionReader(DataSourceReader):
    def __init__(self, opts: _Options) -> None:
        self.opts = opts

    def read(self, partition: InputPartition) -> Iterator[Any]:
        f = self.opts.open()
        at = self.opts.at if isinstance(self.opts.at, int) else None  # None: the latest
        yield from f.collection(at).to_batches(max_chunksize=_BATCH_ROWS)


class _UpdatesStreamReader(DataSourceStreamReader):
    """Offsets are frontiers: ``{"time": F}``."""

    def __init__(self, opts: _Options) -> None:
        self.opts = opts
        # the schema the query was started with: a newer version ends what it can read
        self.version = opts.open().schema_versions[-1]["from"]

    def initialOffset(self) -> dict[str, int]:
        return {"time": self.opts.starting or 0}

    def latestOffset(
        self, start: dict[str, int] | None = None, limit: Any = None
    ) -> dict[str, int]:
        f = self.opts.open()
        end = f.frontier if self.opts.ending is None else min(self.opts.ending, f.frontier)
        newer = [v["from"] for v in f.schema_versions if v["from"] > self.version]
        if newer:
            # times from there on have columns this query's schema lacks
            if start is not None and int(start["time"]) >= newer[0]:
                raise ValueError(
                    f"tidefeed: feed {f.name!r} has a new record schema version from time "
                    f"{newer[0]} (docs/sources.md, 'Schema changes'); this query read "
                    "everything before it. Restart the query: it goes on from its "
                    "checkpoint with the new schema"
                )
            end = min(end, newer[0])
        if start is not None:
            end = max(end, int(start["time"]))
        return {"time": end}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        return _spans(self.opts.open(), int(start["time"]), int(end["time"]))

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, _Span)
        yield from _read_span(self.opts, partition)

    def commit(self, end: dict[str, int]) -> None:
        pass  # the feed keeps its times; a named pull subscription is the way to hold them
