"""A transaction computed in Spark: its input read into changes, diffs against the keyed
state and consolidated updates (:mod:`feed.txn.dataflow`), written as segments, state and
quarantined rows (:mod:`feed.txn.segments`), and with eager delivery pushed by the executors
(:mod:`feed.emit.eager`). The driver (:mod:`feed.emit.emitter`) commits what it returns."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from feed.txn.context import NEED_MORE, ReadChanges, TxnContext, base_name
from feed.txn.dataflow import compute_updates, read_input
from feed.txn.segments import Written, write_transaction

__all__ = ["compute_and_write", "run"]


def run(
    ctx: TxnContext,
    files: Sequence[str],
    tx_files: Sequence[str],
    secs: dict[str, float],
    *,
    more: bool,
    reached: Callable[..., None],
    eager: Any = None,
) -> Written | object | None:
    """Read, compute and write one transaction over ``files`` (and the pending
    ``--tx-metadata`` files ``tx_files``), timing its stages into ``secs`` and telling
    ``reached`` each step. ``None``: nothing to do yet (every source transaction read is
    incomplete); :data:`~feed.txn.context.NEED_MORE`: the same, with more input pending."""
    t0 = time.perf_counter()
    read = read_input(ctx, files, tx_files, more=more)
    if read is NEED_MORE or read is None:
        return read
    assert isinstance(read, ReadChanges)
    secs["read"] = time.perf_counter() - t0
    reached("after_read", rows_read=read.input_rows)
    return compute_and_write(ctx, read, secs, reached=reached, eager=eager)


def compute_and_write(
    ctx: TxnContext,
    read: ReadChanges,
    secs: dict[str, float],
    *,
    reached: Callable[..., None],
    eager: Any = None,
) -> Written:
    """The rest of :func:`run` once the input is read: diffs, updates, and their files."""
    from pyspark.sql import functions as F

    from feed.sources.positions import snapshot_read

    cfg, cp = ctx.config, ctx.cp
    t1 = time.perf_counter()
    done = compute_updates(ctx, read)
    secs["compute"] = time.perf_counter() - t1
    try:
        t2 = time.perf_counter()
        reached("before_write", bad_rows=done.bad_rows)
        segments, state_ref = write_transaction(ctx, cp.seq + 1, done)
        secs["write"] = time.perf_counter() - t2
        if eager is not None and segments:
            t_eager = time.perf_counter()
            fl = ctx.feedlog
            files = sorted({f for s in segments for f in s.files})  # (a pack holds many)
            if fl.store is not None and cfg.layout == "packs":  # read through pyarrow
                report = eager.push(ctx.spark, [fl.path(f) for f in files], cp.epoch, fl.store)
            else:
                paths = [ctx.spark_path(fl.path(f)) for f in files]
                report = eager.push(ctx.spark, paths, cp.epoch)
            report.log(ctx.log, cfg.feed)
            secs["eager"] = time.perf_counter() - t_eager
        snapshot_lsn = snapshot_txn = None
        if cfg.kind.events and "snapshot_lsn" not in cp.source and read.snapshot_reads:
            # the first snapshot read committed: later reads of another are a new one
            first = F.min(F.struct("pos_lo", "txn")).alias("m")
            m = done.good.where(snapshot_read()).agg(first).collect()[0]["m"]
            if m is not None:  # (None: the feed had none)
                snapshot_lsn, snapshot_txn = m["pos_lo"], m["txn"]
    finally:
        done.release()
    return Written(
        segments=segments,
        state_ref=state_ref,
        units=done.units,
        position=done.position,
        input_rows=read.input_rows,
        skipped=read.skipped,
        redelivered=read.redelivered,
        snapshot_lsn=snapshot_lsn,
        snapshot_txn=snapshot_txn,
        bad_rows=done.bad_rows,
        held=read.held,
        held_files=frozenset(base_name(f) for f in read.held_files),
        replaces=read.replaces,
    )
