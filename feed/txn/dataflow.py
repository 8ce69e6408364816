"""One transaction's dataflow in Spark: input files -> changes -> diffs -> updates.

:func:`read_input` reads the pending input into canonical changes (:mod:`feed.sources.kinds`),
orders Debezium's source transactions and holds back the incomplete ones
(:mod:`feed.sources.transactions`), drops redelivered input and counts what was read.
:func:`compute_updates` assigns times, diffs the changes against the keyed state
(:mod:`feed.txn.state`, :mod:`feed.txn.diffs`), finds the bad rows and consolidates per time. The
driver (:mod:`feed.emit.emitter`) writes what they return and commits it.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from feed.log.checkpoint import Checkpoint, fixed
from feed.log.store import FeedLog
from protocol import SourceError

__all__ = [
    "NEED_MORE",
    "Computed",
    "ReadChanges",
    "TxnContext",
    "compute_updates",
    "read_input",
    "read_source",
]

#: what :func:`read_input` returns when nothing in its input is complete yet but more input
#: files are pending
NEED_MORE = object()


def spillable() -> Any:
    """Serialized, spilling to disk: cached input never fills the driver's heap."""
    from pyspark import StorageLevel

    return StorageLevel.MEMORY_AND_DISK


def base_name(uri: str) -> str:
    """The file name in a path or in Spark's ``_metadata.file_path`` (a quoted URI)."""
    return urllib.parse.unquote(uri.rstrip("/").rsplit("/", 1)[-1])


def _bad_sample(bad: Any, cached: Sequence[Any]) -> str:
    """The first bad rows' files and reasons, for the error of a transaction that stops
    (``bad`` and ``cached``, of no more use, are released)."""
    sample = bad.limit(3).collect()
    for df in (bad, *cached):
        df.unpersist()
    return "; ".join(f"{base_name(r['_file'])}: {r['_error']}" for r in sample)


def _tally(grouped: Any, stale: Any, fresh: Any = None) -> Any:
    """Input rows, TOAST placeholders, stale (already committed) rows, bad rows and deletes
    per group, and the table shapes of the ``fresh`` events (past the committed position:
    an event read again, committed under an older shape, is no change of shape)."""
    from pyspark.sql import functions as F

    if fresh is None:
        fresh = F.lit(True)

    ok = F.col("_error").isNull()
    return grouped.agg(
        F.count(F.lit(1)).alias("n"),
        F.count("_toast").alias("toast"),
        F.count(F.when(stale & ok, 1)).alias("stale"),
        F.count("_error").alias("errors"),
        F.count(F.when(ok & (F.col("op") == "d"), 1)).alias("deletes"),
        F.collect_set(F.when(fresh, F.col("_shape"))).alias("shapes"),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class TxnContext:
    """What a transaction's dataflow needs from its driver."""

    spark: Any
    config: Any  # the settled EmitterConfig
    cp: Checkpoint  # the committed checkpoint the transaction starts from
    info: Any  # the feed's settings (feed.json)
    record_type: Any  # the record's Spark struct type
    state: Any  # the keyed state (feed.txn.state.BucketedState)
    feedlog: FeedLog
    log: logging.Logger
    spark_path: Callable[[str], str]  # a feed-log path as Spark writes to it
    #: the source table shapes this process found to fit the feed (feed/sources/shapes.py)
    shapes: set[int] = field(default_factory=set)


@dataclass(slots=True, kw_only=True)
class ReadChanges:
    """The input as read: the changes to turn into updates, the bad rows, and the figures."""

    changes: Any  # every input row (cached)
    good: Any  # the changes released for this transaction
    bad: Any  # rows found bad while reading
    order: Any  # the released source transactions in order (a DataFrame), if known
    position: tuple[Any, ...] | None  # the highest source position, when already known
    replaces: tuple[int, str] | None  # a new Debezium snapshot: (LSN, source txn)
    touched: frozenset[int] | None  # the state buckets this transaction meets
    held_files: frozenset[str]  # files read again later (a held-back transaction's)
    held: int  # source transactions held back
    redelivered: int  # events dropped as already committed
    input_rows: int
    toast_rows: int
    skipped: dict[str, int]
    #: whether a bad row may turn up: bad input rows, a new snapshot behind the committed
    #: position, deletes (of a key that may not be there) or TOAST placeholders; when not,
    #: no job counts the bad rows
    suspect: bool
    cached: tuple[Any, ...] = ()  # DataFrames to release when the transaction ends
    #: False when no snapshot read was among the input (Debezium: the figures say so)
    snapshot_reads: bool = True
    #: source transactions released (None: not counted), and those held back with the
    #: first place in delivery order of any of them (feed/emit/group.py needs them)
    ready: int | None = None
    held_txns: frozenset[str] = frozenset()
    held_at: tuple[int, int] | None = None
    #: a group's feed: the table changed shape (raised by the group if nothing is ready)
    shape_error: Exception | None = None

    def release(self) -> None:
        for df in (self.changes, *self.cached):
            df.unpersist()


@dataclass(frozen=True, slots=True)
class GroupHold:
    """What a group of feeds holds back in every one of its feeds (feed/emit/group.py): these
    source transactions, and whatever is delivered from ``at`` on."""

    txns: frozenset[str] = frozenset()
    at: tuple[int, int] | None = None


@dataclass(slots=True, kw_only=True)
class Computed:
    """A transaction's updates and what else its commit writes."""

    updates: Any  # consolidated updates: time, data, diff
    good: Any  # the changes the updates come from
    bad: Any  # every bad row (cached)
    bad_rows: int
    units: int  # how many times the updates take from ``next``
    position: tuple[Any, ...] | None  # the highest source position
    new_state: Any  # the keyed state to write, if any
    loaded: Any  # the state buckets read (feed.txn.state), if keyed
    cached: list[Any] = field(default_factory=list)

    def release(self) -> None:
        for df in self.cached:
            if df is not None:
                df.unpersist()


def read_source(ctx: TxnContext, files: Sequence[str]) -> Any:
    """The canonical changes of ``files`` (:func:`feed.sources.kinds.read_changes`), a DataFrame."""
    from feed.sources.kinds import read_changes

    cfg = ctx.config
    options: dict[str, Any] = {
        k: v for k, v in (("order", cfg.order), ("deleted", cfg.deleted)) if v
    }
    options.update(table=ctx.info.table, schema=ctx.info.schema)
    return read_changes(
        ctx.spark,
        "cdf" if cfg.source_kind == "delta" else cfg.source_kind,
        files,
        ctx.record_type,
        ctx.info.key,
        options,
    )


def unfit_shape(
    ctx: TxnContext, files: Sequence[str], shapes: Iterable[int]
) -> tuple[int, Any] | None:
    """The first source table shape in ``files`` that does not fit the feed's record
    schema, and how (:mod:`feed.sources.shapes`); None when all fit."""
    from feed.sources.shapes import first_unfit, sample_in

    return first_unfit(
        feed_schema=ctx.info.schema,
        shapes=shapes,
        known=ctx.shapes,
        sample=sample_in(ctx.spark, files),
        gone=ctx.info.dropped,
    )


def _first_of_shape(changes: Any, shape: int) -> tuple[Any, str]:
    """Where the source transaction of the first event of table shape ``shape`` begins
    (``ord_file``, ``ord_row``, ``_file``): from there on, everything is held back (DDL may
    sit between two changes of one PostgreSQL transaction); and the file of that event."""
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
    return start, base_name(txn["at"]["_file"])


def read_input(
    ctx: TxnContext,
    files: Sequence[str],
    tx_files: Sequence[str],
    *,
    more: bool,
    group: GroupHold | None = None,
) -> ReadChanges | object | None:
    """Read ``files`` (and the pending ``--tx-metadata`` files) into changes. ``None``:
    every source transaction read is still incomplete and no more input is pending;
    :data:`NEED_MORE`: the same, with more input files pending.

    A feed of a group (``group``: feed/emit/group.py) also holds back what the group holds,
    and always gets its :class:`ReadChanges` (``ready`` 0 when nothing is released, and a
    table's change of shape in ``shape_error`` instead of raised: the next schema version
    as an :class:`~feed.sources.shapes.Evolve`, or the error that stops the feed): the group
    decides."""
    from pyspark.sql import functions as F

    cfg, cp = ctx.config, ctx.cp
    changes = read_source(ctx, [*files, *tx_files])
    # keep the raw text only where a bad row may need it (parse errors; deletes and
    # snapshot rows, which the keyed checks may still find bad): the cache stays small
    keep_raw = F.col("_error").isNotNull() | (F.col("op") == "d") | F.col("_toast").isNotNull()
    if cfg.source_kind == "snapshot":
        keep_raw = F.lit(True)
    changes = changes.withColumn("_raw", F.when(keep_raw, F.col("_raw"))).persist(spillable())
    bad = changes.where(F.col("_error").isNotNull()).select("_file", "_raw", "_error")
    # (another table's last snapshot read stays: it says where a snapshot ends)
    good = changes.where(
        F.col("_error").isNull() & ((F.col("op") != "x") | (F.col("_snap") == "last"))
    )
    held_files: frozenset[str] = frozenset()
    order: Any = None  # the released source transactions in order (a DataFrame)
    position: Any = None  # the highest source position, when the source tells it
    txn_cached: tuple[Any, ...] = ()
    held = redelivered = behind = 0
    ready: int | None = None
    held_txns: frozenset[str] = frozenset()
    held_at: tuple[int, int] | None = None
    shape_stop: Exception | None = None
    replaces: tuple[int, str] | None = None  # a new Debezium snapshot: (LSN, txn)
    keyed = bool(ctx.info.key) and cfg.source_kind != "snapshot"
    image = F.when(F.col("op") == "d", F.col("before")).otherwise(F.col("after"))
    touched: frozenset[int] | None = None  # the state buckets this transaction meets
    tally_rows: list[Any] | None = None
    snapshot_reads = True
    if cfg.source_kind == "debezium":
        found = _assemble_debezium(
            ctx, changes, good, files, more=more, group=group, keyed=keyed, image=image
        )
        if not isinstance(found, _Debezium):
            return found
        assembled = found.assembled
        touched, tally_rows, shape_stop = found.touched, found.tally_rows, found.shape_stop
        good, held_files = assembled.changes, assembled.held_files | found.shape_held
        order, position = assembled.order, assembled.position
        bad = bad.unionByName(assembled.bad)
        held, redelivered = assembled.held, assembled.redelivered
        behind = assembled.bad_rows
        txn_cached = assembled.cached
        replaces = assembled.replaces
        snapshot_reads = assembled.snapshot_rows > 0
        ready, held_txns, held_at = assembled.ready, assembled.held_txns, assembled.held_at
    if held_files:
        # a file that is read again later is quarantined and counted then
        held_list = sorted(held_files)
        bad = bad.where(~F.col("_file").isin(held_list))
        counted = changes.where(~F.col("_file").isin(held_list))
    else:
        counted = changes
    done_version = cp.source.get("cdf_version") if cfg.source_kind == "cdf" else None
    stale = F.lit(False)
    if done_version is not None:
        # a Delta commit is whole in one emitter transaction (the file window never
        # splits a version): a version at or below the committed one is a redelivery
        stale = (F.col("op") != "x") & (F.col("pos_hi") <= F.lit(done_version))
        good = good.where(~stale)
    if tally_rows is None:
        tally_rows = _tally(counted.groupBy("_skip"), stale).collect()
    else:  # by file: a file that is read again later is counted then
        tally_rows = [r for r in tally_rows if r["_file"] not in held_files]
    input_rows, toast_rows, suspect_rows = 0, 0, behind
    skipped: dict[str, int] = {}
    for r in tally_rows:
        input_rows += r["n"]
        toast_rows += r["toast"]
        redelivered += r["stale"]
        suspect_rows += r["errors"] + r["deletes"] + r["toast"]
        if r["_skip"] is not None:
            skipped[r["_skip"]] = skipped.get(r["_skip"], 0) + r["n"]
    return ReadChanges(
        changes=changes,
        good=good,
        bad=bad,
        order=order,
        position=position,
        replaces=replaces,
        touched=touched,
        held_files=held_files,
        held=held,
        redelivered=redelivered,
        input_rows=input_rows,
        toast_rows=toast_rows,
        skipped=skipped,
        suspect=suspect_rows > 0 or replaces is not None or cfg.source_kind == "snapshot",
        cached=txn_cached,
        snapshot_reads=snapshot_reads,
        ready=ready,
        held_txns=held_txns,
        held_at=held_at,
        shape_error=shape_stop,
    )


@dataclass(frozen=True)
class _Debezium:
    """What assembling a Debezium read gave :func:`read_input`."""

    assembled: Any  # feed.sources.transactions.Assembled
    touched: frozenset[int] | None  # the state buckets this transaction meets
    tally_rows: list[Any]  # the input's figures per file
    shape_held: frozenset[str]  # files read again: the table changed shape in them
    shape_stop: Exception | None  # a group's feed: the change of shape, for the group


def _assemble_debezium(
    ctx: TxnContext,
    changes: Any,
    good: Any,
    files: Sequence[str],
    *,
    more: bool,
    group: GroupHold | None,
    keyed: bool,
    image: Any,
) -> _Debezium | object | None:
    """Debezium's source transactions decided (feed/sources/transactions.py), cut before
    a change of the table's shape; ``None`` or :data:`NEED_MORE` as for
    :func:`read_input` when nothing is released. Refusals raise, with the cache let go."""
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
            new_feed="snapshot_lsn" not in cp.source,
            logger=ctx.log,
            feed=cfg.feed,
            bucket=bucket_of(image, ctx.info.key, buckets) if buckets else None,
            also=_tally(changes.groupBy("_file", "_skip"), F.lit(False), fresh),
            hold_at=hold_at,
            hold_txns=group.txns if group is not None else frozenset(),
        )

    assembled = assembled_with()
    shape_held: frozenset[str] = frozenset()
    shape_stop: Exception | None = None
    touched, tally_rows = assembled.buckets, list(assembled.also)
    unfit = unfit_shape(ctx, files, (h for r in tally_rows for h in r["shapes"] or ()))
    if unfit is not None:
        for df in assembled.cached:
            df.unpersist()
        assembled, shape_held, shape_stop = _cut_at_shape(
            ctx, changes, unfit, group, assembled_with
        )
        touched, tally_rows = assembled.buckets, list(assembled.also)
    txn_cached = assembled.cached
    replaces = assembled.replaces
    if replaces is not None and not keyed:
        for df in (changes, *txn_cached):
            df.unpersist()
        raise SourceError(
            f"feed {cfg.feed!r}: Debezium snapshotted {cfg.table or 'the table'} "
            f"again (snapshot LSN {replaces[0]}); an unkeyed feed cannot tell which "
            "rows the new snapshot no longer holds, so nothing was committed: give "
            "the feed --key, or start a new feed from the new snapshot"
        )
    if replaces is not None and buckets:
        touched = frozenset(range(buckets))  # every key may have gone
    if assembled.endless > 1 and not more and not cfg.tx_metadata:
        # Debezium writes a transaction's END before the next transaction's events:
        # two transactions without one END in all the input mean the END records
        # are not in it, and without them no transaction would ever be released
        for df in (changes, *txn_cached):
            df.unpersist()
        raise SourceError(
            f"feed {cfg.feed!r}: {assembled.endless} source transactions in "
            f"{cfg.source_path} carry Debezium 'transaction' blocks, but no "
            "transaction END record was read; give --tx-metadata PATH (the folder of "
            "the connector's transaction metadata topic), or capture with "
            "provide.transaction.metadata=false. Nothing was committed."
        )
    if assembled.held and not assembled.ready and group is None:
        for df in (changes, *txn_cached):
            df.unpersist()
        if more:
            return NEED_MORE
        ctx.log.info(
            "feed %s: waiting for the rest of %d source transaction(s)", cfg.feed, assembled.held
        )
        return None
    return _Debezium(assembled, touched, tally_rows, shape_held, shape_stop)


def _cut_at_shape(
    ctx: TxnContext,
    changes: Any,
    unfit: Any,
    group: GroupHold | None,
    assembled_with: Callable[[tuple[int, int] | None], Any],
) -> tuple[Any, frozenset[str], Exception | None]:
    """The table changed shape in this read: assemble again holding everything from its
    first event of the new shape (committed first is what came before), and find the
    feed's next schema version when that event heads the input. The assembly, the files
    read again, and for a group's feed the change (a lone feed's is raised)."""
    from pyspark.sql import functions as F

    from feed.sources.inputs import list_files
    from feed.sources.shapes import next_version, with_renames

    cfg = ctx.config
    first, shape_file = _first_of_shape(changes, unfit[0])
    assembled = assembled_with((first["ord_file"], first["ord_row"]))
    shape_stop: Exception | None = None
    if not assembled.ready:
        # at the head of the input: the feed's next schema version, if any
        where = base_name(first["_file"])
        change = with_renames(unfit[1], list_files(cfg.source_path), ctx.info.table, shape_file)
        found = next_version(cfg.feed, ctx.info.table, ctx.info, change, where)
        if group is None:
            for df in (changes, *assembled.cached):
                df.unpersist()
            raise found
        shape_stop = found  # the group commits it with its other feeds
    ctx.log.info(
        "feed %s: the source table changed shape in %s (%s): committing what came before it first",
        cfg.feed,
        base_name(first["_file"]),
        unfit[1].describe(),
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


def compute_updates(ctx: TxnContext, r: ReadChanges) -> Computed:
    """Times, diffs against the keyed state, bad rows and consolidated updates. Raises
    :class:`SourceError` (nothing written) when the input is all bad in a new feed, or has
    bad rows with ``--on-bad-record fail``."""
    from pyspark.sql import functions as F

    from feed.txn.diffs import (
        consolidate_diffs,
        fill_unavailable,
        keyed_diffs,
        replacement_deletes,
        snapshot_diffs,
        unkeyed_diffs,
    )
    from feed.txn.times import assign_units

    cfg, cp = ctx.config, ctx.cp
    changes, good, bad, order, position = r.changes, r.good, r.bad, r.order, r.position
    replaces, skipped, input_rows, txn_cached = r.replaces, r.skipped, r.input_rows, r.cached
    keyed = bool(ctx.info.key) and cfg.source_kind != "snapshot"
    image = F.when(F.col("op") == "d", F.col("before")).otherwise(F.col("after"))
    touched, toast_rows = r.touched, r.toast_rows

    good, units, ranked = assign_units(good, cfg.granularity, order)
    loaded = live = None
    if keyed:
        from feed.txn.state import GONE_COLUMN

        # only the state buckets this transaction's keys fall in
        loaded = ctx.state.load(cp.state, good, image, touched=touched, input_rows=input_rows)
        if loaded.rows is not None:  # a deleted key's tombstone is not a row
            live = loaded.rows.where(~F.col(GONE_COLUMN))
        if replaces is not None:
            gone = replacement_deletes(good, live, ctx.info.key, replaces)
            good = good.unionByName(gone)
    if toast_rows:
        if loaded is not None:
            filled = fill_unavailable(good, live, ctx.info.key)
            good = filled.diffs
            assert filled.bad is not None
            bad = bad.unionByName(filled.bad)
        else:
            bad = bad.unionByName(
                good.where(F.col("_toast").isNotNull()).select(
                    "_file",
                    "_raw",
                    F.concat(
                        F.lit("unavailable value (unchanged TOASTed column) in "),
                        F.col("_toast"),
                        F.lit(
                            ": give --key so the feed's state fills it in, or set "
                            "REPLICA IDENTITY FULL on the table"
                        ),
                    ).alias("_error"),
                )
            )
            good = good.where(F.col("_toast").isNull())
    new_state = None
    cached = None
    if cfg.source_kind == "snapshot":
        # the previous snapshot, whole: diffing full snapshots is O(table) by nature
        last = ctx.state.read([cp.state]) if cp.state else None
        d = snapshot_diffs(good, last, ctx.info.key, cfg.granularity)
        diffs, new_state, cached = d.diffs, d.state, d.cached
        if d.bad is not None:
            bad = bad.unionByName(d.bad)
    elif loaded is not None:
        # a Delta update pre-image says nothing the keyed state does not know already
        d = keyed_diffs(
            good.where(F.col("op") != "p"),
            loaded.rows,
            ctx.info.key,
            per_key=cfg.source_kind in ("upsert", "cdf", "delta"),
            one_unit=units <= 1,
        )
        diffs, new_state, cached = d.diffs, d.state, d.cached
        assert d.bad is not None
        bad = bad.unionByName(d.bad)
    else:
        diffs = unkeyed_diffs(good)
    t_next = cp.next
    updates = consolidate_diffs(diffs, t_next)
    bad_rows = 0
    if r.suspect:
        bad = bad.persist(spillable())
        bad_rows = bad.count()
    if bad_rows and not fixed(cp) and bad_rows + sum(skipped.values()) >= input_rows:
        # a new feed whose first input is all bad (the wrong source kind or file, say)
        # fixes nothing: no commit, no consumed files, no settings
        reasons = _bad_sample(bad, (changes, *txn_cached))
        ctx.feedlog.delete_file(ctx.feedlog.path("feed.json"))
        raise SourceError(
            f"feed {cfg.feed!r}: every one of the {bad_rows} input row(s) is bad, e.g. "
            f"{reasons}; nothing was committed and the feed was not created (check "
            "--source KIND and the input files)"
        )
    if bad_rows and cfg.on_bad_record == "fail":
        reasons = _bad_sample(bad, (changes, *txn_cached))
        raise SourceError(
            f"feed {cfg.feed!r}: {bad_rows} bad input row(s), e.g. {reasons}; "
            "nothing was committed (--on-bad-record fail)"
        )
    if cfg.source_kind != "debezium":
        # (Debezium's position came with the transaction figures, without a job)
        last = good.agg(F.max(F.struct("pos_hi", "pos_lo", "pos_n")).alias("m"))
        row = last.collect()[0]["m"]
        position = None if row is None else tuple(row)
    return Computed(
        updates=updates,
        good=good,
        bad=bad,
        bad_rows=bad_rows,
        units=units,
        position=position,
        new_state=new_state,
        loaded=loaded,
        cached=[changes, bad, cached, ranked, *txn_cached],
    )
