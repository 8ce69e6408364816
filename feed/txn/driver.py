"""A small Debezium transaction, computed on the driver.

A follow-mode transaction of ten changes against a large keyed table costs the Spark path
(:mod:`feed.txn.dataflow`) about two seconds whatever the table's size: a dozen small jobs
(transaction figures, state buckets, updates, the state write) and about a second of
planning on the driver, all for a few rows. Here the input is parsed on the driver
(:mod:`feed.sources.debezium_lines`: the rows Spark's parse gives, each event's state
bucket by the same xxhash64), so a process whose transactions all come here never starts
Spark; input that parse declines (anything but what connectors write, or a bad row) is
parsed by one Spark job, exactly as the Spark path parses it
(:func:`feed.txn.context.read_source`), and comes to the driver as Arrow. The rest is
done there, following :mod:`feed.sources.transactions`, :mod:`feed.txn.times` and
:mod:`feed.txn.diffs` for the plain case: drop input at or below the committed position,
number the source transactions, diff each key's changes against its row in the touched
state buckets (read and rewritten with pyarrow), consolidate per time, and write each
time's segment. An unkeyed feed has no state: each event retracts its before image and
adds its after image, as :func:`feed.txn.diffs.unkeyed_diffs` has it. A new feed's first
transaction is taken too (a bad row in it, which may stop the feed being created, goes to
Spark as any bad row does); a keyed feed's new state gets the bucket count Spark would
give it.

The plain case is what a Debezium connector delivers from its first snapshot on: data
events (c/u/d), reads of the feed's own snapshot (on a new feed, the one it reads
first) and its end marker, END records and skipped lines only; no bad row, no read of
another snapshot (a new one replaces the table; an old one is quarantined) and no
incremental snapshot read; no unavailable-value placeholder without an earlier value to
fill it (in an unkeyed feed, none at all: Spark quarantines those); no source
transaction with more events than its END record counts, nor transaction blocks without
any END record read; no delete of a key the feed does not hold; a record of scalar
columns and a key without floating-point ones; a bucketed state not due to be
rebucketed. An event delivered twice is kept once, as the Spark path keeps it, and an
incomplete source transaction is held back with every one delivered after it
(:func:`~feed.txn.driver_diffs.held_back`); a change of the table's shape is cut as
:func:`feed.txn.assembly._cut_at_shape` cuts it
(:func:`feed.txn.driver_plain.shape_cut`). A group's
transaction (:func:`run_group`) is taken when every feed's part is plain and none
changed shape. On anything else :func:`run` declines before writing a file, and the
Spark path computes the transaction. Input larger than ``--driver-txn-bytes`` goes to
Spark directly. The row-by-row semantics are in :mod:`feed.txn.driver_diffs`.

Both paths give the same feed: tests/feed/test_driver_txn.py runs random histories
through each and compares the updates, the progress and the state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from feed.sources.debezium_lines import Declined, shape_sample
from feed.sources.positions import Position, committed_position, snapshot_done
from feed.sources.rows import CHANGE_COLUMNS
from feed.sources.snapshots import say_moved
from feed.txn.assembly import find_unfit_shapes, version_at_head
from feed.txn.context import (
    DECLINED,
    GroupHold,
    TxnContext,
    base_name,
    read_source,
    waiting,
)
from feed.txn.driver_diffs import (
    assign_units,
    at_commit,
    consolidate,
    once,
    unkeyed_diffs,
)
from feed.txn.driver_plain import (
    Cut,
    Snapshot,
    after_committed,
    data_events,
    not_plain,
    one_snapshot_each,
    own_snapshot,
    shape_cut,
)
from feed.txn.driver_release import Events, Release, release, released_together
from feed.txn.driver_state import Keyed, against_state, write_segments, write_state
from feed.txn.segments import Written
from feed.txn.state import LoadedState, new_state
from protocol import SourceError

__all__ = ["run", "run_group"]

#: the parsed columns the driver needs (not the weight or the raw line)
_COLUMNS = tuple(c for c in CHANGE_COLUMNS if c not in ("weight", "_raw"))


class _Stateless:
    """What an unkeyed feed's transaction starts from: it has no state."""


_STATELESS = _Stateless()


def _start(
    ctx: TxnContext, files: Sequence[str], tx_files: Sequence[str]
) -> LoadedState | _Stateless | None:
    """What this transaction starts from on the driver: the committed keyed state (a new,
    empty one, :func:`~feed.txn.state.new_state`, when the feed has none yet),
    :data:`_STATELESS` for an unkeyed feed, or None when it goes to Spark: not a Debezium
    feed, input over the size limit, pending ``--tx-metadata`` files, or a keyed state
    :meth:`~feed.txn.state.BucketedState.committed` does not give."""
    cfg = ctx.config
    if not cfg.kind.events or tx_files or not files:
        return None
    from feed.sources.inputs import input_bytes

    try:
        if input_bytes(files) > cfg.driver_txn_bytes:
            return None
    except (OSError, SourceError):
        return None  # Spark's read says what is wrong
    if not ctx.info.key:
        return _STATELESS
    if not ctx.cp.state:  # (its size is checked against the input: _not_new)
        return new_state()
    committed: LoadedState | None = ctx.state.committed(ctx.cp.state)
    return committed


def _not_new(ctx: TxnContext, t: pa.Table, start: LoadedState | _Stateless) -> str | None:
    """Why a keyed feed's first transaction with state goes to Spark, or None: a new state
    is sized by the rows read (:func:`~feed.txn.state.new_state`), which must give the
    bucket count the parse computed buckets with (:func:`_start`'s)."""
    if not isinstance(start, LoadedState) or ctx.cp.state:
        return None
    return "a new state of more buckets" if new_state(t.num_rows) != start else None


def _parsed(ctx: TxnContext, files: Sequence[str], start: LoadedState | _Stateless) -> pa.Table:
    """The input rows (:data:`_COLUMNS`, and each event's state bucket in a keyed feed):
    parsed here (:mod:`feed.sources.debezium_lines`), or by one Spark job when that parse
    declines the input."""
    from pyspark.sql.pandas.types import to_arrow_type

    from feed.sources.connect import connect_names
    from feed.sources.debezium_lines import parse_lines

    key = tuple(ctx.info.key)
    buckets = start.buckets if isinstance(start, LoadedState) else None
    try:
        record = to_arrow_type(ctx.record_type, timezone="UTC")
        encodings = connect_names(ctx.info.schema)
        table, budget = ctx.info.table, ctx.config.driver_txn_bytes
        return parse_lines(files, record, encodings, key, table, buckets, budget)
    except Declined as e:
        ctx.log.debug("feed %s: input parsed by Spark: %s", ctx.config.feed, e)
    from pyspark.sql import functions as F

    from feed.txn.state import bucket_of

    changes = read_source(ctx, files)
    if buckets is None:
        return changes.select(*_COLUMNS).toArrow()
    image = F.when(F.col("op") == "d", F.col("before")).otherwise(F.col("after"))
    return changes.select(*_COLUMNS, bucket_of(image, key, buckets).alias("_bucket")).toArrow()


@dataclass(frozen=True, slots=True)
class _Read:
    """A transaction's input parsed by one Spark job and found the plain case, before
    anything is held back or numbered (:func:`_read`)."""

    start: LoadedState | _Stateless  # what it starts from
    t: pa.Table  # every row parsed
    data: list[dict[str, Any]]  # its data events, at their commit LSNs (at_commit)
    ends: list[dict[str, Any]]  # its END records (txn, pos_hi, tx_count)
    fresh: list[dict[str, Any]]  # the data events past the committed position, each once
    snapshot: Snapshot
    committed: Position
    record: pa.Schema
    key: tuple[str, ...]
    cut: Cut | None  # where the table changed shape, if it did

    def events(self) -> Events:
        """What :func:`~feed.txn.driver_release.release` takes of the read."""
        return Events(self.t, self.data, self.fresh, self.ends, self.committed[0], self.key)


def _read(ctx: TxnContext, files: Sequence[str], tx_files: Sequence[str]) -> _Read | str | None:
    """The input of a transaction over ``files``, parsed; why it goes to Spark; or None
    when it is not the driver's at all, unparsed (:func:`_start`)."""
    start = _start(ctx, files, tx_files)
    if start is None:
        return None
    cp, key = ctx.cp, tuple(ctx.info.key)
    t = _parsed(ctx, files, start)
    t, moves = one_snapshot_each(t, cp.source)
    data = data_events(t)
    why = not_plain(t, data, key) or _not_new(ctx, t, start)
    if why is not None:
        return why
    snapshot = own_snapshot(t, data, cp.source)
    if isinstance(snapshot, str):
        return snapshot
    # (said once the input is the driver's: Spark's path says it for what it takes)
    say_moved(ctx.log, ctx.config.feed, moves)
    committed = committed_position(cp.source.get("pos", [0, 0]))
    # (an event read again, committed under an older shape, is no change of shape; one
    # without a commit position yet is not committed, as position_filter has it)
    rows = t.select(["_shape", "op", "pos_hi", "pos_lo", "pos_n"]).to_pylist()
    shapes = {
        r["_shape"] for r in rows if r["_shape"] is not None and after_committed(r, committed)
    }
    try:
        unfit = find_unfit_shapes(ctx, files, shapes, sample=lambda h: shape_sample(files, h))
    except Declined as e:
        return str(e)
    record = pa.schema(list(t.schema.field("after").type))
    # (the change delivered first: feed/sources/shapes.py:unfit_shapes)
    cut = min((shape_cut(t, u) for u in unfit), key=lambda c: (c.at, c.first), default=None)
    # (as dictionaries once: a group's hold may release a read several times)
    events = data.to_pylist()
    ends = t.filter(pc.equal(t.column("op"), "E")).select(["txn", "pos_hi", "tx_count"])
    ends_read = ends.to_pylist()
    at_commit(ends_read, events)
    fresh = once([e for e in events if after_committed(e, committed)])
    if not ends_read and len({e["txn"] for e in fresh if e["tx_meta"]}) > 1:
        return "transaction blocks without any END record read"  # (Spark may refuse them)
    return _Read(start, t, events, ends_read, fresh, snapshot, committed, record, key, cut)


@dataclass(frozen=True, slots=True)
class _Diffs:
    """A transaction's diffs (:func:`_diffs`), before anything is written."""

    counted: int  # the rows read and counted now (a held file's are counted when read again)
    skipped: Counter[str]
    updates: list[tuple[dict[str, Any], int, int]]  # (image, unit, diff)
    keyed: Keyed | None


def _diffs(ctx: TxnContext, rd: _Read, r: Release) -> _Diffs | str:
    """The diffs of the events ``r`` keeps, their units assigned; or why the transaction
    goes to Spark."""
    t = rd.t
    held_files = pa.array(sorted(r.files), t.schema.field("_file").type)
    counted = t.filter(pc.invert(pc.is_in(t.column("_file"), held_files)))
    skipped = Counter(s for s in counted.column("_skip").to_pylist() if s is not None)
    if isinstance(rd.start, _Stateless):
        return _Diffs(counted.num_rows, skipped, unkeyed_diffs(r.kept), None)
    keyed = against_state(ctx, rd.start, r.kept, rd.key, rd.record)
    if isinstance(keyed, str):
        return keyed
    return _Diffs(counted.num_rows, skipped, keyed.diffs, keyed)


def _log_held(ctx: TxnContext, held: int) -> None:
    ctx.log.info(
        "feed %s: %d source transaction(s) incomplete or behind an incomplete one "
        "or a new snapshot: held back until the rest arrives",
        ctx.config.feed,
        held,
    )


def run(
    ctx: TxnContext,
    seq: int,
    files: Sequence[str],
    tx_files: Sequence[str],
    reached: Callable[..., None],
    *,
    more: bool = False,
) -> Written | object | None:
    """Compute and write transaction ``seq`` over ``files`` on the driver, from the
    committed state; :data:`~feed.txn.context.DECLINED`, with nothing written, when it is
    not the driver's (see :func:`_start`) or the input is not the plain case. As the
    Spark path: None when every source transaction read is held back, and
    :data:`~feed.txn.context.NEED_MORE` when ``more`` input files are pending then.
    ``reached(step, **facts)`` is told ``after_read`` and ``before_write`` once the
    transaction is sure to be computed here, before its first file is written."""
    rd = _read(ctx, files, tx_files)
    if rd is None:
        return DECLINED
    if isinstance(rd, str):
        return _to_spark(ctx, seq, rd)
    r = release(rd.events(), GroupHold(at=rd.cut.at) if rd.cut is not None else None)
    if isinstance(r, str):
        return _to_spark(ctx, seq, r)
    if rd.cut is not None:
        if not r.ready:
            cut = rd.cut
            raise version_at_head(
                ctx, cut.change, base_name(cut.start_file), base_name(cut.shape_file)
            )
        ctx.log.info(
            "feed %s: the source table changed shape in %s (%s): committing what came "
            "before it first",
            ctx.config.feed,
            base_name(rd.cut.start_file),
            rd.cut.change.describe(),
        )
        r = replace(r, files=r.files | rd.cut.files)
    if r.held:
        _log_held(ctx, len(r.held))
        if not r.ready:
            return waiting(ctx.log, f"feed {ctx.config.feed}", len(r.held), more=more)
    units = assign_units(r.kept, ctx.config.granularity)
    d = _diffs(ctx, rd, r)
    if isinstance(d, str):
        return _to_spark(ctx, seq, d)
    # (told only now: a transaction handed to Spark above reaches them there, once)
    reached("after_read", rows_read=d.counted)
    reached("before_write", bad_rows=0)
    return _write_txn(ctx, seq, rd, r, d, units)


def run_group(
    ctxs: Sequence[TxnContext],
    files: Sequence[str],
    tx_files: Sequence[str],
    reached: Callable[..., None],
    *,
    more: bool = False,
    group: str,
) -> list[Written] | object | None:
    """A group's transaction (feed/emit/group.py) over ``files``, each feed's computed and
    written on the driver, as :func:`feed.txn.dataflow.read_group` and
    :func:`~feed.txn.dataflow.numbered_once` have it in Spark: every feed holds back the
    same source transactions (and what is delivered after the first of them), and the
    released ones of every feed, in source order, are numbered once. Each feed's
    :class:`~feed.txn.segments.Written`, in the order of ``ctxs``; None or
    :data:`~feed.txn.context.NEED_MORE` when every feed holds back all it read;
    :data:`~feed.txn.context.DECLINED`, with nothing written, when any feed's part is not
    the driver's. ``reached`` is told ``after_read`` once and ``before_write`` per feed."""
    seq = ctxs[0].cp.seq + 1
    reads: list[_Read] = []
    for ctx in ctxs:
        rd = _read(ctx, files, tx_files)
        if rd is None:
            return DECLINED
        if isinstance(rd, str):
            return _to_spark(ctx, seq, rd)
        if rd.cut is not None:  # (the group's Spark path commits the version with the others)
            return _to_spark(ctx, seq, "a group's table changed shape")
        reads.append(rd)
    released = released_together([rd.events() for rd in reads])
    if isinstance(released, str):
        return _to_spark(ctxs[0], seq, released)
    held = len(released[0].held)
    # (the files any feed holds back are read again by all: counted then, in every feed)
    files_held = set().union(*(r.files for r in released))
    released = [replace(r, files=files_held) for r in released]
    if held:
        for ctx in ctxs:
            _log_held(ctx, held)
        if not any(r.ready for r in released):
            return waiting(ctxs[0].log, f"group {group}", held, more=more)
    units = assign_units([e for r in released for e in r.kept], ctxs[0].config.granularity)
    diffs = []
    for ctx, rd, r in zip(ctxs, reads, released, strict=True):
        d = _diffs(ctx, rd, r)
        if isinstance(d, str):
            return _to_spark(ctx, seq, d)
        diffs.append(d)
    reached("after_read", rows_read=max(d.counted for d in diffs))
    out = []
    for ctx, rd, r, d in zip(ctxs, reads, released, diffs, strict=True):
        reached("before_write", bad_rows=0)
        out.append(_write_txn(ctx, ctx.cp.seq + 1, rd, r, d, units))
    return out


def _write_txn(ctx: TxnContext, seq: int, rd: _Read, r: Release, d: _Diffs, units: int) -> Written:
    """Write the transaction's segments and keyed state; what it wrote, for the commit."""
    cp, kept = ctx.cp, r.kept
    segments = write_segments(ctx, seq, consolidate(d.updates, rd.record), rd.record)
    state_ref = cp.state
    if d.keyed is not None and kept:
        new_rows: dict[int, list[dict[str, Any]]] = {}
        for b, img in d.keyed.final.values():
            if img is not None:
                new_rows.setdefault(b, []).append(img)
        state_ref = write_state(ctx, seq, d.keyed.loaded, d.keyed.carried, new_rows, rd.record)
    last = max((e["o"][:3] for e in kept), default=None)
    own = min(((e["pos_lo"], e["txn"]) for e in kept if e["op"] == "r"), default=None)
    return Written(
        segments=segments,
        state_ref=state_ref,
        units=units,
        position=snapshot_done(last, rd.snapshot.ended),
        input_rows=d.counted,
        skipped=dict(d.skipped),
        redelivered=r.redelivered,
        # (a new feed's own snapshot is the one it read, if any)
        snapshot_lsn=own[0] if own else None,
        snapshot_txn=own[1] if own else None,
        held=len(r.held),
        held_files=frozenset(base_name(f) for f in r.files),
    )


def _to_spark(ctx: TxnContext, seq: int, why: str) -> object:
    """:data:`~feed.txn.context.DECLINED` (the transaction goes to Spark), saying why in
    the debug log."""
    ctx.log.debug("feed %s: transaction %d is computed in Spark: %s", ctx.config.feed, seq, why)
    return DECLINED
