"""A Debezium transaction's assembly, for :func:`feed.txn.dataflow.read_input`: the source
transactions released in order or held back until complete
(:mod:`feed.sources.transactions`), and a change of the table's shape found and cut at
(:mod:`feed.sources.shapes`, :mod:`feed.txn.evolve`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from feed.sources.cached import released
from feed.txn.context import GroupHold, TxnContext, base_name, tally, waiting
from protocol import SourceError

__all__ = ["DebeziumRead", "assemble_debezium", "find_unfit_shapes"]


def find_unfit_shapes(
    ctx: TxnContext,
    files: Sequence[str],
    shapes: Iterable[int],
    sample: Callable[[int], list[dict[str, Any]]] | None = None,
) -> list[tuple[int, Any]]:
    """The source table shapes in ``files`` that do not fit the feed's record schema, and
    how (:func:`feed.sources.shapes.unfit_shapes`: the caller cuts at the one delivered
    first); [] when all fit. ``sample`` finds a shape's columns (by default a Spark job
    over ``files``)."""
    from feed.sources.shapes import sample_in, unfit_shapes

    return unfit_shapes(
        feed_schema=ctx.info.schema,
        shapes=shapes,
        known=ctx.shapes,
        sample=sample or sample_in(lambda: ctx.spark, files),
        gone=ctx.info.dropped,
        feed=ctx.config.feed,
        files=files,
    )


def _earliest_cut(changes: Any, unfit: list[tuple[int, Any]]) -> tuple[Any, str, Any]:
    """Of the ``unfit`` shapes (hash, change), the cut delivered first: where its source
    transaction begins, the file of its first event and its change (see
    :func:`_first_of_shape`). Two shapes first met in one source transaction: the one
    whose first event comes first."""
    cuts = []
    for h, change in unfit:
        start, shape_file, event = _first_of_shape(changes, h)
        place = (start["ord_file"], start["ord_row"], event["ord_file"], event["ord_row"])
        cuts.append((place, start, shape_file, change))
    _, start, shape_file, change = min(cuts, key=lambda c: c[0])
    return start, shape_file, change


def _first_of_shape(changes: Any, shape: int) -> tuple[Any, str, Any]:
    """Where the source transaction of the first event of table shape ``shape`` begins
    (``ord_file``, ``ord_row``, ``_file``): from there on, everything is held back (DDL may
    sit between two changes of one PostgreSQL transaction); the file of that event, and
    its own place."""
    from pyspark.sql import functions as F

    at = F.struct("ord_file", "ord_row", "_file")
    txn = (
        changes.where(F.col("_shape") == F.lit(shape))
        .agg(F.min(F.struct(at.alias("at"), F.col("txn"))).alias("m"))
        .collect()[0]["m"]
    )
    start = (
        changes.where(F.col("txn") == F.lit(txn["txn"])).agg(F.min(at).alias("m")).collect()[0]["m"]
    )
    return start, base_name(txn["at"]["_file"]), txn["at"]


@dataclass(frozen=True)
class DebeziumRead:
    """What assembling a Debezium read gave :func:`read_input`."""

    assembled: Any  # feed.sources.transactions.Assembled
    touched: frozenset[int] | None  # the state buckets this transaction meets
    tally_rows: list[Any]  # the input's figures per file
    shape_held: frozenset[str]  # files read again: the table changed shape in them
    shape_stop: Exception | None  # a group's feed: the change of shape, for the group


def assemble_debezium(
    ctx: TxnContext,
    changes: Any,
    good: Any,
    files: Sequence[str],
    *,
    more: bool,
    group: GroupHold | None,
    keyed: bool,
    image: Any,
    distinct: bool = False,
    ends: bool = True,
) -> DebeziumRead | object | None:
    """Debezium's source transactions decided (feed/sources/transactions.py), cut before
    a change of the table's shape; ``None`` or :data:`NEED_MORE` as for
    :func:`read_input` when nothing is released. Refusals raise, with the cache let go.
    ``distinct``: the read showed that no two data events share a position; ``ends``
    False: it counted no transaction END record."""
    from pyspark.sql import functions as F

    from feed.sources.positions import committed_position, position_filter
    from feed.sources.transactions import assemble
    from feed.txn.state import bucket_of

    cfg, cp = ctx.config, ctx.cp
    buckets = ctx.state.buckets(cp.state) if keyed else None
    # the events assemble keeps (an event read again, committed already, is not)
    fresh, _ = position_filter(
        committed_position(cp.source.get("pos", [0, 0])), cp.source.get("snapshot_lsn")
    )

    def assembled_with(hold_at: tuple[int, int] | None = None) -> Any:
        # the counts and the state buckets come with the transaction figures: one job
        if group is not None and group.at is not None:
            hold_at = group.at if hold_at is None else min(hold_at, group.at)
        return assemble(
            good,
            cp.source.get("pos", [0, 0]),
            snapshot_lsn=cp.source.get("snapshot_lsn"),
            snapshot_txn=cp.source.get("snapshot_txn"),
            new_feed="snapshot_lsn" not in cp.source,
            logger=ctx.log,
            feed=cfg.feed,
            bucket=bucket_of(image, ctx.info.key, buckets) if buckets else None,
            also=tally(changes.groupBy("_file", "_skip"), F.lit(False), fresh),
            hold_at=hold_at,
            hold_txns=group.txns if group is not None else frozenset(),
            distinct=distinct,
            ends=ends,
        )

    assembled = assembled_with()
    shape_held: frozenset[str] = frozenset()
    shape_stop: Exception | None = None
    touched, tally_rows = assembled.buckets, list(assembled.also)
    try:
        unfit = find_unfit_shapes(ctx, files, (h for r in tally_rows for h in r["shapes"] or ()))
    except SourceError:
        released(changes, *assembled.cached)
        raise
    if unfit:
        released(*assembled.cached)
        assembled, shape_held, shape_stop = _cut_at_shape(
            ctx, changes, unfit, group, assembled_with
        )
        touched, tally_rows = assembled.buckets, list(assembled.also)
    txn_cached = assembled.cached
    why = _refusal(ctx, assembled, keyed=keyed, more=more)
    if why is not None:
        released(changes, *txn_cached)
        raise SourceError(why)
    if assembled.replaces is not None and buckets:
        touched = frozenset(range(buckets))  # every key may have gone
    if assembled.held and not assembled.ready and group is None:
        released(changes, *txn_cached)
        return waiting(ctx.log, f"feed {cfg.feed}", assembled.held, more=more)
    return DebeziumRead(assembled, touched, tally_rows, shape_held, shape_stop)


def _refusal(ctx: TxnContext, assembled: Any, *, keyed: bool, more: bool) -> str | None:
    """Why the feed stops at what :func:`assemble_debezium` assembled (nothing is
    committed), or None: a new snapshot of an unkeyed feed, or transaction blocks
    without any END record."""
    cfg = ctx.config
    replaces = assembled.replaces
    if replaces is not None and not keyed:
        return (
            f"feed {cfg.feed!r}: Debezium snapshotted {cfg.table or 'the table'} "
            f"again (snapshot LSN {replaces[0]}); an unkeyed feed cannot tell which "
            "rows the new snapshot no longer holds, so nothing was committed: give "
            "the feed --key, or start a new feed from the new snapshot"
        )
    if assembled.endless > 1 and not more and not cfg.tx_metadata:
        # Debezium writes a transaction's END before the next transaction's events:
        # two transactions without one END in all the input mean the END records
        # are not in it, and without them no transaction would ever be released
        return (
            f"feed {cfg.feed!r}: {assembled.endless} source transactions in "
            f"{cfg.source_path} carry Debezium 'transaction' blocks, but no "
            "transaction END record was read; give --tx-metadata PATH (the folder of "
            "the connector's transaction metadata topic), or capture with "
            "provide.transaction.metadata=false. Nothing was committed."
        )
    return None


def version_at_head(ctx: TxnContext, change: Any, where: str, shape_file: str) -> Exception:
    """What a change of shape at the head of the input raises: the feed's next schema
    version (:class:`~feed.sources.shapes.Evolve`), or the error that stops the feed.
    ``where``: the file its source transaction begins in; ``shape_file``: the file of
    its first event of the new shape (both base names)."""
    from feed.sources.inputs import list_files
    from feed.sources.shapes import next_version, with_renames

    cfg, info = ctx.config, ctx.info
    change = with_renames(change, list_files(cfg.source_path), info.table, shape_file)
    return next_version(cfg.feed, info.table, info, change, where)


def _cut_at_shape(
    ctx: TxnContext,
    changes: Any,
    unfit: list[tuple[int, Any]],
    group: GroupHold | None,
    assembled_with: Callable[[tuple[int, int] | None], Any],
) -> tuple[Any, frozenset[str], Exception | None]:
    """The table changed shape in this read: assemble again holding everything from its
    first event of a new shape (committed first is what came before), and find the
    feed's next schema version when that event heads the input. The assembly, the files
    read again, and for a group's feed the change (a lone feed's is raised)."""
    from pyspark.sql import functions as F

    cfg = ctx.config
    first, shape_file, change = _earliest_cut(changes, unfit)
    assembled = assembled_with((first["ord_file"], first["ord_row"]))
    shape_stop: Exception | None = None
    if not assembled.ready:
        # at the head of the input: the feed's next schema version, if any
        found = version_at_head(ctx, change, base_name(first["_file"]), shape_file)
        if group is None:
            released(changes, *assembled.cached)
            raise found
        shape_stop = found  # the group commits it with its other feeds
    ctx.log.info(
        "feed %s: the source table changed shape in %s (%s): committing what came before it first",
        cfg.feed,
        base_name(first["_file"]),
        change.describe(),
    )
    # every file from there on is read again (and none of its rows quarantined: a
    # row of the new shape may not fit the old record, and its transaction's END
    # may sit in a later file than the row)
    shape_held = frozenset(
        r["_file"]
        for r in changes.where(F.col("ord_file") >= F.lit(first["ord_file"]))
        .select("_file")
        .distinct()
        .collect()
    )
    return assembled, shape_held, shape_stop
