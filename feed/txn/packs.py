"""Packs: a transaction's updates in a few files instead of a folder per time (the ``packs``
layout, ``emit --layout packs``; docs/operations.md, "Packs").

Each writer (a Spark task, or the driver engine) writes one Parquet file,
``packs/<seq:020d>-e<epoch>-<random>.parquet``, straight into its final place: the times
it holds in order, each in its own row groups, with a ``time`` column beside the record
columns and ``diff`` (a pack read whole says each row's time). The manifest gives each time
its packs and row groups (:class:`feed.log.manifest.Segment`), so a transaction of any
number of times writes one object per task, and nothing is staged or moved: a file no
commit names is an uncommitted transaction's, and the next start deletes it
(:meth:`feed.log.commits.Committer.claim`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from feed.log.manifest import PACKS, Segment
from feed.log.store import PARQUET_PAGES, FeedLog

__all__ = ["PackWriter", "pack_name", "pack_segments", "write_pack", "write_packs"]

#: the most rows of one row group: a time with more takes several
ROW_GROUP = 1 << 20
#: what each writing task returns for each time it wrote
_WRITTEN = "time long, file string, rows long, first int, groups int"


def pack_name(seq: int, epoch: int) -> str:
    """A new pack's path relative to the feed folder (random: a retried task, or a redo,
    never meets another attempt's file)."""
    return f"{PACKS}/{seq:020d}-e{epoch}-{uuid.uuid4().hex[:12]}.parquet"


class PackWriter:
    """Writes one pack: batches given in time order (``time`` their first column); a new
    time starts a new row group. :meth:`close` returns, for each time, its rows and the
    range of row groups holding them."""

    def __init__(self, fs: Any, path: str, schema: pa.Schema) -> None:
        self.fs, self.path, self.schema = fs, path, schema
        self._writer: pq.ParquetWriter | None = None
        self._groups = 0
        self._closed = False
        self.times: list[tuple[int, int, int, int]] = []  # time, rows, first group, groups

    def write(self, time: int, batch: pa.RecordBatch | pa.Table) -> None:
        n = batch.num_rows
        if self.times and time < self.times[-1][0]:
            raise ValueError(f"pack {self.path}: time {time} after {self.times[-1][0]}")
        if self._closed:
            raise ValueError(f"pack {self.path} is closed")
        if not n:
            return
        if self._writer is None:
            self.fs.create_dir(self.path.rsplit("/", 1)[0], recursive=True)
            self._writer = pq.ParquetWriter(
                self.path, self.schema, filesystem=self.fs, **PARQUET_PAGES
            )
        self._writer.write(batch, row_group_size=ROW_GROUP)
        k = -(-n // ROW_GROUP)  # each call writes ceil(n / ROW_GROUP) row groups
        if self.times and self.times[-1][0] == time:
            t, rows, first, groups = self.times[-1]
            self.times[-1] = (t, rows + n, first, groups + k)
        else:
            self.times.append((time, n, self._groups, k))
        self._groups += k

    def close(self) -> list[tuple[int, int, int, int]]:
        self._closed = True
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        return self.times


def write_packs(df: Any, fl: FeedLog, seq: int, epoch: int) -> list[Segment]:
    """Write ``df`` (columns time, the record's, diff) as packs, one per Spark task; return
    each time's segment."""
    ordered = df.sortWithinPartitions("time")
    task = _pack_task(fl.store, fl.root, seq, epoch)
    written = ordered.mapInArrow(task, _WRITTEN).collect()
    return pack_segments(
        [(r["time"], r["file"], r["rows"], r["first"], r["groups"]) for r in written], epoch
    )


def _pack_task(
    store: str | None, root: str, seq: int, epoch: int
) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The function each task runs over its Arrow batches, sorted by time. Runs on
    executors: it needs nothing but pyarrow and numpy."""

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        import itertools

        import numpy as np

        from feed.txn.grouped import store_fs

        rel = pack_name(seq, epoch)
        writer: PackWriter | None = None
        try:
            for batch in batches:
                if writer is None:
                    writer = PackWriter(store_fs(store), f"{root}/{rel}", batch.schema)
                t_col = batch.column(0).to_numpy()
                starts = [0, *(np.flatnonzero(np.diff(t_col)) + 1).tolist(), len(t_col)]
                for lo, hi in itertools.pairwise(starts):
                    writer.write(int(t_col[lo]), batch.slice(lo, hi - lo))
        finally:
            times = writer.close() if writer is not None else []
        if times:
            t, rows, first, groups = (list(c) for c in zip(*times, strict=True))
            yield pa.RecordBatch.from_arrays(
                [
                    pa.array(t, pa.int64()),
                    pa.array([rel] * len(t)),
                    pa.array(rows, pa.int64()),
                    pa.array(first, pa.int32()),
                    pa.array(groups, pa.int32()),
                ],
                names=["time", "file", "rows", "first", "groups"],
            )

    return run


def write_pack(fl: FeedLog, seq: int, epoch: int, tables: dict[int, pa.Table]) -> list[Segment]:
    """Write ``tables`` (each time's updates: record columns and diff) as one pack from
    the driver; return each time's segment."""
    rel = pack_name(seq, epoch)
    writer: PackWriter | None = None
    for t, table in sorted(tables.items()):
        if not table.num_rows:
            continue
        with_time = table.add_column(0, "time", pa.array([t] * table.num_rows, pa.int64()))
        if writer is None:
            writer = PackWriter(fl.fs, fl.path(rel), with_time.schema)
        writer.write(t, with_time)
    if writer is None:
        return []
    return pack_segments([(t, rel, n, g0, k) for t, n, g0, k in writer.close()], epoch)


def pack_segments(written: list[tuple[int, str, int, int, int]], epoch: int) -> list[Segment]:
    """Each time's segment from what the writers returned: (time, pack, rows, first row
    group, row groups) for every time of every pack."""
    by_time: dict[int, list[tuple[str, int, int, int]]] = {}
    for t, f, n, first, k in written:
        by_time.setdefault(t, []).append((f, n, first, k))
    out = []
    for t, pieces in sorted(by_time.items()):
        pieces.sort()
        out.append(
            Segment(
                t,
                epoch,
                sum(n for _, n, _, _ in pieces),
                tuple(f for f, _, _, _ in pieces),
                tuple(tuple(range(first, first + k)) for _, _, first, k in pieces),
            )
        )
    return out
