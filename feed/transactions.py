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
  read first.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, Row
from pyspark.sql import functions as F

__all__ = ["Assembled", "Position", "assemble", "order_column"]

Position = tuple[int, int, int]
DATA_OPS = ("c", "u", "d", "r")


def order_column() -> Column:
    """The order of changes inside what one emitter transaction read: source position
    first, delivery order to break ties (and for sources without positions)."""
    return F.struct("pos_hi", "pos_lo", "pos_n", "ord_file", "ord_row")


@dataclass(frozen=True, slots=True)
class Assembled:
    """What :func:`assemble` decided for one emitter transaction's read."""

    changes: DataFrame  # the events to turn into updates now (END records removed)
    held_files: frozenset[str]  # input files that must be read again
    ready: int  # source transactions released
    held: int  # source transactions held back
    redelivered: int  # events dropped as already done or repeated
    bad: DataFrame  # snapshot reads of a new snapshot behind the committed position
    position: Position | None = None  # the highest position among ``changes``
    #: the released transactions (``txn``) and their source order (``o``), for
    #: :func:`feed.diffs.assign_units`
    order: DataFrame | None = None
    cached: tuple[DataFrame, ...] = ()  # persisted here: unpersist after the commit
    #: the distinct values of ``assemble(bucket=...)`` over every data event read (None
    #: when no bucket column was given)
    buckets: frozenset[int] | None = None
    #: the rows of ``assemble(also=...)``, collected by the same job
    also: tuple[Row, ...] = ()


def _position_filter(pos: Position, snapshot_lsn: int | None) -> tuple[Column, Column]:
    """Whether an event comes after ``pos`` (to keep), and whether it is a read of a *new*
    snapshot arriving behind it (bad: see :data:`NEW_SNAPSHOT`)."""
    hi, lo, n = pos
    hi_c, lo_c, n_c = F.col("pos_hi"), F.col("pos_lo"), F.col("pos_n")
    after = (hi_c > hi) | ((hi_c == hi) & (lo_c > lo)) | ((hi_c == hi) & (lo_c == lo) & (n_c > n))
    is_read = F.col("op") == "r"
    same_snapshot = is_read & (hi_c == hi) & (lo_c == lo)
    # an event of a transaction whose END has not been read has no commit position yet
    keep = hi_c.isNull() | after | same_snapshot
    behind = ~keep & is_read
    if snapshot_lsn is not None:
        behind = behind & (lo_c != snapshot_lsn)  # the feed's own snapshot, redelivered
    return keep, behind


#: why a snapshot read behind the committed position is quarantined
NEW_SNAPSHOT = (
    "a new snapshot of the table arrived after the feed's own (Debezium snapshotted again: "
    "offsets lost, snapshot.mode=always, or an incremental snapshot); a snapshot cannot say "
    "which rows went, so it is not applied: start a new feed from it"
)


def assemble(
    changes: DataFrame,
    pos: Sequence[int],
    *,
    snapshot_lsn: int | None = None,
    logger: logging.Logger | None = None,
    feed: str = "",
    bucket: Column | None = None,
    also: DataFrame | None = None,
) -> Assembled:
    """Decide which of ``changes`` (good Debezium rows: data events and END records) can
    become updates, given the committed position ``pos``. See the module docstring.

    One Spark job computes every figure; the caller's own figures ride along with it:
    ``bucket`` (an int column over the data events; its distinct values come back as
    ``buckets``) and ``also`` (a small aggregate of its own, collected as ``also``)."""
    log = logger or logging.getLogger("tidefeed.emit")
    committed: Position = (int(pos[0]), int(pos[1]), int(pos[2]) if len(pos) > 2 else 1 << 62)
    ends = (
        changes.where(F.col("op") == "E")
        .groupBy("txn")
        .agg(
            F.max("pos_hi").alias("commit_lsn"),
            F.max("tx_count").alias("expected"),
            F.collect_set("_file").alias("end_files"),
        )
        .persist()
    )
    data = changes.where(F.col("op").isin(*DATA_OPS))
    data = data.join(F.broadcast(ends.select("txn", "commit_lsn")), "txn", "left").select(
        *[
            F.when(F.col("tx_meta"), F.col("commit_lsn")).otherwise(F.col("pos_hi")).alias(c)
            if c == "pos_hi"
            else F.col(c)
            for c in changes.columns
        ]
    )
    keep, behind = _position_filter(committed, snapshot_lsn)
    dup = F.when(F.col("op") == "r", F.to_json("after")).otherwise(F.lit(""))
    flagged = data.withColumn("_keep", keep).withColumn("_dup", dup)
    bad = flagged.where(behind).select("_file", "_raw", F.lit(NEW_SNAPSHOT).alias("_error"))
    kept_only = F.col("_keep")
    per_txn = (
        flagged.groupBy("txn")
        .agg(
            F.count(F.lit(1)).alias("total"),
            F.count_distinct(F.when(kept_only, F.struct("pos_lo", "pos_n", "op", "_dup"))).alias(
                "events"
            ),
            F.max("tx_meta").alias("meta"),
            F.min(F.when(kept_only, F.struct("ord_file", "ord_row"))).alias("first"),
            F.max(F.when(kept_only, F.struct("pos_hi", "pos_lo", "pos_n"))).alias("last"),
            F.min(F.when(kept_only, order_column())).alias("order"),
            F.collect_set("_file").alias("files"),
        )
        # a transaction redelivered whole after it was turned into updates: its events
        # are filtered out and its END is done with
        .join(ends.where(F.col("commit_lsn") > committed[0]), "txn", "full")
        .persist()
    )
    events = F.coalesce(F.col("events"), F.lit(0))
    with_meta = F.coalesce(F.col("meta"), F.lit(False)) | F.col("expected").isNotNull()
    incomplete = with_meta & (F.col("expected").isNull() | (events < F.col("expected")))
    too_many = with_meta & (events > F.col("expected"))
    # One job for every figure, and nothing per source transaction comes to the driver
    # but the incomplete ones (the tail of the input, at most): a summary row, the
    # distinct state buckets, the incomplete transactions and the caller's aggregate.
    parts = [
        per_txn.agg(
            F.sum("total").alias("total"),
            F.sum(events).alias("kept"),
            F.count(F.when(events > 0, 1)).alias("ready"),
            F.max(F.when(events > 0, F.col("last"))).alias("last"),
        ).withColumn("_kind", F.lit("summary")),
        per_txn.where(incomplete | too_many)
        .select("txn", events.alias("events"), "expected", "first", incomplete.alias("open"))
        .withColumn("_kind", F.lit("txn")),
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
    odd = [r for r in collected if r["_kind"] == "txn"]
    buckets = (
        frozenset(r["bucket"] for r in collected if r["_kind"] == "bucket")
        if bucket is not None
        else None
    )
    for r in odd:
        if r["expected"] is not None and r["events"] > r["expected"]:
            log.warning(
                "feed %s: source transaction %s has %d events, its END record counts %d",
                feed,
                r["txn"],
                r["events"],
                r["expected"],
            )
    data = (
        flagged.where(kept_only)
        .dropDuplicates(["txn", "pos_lo", "pos_n", "op", "_dup"])
        .drop("_keep", "_dup")
    )
    data = persisted = data.persist()
    ready, last = summary["ready"], summary["last"]
    held_txns: set[str] = set()
    held_files: set[str] = set()
    ready_txns = per_txn.where(events > 0)
    opened = [r for r in odd if r["open"]]
    if opened:
        # the first incomplete transaction in delivery order holds back every transaction
        # delivered after it (few: the tail of what was read)
        held = F.col("txn").isin([r["txn"] for r in opened])
        starts = [tuple(r["first"]) for r in opened if r["first"] is not None]
        if starts:
            f, row = min(starts)
            first_f, first_r = F.col("first.ord_file"), F.col("first.ord_row")
            held = held | (first_f > f) | ((first_f == f) & (first_r >= row))
        held = F.coalesce(held, F.lit(False))
        for r in per_txn.where(held).select("txn", "files", "end_files").collect():
            held_txns.add(r["txn"])
            held_files.update(r["files"] or ())
            held_files.update(r["end_files"] or ())
        ready_txns = ready_txns.where(~held)
        again = ready_txns.agg(F.count(F.lit(1)).alias("n"), F.max("last").alias("m"))
        ready, last = again.collect()[0]
        spark = changes.sparkSession
        held_df = spark.createDataFrame([(t,) for t in held_txns], "txn string")
        data = data.join(F.broadcast(held_df), "txn", "left_anti")
        log.info(
            "feed %s: %d source transaction(s) incomplete or behind an incomplete one: "
            "held back until the rest arrives",
            feed,
            len(held_txns),
        )
    return Assembled(
        changes=data.select(*changes.columns),
        held_files=frozenset(held_files),
        ready=ready,
        held=len(held_txns),
        position=tuple(last) if last is not None else None,
        order=ready_txns.select("txn", F.col("order").alias("o")),
        redelivered=(summary["total"] or 0) - (summary["kept"] or 0),
        bad=bad,
        cached=(ends, persisted, per_txn),
        buckets=buckets,
        also=tuple(r for r in collected if r["_kind"] == "also"),
    )
