"""Manifests (DESIGN §5): what each commit says the feed log holds, without a directory listing.

A checkpoint names one manifest, ``_manifests/<seq:020d>-e<epoch>-<random>.json``::

    {"format": 1, "feed": ..., "seq": ..., "epoch": ...,
     "since": C, "compacted": {"files": [...], "records": n} | null,
     "parts": [{"file": "_manifests/parts/<name>.parquet", "lo": t0, "hi": t1,
                "times": k, "updates": n}, ...]}

and each part is a small Parquet table of *segments*, one row per committed time with
updates: ``time``, ``epoch`` (the writer), ``count`` (its updates) and ``files`` (paths
relative to the feed folder). A feed of the ``packs`` layout (docs/operations.md, "Packs")
keeps many times in one file: its parts have a ``groups`` column too, for each file the
row groups that hold the time, and its manifests say ``"format": 2`` (a reader that knows
only format 1 refuses them by name instead of reading a pack whole as one time).

A transaction writes one new part holding only its own times and a manifest listing the
earlier parts plus the new one; parts are merged like a binary counter (the newest two
while the newer holds at least as many times as the older), so a manifest lists O(log
times) parts and each time is rewritten O(log times) times over the feed's life: a commit
costs O(its changes), amortized.

Every manifest and part is written under a name no other writer uses (a random suffix)
through :meth:`FeedLog.create_exclusive` (temporary file, fsync, exclusive link): a reader
sees the whole file or none. Nothing is ever changed in place; files no kept commit names
are deleted by :meth:`ManifestStore.prune`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from feed.log.store import FeedLog
from protocol import CheckpointError

__all__ = ["PACKS", "Manifest", "ManifestStore", "Part", "Segment"]

FORMAT = 1
#: a manifest whose segments may name row groups of packs
PACKS_FORMAT = 2
FOLDER = "_manifests"
#: the folder of a feed's packs: one file per writing task, many times in each
PACKS = "packs"
#: a file no commit names is left alone this long by a listing prune (a compaction may be
#: about to commit it)
GRACE_SECONDS = 600
_PART_SCHEMA = pa.schema(
    [
        pa.field("time", pa.int64(), nullable=False),
        pa.field("epoch", pa.int64(), nullable=False),
        pa.field("count", pa.int64(), nullable=False),
        pa.field("files", pa.list_(pa.string()), nullable=False),
        # packs only: for each file, its row groups that hold the time (null: whole files)
        pa.field("groups", pa.list_(pa.list_(pa.int32()))),
    ]
)


@dataclass(frozen=True, slots=True)
class Segment:
    """One committed time's updates: ``count`` rows in ``files`` written by ``epoch``;
    ``groups``, for packs, the row groups of each file that hold them (empty: every row of
    every file)."""

    time: int
    epoch: int
    count: int
    files: tuple[str, ...]
    groups: tuple[tuple[int, ...], ...] = ()

    def pieces(self) -> list[tuple[str, tuple[int, ...] | None]]:
        """Each file with its row groups to read (None: the whole file)."""
        if not self.groups:
            return [(f, None) for f in self.files]
        return list(zip(self.files, self.groups, strict=True))


@dataclass(frozen=True, slots=True)
class Part:
    """A part file of a manifest and the range of times it covers."""

    file: str
    lo: int
    hi: int
    times: int
    updates: int


@dataclass(frozen=True, slots=True)
class Manifest:
    name: str  # path relative to the feed folder ("" for one built in memory)
    since: int = 0
    compacted: tuple[str, ...] = ()  # the files of the collection at ``since``
    records: int = 0
    parts: tuple[Part, ...] = ()
    format: int = FORMAT  # PACKS_FORMAT once a segment names row groups

    def to_json(self, *, feed: str, seq: int, epoch: int) -> bytes:
        return orjson.dumps(
            {
                "format": self.format,
                "feed": feed,
                "seq": seq,
                "epoch": epoch,
                "since": self.since,
                "compacted": (
                    {"files": list(self.compacted), "records": self.records}
                    if self.compacted
                    else None
                ),
                "parts": [
                    {"file": p.file, "lo": p.lo, "hi": p.hi, "times": p.times, "updates": p.updates}
                    for p in self.parts
                ],
            },
            option=orjson.OPT_INDENT_2,
        )


def _segments_table(segments: Iterable[Segment]) -> pa.Table:
    segs = sorted(segments, key=lambda s: s.time)
    return pa.table(
        {
            "time": pa.array([s.time for s in segs], pa.int64()),
            "epoch": pa.array([s.epoch for s in segs], pa.int64()),
            "count": pa.array([s.count for s in segs], pa.int64()),
            "files": pa.array([list(s.files) for s in segs], pa.list_(pa.string())),
            "groups": pa.array(
                [[list(g) for g in s.groups] if s.groups else None for s in segs],
                _PART_SCHEMA.field("groups").type,
            ),
        },
        schema=_PART_SCHEMA,
    )


def _full(table: pa.Table) -> pa.Table:
    """A part as read, in the part schema (a part of a feed without packs has no
    ``groups`` column: every file is whole)."""
    if "groups" not in table.column_names:
        table = table.append_column("groups", pa.nulls(table.num_rows, _PART_SCHEMA[-1].type))
    return table.cast(_PART_SCHEMA) if table.schema != _PART_SCHEMA else table


def _as_written(table: pa.Table) -> pa.Table:
    """A part as it is written: without ``groups`` when no time names row groups, so a
    feed without packs keeps the parts a format-1 reader knows."""
    if table["groups"].null_count == table.num_rows:
        return table.drop_columns(["groups"])
    return table


class ManifestStore:
    """Reads and writes one feed's manifests; parts are cached (they never change)."""

    def __init__(self, log: FeedLog) -> None:
        self.log = log
        self._parts: dict[str, pa.Table] = {}
        self._manifests: dict[str, Manifest] = {}
        self.written: set[str] = set()  # files this process wrote and may delete later

    # ---- reading -----------------------------------------------------------------------
    def read(self, name: str) -> Manifest:
        cached = self._manifests.get(name)
        if cached is not None:
            return cached
        where = f"feed {self.log.feed!r}: manifest {name}"
        try:
            d = orjson.loads(self.log.read_bytes(self.log.path(name)))
        except FileNotFoundError as e:
            raise CheckpointError(f"{where} is missing; the feed log is damaged") from e
        except (OSError, orjson.JSONDecodeError) as e:
            raise CheckpointError(f"{where} is unreadable: {e}") from e
        if d.get("format") not in (FORMAT, PACKS_FORMAT):
            raise CheckpointError(f"{where}: unknown manifest format {d.get('format')!r}")
        comp = d.get("compacted") or {}
        m = Manifest(
            name=name,
            since=int(d.get("since", 0)),
            compacted=tuple(comp.get("files", ())),
            records=int(comp.get("records", 0)),
            parts=tuple(Part(**p) for p in d.get("parts", ())),
            format=int(d["format"]),
        )
        self._manifests[name] = m
        return m

    def of(self, cp: Any) -> Manifest:
        """The manifest checkpoint ``cp`` names; for a checkpoint from before manifests, the
        one its folders imply (:func:`legacy_manifest`); empty for no checkpoint."""
        if cp is None:
            return Manifest(name="")
        if cp.manifest:
            return self.read(cp.manifest)
        return legacy_manifest(self, cp)

    def _part(self, part: Part) -> pa.Table:
        table = self._parts.get(part.file)
        if table is None:
            try:
                # ParquetFile, not pq.read_table: that goes through pyarrow.dataset, whose
                # import (pandas with it) would cost a server's first read ~0.2 s
                with self.log.fs.open_input_file(self.log.path(part.file)) as f:
                    table = _full(pq.ParquetFile(f).read())
            except FileNotFoundError as e:
                raise CheckpointError(
                    f"feed {self.log.feed!r}: manifest part {part.file} (times {part.lo}.."
                    f"{part.hi}) is missing; the feed log is damaged"
                ) from e
            self._parts[part.file] = table
        return table

    def table(self, m: Manifest, lo: int | None = None, hi: int | None = None) -> pa.Table:
        """The segments of ``m`` with ``lo <= time < hi``, in time order, as a table."""
        lo_ = lo if lo is not None else -(1 << 62)
        hi_ = hi if hi is not None else 1 << 62
        pieces = []
        for p in m.parts:
            if p.hi < lo_ or p.lo >= hi_:
                continue
            t = self._part(p)
            if p.lo < lo_ or p.hi >= hi_:
                t = t.filter(pc.and_(pc.greater_equal(t["time"], lo_), pc.less(t["time"], hi_)))
            pieces.append(t)
        if not pieces:
            return _PART_SCHEMA.empty_table()
        return pa.concat_tables(pieces).sort_by("time")

    def segments(self, m: Manifest, lo: int | None = None, hi: int | None = None) -> list[Segment]:
        return [
            Segment(
                r["time"],
                r["epoch"],
                r["count"],
                tuple(r["files"]),
                tuple(tuple(g) for g in r["groups"]) if r["groups"] else (),
            )
            for r in self.table(m, lo, hi).to_pylist()
        ]

    def packs(self, m: Manifest, lo: int | None = None, hi: int | None = None) -> set[str]:
        """The packs (files under ``packs/``) that ``m``'s times ``>= lo`` and ``< hi``
        name."""
        files = pc.list_flatten(self.table(m, lo, hi)["files"])
        return {f for f in pc.unique(files).to_pylist() if f.startswith(PACKS + "/")}

    # ---- writing -----------------------------------------------------------------------
    def _write_part(self, table: pa.Table) -> Part:
        name = f"{FOLDER}/parts/{uuid.uuid4().hex}.parquet"
        sink = pa.BufferOutputStream()
        pq.write_table(_as_written(table), sink, compression="zstd")
        self.log.create_exclusive(self.log.path(name), sink.getvalue().to_pybytes())
        self.written.add(name)
        self._parts[name] = table
        times = table["time"]
        return Part(
            file=name,
            lo=int(pc.min(times).as_py()),
            hi=int(pc.max(times).as_py()),
            times=table.num_rows,
            updates=int(pc.sum(table["count"]).as_py() or 0),
        )

    def write(
        self,
        *,
        seq: int,
        epoch: int,
        base: Manifest | None,
        added: Iterable[Segment] = (),
        since: int | None = None,
        compacted: tuple[tuple[str, ...], int] | None = None,
    ) -> Manifest:
        """Write the manifest of commit ``seq``: ``base``'s segments at or above ``since``
        plus ``added`` (which must all lie above ``base``'s), published whole."""
        added = list(added)
        packed = any(s.groups for s in added) or (base is not None and base.format == PACKS_FORMAT)
        parts = list(base.parts) if base is not None else []
        new_since = base.since if base is not None else 0
        files, records = (base.compacted, base.records) if base is not None else ((), 0)
        if base is not None and any(p.file.startswith("<") for p in parts):
            # a feed from before manifests (legacy_manifest): its segments become real parts
            added = [*self.segments(base), *added]
            parts = []
        if since is not None and since != new_since:
            new_since = since
            kept = []
            for p in parts:
                if p.hi < since:
                    continue
                if p.lo < since:
                    t = self._part(p)
                    p = self._write_part(t.filter(pc.greater_equal(t["time"], since)))
                kept.append(p)
            parts = kept
        if compacted is not None:
            files, records = compacted
        new = _segments_table(added)
        if new.num_rows:
            if parts and int(new["time"][0].as_py()) <= parts[-1].hi:
                raise CheckpointError(
                    f"feed {self.log.feed!r}: times {new['time'][0]}… are already in the log"
                )
            parts.append(self._write_part(new))
        while len(parts) >= 2 and parts[-1].times >= parts[-2].times:
            older, newer = parts[-2], parts[-1]
            merged = pa.concat_tables([self._part(older), self._part(newer)])
            parts[-2:] = [self._write_part(merged)]
        m = Manifest(
            name=f"{FOLDER}/{seq:020d}-e{epoch}-{uuid.uuid4().hex[:8]}.json",
            since=new_since,
            compacted=tuple(files),
            records=records,
            parts=tuple(parts),
            format=PACKS_FORMAT if packed else FORMAT,
        )
        body = m.to_json(feed=self.log.feed, seq=seq, epoch=epoch)
        if not self.log.create_exclusive(self.log.path(m.name), body):
            raise CheckpointError(f"feed {self.log.feed!r}: {m.name} exists already")
        self.written.add(m.name)
        self._manifests[m.name] = m
        return m

    def prune(self, keep: Iterable[str | None], *, written: set[str] | None = None) -> None:
        """Delete the manifests and parts that none of the ``keep`` manifests uses.

        With ``written`` (the files this process wrote) only those are candidates: a commit
        costs no listing. Without it the folders are listed and only files older than
        :data:`GRACE_SECONDS` go, so a compaction's files written just before its commit
        are never taken."""
        names = {n for n in keep if n}
        used: set[str] = set(names)
        for n in names:
            try:
                used.update(p.file for p in self.read(n).parts)
            except CheckpointError:
                return  # never delete what a manifest we cannot read may name
        if written is not None:
            for rel in sorted(written - used):
                self.log.delete_file(self.log.path(rel))
                written.discard(rel)
        else:
            cutoff = time.time() - GRACE_SECONDS
            for folder in (FOLDER, f"{FOLDER}/parts"):
                for info in self.log.list_dir(self.log.path(folder)):
                    rel = f"{folder}/{info.base_name}"
                    if info.type != pafs.FileType.File or rel in used:
                        continue
                    if info.mtime is not None and info.mtime.timestamp() > cutoff:
                        continue
                    self.log.delete_file(info.path)
        for rel in [k for k in self._parts if k not in used]:
            del self._parts[rel]
        for rel in [k for k in self._manifests if k not in names]:
            del self._manifests[rel]


def legacy_manifest(store: ManifestStore, cp: Any) -> Manifest:
    """The manifest a feed written before manifests existed implies, built in memory from
    its folders: each time's files of the epoch the checkpoint's ``writers`` names, counts
    from the Parquet footers, the highest ``compacted/<c>`` holding ``_committed.json``.
    The emitter's start-up publishes it (the migration); readers use it until then."""
    log = store.log
    since = max(cp.since, log.compacted_since())
    segments = []
    for t in log.time_dirs():
        if not since <= t < cp.frontier:
            continue
        epoch = cp.epoch_for(t)
        files = log.time_files(t, epoch)
        n = log.row_count(files) if files else 0
        if n:
            rel = tuple(f[len(log.root) + 1 :] for f in files)
            segments.append(Segment(t, epoch, n, rel))
    compacted: tuple[str, ...] = ()
    records = 0
    if since:
        paths = log.parquet_files(log.path("compacted", str(since)))
        compacted = tuple(p[len(log.root) + 1 :] for p in paths)
        records = log.row_count(paths)
    table = _segments_table(segments)
    parts: tuple[Part, ...] = ()
    if table.num_rows:
        name = f"<legacy {cp.seq}>"
        store._parts[name] = table
        parts = (
            Part(
                name,
                segments[0].time,
                segments[-1].time,
                len(segments),
                sum(s.count for s in segments),
            ),
        )
    return Manifest(name="", since=since, compacted=compacted, records=records, parts=parts)
