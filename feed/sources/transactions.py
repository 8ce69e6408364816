"""Source transactions: drop redeliveries, hold back incomplete transactions, keep order.

Debezium delivers at least once and in commit order, but not in whole transactions: a
transaction may straddle input files, arrive partly before a connector crash and again in
full after it, or have its END record in a separate transaction-metadata topic. This module
decides, for the changes one emitter transaction has read, which of them may be turned into
updates now:

* **Redelivery.** An event at or below the committed position ``(pos_hi, pos_lo, pos_n)``
  was turned into updates already and is dropped. Snapshot reads (op ``r``) of one snapshot
  share a position, so at the committed position they are kept (a keyed feed absorbs a
  repeated row as a no-op; an unkeyed feed must not see a snapshot redelivered across
  emitter transactions). Repeated events inside what was read are dropped down to one copy:
  same transaction, position and op, and for snapshot reads the same row.
* **Completeness.** With transaction metadata (Debezium's ``provide.transaction.metadata``)
  a transaction is complete when its END record has been read and as many of the feed
  table's events as END counts for that table are in. A transaction without metadata is
  complete as soon as it is seen (a snapshot, or a connector that gives no metadata).
* **Hold-back.** The first incomplete transaction in delivery order and every transaction
  delivered after it are held back: their events are not turned into updates, and the input
  files holding any of their events or END records are not marked consumed, so the next
  emitter transaction reads them again (the position filter drops what was done).
* **Order.** A transaction with metadata takes its END record's commit LSN as ``pos_hi``:
  times then follow the source's commit order whichever copy of a redelivered event was
  read first. A snapshot's reads take the snapshot's LSN.
* **A new snapshot.** Debezium snapshots the table again when its offsets are lost (or
  were never flushed past the first snapshot, or ``snapshot.mode=always``): reads at
  another LSN than the feed's own snapshot, after the committed position. Such a snapshot
  is the whole table at its LSN, so it is released as a *replacement* (``Assembled.
  replaces``: the emitter retracts every key it does not hold), once it is complete: its
  ``last`` read (of any table) is in, or an event delivered after it. The transactions
  delivered before it go first, in an emitter transaction of their own, and what comes
  after it follows it in the same one; an incomplete one delivered before it will
  never complete (Debezium streams on from the new snapshot, which holds its effect if it
  committed) and is dropped as *superseded*, as is an unfinished snapshot before it.
  Incremental snapshot reads (``source.snapshot`` ``incremental``) are not whole-table
  snapshots: they are applied as they come.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, Row
from pyspark.sql import functions as F

from feed.sources.cached import cached
from feed.sources.holdback import SecondPass
from feed.sources.positions import (
    DATA_OPS,
    EVENT,
    NEW_SNAPSHOT,
    Position,
    committed_position,
    position_filter,
    snapshot_done,
    source_order,
)
from feed.sources.snapshots import (
    classify,
    empty_snapshot,
    moved_reads,
    one_lsn_each,
    say_moved,
    snapshot_figures,
    snapshot_row,
)

__all__ = ["ENDS_SCAN_BYTES", "Assembled", "assemble", "may_hold_ends"]

#: input up to this size in all is looked through on the driver for END records
#: (:func:`may_hold_ends`); larger input is not read twice for it
ENDS_SCAN_BYTES = 32 << 20
#: an END record's status, or an escape that could spell it
_MAY_END = re.compile(rb"END|\\u")


@dataclass(frozen=True, slots=True)
class Assembled:
    """What :func:`assemble` decided for one emitter transaction's read."""

    changes: DataFrame  # the events to turn into updates now (END records removed)
    held_files: frozenset[str]  # input files that must be read again
    ready: int | None  # source transactions released (None: not counted, none held)
    held: int  # source transactions held back
    redelivered: int  # events dropped as already done or repeated
    bad: DataFrame  # snapshot reads of a new snapshot behind the committed position
    bad_rows: int  # how many (at most: some may be in files read again later)
    position: Position | None = None  # the highest position among ``changes``
    #: the released transactions (``txn``) and their source order (``o``), for
    #: :func:`feed.txn.times.assign_units`, where ``changes`` alone does not tell it (a new
    #: snapshot of an empty table adds a transaction without rows); None: it does
    order: DataFrame | None = None
    cached: tuple[DataFrame, ...] = ()  # persisted here: unpersist after the commit
    #: the distinct values of ``assemble(bucket=...)`` over every data event read (None
    #: when no bucket column was given)
    buckets: frozenset[int] | None = None
    #: the rows of ``assemble(also=...)``, collected by the same job
    also: tuple[Row, ...] = ()
    #: a new snapshot, the first transaction released, as the whole table: (LSN, ``txn``)
    replaces: tuple[int, str] | None = None
    #: snapshot reads and snapshot end markers among ``changes`` as given
    snapshot_rows: int = 0
    #: source transactions whose events carry Debezium ``transaction`` blocks, none of
    #: whose END records was read (when END records were read at all, 0)
    endless: int = 0
    #: the held-back source transactions (``txn``), and the first place in delivery order
    #: (``ord_file``, ``ord_row``) of any of their events or of ``hold_at``: a group of
    #: feeds holds the same ones in every feed (feed/emit/group.py)
    held_txns: frozenset[str] = frozenset()
    held_at: tuple[int, int] | None = None


def may_hold_ends(files: Sequence[str]) -> bool:
    """Whether a transaction END record may be among the lines of ``files``. False only
    when every file is local and uncompressed, ``ENDS_SCAN_BYTES`` at most in all, and
    none holds the bytes ``END`` (an END record's status is that text) nor a ``\\u``
    escape (which could spell it). Without END records the figures need no list of them:
    a Spark job and a cache less in each transaction read without transaction metadata."""
    from feed.sources.file_text import codec_of, search_text
    from feed.sources.inputs import input_bytes
    from feed.sources.stores import is_remote
    from protocol import SourceError

    try:
        if any(is_remote(p) or codec_of(p) is not None for p in files):
            return True
        size = input_bytes(files)
        if size > ENDS_SCAN_BYTES:
            return True
        return search_text(files, _MAY_END, size, whole=ENDS_SCAN_BYTES) is not None
    except (OSError, SourceError):  # (the read itself says what is wrong with a file)
        return True


def _at_commit_lsn(changes: DataFrame, ends: DataFrame | None) -> DataFrame:
    """``changes`` with each data event of a transaction with metadata at the commit LSN
    of its END record (``ends``: ``txn``, ``commit_lsn``) as ``pos_hi``; ``ends`` None:
    there is no END record, so no such event has a commit LSN (null, as the join gives)."""
    is_data = F.col("op").isin(*DATA_OPS)
    if ends is None:  # (no join: no broadcast job of an empty list)
        joined, lsn = changes, F.lit(None).cast(changes.schema["pos_hi"].dataType)
    else:
        joined = changes.join(F.broadcast(ends.select("txn", "commit_lsn")), "txn", "left")
        lsn = F.col("commit_lsn")
    at_commit = F.when(F.col("tx_meta") & is_data, lsn).otherwise(F.col("pos_hi"))
    return joined.select(
        *[at_commit.alias(c) if c == "pos_hi" else F.col(c) for c in changes.columns]
    )


def assemble(
    changes: DataFrame,
    pos: Sequence[int],
    *,
    snapshot_lsn: int | None = None,
    snapshot_txn: str | None = None,
    new_feed: bool = False,
    logger: logging.Logger | None = None,
    feed: str = "",
    bucket: Column | None = None,
    also: DataFrame | None = None,
    hold_at: tuple[int, int] | None = None,
    hold_txns: frozenset[str] = frozenset(),
    distinct: bool = False,
    ends: bool = True,
) -> Assembled:
    """Decide which of ``changes`` (good Debezium rows: data events and END records) can
    become updates, given the committed position ``pos``. See the module docstring.
    ``snapshot_lsn`` is the feed's own snapshot (``snapshot_txn`` its transaction, when
    recorded); on a ``new_feed`` (none decided yet) the first snapshot delivered is its
    own. A snapshot is its transaction: rows of one at several LSNs are moved to one
    (:func:`~feed.sources.snapshots.one_lsn_each`), and the figures taken again. Rows
    whose ``_snap`` is ``last`` may come from other tables (op ``x``): they only say where
    a snapshot ends.

    One Spark job computes the figures over all events; a small one lists the snapshots
    when snapshot rows were read; and only where metadata, a repeated event or a new
    snapshot needs them another computes those per source transaction.
    The caller's own figures ride along with the first:
    ``bucket`` (an int column over the data events; its distinct values come back as
    ``buckets``) and ``also`` (a small aggregate of its own, collected as ``also``).
    ``hold_at`` (``ord_file``, ``ord_row``) holds back every source transaction
    delivered from that place on, as an incomplete one does (a table that changed shape
    there: feed/sources/shapes.py); ``hold_txns`` holds those source transactions (and what is
    delivered after them) too (held in another feed of a group: feed/emit/group.py).
    ``distinct``: the caller has shown that no two data events share a position
    (feed/sources/columnar.py), so none is there twice and the first job does not look;
    ``ends`` False: the caller counted no END record among ``changes``, so no list of
    them is cached and joined."""
    run = _Assembly(changes, pos, (snapshot_lsn, snapshot_txn), logger, feed)
    run.distinct, run.no_ends = distinct, not ends
    run.first_job(bucket, also)
    moves = run.find_snapshots(new_feed)
    if moves:
        run.move_snapshot_rows(moves)
        run.first_job(bucket, also)
        run.find_snapshots(new_feed)
    if not (run.summary["meta"] or run.n_ends or run.repeats or run.fresh or hold_at or hold_txns):
        return run.plain()
    # Otherwise the figures per source transaction decide: a second job.
    run.per_transaction()
    if run.fresh:
        run.new_snapshot()
    if run.opened or run.held_from is not None or run.dropped or hold_at is not None or hold_txns:
        run.hold(hold_at, hold_txns)
    return run.result()


class _Assembly(SecondPass):
    """The steps of :func:`assemble`, and what each leaves for the next (the per-transaction
    ones in :class:`~feed.sources.holdback.SecondPass`)."""

    def __init__(
        self,
        changes: DataFrame,
        pos: Sequence[int],
        own: tuple[int | None, str | None],
        logger: logging.Logger | None,
        feed: str,
    ) -> None:
        self.changes, self.feed = changes, feed
        self.snapshot_lsn, self.snapshot_txn = own
        self.log = logger or logging.getLogger("tidefeed.emit")
        self.committed = committed_position(pos)
        self.dropped: set[str] = set()  # superseded by a new snapshot
        self.held_from: tuple[int, int] | None = None  # hold what is delivered from here on
        self.replaces: tuple[int, str] | None = None
        self.empty_at: tuple[int, int] | None = None  # where a new snapshot without rows is
        self.held_txns: set[str] = set()
        self.held_files: set[str] = set()
        self.held_at: tuple[int, int] | None = None
        self.persisted: tuple[DataFrame, ...] = ()
        self.distinct = False  # no two data events at one position: none is repeated
        self.no_ends = False  # no END record among the changes

    def first_job(self, bucket: Column | None, also: DataFrame | None) -> None:
        """Figures over every event, none per source transaction (grouping 1 M
        transactions costs seconds), whether any event is there twice, and the caller's
        figures. Each part is a scan of the cached input: the counts share one."""
        changes, committed = self.changes, self.committed
        ends = (
            changes.where(F.col("op") == "E")
            .groupBy("txn")
            .agg(
                F.max("pos_hi").alias("commit_lsn"),
                F.max("tx_count").alias("expected"),
            )
        )
        # (none: an empty list, which Spark plans without a job)
        self.ends = ends.limit(0) if self.no_ends else cached(ends)
        is_data = F.col("op").isin(*DATA_OPS)
        # every row with its commit LSN: the figures below are over all of them in one scan
        joined = _at_commit_lsn(changes, None if self.no_ends else self.ends)
        keep, behind = position_filter(committed, self.snapshot_lsn)
        dup = F.when(F.col("op") == "r", F.to_json("after")).otherwise(F.lit(""))
        self.flagged = flagged = joined.where(is_data).withColumn("_keep", keep)
        self.flagged = flagged = flagged.withColumn("_dup", dup)
        self.bad = flagged.where(behind).select(
            "_file", "_raw", F.lit(NEW_SNAPSHOT).alias("_error")
        )
        kept = is_data & keep
        delivered = F.struct("ord_file", "ord_row")  # the place in delivery order
        parts: list[DataFrame] = [
            joined.agg(
                F.count(F.when(is_data, 1)).alias("total"),
                F.count(F.when(kept, 1)).alias("kept_rows"),
                F.max(F.when(is_data, F.col("tx_meta"))).alias("meta"),
                F.max(F.when(kept, F.struct("pos_hi", "pos_lo", "pos_n"))).alias("last"),
                F.max(F.when(is_data, delivered)).alias("latest"),
                F.count(F.when(is_data & behind, 1)).alias("behind"),
                F.count(F.when(F.col("op") == "E", 1)).alias("ends"),
                F.count(F.when(snapshot_row(), 1)).alias("snapshot_rows"),
            ).withColumn("_kind", F.lit("summary"))
        ]
        if not self.distinct:
            # an event read twice: its rows share the hash of what makes it one event (see
            # EVENT). Two different events with one hash (about one in 10^7 reads of 2 M
            # events) only send the read down the exact path below, which drops repeats by
            # the event itself; a long key is cheaper to group than the event's columns.
            parts.append(
                flagged.where(F.col("_keep"))
                .groupBy(F.xxhash64(*EVENT).alias("h"))
                .agg(F.count(F.lit(1)).alias("copies"))
                .where(F.col("copies") > 1)
                .limit(1)
                .select("copies", F.lit("repeat").alias("_kind"))
            )
        if bucket is not None:
            parts.append(
                flagged.select(bucket.alias("bucket"))
                .distinct()
                .withColumn("_kind", F.lit("bucket"))
            )
        if also is not None:
            parts.append(also.withColumn("_kind", F.lit("also")))
        figures = parts[0]
        for part in parts[1:]:
            figures = figures.unionByName(part, allowMissingColumns=True)
        collected = figures.collect()
        self.summary = next(r for r in collected if r["_kind"] == "summary")
        self.n_ends = self.summary["ends"]
        self.repeats = any(r["_kind"] == "repeat" for r in collected)
        self.buckets = (
            frozenset(r["bucket"] for r in collected if r["_kind"] == "bucket")
            if bucket is not None
            else None
        )
        self.extra = tuple(r for r in collected if r["_kind"] == "also")
        self.last = self.summary["last"]
        self.latest = self.summary["latest"]

    def find_snapshots(self, new_feed: bool) -> dict[str, tuple[int, list[int]]]:
        """The snapshots read, if any (a second, small job): which is the feed's own, which
        are new, which are known whole (feed/sources/snapshots.py decides); or, first, the
        snapshot transactions whose rows are to move to one LSN."""
        rows = snapshot_figures(self.changes).collect() if self.summary["snapshot_rows"] else []
        moves = one_lsn_each(rows, own_txn=self.snapshot_txn, own_lsn=self.snapshot_lsn)
        if moves:
            return moves
        found = classify(
            rows,
            own=self.snapshot_lsn,
            new_feed=new_feed,
            committed_hi=self.committed[0],
            latest=self.latest,
        )
        self.snaps, self.fresh, self.whole = found.all, found.fresh, found.whole
        return {}

    def move_snapshot_rows(self, moves: dict[str, tuple[int, list[int]]]) -> None:
        """Put the snapshot rows of each transaction in ``moves`` at its snapshot's LSN
        (:func:`~feed.sources.snapshots.moved_reads`), saying so, before the figures are
        taken again."""
        say_moved(self.log, self.feed, moves)
        self.ends.unpersist()
        hi, lo = moved_reads(moves)
        moved = {"pos_hi": hi, "pos_lo": lo}
        self.distinct = False  # (the positions shown distinct were those read)
        self.changes = self.changes.select(
            *[moved[c].alias(c) if c in moved else F.col(c) for c in self.changes.columns]
        )

    def plain(self) -> Assembled:
        """The plain case (no transaction metadata, nothing delivered twice, no new
        snapshot): every source transaction is complete as read and released whole, in
        one pass over the cached input; no figure per transaction is needed."""
        summary = self.summary
        return Assembled(
            changes=self.flagged.where(F.col("_keep")).select(*self.changes.columns),
            held_files=frozenset(),
            ready=None,
            held=0,
            position=snapshot_done(self.last, self.whole),
            redelivered=(summary["total"] or 0) - (summary["kept_rows"] or 0),
            bad=self.bad,
            bad_rows=summary["behind"] or 0,
            cached=(self.ends,),
            buckets=self.buckets,
            also=self.extra,
            snapshot_rows=summary["snapshot_rows"],
        )

    def result(self) -> Assembled:
        order: DataFrame | None = None  # (assign_units finds it from the changes)
        if self.replaces is not None and self.empty_at is not None:
            # the table was empty in the new snapshot: its time holds only retractions, in
            # a transaction without rows placed in the source order
            lsn = self.replaces[0]
            empty = empty_snapshot(self.changes.sparkSession, self.replaces, self.empty_at)
            order = source_order(self.data).unionByName(empty)
            self.ready = (self.ready or 0) + 1
            mark = (lsn, lsn, 0)
            self.last = mark if self.last is None or tuple(self.last) < mark else self.last
        summary = self.summary
        # transaction blocks and not one END record among them: where are the END records?
        endless = 0 if self.n_ends else sum(1 for r in self.opened if r["expected"] is None)
        return Assembled(
            changes=self.data.select(*self.changes.columns),
            held_files=frozenset(self.held_files),
            ready=self.ready,
            held=len(self.held_txns),
            position=snapshot_done(self.last, self.whole),
            order=order,
            redelivered=(summary["total"] or 0) - (self.counted["kept"] or 0),
            bad=self.bad,
            bad_rows=summary["behind"] or 0,
            cached=(self.ends, *self.persisted, self.per_txn),
            buckets=self.buckets,
            also=self.extra,
            replaces=self.replaces,
            snapshot_rows=summary["snapshot_rows"],
            endless=endless,
            held_txns=frozenset(self.held_txns),
            held_at=self.held_at,
        )
