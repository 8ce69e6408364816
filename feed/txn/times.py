"""Each change's time: its offset (``unit``) from the transaction's first time ``next``.

With ``batch`` granularity every change of an emitter transaction gets the time ``next``.
With ``transaction`` granularity each source transaction gets its own time, ``next``,
``next + 1``, … in the order the source committed them (delivery order), so a source
transaction is never split or merged. (The clock, logical or wall-clock, decides ``next``
itself: :mod:`feed.emit.emitter`.)
"""

from __future__ import annotations

from pyspark import StorageLevel
from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

from feed.log.info import Granularity
from feed.sources.cached import cached
from feed.sources.positions import source_order

__all__ = ["LISTED_TXNS", "assign_units"]

#: up to this many source transactions are numbered by their place in one literal of the
#: plan; more by a broadcast join with their list (which takes a Spark job of its own to
#: broadcast: a tenth of a second of each small transaction's time)
INLINE_TXNS = 64
#: what joins the names of the inlined transactions into that literal (one py4j call
#: instead of one per name); names that hold it take the join
_SEP = "\x00"


#: up to this many source transactions are numbered from a list on the driver (one small
#: job, as a follow-mode transaction needs); beyond it they are numbered in Spark
LISTED_TXNS = 50_000


def assign_units(
    changes: DataFrame, granularity: Granularity, order: DataFrame | None = None
) -> tuple[DataFrame, int, DataFrame | None]:
    """Add ``unit`` (0, 1, …: the offset from ``next``); return the changes, how many units
    there are, and a persisted frame to unpersist after the commit (or None).

    ``order``, when the caller has it already, holds each source transaction (``txn``) with
    its place in source order (``o``). Up to :data:`LISTED_TXNS` transactions are listed on
    the driver in order. More are numbered in Spark: sorted into ranges, numbered within
    each, and shifted by the sizes of the ranges before it (only one count per range comes
    to the driver, never the list of transactions)."""
    if granularity == "batch":
        return changes.withColumn("unit", F.lit(0).cast("long")), 1, None
    if order is None:
        order = source_order(changes)
    spark = changes.sparkSession
    head = order.orderBy("o").select("txn").limit(LISTED_TXNS + 1).collect()
    if len(head) <= LISTED_TXNS:
        if not head:
            return changes.withColumn("unit", F.lit(0).cast("long")), 0, None
        return _listed(changes, [r["txn"] for r in head]), len(head), None
    try:
        ranges = max(1, int(spark.conf.get("spark.sql.shuffle.partitions") or 8))
    except ValueError:
        ranges = 8
    # The range a row lands in is only known once: persisted, so the sizes counted here
    # and the numbering joined below are of the same ranges (computed twice, the optimizer
    # dropped the sort in one plan). An explicit range repartition: the optimizer may drop
    # a sort whose order nothing above asks for, never a repartition asked for by number.
    ranked = cached(
        order.repartitionByRange(ranges, "o")
        .withColumn("_range", F.spark_partition_id())
        .withColumn("_n", F.row_number().over(Window.partitionBy("_range").orderBy("o"))),
        StorageLevel.MEMORY_AND_DISK,
    )
    sizes = sorted(tuple(r) for r in ranked.groupBy("_range").count().collect())
    starts, total = [], 0
    for rng, n in sizes:
        starts.append((rng, total))
        total += n
    shift = spark.createDataFrame(starts, "_range int, _start long")
    units = ranked.join(F.broadcast(shift), "_range").select(
        "txn", (F.col("_start") + F.col("_n") - 1).cast("long").alias("unit")
    )
    return changes.join(units, "txn"), total, ranked


def _listed(changes: DataFrame, txns: list[str | None]) -> DataFrame:
    """``changes`` with ``unit``, the place of each row's source transaction in ``txns``
    (distinct, in source order), its columns as a join on ``txn`` gives them (``txn``
    first); a row of no transaction listed is left out."""
    named = [t for t in txns if t is not None and _SEP not in t]
    if len(txns) <= INLINE_TXNS and len(named) == len(txns):
        names = F.split(F.lit(_SEP.join(named)), _SEP)
        unit = F.array_position(names, F.col("txn")) - 1
        rest = [c for c in changes.columns if c != "txn"]
        with_unit = changes.select("txn", *rest, unit.cast("long").alias("unit"))
        return with_unit.where(F.col("unit") >= 0)
    listed = changes.sparkSession.createDataFrame(
        [(t, i) for i, t in enumerate(txns)], "txn string, unit long"
    )
    return changes.join(F.broadcast(listed), "txn")
