"""Writing a transaction: its updates as each time's segment files, its keyed state and its
quarantined rows, all before the commit names them (see :mod:`feed.emit.emitter`).

Updates are written by one Spark job to ``_staging/<seq>-<random>/time=<t>/`` and moved to
``times/<t>/`` under names of the writing epoch (:meth:`feed.log.store.FeedLog.install_time`): a
redo of the same transaction replaces them. The job's tasks write the files themselves with
pyarrow (:func:`feed.txn.grouped.write_groups`) and return each file's time and row count, so
the manifest's counts come from the write, and a file a failed task attempt left behind is
never named.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from feed.log.manifest import Segment
from feed.log.store import FeedLog
from feed.txn.context import Computed, TxnContext
from feed.txn.grouped import by_group, write_groups, write_json_lines
from feed.txn.packs import write_packs

__all__ = [
    "Written",
    "install_segments",
    "staging_folder",
    "write_transaction",
    "write_updates",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Written:
    """What a transaction wrote before its commit, and what the commit records."""

    segments: list[Segment]
    state_ref: str | None
    units: int  # how many times it takes from ``next``
    position: tuple[Any, ...] | None  # the highest source position turned into updates
    input_rows: int
    skipped: dict[str, int]
    redelivered: int
    snapshot_lsn: int | None  # a Debezium feed's first snapshot (when not recorded yet)
    snapshot_txn: str | None = None  # and its source transaction
    bad_rows: int = 0
    held: int = 0
    held_files: frozenset[str] = frozenset()  # base names of files read again later
    replaces: tuple[int, str] | None = None


def write_transaction(
    ctx: TxnContext, seq: int, done: Computed
) -> tuple[list[Segment], str | None]:
    """Write transaction ``seq``'s updates, state and bad rows; return its segments (by
    time) and the state reference its commit names."""
    from pyspark.sql import functions as F

    fl, cp = ctx.feedlog, ctx.cp
    segments = write_updates(ctx, seq, done.updates)
    state_ref = cp.state
    if done.new_state is not None and done.loaded is not None:
        state_ref = ctx.state.write(seq, done.new_state, done.loaded)
    elif done.new_state is not None:  # successive snapshots: the last one, whole
        state_ref = ctx.state.write_whole(seq, done.new_state)
    if done.bad_rows:
        bad = done.bad.select(
            F.col("_file").alias("file"),
            F.col("_raw").alias("raw"),
            F.col("_error").alias("reason"),
        )
        write_json_lines(bad, fl.store, fl.path("quarantine", str(seq)))
    return segments, state_ref


def write_updates(ctx: TxnContext, seq: int, updates: Any) -> list[Segment]:
    """Write transaction ``seq``'s ``updates`` (columns time, data, diff) as each time's
    segment files, staged and then moved into place (in a feed of packs, a pack per
    task: :mod:`feed.txn.packs`); return the segments by time."""
    if ctx.config.layout == "packs":
        cols = updates.select("time", "data.*", "diff")
        return write_packs(cols, ctx.feedlog, seq, ctx.cp.epoch)
    staging = staging_folder(ctx.feedlog, seq)
    flat = updates.select("time", "data.*", "diff")
    staged = write_groups(flat, "time", ctx.feedlog.store, staging, "time=")
    segments = install_segments(ctx, staged, ctx.cp.epoch)
    ctx.feedlog.delete_dir(staging)
    return segments


def staging_folder(fl: FeedLog, seq: int) -> str:
    """A new folder for transaction ``seq``'s updates before they are installed (random:
    a redo never meets a killed attempt's files)."""
    return fl.path("_staging", f"{seq}-{uuid.uuid4().hex[:8]}")


def install_segments(
    ctx: TxnContext, staged: list[tuple[int, str, int]], epoch: int
) -> list[Segment]:
    """Move the staged files (time, file, rows) to ``times/<t>``; return each time's
    segment."""
    segments = []
    for t, (files, n) in sorted(by_group(staged).items()):
        if n:
            installed = ctx.feedlog.install_time(t, epoch, files)
            segments.append(Segment(t, epoch, n, tuple(installed)))
    return segments
