"""The second pass of :func:`feed.sources.transactions.assemble`, taken only where
transaction metadata, a repeated event, a new snapshot or a hold asks for it: the figures
per source transaction, what a new snapshot replaces and supersedes, and which source
transactions (and files) are held back."""

from __future__ import annotations

import logging
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from feed.sources.cached import cached
from feed.sources.positions import DATA_OPS, EVENT, first_from, place, unplace
from feed.sources.snapshots import settle, superseded

__all__ = ["SecondPass"]


class SecondPass:
    """The per-transaction steps of the assembly (a mixin of
    ``feed.sources.transactions._Assembly``, whose first pass sets what it names below)."""

    changes: DataFrame
    flagged: DataFrame
    ends: DataFrame
    committed: tuple[int, int, int]
    repeats: bool
    log: logging.Logger
    feed: str
    fresh: list[Any]
    snaps: list[Any]
    latest: Any
    last: Any
    dropped: set[str]
    held_from: tuple[int, int] | None
    replaces: tuple[int, str] | None
    empty_at: tuple[int, int] | None
    held_txns: set[str]
    held_files: set[str]
    held_at: tuple[int, int] | None
    persisted: tuple[DataFrame, ...]
    per_txn: DataFrame
    events: Column
    counted: Any
    data: DataFrame
    ready: Any
    opened: list[dict[str, Any]]

    def per_transaction(self) -> None:
        """The figures per source transaction: events, metadata, first place, last LSN;
        only the incomplete ones (the tail of the input, at most) and a summary row come
        to the driver."""
        kept_only = F.col("_keep")
        # (Without repeats an event's rows are its distinct events: no count_distinct,
        # whose sort is the costliest part of this job.)
        events_col = (
            F.count_distinct(F.when(kept_only, F.struct(*EVENT[1:])))
            if self.repeats
            else F.count(F.when(kept_only, 1))
        )
        # (every aggregate here is a number: Spark keeps them in a hash table, where a
        # struct would make it sort every row by transaction)
        self.per_txn = per_txn = cached(
            self.flagged.groupBy("txn")
            .agg(
                events_col.alias("events"),
                F.max("tx_meta").alias("meta"),
                F.min(F.when(kept_only, place())).alias("first_at"),
                F.max(F.when(kept_only, F.col("pos_hi"))).alias("last_hi"),
            )
            # a transaction redelivered whole after it was turned into updates: its events
            # are filtered out and its END is done with
            .join(self.ends.where(F.col("commit_lsn") > self.committed[0]), "txn", "full")
        )
        self.events = events = F.coalesce(F.col("events"), F.lit(0))
        with_meta = F.coalesce(F.col("meta"), F.lit(False)) | F.col("expected").isNotNull()
        # (a transaction whose every event read was turned into updates before, read again
        # with a file held back for another one, waits for nothing)
        incomplete = with_meta & (
            (F.col("expected").isNull() & (events > 0)) | (events < F.col("expected"))
        )
        too_many = with_meta & (events > F.col("expected"))
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
        self.counted = next(r for r in collected if r["_kind"] == "summary")
        odd = [
            {**r.asDict(), "first": unplace(r["first_at"])}
            for r in collected
            if r["_kind"] == "txn"
        ]
        for r in odd:
            if r["expected"] is not None and r["events"] > r["expected"]:
                self.log.warning(
                    "feed %s: source transaction %s has %d events, its END record counts %d",
                    self.feed,
                    r["txn"],
                    r["events"],
                    r["expected"],
                )
        data = self.flagged.where(kept_only)
        if self.repeats:
            # an event delivered more than once (Kafka's at-least-once): keep one of each.
            # Without repeats (the first job says so) the sort this takes is skipped.
            data = data.dropDuplicates(EVENT)
        data = data.drop("_keep", "_dup")
        # Kept where repeats were dropped, so later scans do not shuffle again. Otherwise
        # each later scan reads the cached input again, which costs less than caching it
        # twice.
        if self.repeats:
            data = cached(data)
            self.persisted = (data,)
        self.data = data
        self.ready = self.counted["ready"]
        self.opened = [r for r in odd if r["open"]]

    def new_snapshot(self) -> None:
        """Debezium snapshotted the table again: the first new snapshot replaces the feed's
        table in one time once it is whole and nothing delivered before it waits; what it
        supersedes is dropped, what comes after it is held."""
        snap = self.fresh[0]
        at = tuple(snap["s_first"])
        self.dropped = dropped = superseded(snap, self.opened, self.snaps)
        self.opened = [r for r in self.opened if r["txn"] not in dropped]
        before = ~first_from(at)
        earlier = self.per_txn.where((self.events > 0) & before)
        if dropped:
            earlier = earlier.where(~F.col("txn").isin(sorted(dropped)))
        waits = not earlier.isEmpty()  # what came before it goes first
        done = settle(self.fresh, earlier_waits=waits, latest=self.latest)
        self.held_from, self.replaces = done.held_from, done.replaces
        if done.replaces is not None:
            lsn = done.replaces[0]
            if done.empty:
                self.empty_at = (int(at[0]), int(at[1]))
            # delivered after it but committed before it (Debezium streaming again from
            # an older slot position): the snapshot holds their effect
            older = self.per_txn.where((self.events > 0) & ~before & (F.col("last_hi") < lsn))
            dropped |= {r["txn"] for r in older.select("txn").collect()}
            self.log.warning(
                "feed %s: Debezium snapshotted the table again (at LSN %d): the feed moves "
                "to that snapshot in one time, retracting the rows it does not hold",
                self.feed,
                lsn,
            )
        elif not waits:
            self.log.info(
                "feed %s: a new snapshot (LSN %d) is not complete yet", self.feed, snap["lsn"]
            )
        if dropped:
            self.log.warning(
                "feed %s: %d source transaction(s) dropped: delivered in part before the new "
                "snapshot (never to be delivered whole again), or committed before it; the "
                "snapshot holds their effect",
                self.feed,
                len(dropped),
            )

    def hold(self, hold_at: tuple[int, int] | None, hold_txns: frozenset[str]) -> None:
        """Hold back the first incomplete transaction in delivery order and every
        transaction delivered after it (few: the tail of what was read), with what a new
        snapshot, a change of shape (``hold_at``) or the group (``hold_txns``) holds;
        the rest is released."""
        # the first incomplete transaction in delivery order holds back every transaction
        # delivered after it (few: the tail of what was read)
        held = F.lit(False)
        if self.opened or hold_txns:
            held = F.col("txn").isin(sorted({r["txn"] for r in self.opened} | set(hold_txns)))
        starts = [r["first"] for r in self.opened if r["first"] is not None]
        if self.held_from is not None:
            starts.append(self.held_from)
        if hold_at is not None:
            starts.append(hold_at)
        if hold_txns:  # held elsewhere in the group: held from their first event here on
            m = self.per_txn.where(F.col("txn").isin(sorted(hold_txns))).agg(F.min("first_at"))
            first_held = unplace(m.collect()[0][0])
            if first_held is not None:
                starts.append(first_held)
        if starts:
            held = held | first_from(min(starts))
        if self.dropped:
            held = held & ~F.col("txn").isin(sorted(self.dropped))
        held = F.coalesce(held, F.lit(False))
        ready = (self.events > 0) & ~held
        if self.dropped:
            ready = ready & ~F.col("txn").isin(sorted(self.dropped))
        # the held transactions and the count of the released ones, in one job
        found = (
            self.per_txn.where(held)
            .select("txn", "first_at", F.lit("held").alias("_kind"))
            .unionByName(
                self.per_txn.agg(F.count(F.when(ready, 1)).alias("ready")).withColumn(
                    "_kind", F.lit("ready")
                ),
                allowMissingColumns=True,
            )
            .collect()
        )
        held_rows = [r for r in found if r["_kind"] == "held"]
        self.ready = next(r["ready"] for r in found if r["_kind"] == "ready")
        self.held_txns = held_txns = {r["txn"] for r in held_rows}
        firsts = [p for r in held_rows if (p := unplace(r["first_at"])) is not None]
        if hold_at is not None:
            firsts.append((hold_at[0], hold_at[1]))
        self.held_at = min(firsts) if firsts else None
        if self.held_from is not None:  # a held snapshot's files, its end marker's too
            for sn in self.snaps:
                if tuple(sn["s_first"]) >= self.held_from:
                    self.held_files.update(sn["s_files"] or ())
        self.data = data = _without(self.data, held_txns | self.dropped)
        # the highest position released (a scan, no shuffle), and the files holding the
        # held transactions' events and END records (asked for only here: a set of files
        # per source transaction would cost every read a second or more), in one job
        last = data.agg(F.max(F.struct("pos_hi", "pos_lo", "pos_n")).alias("m"))
        last = last.withColumn("_kind", F.lit("last"))
        if named := sorted(t for t in held_txns if t is not None):
            theirs = self.changes.where(F.col("op").isin(*DATA_OPS, "E") & F.col("txn").isin(named))
            files = theirs.select("_file").distinct().withColumn("_kind", F.lit("file"))
            last = last.unionByName(files, allowMissingColumns=True)
        found = last.collect()
        self.held_files.update(r["_file"] for r in found if r["_kind"] == "file")
        self.last = next(r["m"] for r in found if r["_kind"] == "last")
        if held_txns:
            self.log.info(
                "feed %s: %d source transaction(s) incomplete or behind an incomplete one "
                "or a new snapshot: held back until the rest arrives",
                self.feed,
                len(held_txns),
            )


#: up to this many source transactions are left out by a filter naming them, more by a
#: broadcast join (a filter's values are literals in the plan; a join of a list made on
#: the driver takes a Spark job of its own to broadcast it)
LISTED_OUT = 256


def _without(data: DataFrame, txns: set[str | None]) -> DataFrame:
    """``data`` without the rows of the source transactions ``txns``; rows of no
    transaction (a null ``txn``) stay, as a join on ``txn`` keeps them (a null among the
    values of ``NOT IN`` would leave out every other row instead)."""
    named = sorted(t for t in txns if t is not None)
    if not named:
        return data
    if len(named) <= LISTED_OUT:
        return data.where(F.col("txn").isNull() | ~F.col("txn").isin(named))
    out = data.sparkSession.createDataFrame([(t,) for t in named], "txn string")
    return data.join(F.broadcast(out), "txn", "left_anti")
