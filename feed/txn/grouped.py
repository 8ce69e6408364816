"""Parquet files written by Spark's tasks with pyarrow, one per group and task, and read
back the same way.

``write_groups`` writes a DataFrame's rows to ``<root>/<prefix><g>/part-<random>.parquet``
for each value ``g`` of an integer column (the column itself is left out of the files, as
a ``partitionBy`` folder would) and returns, for each file, its group, path and row count:
the caller names exactly the files written, with their counts, without listing folders or
reading footers, and a file a failed task attempt left behind is never named
(:func:`strays` finds those where the folder itself is read).

Why not ``DataFrameWriter.partitionBy``: on a local disk it goes through Hadoop's local
filesystem, which forks a ``chmod`` for every file and folder it creates (the pyspark wheel
has no native Hadoop library): about 7 ms a group, minutes for a backlog written at a time
per source transaction. The tasks write on the log's filesystem through pyarrow (a local
path, or the log's URI: on a cluster, executors reach an ``s3://`` log with pyarrow's
credentials, ``AWS_*`` in their environment).

``read_files`` is the way back for a log that is not local: Spark's own Parquet reader would
go through ``s3a://``, which needs the hadoop-aws jars the pyspark wheel does not carry, so
the tasks read the named files through pyarrow and hand Spark their Arrow batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from pyspark.sql import DataFrame

__all__ = ["by_group", "read_files", "strays", "write_groups", "write_json_lines"]

#: what each writing task returns for a file it wrote
_WRITTEN = "grp long, file string, rows long"


def write_groups(
    df: DataFrame, column: str, store: str | None, root: str, prefix: str
) -> list[tuple[int, str, int]]:
    """Write ``df`` grouped by ``column`` (see the module docstring); ``store`` is the
    filesystem's URI when it is not local, ``root`` a path in it. Returns (group, file,
    rows) of every file written, in no particular order."""
    ordered = df.select(column, *[c for c in df.columns if c != column])
    written = ordered.sortWithinPartitions(column).mapInArrow(
        _write_task(store, root, prefix), _WRITTEN
    )
    return [(r["grp"], r["file"], r["rows"]) for r in written.collect()]


def _write_task(
    store: str | None, root: str, prefix: str
) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The function each task runs over its Arrow batches (the group column first, sorted
    within the task). Runs on executors: it needs nothing but pyarrow and numpy."""

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        import itertools
        import uuid

        import numpy as np
        import pyarrow as pa
        import pyarrow.parquet as pq

        from feed.log.store import PARQUET_PAGES

        fs = store_fs(store)
        groups: list[int] = []
        files: list[str] = []
        rows: list[int] = []
        writer = None
        try:
            for batch in batches:
                g_col = batch.column(0).to_numpy()
                record = pa.RecordBatch.from_arrays(
                    batch.columns[1:], schema=pa.schema(list(batch.schema)[1:])
                )
                starts = [0, *(np.flatnonzero(np.diff(g_col)) + 1).tolist(), len(g_col)]
                for lo, hi in itertools.pairwise(starts):
                    g = int(g_col[lo])
                    if not groups or groups[-1] != g:
                        if writer is not None:
                            writer.close()
                        folder = f"{root}/{prefix}{g}"
                        fs.create_dir(folder, recursive=True)
                        files.append(f"{folder}/part-{uuid.uuid4().hex}.parquet")
                        writer = pq.ParquetWriter(
                            files[-1], record.schema, filesystem=fs, **PARQUET_PAGES
                        )
                        groups.append(g)
                        rows.append(0)
                    assert writer is not None
                    writer.write_batch(record.slice(lo, hi - lo))
                    rows[-1] += hi - lo
        finally:
            if writer is not None:
                writer.close()
        if groups:
            yield pa.RecordBatch.from_arrays(
                [pa.array(groups, pa.int64()), pa.array(files), pa.array(rows, pa.int64())],
                names=["grp", "file", "rows"],
            )

    return run


def write_json_lines(df: DataFrame, store: str | None, folder: str) -> None:
    """Write ``df``'s rows as JSON lines (a null field left out, as Spark's JSON writer
    does) into ``folder``, a file per task, through pyarrow like :func:`write_groups`; the
    folder holds exactly the files the tasks returned (a failed attempt's are deleted)."""

    fs = store_fs(store)
    fs.delete_dir_contents(folder, missing_dir_ok=True)  # (an earlier attempt's, if any)
    written = df.mapInArrow(_json_task(store, folder), _WRITTEN).collect()
    named = [(0, r["file"], r["rows"]) for r in written]
    for stray in strays(fs, folder, named):
        fs.delete_file(stray)


def _json_task(store: str | None, folder: str) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The function each task runs: its rows as one JSON-lines file in ``folder``, whose
    path and row count it returns. Runs on executors: pyarrow and orjson."""

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        import uuid

        import orjson
        import pyarrow as pa

        fs = store_fs(store)
        path, rows, out = f"{folder}/part-{uuid.uuid4().hex}.json", 0, None
        try:
            for batch in batches:
                for row in batch.to_pylist():
                    if out is None:  # (a task with no rows writes no file)
                        fs.create_dir(folder, recursive=True)
                        out = fs.open_output_stream(path)
                    out.write(orjson.dumps({k: v for k, v in row.items() if v is not None}))
                    out.write(b"\n")
                    rows += 1
        finally:
            if out is not None:
                out.close()
        if not rows:
            return
        yield pa.RecordBatch.from_arrays(
            [pa.array([0], pa.int64()), pa.array([path]), pa.array([rows], pa.int64())],
            names=["grp", "file", "rows"],
        )

    return run


def read_files(spark: Any, store: str, files: list[str], schema: Any) -> DataFrame:
    """The rows of the Parquet ``files`` (paths in the filesystem of ``store``, a URI) as a
    DataFrame of ``schema`` (a Spark struct type), read by Spark's tasks through pyarrow; a
    column a file lacks is null, as Spark's reader with a schema gives."""
    from pyspark.sql.pandas.types import to_arrow_schema

    arrow = to_arrow_schema(schema).serialize().to_pybytes()
    paths = spark.createDataFrame([(f,) for f in files], "path string")
    out: DataFrame = paths.mapInArrow(_read_task(store, arrow), schema)
    return out


def _read_task(store: str, schema: bytes) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The function each task runs over its batches of paths. Runs on executors: it needs
    nothing but pyarrow."""

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        import pyarrow.fs as pafs
        import pyarrow.parquet as pq

        want = pa.ipc.read_schema(pa.py_buffer(schema))
        fs = pafs.FileSystem.from_uri(store)[0]
        for batch in batches:
            for path in batch.column(0).to_pylist():
                t = pq.read_table(path, filesystem=fs)
                names = set(t.schema.names)
                columns = [
                    t.column(f.name).cast(f.type) if f.name in names else pa.nulls(len(t), f.type)
                    for f in want
                ]
                yield from pa.Table.from_arrays(columns, schema=want).to_batches()

    return run


def store_fs(store: str | None) -> Any:
    """The pyarrow filesystem of ``store`` (a URI; None: the local disk), opened where it
    is called: on the driver, or in a task."""
    import pyarrow.fs as pafs

    return pafs.FileSystem.from_uri(store)[0] if store else pafs.LocalFileSystem()


def by_group(written: list[tuple[int, str, int]]) -> dict[int, tuple[list[str], int]]:
    """The files and the total rows of each group of :func:`write_groups`' return."""
    out: dict[int, tuple[list[str], int]] = {}
    for g, f, n in written:
        files, rows = out.setdefault(g, ([], 0))
        files.append(f)
        out[g] = (files, rows + n)
    return out


def strays(fs: Any, root: str, written: list[tuple[int, str, int]]) -> list[str]:
    """Files under ``root`` that :func:`write_groups` did not return: what failed task
    attempts left (a retried task writes a new file beside the old one's remains)."""
    import pyarrow.fs as pafs

    named = {f for _, f, _ in written}
    found = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    return [i.path for i in found if i.type == pafs.FileType.File and i.path not in named]
