"""Writing a transaction: its updates as each time's segment files, its keyed state and its
quarantined rows, all before the commit names them (see :mod:`feed.emitter`).

Updates are written by one Spark job to ``_staging/<seq>-<random>/time=<t>/`` and moved to
``times/<t>/`` under names of the writing epoch (:meth:`feed.log.FeedLog.install_time`): a
redo of the same transaction replaces them. The job's tasks write the files themselves with
pyarrow (:func:`_stage_times`) and return each file's time and row count, so the manifest's
counts come from the write, and a file a failed task attempt left behind is never named.
(Spark's own ``partitionBy`` writer goes through Hadoop's local filesystem, which forks a
``chmod`` for every file and folder it creates: about 7 ms a time, minutes for a backlog
at a time per source transaction.)
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

from .dataflow import Computed, TxnContext
from .manifest import Segment

__all__ = ["write_transaction"]

#: what each writing task returns for a file it wrote
_STAGED = "time long, file string, rows long"


def write_transaction(
    ctx: TxnContext, seq: int, done: Computed
) -> tuple[list[Segment], str | None]:
    """Write transaction ``seq``'s updates, state and bad rows; return its segments (by
    time) and the state reference its commit names."""
    from pyspark.sql import functions as F

    fl, cp = ctx.feedlog, ctx.cp
    staging = fl.path("_staging", f"{seq}-{uuid.uuid4().hex[:8]}")
    flat = done.updates.select("time", "data.*", "diff").sortWithinPartitions("time")
    store = None if fl.local_root is not None else fl.uri
    staged = flat.mapInArrow(_stage_times(store, staging), _STAGED).collect()
    segments = _install(ctx, [(r["time"], r["file"], r["rows"]) for r in staged], cp.epoch)
    state_ref = cp.state
    if done.new_state is not None and done.loaded is not None:
        state_ref = ctx.state.write(seq, done.new_state, done.loaded)
    elif done.new_state is not None:  # successive snapshots: the last one, whole
        state_ref = f"state/{seq}-{uuid.uuid4().hex[:8]}"
        done.new_state.select("data.*").write.parquet(ctx.spark_path(fl.path(state_ref)))
    if done.bad_rows:
        done.bad.select(
            F.col("_file").alias("file"),
            F.col("_raw").alias("raw"),
            F.col("_error").alias("reason"),
        ).write.mode("overwrite").json(ctx.spark_path(fl.path("quarantine", str(seq))))
    fl.delete_dir(staging)
    return segments, state_ref


def _install(ctx: TxnContext, staged: list[tuple[int, str, int]], epoch: int) -> list[Segment]:
    """Move the staged files (time, file, rows) to ``times/<t>``; return each time's
    segment."""
    by_time: dict[int, tuple[list[str], int]] = {}
    for t, f, n in staged:
        files, rows = by_time.get(t, ([], 0))
        by_time[t] = ([*files, f], rows + n)
    segments = []
    for t, (files, n) in sorted(by_time.items()):
        if n:
            installed = ctx.feedlog.install_time(t, epoch, files)
            segments.append(Segment(t, epoch, n, tuple(installed)))
    return segments


def _stage_times(store: str | None, staging: str) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The function each writing task runs over its Arrow batches (``time``, the record
    columns, ``diff``; sorted by time within the task): one Parquet file per time at
    ``<staging>/time=<t>/``, on the log's filesystem (``store``: the log's URI when it is
    not local). It yields (time, file, rows) of each file. Runs on executors: it needs
    nothing but pyarrow and numpy."""

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        import itertools
        import uuid

        import numpy as np
        import pyarrow as pa
        import pyarrow.fs as pafs
        import pyarrow.parquet as pq

        fs = pafs.FileSystem.from_uri(store)[0] if store else pafs.LocalFileSystem()
        times: list[int] = []
        files: list[str] = []
        rows: list[int] = []
        writer = None
        try:
            for batch in batches:
                t_col = batch.column(0).to_numpy()
                record = pa.RecordBatch.from_arrays(
                    batch.columns[1:], schema=pa.schema(list(batch.schema)[1:])
                )
                starts = [0, *(np.flatnonzero(np.diff(t_col)) + 1).tolist(), len(t_col)]
                for lo, hi in itertools.pairwise(starts):
                    t = int(t_col[lo])
                    if not times or times[-1] != t:
                        if writer is not None:
                            writer.close()
                        folder = f"{staging}/time={t}"
                        fs.create_dir(folder, recursive=True)
                        files.append(f"{folder}/part-{uuid.uuid4().hex}.parquet")
                        writer = pq.ParquetWriter(files[-1], record.schema, filesystem=fs)
                        times.append(t)
                        rows.append(0)
                    assert writer is not None
                    writer.write_batch(record.slice(lo, hi - lo))
                    rows[-1] += hi - lo
        finally:
            if writer is not None:
                writer.close()
        if times:
            yield pa.RecordBatch.from_arrays(
                [pa.array(times, pa.int64()), pa.array(files), pa.array(rows, pa.int64())],
                names=["time", "file", "rows"],
            )

    return run
