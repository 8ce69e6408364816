"""Successive full snapshots of a table (whole-table sources) turned into diffs: each
snapshot minus the one before it (:func:`snapshot_diffs`)."""

from __future__ import annotations

from collections.abc import Sequence

from pyspark import StorageLevel
from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

from feed.log.info import Granularity
from feed.sources.cached import cached
from feed.txn.diffs import Diffs, key_of

__all__ = ["snapshot_diffs"]


def snapshot_diffs(
    changes: DataFrame, state: DataFrame | None, key: Sequence[str], granularity: Granularity
) -> Diffs:
    """Successive full snapshots -> diffs: each snapshot minus the one before it.

    Every row of snapshot ``i`` is ``+1`` at its own unit and ``-1`` at the next snapshot's
    unit; the previous transaction's last snapshot (the state) is ``-1`` at unit 0.
    Consolidation leaves exactly the multiset difference, keyed or not. With ``batch``
    granularity only the last snapshot counts. Keyed snapshots keep the first row of a key
    that appears more than once and report the others as bad.
    """
    bad = None
    if key:
        k = key_of(F.col("after"), key)
        w = Window.partitionBy("ord_file", k).orderBy("ord_row")
        ranked = changes.withColumn("_n", F.row_number().over(w))
        bad = ranked.where(F.col("_n") > 1).select(
            "_file",
            "_raw",
            F.concat(
                F.lit("key "), F.to_json(k), F.lit(" appears more than once in one snapshot")
            ).alias("_error"),
        )
        changes = ranked.where(F.col("_n") == 1).drop("_n")
    changes = cached(changes, StorageLevel.MEMORY_AND_DISK)
    last_row = changes.agg(F.max("ord_file").alias("m")).collect()[0]
    last = last_row["m"]
    parts = []
    if last is not None:
        if granularity == "transaction":
            parts.append(
                changes.select(F.col("after").alias("data"), "unit", F.lit(1).alias("diff"))
            )
            parts.append(
                changes.where(F.col("ord_file") != last).select(
                    F.col("after").alias("data"),
                    (F.col("unit") + 1).alias("unit"),
                    F.lit(-1).alias("diff"),
                )
            )
        else:
            parts.append(
                changes.where(F.col("ord_file") == last).select(
                    F.col("after").alias("data"),
                    F.lit(0).cast("long").alias("unit"),
                    F.lit(1).alias("diff"),
                )
            )
    if state is not None and last is not None:
        parts.append(
            state.select("data", F.lit(0).cast("long").alias("unit"), F.lit(-1).alias("diff"))
        )
    if not parts:
        empty = changes.select(F.col("after").alias("data"), "unit", F.lit(1).alias("diff"))
        return Diffs(diffs=empty.limit(0), units=0, state=state, bad=bad, cached=changes)
    diffs = parts[0]
    for p in parts[1:]:
        diffs = diffs.unionByName(p)
    new_state = (
        changes.where(F.col("ord_file") == last).select(F.col("after").alias("data"))
        if last is not None
        else state
    )
    return Diffs(
        diffs=diffs.select("data", "unit", F.col("diff").cast("long").alias("diff")),
        units=0,
        state=new_state,
        bad=bad,
        cached=changes,
    )
