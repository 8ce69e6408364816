"""The keyed half of the one-pass engine (:mod:`feed.txn.onepass`).

A keyed feed never trusts a before-image: each key's net change in a transaction of one
time is "retract the state's row, add the last after-image" (:mod:`feed.txn.diffs`). Only
each key's last event matters, so a file's task keeps, of its kept events, each key's
last by position (:func:`last_per_key`) with whether any of them upserted it; the job
then takes the last of those per key across files (:func:`~feed.txn.diffs.last_images`,
the Spark path's own, which gives the same over parts of the events as over all of them).
:func:`compute` loads the state buckets those keys fall in and diffs against them with
the Spark path's :func:`~feed.txn.diffs.diffs_of_last`. A delete of a key that has no row
is a bad row on the Spark path, which quarantines it with its line: here it declines the
transaction, nothing written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from feed.txn.context import Computed, TxnContext

__all__ = ["compute", "last_per_key", "lasts", "task_output"]

#: the order of a transaction's changes (:func:`feed.sources.positions.order_column`)
_ORDER = ("pos_hi", "pos_lo", "pos_n", "ord_file", "ord_row")


def task_output(record: Any, key: Sequence[str]) -> Any:
    """The Spark schema of a task's rows: each key (``k``) with its last event's order
    (``o``), ``op`` and ``after``, and whether the file upserted the key (``up``)."""
    from pyspark.sql import types as T

    fields = {f.name: f for f in record.fields}
    long = T.LongType()
    return T.StructType(
        [
            T.StructField("k", T.StructType([fields[k] for k in key])),
            T.StructField("o", T.StructType([T.StructField(c, long) for c in _ORDER])),
            T.StructField("op", T.StringType()),
            T.StructField("after", record),
            T.StructField("up", T.IntegerType()),
        ]
    )


def last_per_key(kept: pa.Table, key: Sequence[str], schema: pa.Schema) -> pa.Table:
    """Of one file's ``kept`` events (the columns of
    :func:`~feed.sources.debezium_arrow.parse_flat`), each key's last by position, as
    rows of :func:`task_output` (``schema``, its Arrow form)."""
    if kept.num_rows == 0:
        return schema.empty_table()
    op = kept["op"]
    is_delete = pc.fill_null(pc.equal(op, "d"), False)
    keys = {
        f"k{i}": pc.if_else(
            is_delete, pc.struct_field(kept["before"], k), pc.struct_field(kept["after"], k)
        )
        for i, k in enumerate(key)
    }
    # (none of these is null in a kept event of a plain file: no null placement to match)
    order = pc.sort_indices(kept, [(c, "ascending") for c in _ORDER])
    ranked = pa.table(
        {
            **{name: col.take(order) for name, col in keys.items()},
            "_i": pa.array(range(kept.num_rows), pa.int64()),
            "up": pc.invert(is_delete).take(order).cast(pa.int32()),
        }
    )
    last = ranked.group_by(list(keys)).aggregate([("_i", "max"), ("up", "max")])
    rows = kept.take(order.take(last["_i_max"]))
    k_type = schema.field("k").type
    o_type = schema.field("o").type
    k = pa.StructArray.from_arrays(
        [last[n].combine_chunks().cast(k_type.field(i).type) for i, n in enumerate(keys)],
        fields=list(k_type),
    )
    o = pa.StructArray.from_arrays(
        [rows[c].combine_chunks().cast(pa.int64()) for c in _ORDER], fields=list(o_type)
    )
    return pa.table(
        [k, o, rows["op"], rows["after"].cast(schema.field("after").type), last["up_max"]],
        schema=schema,
    )


def lasts(tasks: Any) -> Any:
    """The tasks' rows (:func:`task_output`) reduced to each key's last image across
    files: the columns of :func:`~feed.txn.diffs.last_images`, one time."""
    from pyspark.sql import functions as F

    from feed.txn.diffs import last_images

    p = F.struct(*[F.col(f"o.{c}").alias(c) for c in _ORDER[:3]])
    events = tasks.select(
        "k", F.lit(0).cast("long").alias("unit"), "op", "after", "o", p.alias("p"), "up"
    )
    return last_images(events)


def compute(ctx: TxnContext, last: Any, input_rows: int) -> Computed | str:
    """The updates and the new state of the keys' ``last`` images (cached by the caller)
    against the state buckets they fall in, or why the transaction is declined (nothing
    written, nothing left cached but ``last``)."""
    from pyspark.sql import functions as F

    from feed.txn.diffs import absent_delete, consolidate_diffs, diffs_of_last

    cp, key = ctx.cp, ctx.info.key
    loaded = ctx.state.load(cp.state, last, F.col("k"), input_rows=input_rows)
    d = diffs_of_last(last, loaded.rows, key, ctx.record_type, one_unit=True)
    assert d.cached is not None
    try:
        absent = d.cached.where(absent_delete()).count()  # (the job that builds the cache)
    except BaseException:
        d.cached.unpersist()
        raise
    if absent:
        d.cached.unpersist()
        return f"{absent} delete(s) of a key that is not present (bad rows)"
    return Computed(
        updates=consolidate_diffs(d.diffs, cp.next),
        good=None,
        bad=None,
        bad_rows=0,
        units=1,
        position=None,
        new_state=d.state,
        loaded=loaded,
        cached=[d.cached],
    )
