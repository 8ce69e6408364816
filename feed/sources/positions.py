"""Where an event stands: its position in the source and its place in delivery order.

A Debezium event's source position is ``(pos_hi, pos_lo, pos_n)``: its transaction's
commit LSN, its own LSN and its ``total_order`` (:mod:`feed.sources.debezium`). Its place in
delivery order is ``(ord_file, ord_row)``: the input file's index in name order and a row
id growing within the file. The checkpoint's ``source.pos`` is the highest position
committed; :mod:`feed.sources.transactions` keeps what comes after it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from decimal import Decimal

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

__all__ = [
    "ALL_DONE",
    "DATA_OPS",
    "EVENT",
    "NEW_SNAPSHOT",
    "PLACE_SCALE",
    "Position",
    "committed_position",
    "first_from",
    "order_column",
    "source_order",
    "place",
    "position_filter",
    "snapshot_done",
    "snapshot_read",
    "unplace",
]

#: the ops of data events (create, update, delete, snapshot read)
DATA_OPS = ("c", "u", "d", "r")
#: what one event is: the rows of a repeated (redelivered) event agree on all of it
#: (``_dup``: a snapshot read's row, as its reads share a position)
EVENT = ["txn", "pos_lo", "pos_n", "op", "_dup"]


Position = tuple[int, int, int]


def order_column() -> Column:
    """The order of changes inside what one emitter transaction read: source position
    first, delivery order to break ties (and for sources without positions)."""
    return F.struct("pos_hi", "pos_lo", "pos_n", "ord_file", "ord_row")


def source_order(changes: DataFrame) -> DataFrame:
    """Each source transaction (``txn``) of ``changes`` with its place in source order
    (``o``): its first change's :func:`order_column`."""
    return changes.groupBy("txn").agg(F.min(order_column()).alias("o"))


def snapshot_read() -> Column:
    """Whether a row is a read of a whole-table snapshot (op ``r``; an incremental
    snapshot's reads are changes like the others)."""
    return (F.col("op") == "r") & (F.coalesce(F.col("_snap"), F.lit("")) != "incremental")


#: a committed position's ``total_order`` part that says every event at its LSN is done,
#: the reads of a snapshot at that LSN too (their own ``pos_n`` is 0)
ALL_DONE = 1 << 62


def committed_position(pos: Sequence[int]) -> Position:
    """The checkpoint's ``source.pos`` as a position (one written before total orders
    has two parts: every event at its LSN counts as done)."""
    return (int(pos[0]), int(pos[1]), int(pos[2]) if len(pos) > 2 else ALL_DONE)


def snapshot_done(last: Sequence[int] | None, ended: Collection[int]) -> Position | None:
    """The position to commit when ``last`` is the highest position released: a snapshot
    read's (``(lsn, lsn, 0)``) becomes ``(lsn, lsn, ALL_DONE)`` when that snapshot's end
    was read (its LSN in ``ended``). Reads at the committed position are otherwise kept
    (a snapshot may straddle emitter transactions); once its end is committed, a file read
    again (for a transaction held back behind it) must not release it once more."""
    if last is None:
        return None
    hi, lo, n = (int(v) for v in last)
    if n == 0 and hi == lo and lo in ended:
        return (hi, lo, ALL_DONE)
    return (hi, lo, n)


def position_filter(pos: Position, snapshot_lsn: int | None) -> tuple[Column, Column]:
    """Whether an event comes after ``pos`` (to keep), and whether it is a read of a *new*
    snapshot arriving behind it (bad: see :data:`NEW_SNAPSHOT`)."""
    hi, lo, n = pos
    hi_c, lo_c, n_c = F.col("pos_hi"), F.col("pos_lo"), F.col("pos_n")
    after = (hi_c > hi) | ((hi_c == hi) & (lo_c > lo)) | ((hi_c == hi) & (lo_c == lo) & (n_c > n))
    is_read = F.col("op") == "r"
    same_snapshot = is_read & (hi_c == hi) & (lo_c == lo) & F.lit(n < ALL_DONE)
    # an event of a transaction whose END has not been read has no commit position yet
    keep = hi_c.isNull() | after | same_snapshot
    # (an incremental snapshot's reads behind the position are redelivered, not an older
    # snapshot of the table)
    behind = ~keep & snapshot_read()
    if snapshot_lsn is not None:
        behind = behind & (lo_c != snapshot_lsn)  # the feed's own snapshot, redelivered
    return keep, behind


#: why a snapshot read behind the committed position is quarantined
NEW_SNAPSHOT = (
    "a snapshot of the table older than the feed's committed position and not the feed's "
    "own: the feed holds later changes than it, so it is not applied"
)


#: a place in delivery order, (``ord_file``, ``ord_row``), as one number:
#: ``ord_file * PLACE_SCALE + ord_row``
PLACE_SCALE = 1 << 64


def place() -> Column:
    """A row's place in delivery order as one number (decimal(38,0)): its minimum per
    source transaction is a hash aggregate, where the minimum of a struct makes Spark sort
    every row by transaction."""
    big = "decimal(38,0)"
    return F.col("ord_file").cast(big) * F.lit(Decimal(PLACE_SCALE)).cast(big) + F.col(
        "ord_row"
    ).cast(big)


def unplace(v: Decimal | None) -> tuple[int, int] | None:
    """:func:`place`'s number back as (``ord_file``, ``ord_row``)."""
    return None if v is None else divmod(int(v), PLACE_SCALE)


def first_from(at: tuple[int, int]) -> Column:
    """Whether a source transaction whose first place (:func:`place`) is in column
    ``first_at`` was first delivered at or after ``at`` (``ord_file``, ``ord_row``)."""
    f, row = at
    return F.col("first_at") >= F.lit(Decimal(f * PLACE_SCALE + row)).cast("decimal(38,0)")
