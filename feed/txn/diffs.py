"""Changes -> timed diffs -> consolidated updates, with keyed state, in native Spark.

* **Times** come from :mod:`feed.txn.times` (a time per emitter or per source transaction).
* **Unkeyed feeds** trust the images: insert ``+after``, delete ``-before``, update ``-before
  +after``, a weighted row ``record`` times ``delta``.
* **Keyed feeds** keep the current row of every key (the state) and never trust a
  before-image: for each key and time the change's net effect is "retract what was emitted
  last for this key, emit the last after-image" (nothing for a delete). This is right with
  or without full before-images (Debezium ``REPLICA IDENTITY DEFAULT``, upserts, deletes by
  key) and keeps the feed non-negative with at most one live row per key (DESIGN §2.6). A
  delete of a key that is not there is a bad row.
* **Whole-table snapshots** are diffed against the one before in :mod:`feed.txn.snapshots`.
* **Consolidation** sums diffs per ``(record, time)`` and drops zeros (a no-op update or an
  update undone in the same time vanishes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from feed.sources.cached import cached
from feed.sources.positions import order_column
from feed.txn.state import GONE_COLUMN, POS_COLUMN, POS_TYPE

__all__ = [
    "Diffs",
    "absent_delete",
    "consolidate_diffs",
    "diffs_of_last",
    "fill_unavailable",
    "groups_as_is",
    "key_of",
    "keyed_diffs",
    "last_images",
    "one_unit_updates",
    "replacement_deletes",
    "unkeyed_diffs",
]


@dataclass(frozen=True, slots=True)
class Diffs:
    """The result of turning one transaction's changes into diffs."""

    diffs: DataFrame  # data (record struct), unit (long), diff (long)
    units: int  # how many times this transaction uses
    state: DataFrame | None = None  # keyed: the new state (record struct column ``data``)
    bad: DataFrame | None = None  # keyed: changes found bad against the state
    cached: DataFrame | None = None  # persisted along the way: unpersist after the commit


def unkeyed_diffs(changes: DataFrame) -> DataFrame:
    minus = changes.where(F.col("before").isNotNull()).select(
        F.col("before").alias("data"), "unit", (-F.col("weight")).alias("diff")
    )
    plus = changes.where(F.col("after").isNotNull()).select(
        F.col("after").alias("data"), "unit", F.col("weight").alias("diff")
    )
    return minus.unionByName(plus)


def key_of(image: Column, key: Sequence[str]) -> Column:
    """The struct of the ``key`` columns of a record struct ``image``."""
    return F.struct(*[image[k].alias(k) for k in key])


def keyed_diffs(
    changes: DataFrame,
    state: DataFrame | None,
    key: Sequence[str],
    *,
    per_key: bool = False,
    one_unit: bool = False,
) -> Diffs:
    """Diffs of keyed changes against ``state`` (a DataFrame with a record column ``data``).

    With ``per_key`` (sources whose positions order each key's changes: upsert order values,
    CDF commit versions) the new state keeps each key's last position (``_pos``), and a
    key's changes at or below the position its state row holds are dropped: a redelivered
    or older row in a later file never overwrites newer state.

    ``one_unit``: every change has the same ``unit`` (``--granularity batch``, or a single
    source transaction), so a key has one row of ``last``: its previous image is the
    state's, and no window (a sort of every key) is needed."""
    image = F.when(F.col("op") == "d", F.col("before")).otherwise(F.col("after"))
    events = changes.select(
        key_of(image, key).alias("k"),
        "unit",
        "op",
        "after",
        order_column().alias("o"),
        F.struct("pos_hi", "pos_lo", "pos_n").alias("p"),
        (F.col("op") != "d").cast("int").alias("up"),
        "_file",
        "_raw",
    )
    record_t = changes.schema["after"].dataType
    assert isinstance(record_t, T.StructType)
    d = diffs_of_last(last_images(events), state, key, record_t, per_key=per_key, one_unit=one_unit)
    assert d.cached is not None
    return replace(d, bad=_absent_deletes(events, d.cached))


def diffs_of_last(
    last: DataFrame,
    state: DataFrame | None,
    key: Sequence[str],
    record_t: T.StructType,
    *,
    per_key: bool = False,
    one_unit: bool = False,
    persist: bool = True,
) -> Diffs:
    """The diffs and the new state of each key's :func:`last_images` against ``state``
    (see :func:`keyed_diffs`). ``cached`` is ``last`` with each key's row in the state
    (``old``) and the image it retracts (``prev``), persisted unless ``persist`` is
    False (``last`` cached already, and no state to join); no bad rows are looked for
    here."""
    last = _against_state(last, state, key, per_key=per_key)
    if state is None:
        last = last.withColumn("old", F.lit(None).cast(record_t))
    if one_unit:
        prev = F.col("old")
    else:
        by_key = Window.partitionBy("k").orderBy("unit")
        first = F.row_number().over(by_key) == 1
        prev = F.when(first, F.col("old")).otherwise(F.lag("img").over(by_key))
    last = last.withColumn("prev", prev)
    if persist:
        last = cached(last, StorageLevel.MEMORY_AND_DISK)
    new_state = _new_state(last, state, key, record_t, per_key=per_key, one_unit=one_unit)
    return Diffs(diffs=_retract_and_add(last, F.col("unit")), units=0, state=new_state, cached=last)


def _retract_and_add(last: DataFrame, when: Column) -> DataFrame:
    """Each row of ``last``'s ``prev`` retracted (-1) and its ``img`` added (+1), where
    present: columns ``data``, ``when``'s and ``diff``."""
    minus = last.where(F.col("prev").isNotNull()).select(
        F.col("prev").alias("data"), when, F.lit(-1).cast("long").alias("diff")
    )
    plus = last.where(F.col("img").isNotNull()).select(
        F.col("img").alias("data"), when, F.lit(1).cast("long").alias("diff")
    )
    return minus.unionByName(plus)


def absent_delete() -> Column:
    """Whether a row of :func:`diffs_of_last`'s ``cached`` deletes a key that had no row,
    neither before in its unit nor in the state (the deletes behind it are bad rows)."""
    return F.col("img").isNull() & F.col("prev").isNull() & (F.col("has_upsert") == 0)


def last_images(events: DataFrame) -> DataFrame:
    """Each key's (``k``) last image in each unit (``img``; null: deleted) by the order
    ``o``, whether the unit upserts it at all (the highest ``up``), and its highest
    position (``p``)."""
    last = events.groupBy("k", "unit").agg(
        F.max_by(F.struct("op", "after"), "o").alias("last"),
        F.max("up").alias("has_upsert"),
        F.max("p").alias("p"),
    )
    return last.select(
        "k",
        "unit",
        "has_upsert",
        "p",
        F.when(F.col("last.op") == "d", F.lit(None)).otherwise(F.col("last.after")).alias("img"),
    )


def _against_state(
    last: DataFrame, state: DataFrame | None, key: Sequence[str], *, per_key: bool
) -> DataFrame:
    """``last`` with each key's row in ``state`` (``old``, null for a tombstone, and its
    position ``old_pos``); with ``per_key``, a unit not past the key's state is dropped."""
    if state is None:
        return last
    pos = F.col(POS_COLUMN) if POS_COLUMN in state.columns else F.lit(None).cast(POS_TYPE)
    gone = F.col(GONE_COLUMN) if GONE_COLUMN in state.columns else F.lit(False)
    st = state.select(
        key_of(F.col("data"), key).alias("k"),
        F.when(~gone, F.col("data")).alias("old"),
        pos.cast(POS_TYPE).alias("old_pos"),
    )
    last = last.join(st, "k", "left")
    if per_key:
        # a unit whose newest change is not past the key's state is a redelivery
        last = last.where(F.col("old_pos").isNull() | (F.col("p") > F.col("old_pos")))
    return last


def _absent_deletes(events: DataFrame, last: DataFrame) -> DataFrame:
    """The deletes of a key that had no row, neither before them in this transaction nor
    in the state: bad rows."""
    missing = last.where(absent_delete()).select("k", "unit")
    not_present = F.concat(F.lit("delete of key "), F.to_json("k"), F.lit(" that is not present"))
    return (
        events.where(F.col("op") == "d")
        .join(missing, ["k", "unit"])
        .select("_file", "_raw", not_present.alias("_error"))
    )


def _new_state(
    last: DataFrame,
    state: DataFrame | None,
    key: Sequence[str],
    record_t: T.StructType,
    *,
    per_key: bool,
    one_unit: bool,
) -> DataFrame:
    """The new state: the last image of every touched key (with ``per_key``, a deleted
    key as a tombstone: its key columns, position and ``_gone``), and the untouched keys'
    rows of ``state``."""
    if one_unit:
        touched = last.select("k", "img", "p")
    else:
        final = Window.partitionBy("k").orderBy(F.col("unit").desc())
        rank = F.row_number().over(final)
        touched = last.select("k", "img", "p", rank.alias("rn")).where("rn = 1")
    new_rows = touched.where(F.col("img").isNotNull()).select(F.col("img").alias("data"))
    if per_key:
        key_only = F.struct(
            *[
                (F.col(f"k.{f.name}") if f.name in key else F.lit(None))
                .cast(f.dataType)
                .alias(f.name)
                for f in record_t.fields
            ]
        )
        new_rows = touched.select(
            F.coalesce(F.col("img"), key_only).alias("data"),
            F.col("p").cast(POS_TYPE).alias(POS_COLUMN),
            F.col("img").isNull().alias(GONE_COLUMN),
        )
    if state is None:
        return new_rows
    carried = [c for c in (POS_COLUMN, GONE_COLUMN) if per_key and c in state.columns]
    # (the key as a column of its own before the join: over state read by Python tasks,
    # feed/txn/grouped.py:read_files, a condition on ``data``'s fields met a bug of Spark
    # 4's nested column aliasing, INTERNAL_ERROR_ATTRIBUTE_NOT_FOUND in the anti join)
    kept = (
        state.select("*", key_of(F.col("data"), key).alias("k"))
        .join(touched.select("k"), "k", "left_anti")
        .select("data", *carried)
    )
    return kept.unionByName(new_rows, allowMissingColumns=True)


def replacement_deletes(
    changes: DataFrame, live: DataFrame | None, key: Sequence[str], snapshot: tuple[int, str]
) -> DataFrame:
    """``snapshot`` (its LSN and source transaction) replaces the collection: a delete of
    every ``live`` state row (the whole state before it, tombstones left out) whose key
    none of its reads in ``changes`` has, shaped like ``changes``. The snapshot is the
    first source transaction released (unit 0) and its deletes sit at its LSN, before
    every later change."""
    if live is None:
        return changes.limit(0)
    lsn, txn = snapshot
    reads = changes.where((F.col("op") == "r") & (F.col("txn") == txn))
    held = reads.select(key_of(F.col("after"), key).alias("k")).distinct()
    given = {
        "op": F.lit("d"),
        "before": F.col("data"),
        "weight": F.lit(1),
        "pos_hi": F.lit(lsn),
        "pos_lo": F.lit(lsn),
        "pos_n": F.lit(0),
        "txn": F.lit(txn),
        "unit": F.lit(0),
        "ord_file": F.lit(0),
        "ord_row": F.lit(0),
        "_file": F.lit("(new snapshot)"),
    }
    keyed = live.select(key_of(F.col("data"), key).alias("k"), "data")
    return keyed.join(held, "k", "left_anti").select(
        *[
            given.get(f.name, F.lit(None)).cast(f.dataType).alias(f.name)
            for f in changes.schema.fields
        ]
    )


def fill_unavailable(changes: DataFrame, state: DataFrame | None, key: Sequence[str]) -> Diffs:
    """Fill Debezium's unavailable-value placeholders (``_toast`` names the columns) from the
    key's latest earlier value: an earlier change read in the same transaction, else the
    keyed state. Returns the changes with the values filled in (``diffs``) and, as ``bad``,
    the changes whose key has no earlier value to take (they are left out of ``diffs``).

    Only the keys that meet a placeholder are sorted; the other changes pass untouched.
    """
    after_t = changes.schema["after"].dataType
    columns = [f.name for f in after_t.fields]  # type: ignore[attr-defined]
    k = key_of(F.when(F.col("op") == "d", F.col("before")).otherwise(F.col("after")), key)
    keyed = changes.withColumn("_k", k)
    toast_keys = keyed.where(F.col("_toast").isNotNull()).select("_k").distinct()
    hit = keyed.join(F.broadcast(toast_keys), "_k", "left_semi")
    rest = keyed.join(F.broadcast(toast_keys), "_k", "left_anti").drop("_k")
    events = hit.select("*", F.lit(1).alias("_src"))
    if state is not None:
        earlier = (
            state.select(key_of(F.col("data"), key).alias("_k"), F.col("data").alias("after"))
            .join(F.broadcast(toast_keys), "_k", "left_semi")
            .select("_k", "after", F.lit(0).alias("_src"))
        )
        events = events.unionByName(earlier, allowMissingColumns=True)
    names = F.split(F.coalesce(F.col("_toast"), F.lit("")), ",")
    w = (
        Window.partitionBy("_k")
        .orderBy("_src", F.col("unit").asc_nulls_first(), order_column())
        .rowsBetween(Window.unboundedPreceding, -1)
    )
    filled, missing = [], []
    for c in columns:
        toasted = F.array_contains(names, c)
        # a value wrapped in a struct, so that a real NULL still counts as a value
        known = F.when(
            F.col("after").isNotNull() & ~toasted, F.struct(F.col(f"after.{c}").alias("v"))
        )
        earlier_v = F.last(known, ignorenulls=True).over(w)
        filled.append(F.when(toasted, earlier_v["v"]).otherwise(F.col(f"after.{c}")).alias(c))
        missing.append(F.when(toasted & earlier_v.isNull(), F.lit(c)))
    out = events.select(
        "*",
        F.when(F.col("after").isNull(), F.col("after"))
        .otherwise(F.struct(*filled))
        .cast(after_t)
        .alias("_filled"),
        F.concat_ws(", ", *missing).alias("_missing"),
    ).where(F.col("_src") == 1)
    bad = out.where(F.col("_missing") != "").select(
        "_file",
        "_raw",
        F.concat(
            F.lit("unavailable value (unchanged TOASTed column) in "),
            F.col("_missing"),
            F.lit(" and key "),
            F.to_json("_k"),
            F.lit(" has no earlier row to take it from"),
        ).alias("_error"),
    )
    good = (
        out.where(F.col("_missing") == "")
        .withColumn("after", F.col("_filled"))
        .select(*changes.columns)
    )
    return Diffs(diffs=rest.unionByName(good), units=0, bad=bad)


def one_unit_updates(last: DataFrame, next_time: int) -> DataFrame:
    """:func:`consolidate_diffs` of :func:`diffs_of_last`'s diffs where there is one unit
    and each record holds its key: no record of one key is a record of another, so the
    sums are per key (``-prev +img``, both dropped where they are equal) and need no
    shuffle. Only for records of :func:`groups_as_is` fields: Spark's grouping writes
    -0.0 as 0.0 and makes NaNs one, which this does not."""
    changed = last.where(~F.col("prev").eqNullSafe(F.col("img")))
    return _retract_and_add(changed, F.lit(next_time).cast("long").alias("time"))


def groups_as_is(record_t: T.StructType) -> bool:
    """Whether every field of ``record_t`` is of an atomic type that Spark groups by its
    value as it is (no float or double, no nested type)."""
    nested = (T.StructType, T.ArrayType, T.MapType, T.FloatType, T.DoubleType)
    return not any(isinstance(f.dataType, nested) for f in record_t.fields)


def consolidate_diffs(diffs: DataFrame, next_time: int) -> DataFrame:
    """Sum diffs per (record, time), drop zeros; ``time = next_time + unit``."""
    return (
        diffs.groupBy("data", "unit")
        .agg(F.sum("diff").alias("diff"))
        .where(F.col("diff") != 0)
        .select("data", (F.lit(next_time) + F.col("unit")).alias("time"), "diff")
    )
