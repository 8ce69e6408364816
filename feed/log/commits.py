"""Committing a feed: epoch claims, the manifest-then-checkpoint commit, rollback and pruning.

The checkpoint is the single commit point (:mod:`feed.log.checkpoint`); a transaction's
manifest (:mod:`feed.log.manifest`) is published first and the checkpoint names it. Claiming a
new epoch commits ``seq + 1`` (a racing emitter loses with :class:`CommitConflict`) and
rolls back whatever no commit names: times at or above the committed ``upper``, staged
files, state and quarantine folders of transactions that did not commit.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Protocol

import pyarrow.fs as pafs

from feed._faults import maybe_die
from feed.log.checkpoint import Checkpoint, CheckpointStore
from feed.log.manifest import PACKS, ManifestStore, Segment
from feed.log.store import FeedLog
from protocol import CheckpointError, CommitConflict


class BucketedState(Protocol):
    """What committing needs of the keyed state (feed/txn/state.py): dropping the
    snapshots no kept commit names."""

    def prune(self, refs: Iterable[str | None]) -> None: ...


__all__ = ["LIST_PRUNE_EVERY", "Committer", "time_ranges"]

#: every this many commits, also prune what crashed or finished processes left (by listing)
LIST_PRUNE_EVERY = 256


class Committer:
    """The commits of one feed, as its emitter makes them."""

    def __init__(self, feedlog: FeedLog, *, feed: str, logger: logging.Logger) -> None:
        self.feedlog = feedlog
        self.feed = feed
        self.log = logger
        self.store = CheckpointStore(feedlog)
        self.manifests = ManifestStore(feedlog)

    def claim(self, latest: Checkpoint, state: BucketedState) -> tuple[Checkpoint, list[int]]:
        """Commit a new epoch on top of ``latest`` and roll back what no commit names;
        return the claimed checkpoint and the uncommitted times deleted. A compaction that
        committed since ``latest`` was read (same epoch, a higher seq) is claimed on top
        of, as :meth:`commit` does; a higher epoch means another emitter claimed first."""
        read = latest  # (what this start read: later seqs are uncommitted or compactions)
        for _ in range(16):
            claimed = latest.successor(epoch=latest.epoch + 1)
            if latest.seq and latest.manifest is None and latest.frontier > 0:
                # a feed from before manifests: publish the one its folders imply
                legacy = self.manifests.of(latest)
                m = self.manifests.write(seq=claimed.seq, epoch=claimed.epoch, base=legacy)
                claimed = replace(claimed, manifest=m.name, writers=())
                self.log.info("feed %s: migrated to a manifest-based log (%s)", self.feed, m.name)
            try:
                self.store.commit(claimed)
                break
            except CommitConflict:
                winner = self._compaction_over(latest, claimed.seq, "claiming")
                if winner is None:
                    raise
                latest = winner
        else:
            raise CommitConflict(f"feed {self.feed!r}: gave up claiming after 16 conflicts")
        kept_states, kept_manifests = self.kept_refs(claimed)
        self.manifests.prune(kept_manifests)
        gone = self.feedlog.delete_times_from(claimed.progress.upper)
        self._drop_unnamed_packs(claimed)
        self.feedlog.delete_dir(self.feedlog.path("_staging"))
        state.prune(kept_states)
        for n in self.feedlog.numbered_dirs("quarantine"):
            # past the commits read, or at a claim's or a compaction's seq (a transaction
            # that lost its seq to a compaction moves its rows on: see commit; one that
            # lost it to another emitter's claim never commits): never committed
            if n > read.seq or self.store.made_by(n) in ("claim", "compaction"):
                self.feedlog.delete_dir(self.feedlog.path("quarantine", str(n)))
        return claimed, gone

    def _drop_unnamed_packs(self, claimed: Checkpoint) -> None:
        """Delete the packs ``claimed``'s manifest does not name: uncommitted transactions'
        (the rollback of a feed of packs) or, after a compaction cut short, folded ones.
        One listing of ``packs/``; no other writer of packs runs at a claim."""
        found = [
            i
            for i in self.feedlog.list_dir(self.feedlog.path(PACKS))
            if i.type == pafs.FileType.File
        ]
        if not found:
            return
        named = self.manifests.packs(self.manifests.of(claimed))
        unnamed = [i for i in found if f"{PACKS}/{i.base_name}" not in named]
        for i in unnamed:
            self.feedlog.delete_file(i.path)
        if unnamed:
            self.log.info(
                "feed %s: rolled back %d pack(s) no commit names", self.feed, len(unnamed)
            )

    def _move_quarantine(self, seq: int, to: int) -> None:
        """Transaction ``seq``'s quarantined rows, as transaction ``to``'s (its commit lost
        ``seq`` to a compaction). A move cut short leaves both folders uncommitted: the
        next start deletes them, and the transaction is redone."""
        src, dst = (
            self.feedlog.path("quarantine", str(seq)),
            self.feedlog.path("quarantine", str(to)),
        )
        files = [f for f in self.feedlog.list_dir(src) if f.type == pafs.FileType.File]
        if not files:
            return
        self.feedlog.fs.create_dir(dst, recursive=True)
        for f in files:
            self.feedlog.fs.move(f.path, f"{dst}/{f.base_name}")
        self.feedlog.delete_dir(src)

    def commit(
        self,
        base: Checkpoint,
        build: Callable[[Checkpoint], Checkpoint],
        segments: Sequence[Segment],
    ) -> Checkpoint:
        """Commit ``build(latest)``: publish its manifest (the latest one plus ``segments``)
        first, then the checkpoint. A compaction may have committed in between (same epoch,
        a higher seq): then commit on top of it; a higher epoch means this emitter is stale."""
        lost: int | None = None  # the seq a compaction took from this commit
        for _ in range(16):
            new_cp = build(base)
            if lost is not None and lost != new_cp.seq:
                self._move_quarantine(lost, new_cp.seq)
            if segments:
                m = self.manifests.write(
                    seq=new_cp.seq,
                    epoch=new_cp.epoch,
                    base=self.manifests.of(base),
                    added=segments,
                )
                new_cp = replace(new_cp, manifest=m.name)
            maybe_die("before_commit")
            try:
                self.store.commit(new_cp)
            except CommitConflict:
                winner = self._compaction_over(base, new_cp.seq, "committing")
                if winner is None:
                    raise
                base, lost = winner, new_cp.seq
                continue
            return new_cp
        raise CommitConflict(f"feed {self.feed!r}: gave up committing after 16 conflicts")

    def _compaction_over(self, base: Checkpoint, seq: int, doing: str) -> Checkpoint | None:
        """After commit ``seq`` on top of ``base`` lost: the latest commit when a compaction
        made it (same epoch, a higher seq), said in the log, for ``doing`` again on top of
        it; None when another emitter did (a higher epoch: this one is stale)."""
        winner = self.store.latest()
        if winner is None or winner.epoch != base.epoch or winner.seq <= base.seq:
            return None
        self.log.info(
            "feed %s: commit %d was taken by a compaction (since %d); %s on top of it",
            self.feed,
            seq,
            winner.since,
            doing,
        )
        return winner

    def kept_refs(self, cp: Checkpoint) -> tuple[set[str | None], set[str | None]]:
        """The state snapshots and manifests the kept commits name."""
        states, manifests = {cp.state}, {cp.manifest}
        for s in self.store._seqs():
            if s != cp.seq:
                with contextlib.suppress(CheckpointError):
                    other = self.store.read(s)
                    states.add(other.state)
                    manifests.add(other.manifest)
        return states, manifests

    def prune(self, cp: Checkpoint, state: BucketedState) -> None:
        """Delete the state and manifest files no kept commit needs (and an uncommitted
        transaction's); every :data:`LIST_PRUNE_EVERY` commits also whatever a crashed or
        finished process left (by listing, with a grace period)."""
        states, manifests = self.kept_refs(cp)
        state.prune(states)
        listing = cp.seq % LIST_PRUNE_EVERY == 0
        self.manifests.prune(manifests, written=None if listing else self.manifests.written)


def time_ranges(times: Iterable[int], most: int = 6) -> str:
    """``times`` for a log line as runs (``"3-3608, 3610"``), at most ``most`` of them
    and the number of the rest: a rollback of thousands of times is one short line."""
    runs: list[list[int]] = []
    for t in sorted(set(times)):
        if runs and t == runs[-1][1] + 1:
            runs[-1][1] = t
        else:
            runs.append([t, t])
    shown = ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs[:most])
    if len(runs) > most:
        shown += f" and {len(runs) - most} more run(s)"
    return shown or "none"
