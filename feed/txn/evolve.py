"""A feed's next record schema version, committed at a time of its own.

When a Debezium table changes shape (feed/sources/shapes.py) in a way one growing schema holds (a
column added, dropped, or widened), the emitter commits what came before the change, then
this step at the next time ``T``:

1. the new version is written to ``schemas/<T>.json`` (every old column kept: a dropped
   one nullable and null from ``T`` on, an added one nullable, a widened one in its new
   type);
2. every row the keyed state holds is rewritten into it, as PostgreSQL rewrites the table:
   an added column takes its default (the Connect schema's ``default``: a constant
   ``DEFAULT``; null without one), a dropped one becomes null, a renamed one (the
   capture's column numbers tell it: feed/sources/shapes.py) moves its values to its new name.
   Each row that changes is an update at ``T``: ``-old`` (the old row read through the
   new schema: absent columns null) and ``+new``. A widened column changes no row;
3. the commit of ``T`` names the new state and the new schema's fingerprint; no input is
   consumed, so the next step reads the held input again through the new schema.

``T`` stands for the ``ALTER TABLE`` itself, which is a PostgreSQL transaction of its
own: at every complete time the collection equals the table. A crash before the commit
leaves the version file of an uncommitted time, which readers never take
(:meth:`feed.log.info.FeedInfo.at`) and the redo writes again. Readers read every time through
the newest version (feed/log/reader.py): a record read that way is the record as it was,
because a null column counts as absent (:func:`protocol.messages.record_key`).
"""

from __future__ import annotations

from typing import Any

import orjson

from feed.log.info import SchemaVersion
from feed.log.manifest import Segment
from feed.sources.cached import cached
from feed.sources.shapes import Evolve
from feed.txn.context import TxnContext
from feed.txn.driver_evolve import rewrite_on_driver
from protocol import SourceError

__all__ = ["rewrite"]


def _defaults(
    ctx: TxnContext, new_type: Any, schema: dict[str, Any], defaults: dict[str, Any]
) -> Any:
    """A one-row DataFrame whose struct column ``_defaults`` holds each added column's
    default, decoded from its Connect encoding as an event's value would be."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    from feed.sources.connect import as_strings, connect_names, connect_scales, typed_record

    sub = T.StructType([f for f in new_type.fields if f.name in defaults])
    raw = F.from_json(F.lit(orjson.dumps(defaults).decode()), as_strings(sub))
    value, _ = typed_record(raw, sub, "default:", connect_names(schema), connect_scales(schema))
    return ctx.spark.range(1).select(value.alias("_defaults"))


def rewrite(
    ctx: TxnContext, ev: Evolve, seq: int, start: int, *, driver: bool = False
) -> tuple[SchemaVersion, list[Segment], str | None, bool]:
    """Write the version ``ev`` describes (from ``start``), the state rewritten into it and
    the updates that rewrite makes at ``start``; return the version, the segments, the
    state reference the commit names and whether Spark was left alone. With ``driver``,
    the driver rewrites a state :func:`feed.txn.driver_evolve.rewrite_on_driver` takes."""
    from pyspark.sql import functions as F

    from feed.sources.rows import spark_record_type
    from feed.txn.segments import write_updates
    from feed.txn.state import GONE_COLUMN, POS_COLUMN

    change = ev.change
    version = SchemaVersion(
        start=start,
        schema=ev.schema,
        added=change.added,
        dropped=change.dropped,
        widened=ev.widened,
        renamed=change.renamed,
        shapes=tuple(sorted(ctx.shapes)),
    )
    fl, cp = ctx.feedlog, ctx.cp
    fl.write_schema_version(version)
    if not ctx.info.key:
        if change.dropped or ev.defaults:
            raise SourceError(
                f"feed {ctx.config.feed!r}: the source table changed shape at {ev.where} "
                f"({change.describe()}), which changes rows the feed does not keep: an "
                "unkeyed feed cannot rewrite them. Nothing after the change was committed; "
                "start a new feed from a new snapshot of the table."
            )
        return version, [], cp.state, True
    if not cp.state:
        return version, [], cp.state, True
    if driver:
        done = rewrite_on_driver(ctx, ev, seq, start)
        if done is not None:
            return version, *done, True
    loaded = ctx.state.everything(cp.state)
    if loaded.rows is None:
        return version, [], cp.state, False
    new_type = spark_record_type(ev.schema)
    rows = loaded.rows
    if ev.defaults:
        rows = rows.crossJoin(F.broadcast(_defaults(ctx, new_type, ev.schema, ev.defaults)))
    old_cols, new_cols = _old_and_new(ev, new_type, set(ctx.record_type.fieldNames()))
    both = cached(
        rows.select(
            F.struct(*old_cols).alias("old"),
            F.struct(*new_cols).alias("new"),
            POS_COLUMN,
            GONE_COLUMN,
        )
    )
    try:
        changed = both.where(~F.col(GONE_COLUMN) & ~F.col("old").eqNullSafe(F.col("new")))
        updates = changed.select(
            F.lit(start).cast("long").alias("time"),
            F.col("old").alias("data"),
            F.lit(-1).cast("long").alias("diff"),
        ).unionByName(
            changed.select(
                F.lit(start).cast("long").alias("time"),
                F.col("new").alias("data"),
                F.lit(1).cast("long").alias("diff"),
            )
        )
        segments = write_updates(ctx, seq, updates)
        state_ref = ctx.state.write(
            seq, both.select(F.col("new").alias("data"), POS_COLUMN, GONE_COLUMN), loaded
        )
    finally:
        both.unpersist()
    return version, segments, state_ref, False


def _old_and_new(ev: Evolve, new_type: Any, old_names: set[str]) -> tuple[list[Any], list[Any]]:
    """For each column of the new version, its value in a state row as it was (read
    through the new version: null where the old shape had no such column) and as it is
    now (a renamed column's old value, a new column's default, a dropped column null)."""
    from pyspark.sql import functions as F

    change = ev.change
    carried = {new: old for old, new in change.renamed}
    old_cols, new_cols = [], []
    for f in new_type.fields:
        was = (
            F.col("data")[f.name].cast(f.dataType)
            if f.name in old_names
            else F.lit(None).cast(f.dataType)
        )
        now = was
        if f.name in carried:
            now = F.col("data")[carried[f.name]].cast(f.dataType)
        elif f.name in ev.defaults:
            now = F.col("_defaults")[f.name]
        elif f.name in change.dropped:
            now = F.lit(None).cast(f.dataType)
        old_cols.append(was.alias(f.name))
        new_cols.append(now.alias(f.name))
    return old_cols, new_cols
