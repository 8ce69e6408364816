"""The keyed half of the one-pass engine (:mod:`feed.txn.onepass`).

A keyed feed never trusts a before-image: each key's net change in a transaction of one
time is "retract the state's row, add the last after-image" (:mod:`feed.txn.diffs`). Only
each key's last event matters, so a file's task keeps, of its kept events, each key's
last by position (:func:`last_per_key`) with whether any of them upserted it. The job
then takes the last of those per key across files (:func:`lasts`: the keys hashed to
partitions, pyarrow in each), which gives what the Spark path's
:func:`~feed.txn.diffs.last_images` gives over all the events, and caches it; the same
job finds the state buckets the keys touch (:func:`probe`). :func:`compute` loads those
buckets and diffs against them with the Spark path's
:func:`~feed.txn.diffs.diffs_of_last`. A delete of a key that has no row is a bad row on
the Spark path, which quarantines it with its line: here it declines the transaction,
nothing written.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from feed.txn.context import Computed, TxnContext

__all__ = ["Probe", "compute", "last_per_key", "lasts", "probe", "task_output"]

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
    is_delete = pc.fill_null(pc.equal(kept["op"], "d"), False)
    keys = [
        pc.if_else(is_delete, pc.struct_field(kept["before"], k), pc.struct_field(kept["after"], k))
        for k in key
    ]
    up = pc.invert(is_delete).cast(pa.int32())
    at, ups = _last(keys, kept.select(list(_ORDER)), up)
    rows = kept.take(at)
    k_type, o_type = schema.field("k").type, schema.field("o").type
    k = pa.StructArray.from_arrays(
        [a.take(at).combine_chunks().cast(k_type.field(i).type) for i, a in enumerate(keys)],
        fields=list(k_type),
    )
    o = pa.StructArray.from_arrays(
        [rows[c].combine_chunks().cast(pa.int64()) for c in _ORDER], fields=list(o_type)
    )
    after = rows["after"].cast(schema.field("after").type)
    return pa.table([k, o, rows["op"], after, ups], schema=schema)


def _last(keys: Sequence[Any], order: pa.Table, up: Any) -> tuple[pa.Array, pa.ChunkedArray]:
    """Which row is each key's last by ``order`` (its columns, ascending; none null), and
    the highest ``up`` of each key's rows: the rows' indices and those highs."""
    by = pc.sort_indices(order, [(c, "ascending") for c in order.column_names])
    names = [f"k{i}" for i in range(len(keys))]
    ranked = pa.table(
        {
            **{n: a.take(by) for n, a in zip(names, keys, strict=True)},
            "_i": pa.array(np.arange(len(by), dtype=np.int64)),
            "up": up.take(by),
        }
    )
    last = ranked.group_by(names).aggregate([("_i", "max"), ("up", "max")])
    return by.take(last["_i_max"]), last["up_max"]


def last_output(tasks: Any) -> Any:
    """The Spark schema of :func:`lasts`' rows: :func:`~feed.txn.diffs.last_images`'."""
    from pyspark.sql import types as T

    long = T.LongType()
    return T.StructType(
        [
            T.StructField("k", tasks["k"].dataType),
            T.StructField("unit", long),
            T.StructField("has_upsert", T.IntegerType()),
            T.StructField("p", T.StructType([T.StructField(c, long) for c in _ORDER[:3]])),
            T.StructField("img", tasks["after"].dataType),
        ]
    )


def lasts(tasks: Any) -> Any:
    """The tasks' rows (:func:`task_output`) reduced to each key's last image across
    files: the columns of :func:`~feed.txn.diffs.last_images`, one time. Each key's rows
    meet in one partition (Spark's hash of the key) and pyarrow takes the last there:
    Spark's own aggregate of a struct by the greatest order sorts every row twice."""
    from pyspark.sql.pandas.types import to_arrow_schema

    out = last_output(tasks.schema)
    schema = to_arrow_schema(out, timezone="UTC")
    return tasks.repartition("k").mapInArrow(functools.partial(_lasts, schema=schema), out)


def _lasts(batches: Iterator[pa.RecordBatch], schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """One partition's part of :func:`lasts`."""
    got = list(batches)
    if not got or not any(b.num_rows for b in got):
        return
    t = pa.Table.from_batches(got)
    k, o = t["k"].combine_chunks(), t["o"].combine_chunks()
    keys = [k.field(i) for i in range(k.type.num_fields)]
    order = pa.table({c: o.field(c) for c in _ORDER})
    at, ups = _last(keys, order, t["up"])
    rows = t.take(at)
    deleted = pc.fill_null(pc.equal(rows["op"], "d"), False)
    after = rows["after"].combine_chunks()
    img = pc.if_else(deleted, pa.nulls(len(after), after.type), after)
    lo = rows["o"].combine_chunks()
    p = pa.StructArray.from_arrays(
        [lo.field(c) for c in _ORDER[:3]], fields=list(schema.field("p").type)
    )
    unit = pa.array(np.zeros(len(at), dtype=np.int64))
    yield from pa.table([rows["k"], unit, ups, p, img], schema=schema).to_batches()


class Probe(NamedTuple):
    """What the job that caches the keys' last images finds of them."""

    #: the state buckets the keys fall in (None: not asked, the state is loaded otherwise)
    touched: frozenset[int] | None
    #: whether a key is only deleted here (a delete of a key not present, if the state
    #: has no row of it either)
    deletes_only: bool


def probe(ctx: TxnContext, last: Any) -> Probe:
    """Build the cache of ``last`` (:func:`lasts`) in a job that also finds its
    :class:`Probe`: the buckets, where the committed state is loaded bucket by bucket
    (:meth:`~feed.txn.state.BucketedState.committed`)."""
    from pyspark.sql import functions as F

    from feed.txn.state import bucket_of

    committed = ctx.state.committed(ctx.cp.state)
    b = bucket_of(F.col("k"), ctx.info.key, committed.buckets) if committed else F.lit(-1)
    only = (F.col("img").isNull() & (F.col("has_upsert") == 0)).cast("int")
    rows = last.groupBy(b.alias("b")).agg(F.max(only).alias("only")).collect()
    return Probe(
        frozenset(r["b"] for r in rows) if committed else None, any(r["only"] for r in rows)
    )


def compute(ctx: TxnContext, last: Any, input_rows: int, found: Probe) -> Computed | str:
    """The updates and the new state of the keys' ``last`` images (cached by the caller;
    ``found`` by :func:`probe`) against the state buckets they fall in, or why the
    transaction is declined (nothing written, nothing left cached but ``last``)."""
    from pyspark.sql import functions as F

    from feed.txn.diffs import (
        absent_delete,
        consolidate_diffs,
        diffs_of_last,
        groups_as_is,
        one_unit_updates,
    )

    cp, key, record_t = ctx.cp, ctx.info.key, ctx.record_type
    loaded = ctx.state.load(
        cp.state, last, F.col("k"), touched=found.touched, input_rows=input_rows
    )
    # (no state rows to join: ``last`` is all there is, cached already)
    joined = loaded.rows is not None
    d = diffs_of_last(last, loaded.rows, key, record_t, one_unit=True, persist=joined)
    assert d.cached is not None
    if found.deletes_only:
        try:
            absent = d.cached.where(absent_delete()).count()  # (builds the cache)
        except BaseException:
            d.cached.unpersist()
            raise
        if absent:
            d.cached.unpersist()
            return f"{absent} delete(s) of a key that is not present (bad rows)"
    if groups_as_is(record_t):
        updates = one_unit_updates(d.cached, cp.next)
    else:
        updates = consolidate_diffs(d.diffs, cp.next)
    return Computed(
        updates=updates,
        good=None,
        bad=None,
        bad_rows=0,
        units=1,
        position=None,
        new_state=d.state,
        loaded=loaded,
        cached=[d.cached] if joined else [],
    )
