"""Reading a committed feed from Python: Arrow tables for notebooks and scripts (no Spark).

    from feed.log.read import open_feed

    f = open_feed("demo-output/latest/log", "accounts")
    f.updates(after=10, upto=20)   # time, diff and the record columns
    f.collection(at=20)            # the record columns and count, at a complete time
    f.deltas(10, 20)               # what changed from time 10 to time 20, consolidated
    f.history(id=7)                # one record's life: each time, its diff and the row
    f.progress()                   # each kept commit: seq, epoch, lower, upper, updates, time

Every method returns a ``pyarrow.Table``; ``.to_pandas()`` and ``polars.from_arrow()``
convert it (Polars without a copy). :meth:`Feed.batches` streams updates one time at a time,
so a feed larger than memory can be read in a loop. Every answer is read from one commit
(the latest when the feed was opened; :meth:`Feed.refresh` moves on) through its manifest, so
a compacted feed reads the same: the collection at ``since`` stands for the folded times.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from feed.log.checkpoint import CheckpointStore
from feed.log.reader import FeedReader
from protocol import CheckpointError, Compacted, Updates, consolidate

__all__ = ["Feed", "open_feed"]


def open_feed(log: str, feed: str) -> Feed:
    """The committed feed ``feed`` of the feed log ``log`` (a path or a pyarrow URI)."""
    return Feed(FeedReader(log, feed))


class Feed:
    """A read-only view of one committed feed (see the module docstring)."""

    def __init__(self, reader: FeedReader) -> None:
        self._r = reader

    def refresh(self) -> Feed:
        """Move on to the latest commit (an emitter may have committed more)."""
        self._r.refresh()
        return self

    @property
    def frontier(self) -> int:
        """Every time below it is complete."""
        return self._r.frontier

    @property
    def since(self) -> int:
        """Times below it are folded into the collection at ``since`` (0: nothing folded)."""
        return self._r.since

    @property
    def clock(self) -> str:
        """``wallclock`` (times are milliseconds since the epoch) or ``logical``."""
        return str(self._r.info.clock)

    @property
    def key(self) -> tuple[str, ...]:
        return tuple(self._r.info.key)

    @property
    def name(self) -> str:
        return self._r.name

    def counts(self) -> dict[int, int]:
        """The kept times below the frontier and how many updates each has."""
        return dict(self._r.counts())

    @property
    def schema_versions(self) -> list[dict[str, Any]]:
        """Every version of the record schema, oldest first: ``from`` (a record at time
        ``t`` has the newest version from ``t`` or before), ``schema`` (Avro), and the
        columns it ``added``, ``dropped`` and ``widened``. Every time is read through the
        last one (docs/sources.md, "Schema changes")."""
        return [
            {"from": v.start, "schema": v.schema, **v.changes()} for v in self._r.info.history()
        ]

    @property
    def schema(self) -> pa.Schema:
        """The columns of :meth:`updates`: ``time``, ``diff``, then the record's."""
        record = [f.with_nullable(True) for f in self._r.record_type]
        return pa.schema([pa.field("time", pa.int64()), pa.field("diff", pa.int64()), *record])

    @property
    def collection_schema(self) -> pa.Schema:
        """The columns of :meth:`collection`: the record's, then ``count``."""
        record = [f.with_nullable(True) for f in self._r.record_type]
        return pa.schema([*record, pa.field("count", pa.int64())])

    # ---- updates -----------------------------------------------------------------------
    def batches(self, after: int | None = None, upto: int | None = None) -> Iterator[pa.Table]:
        """The updates at times ``>= after`` and ``< upto`` (default: from the start to the
        frontier), one table per time in time order. On a compacted feed a read from the
        start (``after`` 0 or None) begins with the collection at ``since`` (as updates at
        ``since``), and a read from ``since`` or later is exact; any other read of folded
        times raises :class:`Compacted`."""
        r = self._r
        lo = 0 if after is None else after
        hi = r.frontier if upto is None else min(upto, r.frontier)
        if 0 < lo < r.since or (lo < r.since and 0 < hi <= r.since):
            raise Compacted(
                f"feed {r.name!r}: times below {r.since} were compacted; read from "
                f"after={r.since}, or from the start up to a time above {r.since} (the "
                f"collection at {r.since} stands for the folded times)",
                since=r.since,
            )
        if lo < r.since < hi:  # from the start of a compacted feed
            yield self._flat(r.snapshot_updates(r.since).table(r.record_type))
            lo = r.since + 1
        for t in r.times(after=lo, until=hi):
            yield self._flat(r.updates(t).table(r.record_type))

    def updates(self, after: int | None = None, upto: int | None = None) -> pa.Table:
        """:meth:`batches` as one table."""
        return pa.concat_tables([self.schema.empty_table(), *self.batches(after, upto)])

    # ---- collections ---------------------------------------------------------------------
    def collection(self, at: int | None = None) -> pa.Table:
        """The collection at complete time ``at`` (default: the latest): the record
        columns and ``count``, one row per record with a non-zero multiplicity."""
        if self._r.frontier == 0:
            return self.collection_schema.empty_table()
        return self._r.snapshot(at).cast(self.collection_schema)

    def deltas(self, t1: int, t2: int) -> pa.Table:
        """What changed from complete time ``t1`` to complete time ``t2`` (``t1 < t2``):
        the updates at times in ``(t1, t2]``, consolidated: the record columns and
        ``diff`` (``collection(t2) - collection(t1)``, zeros dropped)."""
        r = self._r
        if not t1 < t2 < r.frontier:
            raise CheckpointError(
                f"feed {r.name!r}: deltas({t1}, {t2}) needs t1 < t2 < frontier {r.frontier}"
            )
        if t1 < r.since:
            raise Compacted(
                f"feed {r.name!r}: time {t1} was compacted (since {r.since})", since=r.since
            )
        parts = [r.updates(t).table(r.record_type) for t in r.times(after=t1 + 1, until=t2 + 1)]
        if not parts:
            return pa.schema([*r.record_type, pa.field("diff", pa.int64())]).empty_table()
        merged = pa.concat_tables(parts)
        merged = merged.set_column(1, "time", pa.array([t2] * merged.num_rows, pa.int64()))
        out = consolidate(Updates.from_arrow(merged)).table(r.record_type)
        flat = self._flat(out)
        return flat.select([*flat.column_names[2:], "diff"])

    def history(self, **key: Any) -> pa.Table:
        """One record's life, by key (``history(id=7)``; every key column of a keyed feed,
        or any columns of an unkeyed one): each update of a matching record in time order,
        as :meth:`updates` has them. Reads the feed one time at a time."""
        if not key:
            raise ValueError("history() needs the key, e.g. history(id=7)")
        names = {f.name for f in self._r.record_type}
        unknown = sorted(set(key) - names)
        if unknown:
            raise ValueError(f"feed {self._r.name!r} has no column(s) {unknown}")
        out = [self.schema.empty_table()]
        for batch in self.batches():
            mask = None
            for col, value in key.items():
                hit = pc.equal(batch.column(col), pa.scalar(value, batch.schema.field(col).type))
                mask = hit if mask is None else pc.and_(mask, hit)
            found = batch.filter(mask)
            if found.num_rows:
                out.append(found.sort_by([("diff", "ascending")]))
        return pa.concat_tables(out)

    # ---- progress ------------------------------------------------------------------------
    def progress(self) -> pa.Table:
        """One row per kept commit, oldest first: ``seq``, ``epoch``, ``lower``, ``upper``,
        ``times`` and ``updates`` (what its progress counts) and ``committed_at`` (the
        commit file's time, UTC). Older commits are pruned by the emitter."""
        store = CheckpointStore(self._r.log)
        rows: dict[str, list[Any]] = {
            k: [] for k in ("seq", "epoch", "lower", "upper", "times", "updates", "committed_at")
        }
        for seq in store.seqs():
            try:
                cp = store.read(seq)
            except CheckpointError:
                continue  # pruned or cut meanwhile
            info = self._r.log.fs.get_file_info(store.path_of(seq))
            rows["seq"].append(cp.seq)
            rows["epoch"].append(cp.epoch)
            rows["lower"].append(cp.progress.lower)
            rows["upper"].append(cp.progress.upper)
            rows["times"].append(len(cp.progress.counts))
            rows["updates"].append(sum(n for _, n in cp.progress.counts))
            rows["committed_at"].append(info.mtime)
        types = [pa.int64()] * 6 + [pa.timestamp("ms", tz="UTC")]
        return pa.table({k: pa.array(v, t) for (k, v), t in zip(rows.items(), types, strict=True)})

    # ---- helpers -------------------------------------------------------------------------
    def _flat(self, table: pa.Table) -> pa.Table:
        """``data``/``time``/``diff`` as ``time``, ``diff`` and the record columns."""
        data = table.column("data").combine_chunks()
        cols = {"time": table.column("time"), "diff": table.column("diff")}
        for i, f in enumerate(data.type):
            cols[f.name] = data.field(i)
        return pa.table(cols).cast(self.schema)
