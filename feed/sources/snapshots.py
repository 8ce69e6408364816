"""Whole-table snapshots among the changes one emitter transaction read (the "new
snapshot" rule of :mod:`feed.sources.transactions`).

Spark computes one row of figures per snapshot LSN (:func:`snapshot_figures`); what to do
about them is decided on the driver by plain functions over those rows, which the tests
call without Spark (tests/feed/test_snapshots.py):

- :func:`classify`: which snapshots are new (not the feed's own, past the committed
  position) and which are known whole;
- :func:`superseded`: the source transactions a new snapshot makes moot;
- :func:`settle`: whether the first new snapshot is released now as the whole table, or
  held, and from where the input after it is held.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from feed.sources.positions import snapshot_read

__all__ = [
    "Settled",
    "Snapshots",
    "classify",
    "empty_snapshot",
    "moved_reads",
    "one_lsn_each",
    "say_moved",
    "settle",
    "snapshot_figures",
    "snapshot_row",
    "superseded",
]

#: a snapshot's figures, indexed by name: ``lsn``, ``s_first`` and ``s_last`` (places in
#: delivery order, ``(ord_file, ord_row)``), ``s_end``, ``s_txn``, ``s_files`` (see
#: :func:`snapshot_figures`): a Spark Row, or a dict in tests
Figures = Any


def snapshot_row() -> Column:
    """Whether a row is a read of a whole-table snapshot, or says where a snapshot ends
    (of any table: another table's last read says the feed's table had no more rows)."""
    return snapshot_read() | (F.coalesce(F.col("_snap"), F.lit("")) == "last")


def snapshot_figures(changes: DataFrame) -> DataFrame:
    """One row per snapshot LSN among ``changes``: its first and last place in delivery
    order, whether its end was read (``s_end``), its transaction (``s_txn``: null when
    only another table's end marker is at that LSN), the transactions of all its rows
    (``s_txns``) and its files."""
    snap = F.coalesce(F.col("_snap"), F.lit(""))
    ends_here = (snap == "last") | ((F.col("op") == "r") & (snap == "last_in_data_collection"))
    at = F.struct("ord_file", "ord_row")
    return (
        changes.where(snapshot_row())
        .groupBy(F.col("pos_lo").alias("lsn"))
        .agg(
            F.min(at).alias("s_first"),
            F.max(F.when(F.col("op") == "r", at)).alias("s_last"),
            F.max(ends_here).alias("s_end"),
            F.max(F.when(F.col("op") == "r", F.col("txn"))).alias("s_txn"),
            F.collect_set("txn").alias("s_txns"),
            F.collect_set("_file").alias("s_files"),
        )
    )


@dataclass(frozen=True, slots=True)
class Snapshots:
    """The snapshots read, in delivery order, the new ones among them, and the LSNs of
    those known to be whole."""

    all: list[Figures]
    fresh: list[Figures]
    whole: set[int]


def _place(p: Any) -> tuple[int, int]:
    return (int(p[0]), int(p[1]))


def classify(
    rows: Iterable[Figures],
    *,
    own: int | None,
    new_feed: bool,
    committed_hi: int,
    latest: Sequence[int] | None,
) -> Snapshots:
    """Sort the snapshot ``rows`` into delivery order and decide: on a ``new_feed`` the
    first is the feed's own, else ``own`` is; a new one is any other past the committed
    ``committed_hi`` (one with only another table's end marker: the feed's table was
    empty); a whole one had its end marker read, or an event delivered after its last
    read (``latest``: Debezium streams only once a snapshot is done)."""
    snaps = sorted(
        (r for r in rows if r["s_first"] is not None), key=lambda r: _place(r["s_first"])
    )
    if new_feed:
        own = snaps[0]["lsn"] if snaps else None
    fresh = [r for r in snaps if r["lsn"] != own and r["lsn"] > committed_hi]
    whole = {
        int(r["lsn"])
        for r in snaps
        if r["s_end"]
        or (latest is not None and _place(latest) > _place(r["s_last"] or r["s_first"]))
    }
    return Snapshots(snaps, fresh, whole)


def one_lsn_each(
    rows: Iterable[Figures], *, own_txn: str | None, own_lsn: int | None
) -> dict[str, tuple[int, list[int]]]:
    """The snapshot transactions whose rows are to move to one LSN: each with that LSN
    and the LSNs its rows carry. Debezium gives every row of a snapshot the LSN it was
    taken at, and a new snapshot is a new transaction, so a snapshot is its transaction:
    rows of one transaction at several LSNs (hand-made input, or a connector that numbers
    its reads) are one snapshot, at the lowest of them; rows of the feed's own snapshot
    (``own_txn``) are at its LSN ``own_lsn``, also when they are read after it began."""
    lsns: dict[str, set[int]] = {}
    for r in rows:
        for txn in r["s_txns"] or ():
            lsns.setdefault(txn, set()).add(int(r["lsn"]))
    moves = {}
    for txn, found in lsns.items():
        to = own_lsn if own_txn is not None and txn == own_txn and own_lsn is not None else None
        to = min(found) if to is None else to
        if found != {to}:
            moves[txn] = (to, sorted(found))
    return moves


def say_moved(log: logging.Logger, feed: str, moves: dict[str, tuple[int, list[int]]]) -> None:
    """Log each move of :func:`one_lsn_each` (an info line: the input is not as Debezium
    writes it, and what was made of it)."""
    for txn, (lsn, lsns) in moves.items():
        shown = ", ".join(map(str, lsns[:5])) + (", …" if len(lsns) > 5 else "")
        log.info(
            "feed %s: the snapshot rows of source transaction %s carry %d LSNs (%s): "
            "taken for one snapshot at LSN %d (docs/sources.md)",
            feed,
            txn,
            len(lsns),
            shown,
            lsn,
        )


def moved_reads(moves: dict[str, tuple[int, list[int]]]) -> tuple[Column, Column]:
    """``pos_hi`` and ``pos_lo`` with the snapshot rows of the transactions in ``moves``
    (:func:`one_lsn_each`) at their snapshot's LSN."""
    hi, lo = F.col("pos_hi"), F.col("pos_lo")
    if not moves:
        return hi, lo
    pairs = [(F.lit(txn), F.lit(lsn).cast("long")) for txn, (lsn, _) in moves.items()]
    to = F.create_map(*[c for pair in pairs for c in pair])
    at = F.when(snapshot_row(), to[F.col("txn")])
    return F.coalesce(at, hi), F.coalesce(at, lo)


def superseded(snap: Figures, opened: Iterable[Figures], snaps: Iterable[Figures]) -> set[str]:
    """The source transactions the new snapshot ``snap`` makes moot: those still open
    (``opened``: ``txn`` and ``first`` place) that began before it, which Debezium will
    never deliver whole again, and the unfinished snapshots before it."""
    at = _place(snap["s_first"])
    dropped = {r["txn"] for r in opened if r["first"] is not None and _place(r["first"]) < at}
    dropped |= {
        r["s_txn"] for r in snaps if _place(r["s_first"]) < at and not r["s_end"] and r["s_txn"]
    }
    return dropped


@dataclass(frozen=True, slots=True)
class Settled:
    """What becomes of the first new snapshot: ``replaces`` (its LSN and transaction) when
    it is released now as the whole table, ``empty`` when it has no row of the table, and
    ``held_from``, the place from which what was delivered is held back (None: nothing)."""

    replaces: tuple[int, str] | None
    empty: bool
    held_from: tuple[int, int] | None


def settle(
    fresh: Sequence[Figures], *, earlier_waits: bool, latest: Sequence[int] | None
) -> Settled:
    """The first of the ``fresh`` snapshots goes when it is whole and nothing delivered
    before it waits (``earlier_waits``: that goes first, in a transaction of its own);
    then the next new snapshot waits for a transaction of its own."""
    snap = fresh[0]
    at = _place(snap["s_first"])
    end_at = _place(snap["s_last"] or snap["s_first"])
    ended = bool(snap["s_end"]) or (latest is not None and _place(latest) > end_at)
    if earlier_waits or not ended:
        return Settled(None, False, at)
    lsn = int(snap["lsn"])
    held_from = _place(fresh[1]["s_first"]) if len(fresh) > 1 else None
    return Settled((lsn, snap["s_txn"] or f"snapshot:{lsn}"), snap["s_txn"] is None, held_from)


def empty_snapshot(spark: Any, replaces: tuple[int, str], at: tuple[int, int]) -> DataFrame:
    """The source order's row (``txn``, ``o``) of a new snapshot ``replaces`` (LSN,
    transaction) without any row of the table, read at place ``at``: a transaction without
    rows, whose time holds only the retractions of every row the feed holds."""
    lsn, (f, row) = replaces[0], at
    names = ("pos_hi", "pos_lo", "pos_n", "ord_file", "ord_row")
    values = (lsn, lsn, 0, f, row)
    o = F.struct(*[F.lit(v).cast("long").alias(n) for n, v in zip(names, values, strict=True)])
    empty: DataFrame = spark.range(1).select(F.lit(replaces[1]).alias("txn"), o.alias("o"))
    return empty
