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
from collections.abc import Sequence
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, Row
from pyspark.sql import functions as F

from feed.sources.positions import (
    NEW_SNAPSHOT,
    Position,
    committed_position,
    first_from,
    place,
    position_filter,
    snapshot_done,
    snapshot_read,
    source_order,
    unplace,
)

__all__ = ["Assembled", "assemble"]

DATA_OPS = ("c", "u", "d", "r")
#: what one event is: the rows of a repeated (redelivered) event agree on all of it
#: (``_dup``: a snapshot read's row, as its reads share a position)
EVENT = ["txn", "pos_lo", "pos_n", "op", "_dup"]


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


def _snapshot_row() -> Column:
    """Whether a row is a read of a whole-table snapshot, or says where a snapshot ends
    (of any table: another table's last read says the feed's table had no more rows)."""
    return snapshot_read() | (F.coalesce(F.col("_snap"), F.lit("")) == "last")


def _snapshot_figures(changes: DataFrame) -> DataFrame:
    """One row per snapshot LSN among ``changes``: its first and last place in delivery
    order, whether its end was read (``s_end``) and its transaction (``s_txn``: null when
    only another table's end marker is at that LSN)."""
    snap = F.coalesce(F.col("_snap"), F.lit(""))
    ends_here = (snap == "last") | ((F.col("op") == "r") & (snap == "last_in_data_collection"))
    at = F.struct("ord_file", "ord_row")
    return (
        changes.where(_snapshot_row())
        .groupBy(F.col("pos_lo").alias("lsn"))
        .agg(
            F.min(at).alias("s_first"),
            F.max(F.when(F.col("op") == "r", at)).alias("s_last"),
            F.max(ends_here).alias("s_end"),
            F.max(F.when(F.col("op") == "r", F.col("txn"))).alias("s_txn"),
            F.collect_set("_file").alias("s_files"),
        )
    )


def assemble(
    changes: DataFrame,
    pos: Sequence[int],
    *,
    snapshot_lsn: int | None = None,
    new_feed: bool = False,
    logger: logging.Logger | None = None,
    feed: str = "",
    bucket: Column | None = None,
    also: DataFrame | None = None,
    hold_at: tuple[int, int] | None = None,
    hold_txns: frozenset[str] = frozenset(),
) -> Assembled:
    """Decide which of ``changes`` (good Debezium rows: data events and END records) can
    become updates, given the committed position ``pos``. See the module docstring.
    ``snapshot_lsn`` is the feed's own snapshot; on a ``new_feed`` (none decided yet) the
    first snapshot delivered is its own. Rows whose ``_snap`` is ``last`` may come from
    other tables (op ``x``): they only say where a snapshot ends.

    One Spark job computes the figures over all events; a small one lists the snapshots
    when snapshot rows were read; and only where metadata, a repeated event or a new
    snapshot needs them another computes those per source transaction.
    The caller's own figures ride along with the first:
    ``bucket`` (an int column over the data events; its distinct values come back as
    ``buckets``) and ``also`` (a small aggregate of its own, collected as ``also``).
    ``hold_at`` (``ord_file``, ``ord_row``) holds back every source transaction
    delivered from that place on, as an incomplete one does (a table that changed shape
    there: feed/sources/shapes.py); ``hold_txns`` holds those source transactions (and what is
    delivered after them) too (held in another feed of a group: feed/emit/group.py)."""
    log = logger or logging.getLogger("tidefeed.emit")
    committed = committed_position(pos)
    ends = (
        changes.where(F.col("op") == "E")
        .groupBy("txn")
        .agg(
            F.max("pos_hi").alias("commit_lsn"),
            F.max("tx_count").alias("expected"),
        )
        .persist()
    )
    is_data = F.col("op").isin(*DATA_OPS)
    # every row with its commit LSN: the figures below are over all of them in one scan
    joined = changes.join(F.broadcast(ends.select("txn", "commit_lsn")), "txn", "left").select(
        *[
            F.when(F.col("tx_meta") & is_data, F.col("commit_lsn"))
            .otherwise(F.col("pos_hi"))
            .alias(c)
            if c == "pos_hi"
            else F.col(c)
            for c in changes.columns
        ]
    )
    keep, behind = position_filter(committed, snapshot_lsn)
    dup = F.when(F.col("op") == "r", F.to_json("after")).otherwise(F.lit(""))
    flagged = joined.where(is_data).withColumn("_keep", keep).withColumn("_dup", dup)
    bad = flagged.where(behind).select("_file", "_raw", F.lit(NEW_SNAPSHOT).alias("_error"))
    kept_only = F.col("_keep")
    kept = is_data & keep
    delivered = F.struct("ord_file", "ord_row")  # the place in delivery order
    # The first job: figures over every event, none per source transaction (grouping 1 M
    # transactions costs seconds), whether any event is there twice, and the caller's
    # figures. Each part is a scan of the cached input: the counts share one.
    parts = [
        joined.agg(
            F.count(F.when(is_data, 1)).alias("total"),
            F.count(F.when(kept, 1)).alias("kept_rows"),
            F.max(F.when(is_data, F.col("tx_meta"))).alias("meta"),
            F.max(F.when(kept, F.struct("pos_hi", "pos_lo", "pos_n"))).alias("last"),
            F.max(F.when(is_data, delivered)).alias("latest"),
            F.count(F.when(is_data & behind, 1)).alias("behind"),
            F.count(F.when(F.col("op") == "E", 1)).alias("ends"),
            F.count(F.when(_snapshot_row(), 1)).alias("snapshot_rows"),
        ).withColumn("_kind", F.lit("summary")),
        # an event read twice: its rows share the hash of what makes it one event (see
        # EVENT). Two different events with one hash (about one in 10^7 reads of 2 M
        # events) only send the read down the exact path below, which drops repeats by
        # the event itself; a long key is cheaper to group than the event's columns.
        flagged.where(kept_only)
        .groupBy(F.xxhash64(*EVENT).alias("h"))
        .agg(F.count(F.lit(1)).alias("copies"))
        .where(F.col("copies") > 1)
        .limit(1)
        .select("copies", F.lit("repeat").alias("_kind")),
    ]
    if bucket is not None:
        parts.append(
            flagged.select(bucket.alias("bucket")).distinct().withColumn("_kind", F.lit("bucket"))
        )
    if also is not None:
        parts.append(also.withColumn("_kind", F.lit("also")))
    figures = parts[0]
    for part in parts[1:]:
        figures = figures.unionByName(part, allowMissingColumns=True)
    collected = figures.collect()
    summary = next(r for r in collected if r["_kind"] == "summary")
    n_ends = summary["ends"]
    repeats = any(r["_kind"] == "repeat" for r in collected)
    buckets = (
        frozenset(r["bucket"] for r in collected if r["_kind"] == "bucket")
        if bucket is not None
        else None
    )
    extra = tuple(r for r in collected if r["_kind"] == "also")
    # the snapshots read, if any (a second, small job)
    snap_rows = _snapshot_figures(changes).collect() if summary["snapshot_rows"] else []
    snaps = sorted(
        (r for r in snap_rows if r["s_first"] is not None),
        key=lambda r: tuple(r["s_first"]),
    )
    own = (snaps[0]["lsn"] if snaps else None) if new_feed else snapshot_lsn
    # (a new snapshot with only another table's end marker: the feed's table was empty)
    fresh = [r for r in snaps if r["lsn"] != own and r["lsn"] > committed[0]]
    last = summary["last"]
    latest = summary["latest"]
    # snapshots known to be whole: their end marker was read, or an event delivered after
    # their last read (Debezium streams only once a snapshot is done)
    whole = {
        int(r["lsn"])
        for r in snaps
        if r["s_end"] or (latest is not None and tuple(latest) > tuple(r["s_last"] or r["s_first"]))
    }
    if not (summary["meta"] or n_ends or repeats or fresh or hold_at or hold_txns):
        # The plain case (no transaction metadata, nothing delivered twice, no new
        # snapshot): every source transaction is complete as read and released whole, in
        # one pass over the cached input; no figure per transaction is needed.
        return Assembled(
            changes=flagged.where(kept_only).select(*changes.columns),
            held_files=frozenset(),
            ready=None,
            held=0,
            position=snapshot_done(last, whole),
            redelivered=(summary["total"] or 0) - (summary["kept_rows"] or 0),
            bad=bad,
            bad_rows=summary["behind"] or 0,
            cached=(ends,),
            buckets=buckets,
            also=extra,
            snapshot_rows=summary["snapshot_rows"],
        )
    # Otherwise the figures per source transaction decide: a second job.
    # (Without repeats an event's rows are its distinct events: no count_distinct, whose
    # sort is the costliest part of this job.)
    events_col = (
        F.count_distinct(F.when(kept_only, F.struct(*EVENT[1:])))
        if repeats
        else F.count(F.when(kept_only, 1))
    )
    # (every aggregate here is a number: Spark keeps them in a hash table, where a struct
    # would make it sort every row by transaction)
    per_txn = (
        flagged.groupBy("txn")
        .agg(
            events_col.alias("events"),
            F.max("tx_meta").alias("meta"),
            F.min(F.when(kept_only, place())).alias("first_at"),
            F.max(F.when(kept_only, F.col("pos_hi"))).alias("last_hi"),
        )
        # a transaction redelivered whole after it was turned into updates: its events
        # are filtered out and its END is done with
        .join(ends.where(F.col("commit_lsn") > committed[0]), "txn", "full")
        .persist()
    )
    events = F.coalesce(F.col("events"), F.lit(0))
    with_meta = F.coalesce(F.col("meta"), F.lit(False)) | F.col("expected").isNotNull()
    # (a transaction whose every event read was turned into updates before, read again
    # with a file held back for another one, waits for nothing)
    incomplete = with_meta & (
        (F.col("expected").isNull() & (events > 0)) | (events < F.col("expected"))
    )
    too_many = with_meta & (events > F.col("expected"))
    # nothing per source transaction comes to the driver but the incomplete ones (the tail
    # of the input, at most) and a summary row
    txn_figures = per_txn.agg(
        F.sum(events).alias("kept"),
        F.count(F.when(events > 0, 1)).alias("ready"),
    ).withColumn("_kind", F.lit("summary"))
    txn_figures = txn_figures.unionByName(
        per_txn.where(incomplete | too_many)
        .select("txn", events.alias("events"), "expected", "first_at", incomplete.alias("open"))
        .withColumn("_kind", F.lit("txn")),
        allowMissingColumns=True,
    )
    collected = txn_figures.collect()
    counted = next(r for r in collected if r["_kind"] == "summary")
    odd = [
        {**r.asDict(), "first": unplace(r["first_at"])} for r in collected if r["_kind"] == "txn"
    ]
    for r in odd:
        if r["expected"] is not None and r["events"] > r["expected"]:
            log.warning(
                "feed %s: source transaction %s has %d events, its END record counts %d",
                feed,
                r["txn"],
                r["events"],
                r["expected"],
            )
    data = flagged.where(kept_only)
    if repeats:
        # an event delivered more than once (Kafka's at-least-once): keep one of each.
        # Without repeats (the first job says so) the sort this takes is skipped.
        data = data.dropDuplicates(EVENT)
    data = data.drop("_keep", "_dup")
    # Kept where repeats were dropped, so later scans do not shuffle again. Otherwise each
    # later scan reads the cached input again, which costs less than caching it twice.
    persisted: tuple[DataFrame, ...] = ()
    if repeats:
        data = data.persist()
        persisted = (data,)
    ready = counted["ready"]
    opened = [r for r in odd if r["open"]]
    dropped: set[str] = set()  # superseded by a new snapshot
    held_from: tuple[int, int] | None = None  # hold what is delivered from here on
    replaces: tuple[int, str] | None = None
    empty_at: tuple[int, int] | None = None  # where a new snapshot without rows is
    if fresh:
        snap = fresh[0]
        at = tuple(snap["s_first"])
        dropped = {r["txn"] for r in opened if r["first"] is not None and r["first"] < at}
        dropped |= {
            r["s_txn"] for r in snaps if tuple(r["s_first"]) < at and not r["s_end"] and r["s_txn"]
        }
        opened = [r for r in opened if r["txn"] not in dropped]
        before = ~first_from(at)
        earlier = per_txn.where((events > 0) & before)
        if dropped:
            earlier = earlier.where(~F.col("txn").isin(sorted(dropped)))
        end_at = tuple(snap["s_last"] or snap["s_first"])
        ended = snap["s_end"] or (latest is not None and tuple(latest) > end_at)
        if not earlier.isEmpty():
            held_from = at  # what came before it goes first
        elif ended:
            lsn = int(snap["lsn"])
            replaces = (lsn, snap["s_txn"] or f"snapshot:{lsn}")
            if snap["s_txn"] is None:
                empty_at = at
            if len(fresh) > 1:
                held_from = tuple(fresh[1]["s_first"])  # one new snapshot at a time
            # delivered after it but committed before it (Debezium streaming again from
            # an older slot position): the snapshot holds their effect
            older = per_txn.where((events > 0) & ~before & (F.col("last_hi") < lsn))
            dropped |= {r["txn"] for r in older.select("txn").collect()}
            log.warning(
                "feed %s: Debezium snapshotted the table again (at LSN %d): the feed moves "
                "to that snapshot in one time, retracting the rows it does not hold",
                feed,
                snap["lsn"],
            )
        else:
            held_from = at
            log.info("feed %s: a new snapshot (LSN %d) is not complete yet", feed, snap["lsn"])
        if dropped:
            log.warning(
                "feed %s: %d source transaction(s) dropped: delivered in part before the new "
                "snapshot (never to be delivered whole again), or committed before it; the "
                "snapshot holds their effect",
                feed,
                len(dropped),
            )
    # transaction blocks and not one END record among them: where are the END records?
    endless = 0 if n_ends else sum(1 for r in opened if r["expected"] is None)
    held_txns: set[str] = set()
    held_files: set[str] = set()
    held_at: tuple[int, int] | None = None
    ready_txns = per_txn.where(events > 0)
    if opened or held_from is not None or dropped or hold_at is not None or hold_txns:
        # the first incomplete transaction in delivery order holds back every transaction
        # delivered after it (few: the tail of what was read)
        held = F.lit(False)
        if opened or hold_txns:
            held = F.col("txn").isin(sorted({r["txn"] for r in opened} | set(hold_txns)))
        starts = [r["first"] for r in opened if r["first"] is not None]
        if held_from is not None:
            starts.append(held_from)
        if hold_at is not None:
            starts.append(hold_at)
        if hold_txns:  # held elsewhere in the group: held from their first event here on
            m = per_txn.where(F.col("txn").isin(sorted(hold_txns))).agg(F.min("first_at"))
            first_held = unplace(m.collect()[0][0])
            if first_held is not None:
                starts.append(first_held)
        if starts:
            held = held | first_from(min(starts))
        if dropped:
            held = held & ~F.col("txn").isin(sorted(dropped))
        held = F.coalesce(held, F.lit(False))
        held_rows = per_txn.where(held).select("txn", "first_at").collect()
        held_txns = {r["txn"] for r in held_rows}
        firsts = [p for r in held_rows if (p := unplace(r["first_at"])) is not None]
        if hold_at is not None:
            firsts.append((hold_at[0], hold_at[1]))
        held_at = min(firsts) if firsts else None
        if held_txns:
            # the files holding their events and END records (asked for only here: a set
            # of files per source transaction would cost every read a second or more)
            theirs = changes.where(
                F.col("op").isin(*DATA_OPS, "E") & F.col("txn").isin(sorted(held_txns))
            )
            held_files.update(r["_file"] for r in theirs.select("_file").distinct().collect())
        if held_from is not None:  # a held snapshot's files, its end marker's too
            for sn in snaps:
                if tuple(sn["s_first"]) >= held_from:
                    held_files.update(sn["s_files"] or ())
        ready_txns = ready_txns.where(~held)
        if dropped:
            ready_txns = ready_txns.where(~F.col("txn").isin(sorted(dropped)))
        ready = ready_txns.count()
        spark = changes.sparkSession
        out = spark.createDataFrame([(t,) for t in held_txns | dropped], "txn string")
        data = data.join(F.broadcast(out), "txn", "left_anti")
        # the highest position released (a scan, no shuffle)
        last = data.agg(F.max(F.struct("pos_hi", "pos_lo", "pos_n")).alias("m")).collect()[0]["m"]
        if held_txns:
            log.info(
                "feed %s: %d source transaction(s) incomplete or behind an incomplete one "
                "or a new snapshot: held back until the rest arrives",
                feed,
                len(held_txns),
            )
    order: DataFrame | None = None  # (assign_units finds it from the changes)
    if replaces is not None and empty_at is not None:
        # the table was empty in the new snapshot: its time holds only retractions
        lsn, (f, row) = replaces[0], empty_at
        at_snap = F.struct(
            *[
                F.lit(v).cast("long").alias(n)
                for n, v in (
                    ("pos_hi", lsn),
                    ("pos_lo", lsn),
                    ("pos_n", 0),
                    ("ord_file", f),
                    ("ord_row", row),
                )
            ]
        )
        empty = changes.sparkSession.range(1).select(
            F.lit(replaces[1]).alias("txn"), at_snap.alias("o")
        )
        order = source_order(data).unionByName(empty)
        ready = (ready or 0) + 1
        mark = (lsn, lsn, 0)
        last = mark if last is None or tuple(last) < mark else last
    return Assembled(
        changes=data.select(*changes.columns),
        held_files=frozenset(held_files),
        ready=ready,
        held=len(held_txns),
        position=snapshot_done(last, whole),
        order=order,
        redelivered=(summary["total"] or 0) - (counted["kept"] or 0),
        bad=bad,
        bad_rows=summary["behind"] or 0,
        cached=(ends, *persisted, per_txn),
        buckets=buckets,
        also=extra,
        replaces=replaces,
        snapshot_rows=summary["snapshot_rows"],
        endless=endless,
        held_txns=frozenset(held_txns),
        held_at=held_at,
    )
