"""Reading a committed feed straight from the log, without Spark.

:class:`FeedReader` is the public reading API used by ``tidefeed inspect``, the notebooks
and the feed server. It only ever shows committed times (below the latest checkpoint's
``upper``), each from the files the latest checkpoint's manifest lists for it
(feed/log/manifest.py), never from a directory listing: a listed file that is missing is an
error naming the time and the file.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Generator, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from feed.log.checkpoint import Checkpoint, CheckpointStore
from feed.log.info import FeedInfo
from feed.log.manifest import PACKS, ManifestStore, Segment
from feed.log.store import FeedLog
from protocol import (
    CheckpointError,
    Compacted,
    Message,
    Progress,
    Updates,
    announcement,
    consolidate,
)

__all__ = ["STREAM_ROWS", "FeedReader", "flat_updates"]

#: the most updates of one time :meth:`FeedReader.batches` holds at once
STREAM_ROWS = 50_000
#: the packs whose footers a reader keeps
FOOTERS_KEPT = 8


class FeedReader:
    """A committed feed in a log: its info, times, updates, messages and snapshots."""

    def __init__(self, log: str, feed: str) -> None:
        self.log = FeedLog(log, feed)
        info = self.log.info()
        if info is None:
            raise CheckpointError(f"no feed {feed!r} in log {log!r}")
        #: the feed with every schema version in the log (committed or not)
        self._all: FeedInfo = info
        #: the feed as of the checkpoint read: ``schema`` is the newest committed version,
        #: the one every time is read through (docs/sources.md, "Schema changes")
        self.info: FeedInfo = info
        self._manifests = ManifestStore(self.log)
        self._record_type: tuple[FeedInfo, pa.DataType] | None = None
        self._footers: dict[str, pq.FileMetaData] = {}  # packs' (oldest first)
        self._footers_lock = threading.Lock()
        self.checkpoint: Checkpoint | None = None
        self.refresh()
        self.info = self._all.at(self.frontier)  # (also when nothing is committed)

    def refresh(self) -> Checkpoint | None:
        """Re-read the latest checkpoint (a running emitter may have committed more), its
        manifest, and the schema versions when the frontier moved."""
        before = self.frontier
        self.checkpoint = CheckpointStore(self.log).latest()
        self.manifest = self._manifests.of(self.checkpoint)
        self._since = self.manifest.since
        if self.frontier != before:
            if self.frontier > before:  # a version may have been committed since
                first = self._all.at(0)
                self._all = first.evolved_to(self.log.schema_versions())
            self.info = self._all.at(self.frontier)
        return self.checkpoint

    @property
    def name(self) -> str:
        return self.log.feed

    @property
    def frontier(self) -> int:
        return self.checkpoint.frontier if self.checkpoint else 0

    @property
    def since(self) -> int:
        """The compaction point: times below it exist only folded into the collection at
        ``since``; the updates at ``since`` and above are kept one time at a time."""
        return self._since

    def times(self, after: int | None = None, until: int | None = None) -> list[int]:
        """Committed times with updates, ``>= after`` and ``< until`` (default: the frontier)."""
        lo, hi = self._committed(after or 0, until)
        if lo >= hi:
            return []
        return [int(t) for t in self._manifests.table(self.manifest, lo, hi)["time"].to_pylist()]

    def packs(self, lo: int | None = None, hi: int | None = None) -> set[str]:
        """The packs (feed/txn/packs.py) that the kept times ``>= lo`` and ``< hi`` use."""
        return self._manifests.packs(self.manifest, lo, hi)

    def counts(self) -> dict[int, int]:
        """Update count of every committed time, as the manifest records it."""
        t = self._manifests.table(self.manifest, self.since, self.frontier)
        return dict(zip(t["time"].to_pylist(), t["count"].to_pylist(), strict=True))

    def table(self, time: int) -> pa.Table:
        """The updates at a committed ``time``: record columns and ``diff``."""
        return self._table(self._segment(time))

    def _table(self, seg: Segment | None) -> pa.Table:
        with self._segment_files(seg) as files:
            if not files:
                return pa.table({"diff": pa.array([], pa.int64())})
            return pa.concat_tables(
                [f.read_row_groups(g, columns=_record_columns(f)) for f, g in files],
                promote_options="default",
            )

    def count(self, time: int) -> int:
        """The number of updates at a committed ``time``, as its manifest counts them."""
        seg = self._segment(time)
        return seg.count if seg is not None else 0

    def _segment(self, time: int) -> Segment | None:
        """The manifest's entry for a committed ``time`` (None: no such time)."""
        segs = self._segments(time, time + 1)
        return segs[0] if segs else None

    def _segments(self, lo: int, hi: int) -> list[Segment]:
        """The manifest's entries of the committed times ``>= lo`` and ``< hi`` (and
        ``>= since``), in time order, from one read of the manifest."""
        lo, hi = self._committed(lo, hi)
        return self._manifests.segments(self.manifest, lo, hi) if lo < hi else []

    def _committed(self, lo: int, hi: int | None) -> tuple[int, int]:
        """``[lo, hi)`` clamped to the times kept one at a time, ``[since, frontier)``
        (``hi`` None: the frontier); empty when nothing is committed."""
        cp = self.checkpoint
        if cp is None:
            return 0, 0
        return max(lo, self.since), cp.frontier if hi is None else min(hi, cp.frontier)

    def batches(self, time: int, rows: int = STREAM_ROWS, skip: int = 0) -> Iterator[Updates]:
        """The updates at a committed ``time`` in batches of at most ``rows``, each read
        from the log when it is asked for: a time of any size in bounded memory. The
        files' row counts are checked against the manifest before the first batch.
        ``skip``: begin after that many updates (a stream that let its files go while its
        consumer was not reading opens them again where it was); whole files and row
        groups are skipped unread, only the rest of one row group is read and dropped."""
        return self._batches(self._segment(time), rows, skip)

    def _batches(self, seg: Segment | None, rows: int, skip: int) -> Iterator[Updates]:
        if seg is None:
            return
        with self._segment_files(seg, stream=True) as files:
            for f, groups in files:
                while groups and skip >= (n := f.metadata.row_group(groups[0]).num_rows):
                    skip -= n
                    groups.pop(0)
                if not groups:
                    continue
                columns = _record_columns(f)
                batches = f.iter_batches(
                    batch_size=rows, row_groups=groups, columns=columns, use_threads=False
                )
                for b in batches:
                    if skip >= b.num_rows:
                        skip -= b.num_rows
                        continue
                    if skip:
                        b, skip = b.slice(skip), 0
                    yield _as_updates(pa.Table.from_batches([b]), seg.time, self.record_type)

    @contextlib.contextmanager
    def _segment_files(
        self, seg: Segment | None, stream: bool = False
    ) -> Iterator[list[tuple[pq.ParquetFile, list[int]]]]:
        """The open files of a committed time's segment (none for no segment, or a time
        without updates), each with its row groups that hold the time (every one, but in
        a pack), their row counts checked against the manifest's count; closed on exit,
        or as soon as opening or checking them fails. ``stream``: opened to be read a
        batch at a time (see :meth:`_open`)."""
        with contextlib.ExitStack() as opened:
            files: list[tuple[pq.ParquetFile, list[int]]] = []
            if seg is not None:
                for rel, groups in seg.pieces():
                    f = self._open(rel, f"time {seg.time}", stream=stream)
                    opened.callback(f.close)
                    n = f.metadata.num_row_groups
                    if groups is not None and any(not 0 <= g < n for g in groups):
                        raise CheckpointError(
                            f"feed {self.name!r}: time {seg.time}'s row groups {groups} "
                            f"of {rel} are not all there ({n} in the file)"
                        )
                    files.append((f, list(range(n)) if groups is None else list(groups)))
                meta = [(f.metadata, g) for f, g in files]
                found = sum(m.row_group(i).num_rows for m, g in meta for i in g)
                if found != seg.count:
                    raise CheckpointError(
                        f"feed {self.name!r}: time {seg.time} holds {found} update(s) in "
                        f"{', '.join(seg.files)}, but its manifest counts {seg.count}"
                    )
            yield files

    def _open(self, rel: str, what: str, stream: bool = False) -> pq.ParquetFile:
        # ParquetFile, not pq.read_table (pyarrow.dataset's import costs a server's first
        # read ~0.2 s). ``stream``: a page at a time through a 64 KiB buffer, nothing read
        # ahead (the default pre-buffers every column chunk: ~7.8 MB held by a reader of a
        # 1M-update time after its first batch, ~1.6 MB this way, at the same speed; see
        # docs/operations.md). A pack's footer (it covers every time in it) is kept.
        meta = self._footers.get(rel)
        opts = {"pre_buffer": False, "buffer_size": 1 << 16} if stream else {}
        try:
            f = pq.ParquetFile(self.log.path(rel), filesystem=self.log.fs, metadata=meta, **opts)
        except FileNotFoundError as e:
            raise CheckpointError(
                f"feed {self.name!r}: {what} is committed but its file {rel} is missing "
                "from the feed log"
            ) from e
        except pa.ArrowInvalid as e:  # cut short or overwritten: damaged, not a crash
            raise CheckpointError(
                f"feed {self.name!r}: {what}: its file {rel} is not readable Parquet ({e})"
            ) from e
        if meta is None and rel.startswith(PACKS + "/"):
            with self._footers_lock:  # (a server's streams read in threads)
                while len(self._footers) >= FOOTERS_KEPT:
                    del self._footers[next(iter(self._footers))]
                self._footers[rel] = f.metadata
        return f

    def _read(self, rel: str, what: str) -> pa.Table:
        f = self._open(rel, what)
        try:
            return f.read()
        finally:
            f.close()

    def updates(self, time: int) -> Updates:
        """The updates at a committed ``time`` as a message (columns data, time, diff)."""
        return _as_updates(self.table(time), time, self.record_type)

    @property
    def record_type(self) -> pa.DataType:
        """The Arrow type of the current record schema (every time is read through it)."""
        from protocol import avro_to_arrow

        # (``info`` is replaced only when a refresh finds another schema version)
        cached = self._record_type
        if cached is None or cached[0] is not self.info:
            cached = (self.info, avro_to_arrow(self.info.schema))
            self._record_type = cached
        return cached[1]

    def opening(self, after: int | None) -> tuple[list[Message], int]:
        """The first messages of a delivery to a consumer that holds every time below
        ``after`` (``None``: a consumer that holds nothing), and the time the rest goes on
        from. A new consumer of a compacted feed starts with the collection at ``since``
        (as updates at ``since``); a consumer below ``since`` gets :class:`Compacted`."""
        since = self.since
        if after is not None and after < since:
            raise Compacted(
                f"feed {self.name!r}: times below {since} were compacted away, so a consumer "
                f"at {after} cannot resume; start again from a snapshot",
                since=since,
            )
        if after is None and since > 0:
            return self.snapshot_opening(since + 1), since + 1
        start = since if after is None else after
        return [announcement(start)], start

    def snapshot_opening(self, frontier: int) -> list[Message]:
        """The collection complete below ``frontier`` as a CDCv2 history for a reader that
        holds nothing (DESIGN §7): an announcement at 0, the collection as updates at
        ``frontier - 1``, and one progress ``[0, frontier)`` counting only that time.
        differential dataflow's reader starts at time 0 and only moves on with a progress
        whose lower it has reached, so the closing progress must start at 0."""
        at = frontier - 1
        batch = self.snapshot_updates(at)
        n = len(batch)
        closing = Progress(0, frontier, ((at, n),) if n else ())
        return [announcement(0), *([batch] if n else []), closing]

    def messages(self, after: int | None = None) -> Iterator[Message]:
        """The committed feed for a consumer at ``after`` (see :meth:`opening`), each time's
        updates and progress, then a last progress up to the frontier."""
        first, lower = self.opening(after)
        yield from first
        for turn in self.committed(lower, self.frontier):
            yield from turn

    def committed(
        self, lower: int, frontier: int, rows: int | None = None, skip: int = 0
    ) -> Generator[list[Message], None, None]:
        """The committed times from ``lower`` below ``frontier`` as messages, in turns of
        one batch of updates each (at most ``rows``, read when the turn is asked for;
        None: a time's updates in one batch): a time's last batch comes with the time's
        progress, a time without updates is its progress alone, and a last turn carries a
        progress up to ``frontier``. ``skip`` (with ``rows``): updates of the first time
        already sent, so that a stream that closed this generator while its consumer was
        not reading goes on where it was.

        The one loop from a committed log to a message stream: :meth:`messages` (inspect,
        the demo's check), the pull stream (feed/serve/stream.py) and the push publisher
        (feed/serve/publisher.py) run it, a turn per worker-thread call for the last
        two."""
        for seg in self._segments(lower, frontier):
            t, count = seg.time, seg.count  # (the files' row counts are checked against it)
            n, batches = (
                skip,
                [_as_updates(self._table(seg), t, self.record_type)]
                if rows is None
                else self._batches(seg, rows, skip),
            )
            skip = 0
            for batch in batches:
                if len(batch):
                    n += len(batch)
                    if n < count:
                        yield [batch]
                    else:
                        yield [batch, Progress(lower, t + 1, ((t, n),))]
            if not n:
                yield [Progress(lower, t + 1, ())]
            elif n < count:  # (the files' counts were checked: a file gone while read)
                raise CheckpointError(f"feed {self.name!r}: time {t} ended after {n} updates")
            lower = t + 1
        if lower < frontier:
            yield [Progress(lower, frontier, ())]

    def snapshot_updates(self, at: int) -> Updates:
        """The collection at complete time ``at`` as one update batch, every record at time
        ``at`` with its multiplicity as the diff (a consolidated snapshot of the feed)."""
        snap = self.snapshot(at)
        fields = list(self.record_type)
        data = (
            pa.StructArray.from_arrays(
                [snap.column(f.name).combine_chunks() for f in fields], fields=fields
            )
            if snap.num_rows
            else pa.array([], self.record_type)
        )
        return Updates.from_arrow(
            pa.table(
                {
                    "data": data,
                    "time": pa.array([at] * snap.num_rows, pa.int64()),
                    "diff": snap.column("count"),
                }
            )
        )

    def snapshot(self, at: int | None = None) -> pa.Table:
        """The collection at a complete time ``at`` (default: the frontier - 1): the record
        columns and ``count``, every record with a non-zero multiplicity."""
        hi = self.frontier if at is None else at + 1
        if at is not None and not self.since <= at < self.frontier:
            raise CheckpointError(
                f"feed {self.name!r}: time {at} is not a kept complete time "
                f"(since {self.since}, frontier {self.frontier})"
            )
        since = self.since
        parts = []
        if since > 0:  # the collection at since, then the times after it
            what = f"the collection at {since}"
            compacted = [self._read(f, what) for f in self.manifest.compacted]
            if compacted:
                merged = pa.concat_tables(compacted, promote_options="default")
                parts.append(_as_updates(merged, since, self.record_type))
            parts += [self.updates(t) for t in self.times(after=since + 1, until=hi)]
        else:
            parts += [self.updates(t) for t in self.times(until=hi)]
        parts = [p for p in parts if len(p)]
        if not parts:
            fields = [pa.field(f.name, f.type) for f in self.record_type]
            return pa.schema([*fields, pa.field("count", pa.int64())]).empty_table()
        merged = pa.concat_tables([p.table(self.record_type) for p in parts])
        merged = merged.set_column(1, "time", pa.array([0] * merged.num_rows, pa.int64()))
        snap = consolidate(Updates.from_arrow(merged)).table()
        data = snap.column("data").combine_chunks()
        cols = {f.name: data.field(i) for i, f in enumerate(data.type)}
        return pa.table({**cols, "count": snap.column("diff")})


def _record_columns(f: pq.ParquetFile) -> list[str] | None:
    """The columns of a segment file to read: all but a pack's ``time`` (None: all)."""
    names = f.schema_arrow.names
    return [n for n in names if n != "time"] if "time" in names else None


def _as_updates(table: pa.Table, time: int, record_type: pa.DataType) -> Updates:
    times = pa.array(np.full(table.num_rows, time, dtype=np.int64))
    return flat_updates(table, record_type, times)


def flat_updates(
    table: pa.Table, record_type: pa.DataType, times: pa.Array | pa.ChunkedArray
) -> Updates:
    """An update batch from a log-shaped table (record columns and ``diff``): the record
    columns become the ``data`` struct of ``record_type`` (missing ones null)."""
    n = table.num_rows
    fields = list(record_type)
    arrays = []
    for f in fields:
        if f.name in table.column_names:
            col = table.column(f.name).combine_chunks()
            arrays.append(col.cast(f.type) if col.type != f.type else col)
        else:
            arrays.append(pa.nulls(n, f.type))
    data = (
        pa.StructArray.from_arrays(arrays, fields=fields)
        if fields
        else pa.array([{}] * n, pa.struct([]))
    )
    diff = table.column("diff").combine_chunks() if n else pa.array([], pa.int64())
    if isinstance(times, pa.ChunkedArray):
        times = times.combine_chunks()
    return Updates.from_arrow(
        pa.table({"data": data, "time": times.cast(pa.int64()), "diff": diff.cast(pa.int64())})
    )
