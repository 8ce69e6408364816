"""Compaction and retention (DESIGN §8): fold old times into one consolidated snapshot.

``tidefeed compact --log URI --feed NAME --to C`` (and the feed server's ``--retain``
policy) does, in this order:

1. refuse unless ``since < C < frontier`` (C is a complete time) and ``C`` is at or below the
   lowest ACK of every durable subscription (an ACK ``F`` means the subscriber still needs
   the times ``>= F``; a subscription that never ACKed holds everything);
2. write the collection at ``C`` (every record with its multiplicity as its diff, consolidated)
   to ``compacted/C/part-00000.parquet`` and make it durable (fsync locally);
3. **commit** ``since = C``: a manifest without the folded times and naming the collection
   file, then the next checkpoint (the same commit sequence as the emitter's, in the
   emitter's epoch; an emitter that finds its next seq taken by it commits, or claims
   its epoch at start-up, on top);
4. delete the folded segments: every ``times/<t>`` with ``t < C`` and every older
   ``compacted/<c>``.

``times/C`` itself is kept: a consumer that ACKed ``C`` resumes from ``after=C`` and needs the
updates *at* ``C``, which the snapshot has folded into the collection. So ``after >= since``
is always served exactly and ``after < since`` is 410. A crash before 3 leaves an
uncommitted ``compacted/C`` that no manifest names and the next compaction replaces; a crash
after 3 leaves folded segments that no manifest names, deleted by the next run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import pyarrow.parquet as pq

from feed._faults import maybe_die
from feed.log.checkpoint import Checkpoint, CheckpointStore
from feed.log.manifest import ManifestStore
from feed.log.reader import FeedReader
from feed.log.store import PARQUET_PAGES, FeedLog
from feed.log.subscriptions import SubscriptionStore
from protocol import CheckpointError, CommitConflict

__all__ = ["CompactResult", "compact", "retention_target"]

log = logging.getLogger("tidefeed.compact")


@dataclass(frozen=True, slots=True)
class CompactResult:
    feed: str
    since_before: int
    since: int
    records: int  # rows of the snapshot at ``since``
    deleted_times: int

    def summary(self) -> str:
        if self.since == self.since_before:
            return f"feed {self.feed}: already compacted to {self.since}; nothing to do"
        return (
            f"feed {self.feed}: compacted times {self.since_before}..{self.since} into "
            f"compacted/{self.since} ({self.records} records), since = {self.since}, "
            f"{self.deleted_times} time segment(s) deleted"
        )


def _blockers(log_: FeedLog, to: int) -> list[str]:
    """The subscriptions that have not ACKed up to ``to`` (each with its position)."""
    subs = SubscriptionStore(log_)
    return [
        f"{s.name} (acked {s.acked})"
        for s in sorted(subs.subs.values(), key=lambda s: s.acked or 0)
        if (s.acked or 0) < to
    ]


def compact(log_uri: str, feed: str, to: int) -> CompactResult:
    """Compact ``feed`` to ``to`` (see the module docstring); idempotent for ``to == since``."""
    reader = FeedReader(log_uri, feed)
    flog = reader.log
    before = reader.since
    if reader.checkpoint is None:
        raise CheckpointError(f"feed {feed!r} has nothing committed to compact")
    if to < before:
        raise CheckpointError(
            f"feed {feed!r} is already compacted to {before}; cannot compact to {to}"
        )
    if to >= reader.frontier:
        raise CheckpointError(
            f"feed {feed!r}: time {to} is not complete (frontier {reader.frontier}); "
            f"compact to a time below it"
        )
    if to == before:
        return CompactResult(feed, before, before, 0, _drop_folded(flog, before))
    blockers = _blockers(flog, to)
    if blockers:
        raise CheckpointError(
            f"feed {feed!r}: cannot compact to {to}: subscription(s) {', '.join(blockers)} "
            f"still need earlier times; wait for their ACKs or delete them"
        )
    started = time.monotonic()
    # the packs only times below ``to`` use, deleted once the compaction is committed
    folded = reader.packs(hi=to) - reader.packs(lo=to)
    snap = reader.snapshot(to)  # record columns + count, consolidated
    table = snap.rename_columns([*snap.column_names[:-1], "diff"])
    folder = flog.path("compacted", str(to))
    flog.delete_dir(folder)  # an uncommitted attempt at the same point
    flog.fs.create_dir(folder, recursive=True)
    part = f"{folder}/part-00000.parquet"
    with flog.fs.open_output_stream(part) as f:
        pq.write_table(table, f, **PARQUET_PAGES)
    flog.sync(part)
    maybe_die("compact_before_commit")
    _commit(reader, to, (part[len(flog.root) + 1 :],), table.num_rows)
    maybe_die("compact_after_commit")
    deleted = _drop_folded(flog, to)
    for rel in sorted(folded):
        flog.delete_file(flog.path(rel))
    log.info(
        "feed %s: compacted to %d (%d records) in %.1fs",
        feed,
        to,
        table.num_rows,
        time.monotonic() - started,
    )
    return CompactResult(feed, before, to, table.num_rows, deleted)


def _commit(reader: FeedReader, to: int, files: tuple[str, ...], records: int) -> Checkpoint:
    """Commit ``since = to`` as the next checkpoint, on top of whatever the emitter has
    committed meanwhile (a conflict means it committed first: take its commit as the base
    and try again). The epoch stays the emitter's, so the emitter is not fenced out."""
    flog = reader.log
    store = CheckpointStore(flog)
    manifests = ManifestStore(flog)
    for _ in range(16):
        latest = store.latest()
        assert latest is not None  # the reader found it
        base = manifests.of(latest)
        if base.since >= to:
            raise CheckpointError(f"feed {flog.feed!r}: another compaction to {to} committed first")
        m = manifests.write(
            seq=latest.seq + 1,
            epoch=latest.epoch,
            base=base,
            since=to,
            compacted=(files, records),
        )
        cp = latest.successor(since=to, manifest=m.name, writers=())
        try:
            store.commit(cp)
            return cp
        except CommitConflict:
            manifests.prune((), written=manifests.written)
    raise CheckpointError(f"feed {flog.feed!r}: could not commit the compaction (busy emitter)")


def _drop_folded(flog: FeedLog, since: int) -> int:
    gone = [t for t in flog.time_dirs() if t < since]
    for t in gone:
        flog.delete_dir(flog.path("times", str(t)))
    for c in flog.numbered_dirs("compacted"):
        if c < since:
            flog.delete_dir(flog.path("compacted", str(c)))
    return len(gone)


def retention_target(frontier: int, since: int, retain: int, lowest_ack: int | None) -> int | None:
    """Where the automatic policy compacts to: keep the last ``retain`` time units below the
    frontier and everything a subscription has not ACKed; ``None`` when nothing to do."""
    target = frontier - 1 - retain
    if lowest_ack is not None:
        target = min(target, lowest_ack)
    return target if target > since else None
