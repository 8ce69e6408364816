"""One transaction's dataflow in Spark: input files -> changes -> diffs -> updates.

:func:`read_input` reads the pending input into canonical changes (:mod:`feed.sources.kinds`),
orders Debezium's source transactions and holds back the incomplete ones
(:mod:`feed.sources.transactions`), drops redelivered input and counts what was read.
:func:`compute_updates` assigns times, diffs the changes against the keyed state
(:mod:`feed.txn.state`, :mod:`feed.txn.diffs`), finds the bad rows and consolidates per time. The
driver (:mod:`feed.emit.emitter`) writes what they return and commits it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from feed.log.checkpoint import fixed
from feed.sources.cached import cached
from feed.txn.assembly import DebeziumRead, assemble_debezium
from feed.txn.context import (
    Computed,
    GroupHold,
    ReadChanges,
    TxnContext,
    bad_sample,
    read_source,
    spillable,
    tally,
)
from protocol import CheckpointError, SourceError

__all__ = ["compute_updates", "numbered_once", "read_group", "read_input"]


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

    cfg = ctx.config
    changes, good, bad, shown = _cached_changes(ctx, [*files, *tx_files])
    r = ReadChanges(changes=changes, good=good, bad=bad)  # (figures: _count below)
    tally_rows: list[Any] | None = None
    behind = 0  # snapshot reads of a new snapshot behind the committed position
    if cfg.kind.events:
        keyed = bool(ctx.info.key) and not cfg.kind.whole_table
        image = F.when(F.col("op") == "d", F.col("before")).otherwise(F.col("after"))
        found = assemble_debezium(
            ctx,
            changes,
            good,
            files,
            more=more,
            group=group,
            keyed=keyed,
            image=image,
            distinct=shown.distinct,
            ends=shown.ends,
        )
        if not isinstance(found, DebeziumRead):
            return found
        _take_assembled(r, found)
        tally_rows, behind = found.tally_rows, found.assembled.bad_rows
    _count(ctx, r, tally_rows, behind)
    return r


def _take_assembled(r: ReadChanges, found: DebeziumRead) -> None:
    """Into ``r``: what the source transactions' assembly released, held and dropped."""
    a = found.assembled
    r.good, r.held_files = a.changes, a.held_files | found.shape_held
    r.order, r.position, r.replaces = a.order, a.position, a.replaces
    r.bad = r.bad.unionByName(a.bad)
    r.held, r.redelivered, r.cached = a.held, a.redelivered, a.cached
    r.snapshot_reads = a.snapshot_rows > 0
    r.ready, r.held_txns, r.held_at = a.ready, a.held_txns, a.held_at
    r.touched, r.shape_error = found.touched, found.shape_stop


def _count(ctx: TxnContext, r: ReadChanges, tally_rows: list[Any] | None, behind: int) -> None:
    """Into ``r``: the read's figures (a file read again later is counted, and its bad
    rows quarantined, then), with a Delta version at or below the committed one dropped
    as a redelivery."""
    from pyspark.sql import functions as F

    cfg, cp = ctx.config, ctx.cp
    counted = r.changes
    if r.held_files:
        held_list = sorted(r.held_files)
        r.bad = r.bad.where(~F.col("_file").isin(held_list))
        counted = r.changes.where(~F.col("_file").isin(held_list))
    done_version = cp.source.get("cdf_version") if cfg.kind.versions else None
    stale = F.lit(False)
    if done_version is not None:
        # a Delta commit is whole in one emitter transaction (the file window never
        # splits a version): a version at or below the committed one is a redelivery
        stale = (F.col("op") != "x") & (F.col("pos_hi") <= F.lit(done_version))
        r.good = r.good.where(~stale)
    if tally_rows is None:
        tally_rows = tally(counted.groupBy("_skip"), stale).collect()
    else:  # by file: a file that is read again later is counted then
        tally_rows = [t for t in tally_rows if t["_file"] not in r.held_files]
    r.input_rows, r.toast_rows, stale_rows, suspect_rows, r.skipped = _figures(tally_rows)
    r.redelivered += stale_rows
    suspect_rows += behind
    r.suspect = suspect_rows > 0 or r.replaces is not None or cfg.kind.whole_table


def read_group(
    ctxs: Sequence[TxnContext],
    files: list[str],
    tx_files: list[str],
    *,
    more: bool,
    group: str,
) -> tuple[list[ReadChanges], GroupHold]:
    """Each feed of a ``group`` reading ``files`` under the group's hold (feed/emit/group.py):
    read again, by the feeds that released more, until every feed holds back the same."""
    hold = GroupHold()
    holds = [hold] * len(ctxs)
    reads: list[ReadChanges] = []
    for ctx in ctxs:
        r = read_input(ctx, files, tx_files, more=more, group=hold)
        assert isinstance(r, ReadChanges)
        reads.append(r)
    for _ in range(len(ctxs) + 1):
        txns = frozenset().union(*(r.held_txns for r in reads))
        places = [r.held_at for r in reads if r.held_at is not None]
        hold = GroupHold(txns=txns, at=min(places) if places else None)
        again = [
            i
            for i, r in enumerate(reads)
            if holds[i] != hold and not (r.held_txns >= hold.txns and r.held_at == hold.at)
        ]
        if not again:
            return reads, hold
        for i in again:
            reads[i].release()
            r = read_input(ctxs[i], files, tx_files, more=more, group=hold)
            assert isinstance(r, ReadChanges)
            reads[i], holds[i] = r, hold
    raise CheckpointError(f"group {group}: the feeds' held-back transactions disagree")


@contextmanager
def numbered_once(reads: Sequence[ReadChanges]) -> Iterator[None]:
    """The released source transactions of every feed of a group, in source order,
    numbered once: within the block each reading's ``order`` is that one numbering."""
    from pyspark.sql import functions as F

    from feed.sources.positions import source_order

    parts = [r.order if r.order is not None else source_order(r.good) for r in reads]
    union = parts[0]
    for p in parts[1:]:
        union = union.unionByName(p)
    order = cached(union.groupBy("txn").agg(F.min("o").alias("o")))
    for r in reads:
        r.order = order
    try:
        yield
    finally:
        order.unpersist()


@dataclass(frozen=True, slots=True)
class Shown:
    """What a read showed of its changes, for their assembly: that no two data events
    share a position (:class:`~feed.sources.columnar.Positions`), and whether a transaction
    END record may be among them (False only where the read counted none)."""

    distinct: bool = False
    ends: bool = True


def _cached_changes(ctx: TxnContext, files: Sequence[str]) -> tuple[Any, Any, Any, Shown]:
    """The changes of ``files``, cached, with those that may turn into updates, the bad
    rows found while reading, and what the read showed of them (:class:`Shown`)."""
    from pyspark.sql import functions as F

    changes, shown = _columnar_changes(ctx, files)
    if changes is None:
        if ctx.config.kind.events:
            from feed.sources.transactions import may_hold_ends

            shown = Shown(ends=may_hold_ends(files))
        changes = read_source(ctx, files)
        # keep the raw text only where a bad row may need it (parse errors; deletes and
        # snapshot rows, which the keyed checks may still find bad): the cache stays small
        keep_raw = F.col("_error").isNotNull() | (F.col("op") == "d") | F.col("_toast").isNotNull()
        if ctx.config.kind.whole_table:
            keep_raw = F.lit(True)
        changes = cached(changes.withColumn("_raw", F.when(keep_raw, F.col("_raw"))), spillable())
    bad = changes.where(F.col("_error").isNotNull()).select("_file", "_raw", "_error")
    # (another table's last snapshot read stays: it says where a snapshot ends)
    good = changes.where(
        F.col("_error").isNull() & ((F.col("op") != "x") | (F.col("_snap") == "last"))
    )
    return changes, good, bad, shown


def _columnar_changes(ctx: TxnContext, files: Sequence[str]) -> tuple[Any | None, Shown]:
    """The changes of Debezium ``files`` parsed by pyarrow in Spark's tasks
    (:mod:`feed.sources.debezium_arrow`), cached, and what the read showed of them: None
    where that parse does not apply, or declined a file (then Spark's reader parses them
    all)."""
    from feed.sources.columnar import Positions, declined, read_debezium_columnar, why_not_columnar
    from feed.sources.connect import connect_names

    cfg = ctx.config
    if cfg.parse == "spark" or not cfg.kind.columnar:
        return None, Shown()
    why = why_not_columnar(files, ctx.record_type, connect_names(ctx.info.schema or {}))
    if why is None:
        seen = Positions(ctx.spark, len(files))
        found = read_debezium_columnar(
            ctx.spark, files, ctx.record_type, ctx.info.key, ctx.info.table, seen
        )
        changes = cached(found, spillable())
        why, ends = declined(changes)  # (the job that builds the cache)
        distinct = seen.distinct()
        if why is None:
            ctx.log.debug(
                "feed %s: input parsed by pyarrow in Spark's tasks (events at distinct "
                "positions: %s)",
                cfg.feed,
                "yes" if distinct else "not shown",
            )
            return changes, Shown(distinct=distinct, ends=ends)
        changes.unpersist()
    ctx.log.debug("feed %s: input parsed by Spark's JSON reader: %s", cfg.feed, why)
    return None, Shown()


def _figures(tally_rows: list[Any]) -> tuple[int, int, int, int, dict[str, int]]:
    """Input rows, TOAST placeholders, redelivered rows, rows that may be bad, and the
    skipped lines by reason, summed over :func:`~feed.txn.context.tally`'s rows."""
    input_rows = toast_rows = stale_rows = suspect_rows = 0
    skipped: dict[str, int] = {}
    for r in tally_rows:
        input_rows += r["n"]
        toast_rows += r["toast"]
        stale_rows += r["stale"]
        suspect_rows += r["errors"] + r["deletes"] + r["toast"]
        if r["_skip"] is not None:
            skipped[r["_skip"]] = skipped.get(r["_skip"], 0) + r["n"]
    return input_rows, toast_rows, stale_rows, suspect_rows, skipped


def compute_updates(ctx: TxnContext, r: ReadChanges) -> Computed:
    """Times, diffs against the keyed state, bad rows and consolidated updates. Raises
    :class:`SourceError` (nothing written) when the input is all bad in a new feed, or has
    bad rows with ``--on-bad-record fail``."""
    from pyspark.sql import functions as F

    from feed.txn.diffs import consolidate_diffs, fill_unavailable, replacement_deletes
    from feed.txn.times import assign_units

    cfg, cp = ctx.config, ctx.cp
    changes, good, bad, order, position = r.changes, r.good, r.bad, r.order, r.position
    replaces, input_rows, txn_cached = r.replaces, r.input_rows, r.cached
    keyed = bool(ctx.info.key) and not cfg.kind.whole_table
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
            bad = bad.unionByName(_unfillable(good))
            good = good.where(F.col("_toast").isNull())
    diffs, new_state, released, more_bad = _diffs(ctx, good, loaded, units)
    if more_bad is not None:
        bad = bad.unionByName(more_bad)
    t_next = cp.next
    updates = consolidate_diffs(diffs, t_next)
    bad_rows = 0
    if r.suspect:
        bad = cached(bad, spillable())
        bad_rows = bad.count()
    if bad_rows:
        _stop_on_bad(ctx, r, bad, bad_rows)
    if not cfg.kind.events:
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
        cached=[changes, bad, released, ranked, *txn_cached],
    )


def _diffs(ctx: TxnContext, good: Any, loaded: Any, units: int) -> tuple[Any, Any, Any, Any]:
    """The diffs of the timed changes ``good``, the new state, what to release after the
    commit, and bad rows found (or None): against the whole previous snapshot (whole-table
    sources), the ``loaded`` keyed state, or none (unkeyed feeds)."""
    from pyspark.sql import functions as F

    from feed.txn.diffs import keyed_diffs, unkeyed_diffs
    from feed.txn.snapshots import snapshot_diffs

    cfg, cp = ctx.config, ctx.cp
    if cfg.kind.whole_table:
        # the previous snapshot, whole: diffing full snapshots is O(table) by nature
        last = ctx.state.read([cp.state]) if cp.state else None
        d = snapshot_diffs(good, last, ctx.info.key, cfg.granularity)
        return d.diffs, d.state, d.cached, d.bad
    if loaded is not None:
        # a Delta update pre-image says nothing the keyed state does not know already
        d = keyed_diffs(
            good.where(F.col("op") != "p"),
            loaded.rows,
            ctx.info.key,
            per_key=cfg.kind.per_key,
            one_unit=units <= 1,
        )
        assert d.bad is not None
        return d.diffs, d.state, d.cached, d.bad
    return unkeyed_diffs(good), None, None, None


def _unfillable(good: Any) -> Any:
    """Without keyed state a TOAST placeholder cannot be filled: its rows are bad."""
    from pyspark.sql import functions as F

    return good.where(F.col("_toast").isNotNull()).select(
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


def _stop_on_bad(ctx: TxnContext, r: ReadChanges, bad: Any, bad_rows: int) -> None:
    """Raise :class:`SourceError` (nothing committed) when ``bad_rows`` bad rows stop the
    transaction: all of a new feed's first input, or any with ``--on-bad-record fail``."""
    cfg = ctx.config
    if not fixed(ctx.cp) and bad_rows + sum(r.skipped.values()) >= r.input_rows:
        # a new feed whose first input is all bad (the wrong source kind or file, say)
        # fixes nothing: no commit, no consumed files, no settings
        reasons = bad_sample(bad, (r.changes, *r.cached))
        ctx.feedlog.delete_file(ctx.feedlog.path("feed.json"))
        raise SourceError(
            f"feed {cfg.feed!r}: every one of the {bad_rows} input row(s) is bad, e.g. "
            f"{reasons}; nothing was committed and the feed was not created (check "
            "--source KIND and the input files)"
        )
    if cfg.on_bad_record == "fail":
        reasons = bad_sample(bad, (r.changes, *r.cached))
        raise SourceError(
            f"feed {cfg.feed!r}: {bad_rows} bad input row(s), e.g. {reasons}; "
            "nothing was committed (--on-bad-record fail)"
        )
