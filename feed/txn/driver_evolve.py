"""A schema version's rewrite of the keyed state (:mod:`feed.txn.evolve`) on the driver.

The rewrite is the same as Spark's, column by column: each state row read through the new
version (``was``: a column the old shape had, cast to its new type; null otherwise) and as
it is now (``now``: a renamed column's old value, an added column's default, a dropped
column null, anything else as it was). A row whose ``was`` and ``now`` differ is an update
at the version's time, ``-was`` then ``+now``; every bucket is written again in the new
shape. Only the columns a version can change (renamed, defaulted, dropped) can differ, so
only they are compared, null-safely and with NaN equal to NaN, as Spark's ``eqNullSafe``
compares them.

It works one bucket at a time: memory holds one bucket, not the table. It declines, and
Spark rewrites the state, when the state is larger than :data:`MAX_ROWS`, not a bucketed
state with row counts, holds positions or tombstones (Debezium state has neither), when a
key column changes (its values would fall in other buckets), or when a default is not one
the driver's parse types exactly as Spark does (:mod:`feed.sources.connect_json`).
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from feed.log.manifest import Segment
from feed.log.store import PARQUET_PAGES
from feed.sources.shapes import Evolve
from feed.txn.context import TxnContext
from feed.txn.driver_state import read_buckets, write_parquet, write_time_tables
from feed.txn.segments import install_segments, staging_folder
from feed.txn.state import LoadedState

__all__ = ["MAX_ROWS", "rewrite_on_driver"]

#: the largest state (rows) the driver rewrites; a larger one is Spark's (its tasks in
#: parallel, on a cluster its executors)
MAX_ROWS = 1 << 22


def _arrow_record(record_type: Any) -> pa.Schema:
    from pyspark.sql.pandas.types import to_arrow_type

    return pa.schema(list(to_arrow_type(record_type, timezone="UTC")))


def _decline(ctx: TxnContext, why: str) -> None:
    ctx.log.debug(
        "feed %s: the new schema version's state is rewritten in Spark: %s", ctx.config.feed, why
    )


def _defaults(ev: Evolve, record: pa.Schema) -> dict[str, pa.Scalar] | str:
    """Each added column's default as a scalar of its column's type, typed as an event's
    value of it is, or why not here."""
    from feed.sources.connect import connect_names, connect_scales
    from feed.sources.connect_json import Declined, RecordDecoder

    if not ev.defaults:
        return {}
    if set(connect_scales(ev.schema)) & set(ev.defaults):
        return "a default of a decimal held as text"
    sub = pa.struct([record.field(n) for n in record.names if n in ev.defaults])
    try:
        typed = RecordDecoder(sub, connect_names(ev.schema)).typed(ev.defaults, "default")
        assert typed is not None
        return {n: pa.scalar(v, record.field(n).type) for n, v in typed.items()}
    except Declined as e:
        return str(e)
    except (pa.ArrowException, OverflowError, TypeError) as e:
        return f"a default Arrow does not hold as its column's type: {e}"


def _columns(
    ev: Evolve, rows: pa.Table, record: pa.Schema, defaults: dict[str, pa.Scalar]
) -> tuple[pa.Table, pa.Table, list[str]]:
    """The bucket's rows as they were and as they are now, in the new ``record``, and the
    columns that may differ between the two."""
    change = ev.change
    carried = {new: old for old, new in change.renamed}
    n = rows.num_rows
    was, now, differ = [], [], []
    for f in record:
        w = rows.column(f.name).cast(f.type) if f.name in rows.schema.names else pa.nulls(n, f.type)
        v = w
        if f.name in carried:
            v = rows.column(carried[f.name]).cast(f.type)
        elif f.name in defaults:
            v = pa.repeat(defaults[f.name], n)
        elif f.name in change.dropped:
            v = pa.nulls(n, f.type)
        if v is not w:
            differ.append(f.name)
        was.append(w)
        now.append(v)
    return pa.table(was, schema=record), pa.table(now, schema=record), differ


def _changed(was: pa.Table, now: pa.Table, columns: list[str]) -> pa.Array:
    """Which rows differ in any of ``columns``: null-safely, NaN equal to NaN."""
    mask = pa.repeat(pa.scalar(False), was.num_rows)
    for c in columns:
        a, b = was.column(c), now.column(c)
        one_null = pc.xor(pc.is_null(a), pc.is_null(b))
        ne = pc.fill_null(pc.not_equal(a, b), False)
        if pa.types.is_floating(a.type):
            ne = pc.and_(ne, pc.invert(pc.and_(pc.is_nan(a), pc.is_nan(b))))
            ne = pc.fill_null(ne, False)
        mask = pc.or_(mask, pc.or_(one_null, ne))
    return mask


def rewrite_on_driver(
    ctx: TxnContext, ev: Evolve, seq: int, start: int
) -> tuple[list[Segment], str | None] | None:
    """The keyed state rewritten into the version ``ev`` describes, and the updates that
    makes at ``start``, written on the driver (see the module docstring): the segments and
    the state reference the commit names; None (nothing written) when it declines."""
    from feed.sources.rows import spark_record_type

    cp, key = ctx.cp, tuple(ctx.info.key)
    loaded = ctx.state.committed(cp.state)
    if loaded is None:
        _decline(ctx, "not a bucketed state with row counts")
        return None
    if sum(loaded.counts.values()) > MAX_ROWS:
        _decline(ctx, f"more than {MAX_ROWS} rows")
        return None
    old, new = _arrow_record(ctx.record_type), _arrow_record(spark_record_type(ev.schema))
    moved = {o for o, _ in ev.change.renamed} | set(ev.change.dropped) | set(ev.widened)
    if moved & set(key) or any(old.field(k).type != new.field(k).type for k in key):
        _decline(ctx, "a key column changes")
        return None
    defaults = _defaults(ev, new)
    if isinstance(defaults, str):
        _decline(ctx, defaults)
        return None
    attempt = ctx.state.attempt(seq)
    staging = staging_folder(ctx.feedlog, seq)
    try:
        out = _write(ctx, ev, seq, start, (loaded, attempt, staging), old, new, defaults)
    except BaseException:
        _discard(ctx, attempt, staging)
        raise
    if out is None:  # (nothing it wrote is named by any manifest: gone before Spark's)
        _discard(ctx, attempt, staging)
        _decline(ctx, "state with positions or tombstones")
    return out


def _discard(ctx: TxnContext, attempt: str, staging: str) -> None:
    ctx.feedlog.delete_dir(ctx.feedlog.path("state", attempt))
    ctx.feedlog.delete_dir(staging)


def _write(
    ctx: TxnContext,
    ev: Evolve,
    seq: int,
    start: int,
    where: tuple[LoadedState, str, str],
    old: pa.Schema,
    new: pa.Schema,
    defaults: dict[str, pa.Scalar],
) -> tuple[list[Segment], str] | None:
    """Rewrite every bucket of the state ``loaded`` into ``attempt``, the updates into
    ``staging`` (or a pack), then install them and publish the state manifest; None
    (stopped at the first such bucket) when a bucket holds positions or tombstones."""
    loaded, attempt, staging = where
    fl = ctx.feedlog
    schema = pa.schema([*new, pa.field("diff", pa.int64())])
    packs = ctx.config.layout == "packs"
    path = f"{staging}/time={start}/part-{uuid.uuid4().hex}.parquet"
    kept: list[pa.Table] = []  # (a feed of packs: the updates, written as one pack)
    sink: Any = None
    writer: pq.ParquetWriter | None = None
    count = 0
    written = []
    try:
        for b in sorted(loaded.files):
            state = read_buckets(ctx, loaded, {b}, old)
            if state is None:
                return None
            if b not in state:
                continue
            was, now, differ = _columns(ev, state.pop(b), new, defaults)
            mask = _changed(was, now, differ)
            for side, diff in ((was, -1), (now, 1)):
                part = side.filter(mask)
                if not part.num_rows:
                    continue
                diffs = pa.repeat(pa.scalar(diff, pa.int64()), part.num_rows)
                part = part.append_column("diff", diffs)
                count += part.num_rows
                if packs:
                    kept.append(part)
                    continue
                if writer is None:
                    fl.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
                    sink = fl.fs.open_output_stream(path)
                    writer = pq.ParquetWriter(sink, schema, **PARQUET_PAGES)
                writer.write_table(part)
            if now.num_rows:
                file = f"{ctx.state.bucket_folder(attempt, b)}/part-{uuid.uuid4().hex}.parquet"
                written.append((b, file, write_parquet(fl.fs, file, now)))
    finally:
        if writer is not None:
            writer.close()
            sink.close()
    if packs:
        tables = {start: pa.concat_tables(kept)} if kept else {}
        segments = write_time_tables(ctx, seq, tables)
    else:
        segments = install_segments(ctx, [(start, path, count)] if count else [], ctx.cp.epoch)
        fl.delete_dir(staging)
    every = replace(loaded, touched=frozenset(loaded.files))
    state_ref: str = ctx.state.publish(attempt, written, every)
    return segments, state_ref
