"""The keyed half of the one-pass engine (:mod:`feed.txn.onepass`).

A keyed feed never trusts a before-image: each key's net change in a transaction of one
time is "retract the state's row, add the last after-image" (:mod:`feed.txn.diffs`). Only
each key's last event matters, so a task keeps, of each file's kept events, each key's
last by position (:func:`last_per_key`) with whether any of them upserted it, and of
those of its files the last again (:func:`merge`). The job then takes the last of those
per key across tasks (:func:`lasts`: the keys hashed to
partitions, pyarrow in each), which gives what the Spark path's
:func:`~feed.txn.diffs.last_images` gives over all the events, and caches it (a key
changed by a source transaction whose END is in another file waits, *pending*, until the
driver knows that END's commit LSN: :func:`settle`); the same
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
from feed.txn.onepass_txns import last_of

__all__ = ["Probe", "compute", "last_per_key", "lasts", "merge", "probe", "task_output"]

#: the order of a transaction's changes (:func:`feed.sources.positions.order_column`)
_ORDER = ("pos_hi", "pos_lo", "pos_n", "ord_file", "ord_row")


def task_output(record: Any, key: Sequence[str]) -> Any:
    """The Spark schema of a task's rows: each key (``k``) with its last event's order
    (``o``), ``op`` and ``after``, and whether the file upserted the key (``up``). An
    event of a source transaction whose END record is in another file has no commit LSN
    in its task (``o.pos_hi`` null): the key's last such event of each of those
    transactions comes out too, with the transaction (``txn``; null on the others)."""
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
            T.StructField("txn", T.StringType()),
        ]
    )


def last_per_key(kept: pa.Table, key: Sequence[str], schema: pa.Schema) -> pa.Table:
    """Of one file's ``kept`` events (the columns of
    :func:`~feed.sources.debezium_arrow.parse_flat`, placed at their commit LSN by
    :func:`~feed.txn.onepass_txns.at_commit`), each key's last by position, as rows of
    :func:`task_output` (``schema``, its Arrow form); of the events without a commit LSN,
    each key's last in each of their source transactions."""
    placed = pc.is_valid(kept["pos_hi"])
    if kept.num_rows and not pc.all(placed).as_py():
        parts = (
            _last_rows(kept.filter(placed), key, schema, ()),
            _last_rows(kept.filter(pc.invert(placed)), key, schema, ("txn",)),
        )
        return pa.concat_tables(parts)
    return _last_rows(kept, key, schema, ())


def _last_rows(
    kept: pa.Table, key: Sequence[str], schema: pa.Schema, also: tuple[str, ...]
) -> pa.Table:
    """:func:`last_per_key` of ``kept``, per key and the columns ``also``."""
    if kept.num_rows == 0:
        return schema.empty_table()
    is_delete = pc.fill_null(pc.equal(kept["op"], "d"), False)
    keys = [
        pc.if_else(is_delete, pc.struct_field(kept["before"], k), pc.struct_field(kept["after"], k))
        for k in key
    ]
    up = pc.invert(is_delete).cast(pa.int32())
    by = [*keys, *(kept[c] for c in also)]
    at, ups = last_of(by, kept.select(list(_ORDER)), up)
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
    txn = rows["txn"] if also else pa.nulls(len(at), pa.string())
    return pa.table([k, o, rows["op"], after, ups, txn], schema=schema)


def merge(parts: list[pa.Table]) -> pa.Table:
    """Several files' :func:`last_per_key` rows as one task's: of the placed rows each
    key's last, of the others each key's last in each source transaction, each with the
    highest ``up`` of the rows it stands for (what :func:`lasts` takes of them is the
    same)."""
    t = pa.concat_tables(parts)
    placed = pc.is_valid(t["o"].combine_chunks().field("pos_hi"))
    if pc.all(placed).as_py():
        return _merged(t, ())
    return pa.concat_tables(
        [_merged(t.filter(placed), ()), _merged(t.filter(pc.invert(placed)), ("txn",))]
    )


def _merged(t: pa.Table, also: tuple[str, ...]) -> pa.Table:
    """:func:`merge` of ``t``, per key and the columns ``also``."""
    if t.num_rows == 0:
        return t
    keys, order = _keys_and_order(t)
    at, ups = last_of([*keys, *(t[c] for c in also)], order, t["up"])
    rows = t.take(at)
    i = rows.schema.get_field_index("up")
    return rows.set_column(i, rows.schema.field(i), ups.cast(rows.schema.field(i).type))


def _keys_and_order(t: pa.Table) -> tuple[list[pa.Array], pa.Table]:
    """The key columns of rows of :func:`task_output` (``t``) and their order's columns
    (:data:`_ORDER`), as :func:`~feed.txn.onepass_txns.last_of` takes them."""
    k, o = t["k"].combine_chunks(), t["o"].combine_chunks()
    return [k.field(i) for i in range(k.type.num_fields)], pa.table({c: o.field(c) for c in _ORDER})


def last_output(tasks: Any) -> Any:
    """The Spark schema of :func:`lasts`' rows: :func:`~feed.txn.diffs.last_images`',
    and the columns that say which keys wait for a commit LSN."""
    from pyspark.sql import types as T

    long = T.LongType()
    return T.StructType(
        [
            T.StructField("k", tasks["k"].dataType),
            T.StructField("unit", long),
            T.StructField("has_upsert", T.IntegerType()),
            T.StructField("p", T.StructType([T.StructField(c, long) for c in _ORDER[:3]])),
            T.StructField("img", tasks["after"].dataType),
            T.StructField("txn", T.StringType()),
            T.StructField("pending", T.BooleanType()),
        ]
    )


#: the columns of :func:`~feed.txn.diffs.last_images`
LAST_COLUMNS = ("k", "unit", "has_upsert", "p", "img")


def lasts(tasks: Any) -> Any:
    """The tasks' rows (:func:`task_output`) reduced to each key's last image across
    files: the columns of :func:`~feed.txn.diffs.last_images`, one time. Each key's rows
    meet in one partition (Spark's hash of the key) and pyarrow takes the last there:
    Spark's own aggregate of a struct by the greatest order sorts every row twice. A key
    whose last row has no commit LSN yet (``o.pos_hi`` null) is *pending*: all its rows
    come out, each with its ``txn``, for :func:`settle` to order."""
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
    keys, order = _keys_and_order(t)
    if not order["pos_hi"].null_count:
        at, ups = last_of(keys, order, t["up"])
        yield from _images(t.take(at), ups, schema).to_batches()
        return
    at, ups, each = last_of(keys, order, t["up"], rows=True)
    waits = pc.is_null(order["pos_hi"].take(at))
    settled = pc.invert(waits)
    yield from _images(t.take(at.filter(settled)), ups.filter(settled), schema).to_batches()
    mine = pc.list_flatten(each.filter(waits))
    yield from _images(t.take(mine), t["up"].take(mine), schema, pending=True).to_batches()


def _images(rows: pa.Table, ups: Any, schema: pa.Schema, pending: bool = False) -> pa.Table:
    """``rows`` of :func:`task_output` as rows of :func:`last_output` (``schema``)."""
    deleted = pc.fill_null(pc.equal(rows["op"], "d"), False)
    after = rows["after"].combine_chunks()
    img = pc.if_else(deleted, pa.nulls(len(after), after.type), after)
    lo = rows["o"].combine_chunks()
    p = pa.StructArray.from_arrays(
        [lo.field(c) for c in _ORDER[:3]], fields=list(schema.field("p").type)
    )
    n = rows.num_rows
    txn = rows["txn"] if pending else pa.nulls(n, pa.string())
    flags = pa.array(np.full(n, pending))
    columns = [rows["k"], pa.array(np.zeros(n, dtype=np.int64)), ups, p, img, txn, flags]
    return pa.table(columns, schema=schema)


#: pending rows settled on the driver at most; more go through a Spark job
DRIVER_PENDING = 50_000


def settle(last: Any, commits: dict[str, int], pending: int | None = None) -> Any:
    """``last`` (:func:`lasts`, cached) with each pending key settled now that the
    ``commits`` (source transaction: commit LSN) of the transactions open in the files
    are known: the columns of :func:`~feed.txn.diffs.last_images`. The rest is a
    projection of the cache. The pending rows (``pending`` of them, :class:`Probe`; a few
    keys at each file's ends) are fetched once and settled on the driver, so the writes
    that read the result scan the cache once each; more than :data:`DRIVER_PENDING` of
    them (or an unknown number) are settled in the partitions that hold them."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T
    from pyspark.sql.pandas.types import to_arrow_schema

    settled = last.where(~F.col("pending")).select(*LAST_COLUMNS)
    if not commits or pending == 0:  # (no key waits for a commit LSN)
        return settled
    out = T.StructType([last.schema[c] for c in LAST_COLUMNS])
    schema = to_arrow_schema(out, timezone="UTC")
    waiting = last.where(F.col("pending"))
    if pending is None or pending > DRIVER_PENDING:
        fn = functools.partial(_settle, schema=schema, commits=commits)
        return settled.unionByName(waiting.mapInArrow(fn, out))
    rows = waiting.toArrow()
    done = pa.Table.from_batches(list(_settle(iter(rows.to_batches()), schema, commits)), schema)
    return settled.unionByName(last.sparkSession.createDataFrame(done, schema=out))


def _settle(
    batches: Iterator[pa.RecordBatch], schema: pa.Schema, commits: dict[str, int]
) -> Iterator[pa.RecordBatch]:
    """:func:`settle` of pending rows that hold all the rows of their keys (a partition's:
    a key's rows are all in one, :func:`lasts`; or every pending row, on the driver): each
    key's last of them by commit order."""
    got = list(batches)
    if not got or not any(b.num_rows for b in got):
        return
    w = pa.Table.from_batches(got)
    p = w["p"].combine_chunks()
    known = pa.array([commits.get(x) for x in w["txn"].to_pylist()], pa.int64())
    hi = pc.coalesce(p.field("pos_hi"), known)
    k = w["k"].combine_chunks()
    order = pa.table({"pos_hi": hi, "pos_lo": p.field("pos_lo"), "pos_n": p.field("pos_n")})
    at, ups = last_of([k.field(i) for i in range(k.type.num_fields)], order, w["has_upsert"])
    rows = w.take(at)
    placed = pa.StructArray.from_arrays(
        [hi.take(at), p.field("pos_lo").take(at), p.field("pos_n").take(at)],
        fields=list(schema.field("p").type),
    )
    settled = pa.table([rows["k"], rows["unit"], ups, placed, rows["img"]], schema=schema)
    yield from settled.to_batches()


class Probe(NamedTuple):
    """What the job that caches the keys' last images finds of them."""

    #: the state buckets the keys fall in (None: not asked, the state is loaded otherwise)
    touched: frozenset[int] | None
    #: whether a key is only deleted here (a delete of a key not present, if the state
    #: has no row of it either)
    deletes_only: bool
    #: the rows of the cache: the keys changed, and a pending key's rows each
    keys: int = 0
    #: the rows of keys that wait for a commit LSN (:func:`settle`)
    pending: int = 0


def probe(ctx: TxnContext, last: Any) -> Probe:
    """Build the cache of ``last`` (:func:`lasts`) in a job that also finds its
    :class:`Probe`: the buckets, where the committed state is loaded bucket by bucket
    (:meth:`~feed.txn.state.BucketedState.committed`)."""
    from pyspark.sql import functions as F

    from feed.txn.state import bucket_of

    committed = ctx.state.committed(ctx.cp.state)
    b = bucket_of(F.col("k"), ctx.info.key, committed.buckets) if committed else F.lit(-1)
    only = (F.col("img").isNull() & (F.col("has_upsert") == 0)).cast("int")
    waits = F.sum(F.col("pending").cast("long")).alias("waits")
    figures = [F.max(only).alias("only"), F.count(F.lit(1)).alias("n"), waits]
    rows = last.groupBy(b.alias("b")).agg(*figures).collect()
    return Probe(
        frozenset(r["b"] for r in rows) if committed else None,
        any(r["only"] for r in rows),
        sum(r["n"] for r in rows),
        sum(r["waits"] for r in rows),
    )


def compute(
    ctx: TxnContext, lasts: Any, input_rows: int, found: Probe, commits: dict[str, int]
) -> Computed | str:
    """The updates and the new state of the keys' last images (``lasts``, cached by the
    caller; ``found`` by :func:`probe`; ``commits``: see :func:`settle`) against the state
    buckets they fall in, or why the transaction is declined (nothing written, nothing
    left cached but ``lasts``)."""
    from pyspark.sql import functions as F

    from feed.txn.diffs import (
        absent_delete,
        consolidate_diffs,
        diffs_of_last,
        groups_as_is,
        one_unit_updates,
    )

    cp, key, record_t = ctx.cp, ctx.info.key, ctx.record_type
    last = settle(lasts, commits, found.pending)
    # (a first state is sized by the keys it may hold, not by the events read: the
    # Spark path knows only the latter)
    rows = min(input_rows, found.keys)
    loaded = ctx.state.load(cp.state, last, F.col("k"), touched=found.touched, input_rows=rows)
    # (no state rows to join: ``last`` is all there is, the cache seen through settle())
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
