"""The keyed state of a transaction the driver engine (:mod:`feed.txn.driver`) computes:
the state buckets its keys touch read with pyarrow, its events diffed against them
(:mod:`feed.txn.driver_diffs`), and the touched buckets written again with the
transaction's last image of each key, as the Spark path's :mod:`feed.txn.state` has them."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from feed.log.manifest import Segment
from feed.log.store import PARQUET_PAGES
from feed.txn.context import TxnContext
from feed.txn.driver_diffs import fill_unavailable, keyed_diffs
from feed.txn.packs import write_pack
from feed.txn.segments import install_segments, staging_folder
from feed.txn.state import LoadedState

__all__ = [
    "Keyed",
    "against_state",
    "read_buckets",
    "write_parquet",
    "write_segments",
    "write_state",
    "write_time_tables",
]


@dataclass(frozen=True, slots=True)
class Keyed:
    """A keyed transaction's work against its state (:func:`against_state`)."""

    diffs: list[tuple[dict[str, Any], int, int]]  # (image, unit, diff)
    final: dict[tuple[Any, ...], tuple[int, Any]]  # key -> (bucket, last image or None)
    loaded: LoadedState  # the state it started from, with the buckets its keys touch
    carried: dict[int, pa.Table]  # per touched bucket, the rows of the other keys


def against_state(
    ctx: TxnContext,
    loaded: LoadedState,
    kept: list[dict[str, Any]],
    key: tuple[str, ...],
    record: pa.Schema,
) -> Keyed | str:
    """A keyed feed's diffs of the ``kept`` events against the committed state
    ``loaded``, or why the transaction goes to Spark."""
    touched = {e["_bucket"] for e in kept}
    state = read_buckets(ctx, loaded, touched, record)
    if state is None:
        return "state with positions or tombstones"
    old, carried = split_state(state, {e["k"] for e in kept}, key, record)
    if not fill_unavailable(kept, old):
        return "an unavailable value with no earlier value to take"
    diffs = keyed_diffs(kept, old)
    if diffs is None:
        return "a delete of a key the feed does not hold"
    updates, final = diffs
    return Keyed(updates, final, replace(loaded, touched=frozenset(touched)), carried)


def read_buckets(
    ctx: TxnContext, loaded: LoadedState, buckets: set[int], record: pa.Schema
) -> dict[int, pa.Table] | None:
    """The rows of the committed state's ``buckets``; None when a bucket holds more than
    records: tombstones or positions, which Debezium state never has. (State a schema
    version's rewrite wrote, feed/txn/evolve.py, has the two columns, empty.)"""
    from feed.txn.state import GONE_COLUMN, POS_COLUMN

    fl = ctx.feedlog
    out = {}
    for b in sorted(buckets):
        folder = loaded.files.get(b)
        if folder is None:
            continue
        parts = []
        for f in fl.parquet_files(fl.path(folder)):
            part = pq.read_table(f, filesystem=fl.fs)
            extra = set(part.schema.names) - set(record.names)
            if extra == {POS_COLUMN, GONE_COLUMN}:
                gone = pc.fill_null(part.column(GONE_COLUMN), False)
                if part.column(POS_COLUMN).null_count < part.num_rows or pc.any(gone).as_py():
                    return None
                part = part.select(record.names)
            if part.schema.names != record.names:
                return None
            parts.append(part.cast(record))
        if parts:
            out[b] = pa.concat_tables(parts)
    return out


def split_state(
    state: dict[int, pa.Table], keys: set[tuple[Any, ...]], key: Sequence[str], record: pa.Schema
) -> tuple[dict[tuple[Any, ...], dict[str, Any]], dict[int, pa.Table]]:
    """The state rows of ``keys`` (by key) and, per bucket, the rows of every other key,
    which the new version of the bucket carries as they are (columnar: a bucket holds
    thousands of rows, a transaction touches a few)."""
    wanted = pa.Table.from_pylist(
        [dict(zip(key, k, strict=True)) for k in keys],
        schema=pa.schema([record.field(c) for c in key]),
    )
    old: dict[tuple[Any, ...], dict[str, Any]] = {}
    carried: dict[int, pa.Table] = {}
    for b, rows in state.items():
        for row in rows.join(wanted, list(key), join_type="left semi").to_pylist():
            old[tuple(row[c] for c in key)] = row
        carried[b] = rows.join(wanted, list(key), join_type="left anti").select(record.names)
    return old, carried


def write_state(
    ctx: TxnContext,
    seq: int,
    loaded: LoadedState,
    carried: dict[int, pa.Table],
    new_rows: dict[int, list[dict[str, Any]]],
    record: pa.Schema,
) -> str:
    """Write the touched buckets (their untouched keys' rows and the touched keys' new
    rows) and the state manifest; return the manifest's reference."""
    attempt = ctx.state.attempt(seq)
    written = []
    for b in sorted(loaded.touched):
        parts = [pa.Table.from_pylist(new_rows.get(b, []), record)]
        if b in carried:
            parts.insert(0, carried[b])
        rows = pa.concat_tables(parts)
        if rows.num_rows:
            path = f"{ctx.state.bucket_folder(attempt, b)}/part-{uuid.uuid4().hex}.parquet"
            written.append((b, path, write_parquet(ctx.feedlog.fs, path, rows)))
    ref: str = ctx.state.publish(attempt, written, loaded)
    return ref


def write_parquet(fs: Any, path: str, table: pa.Table) -> int:
    """Write one Parquet file (its folder made first); return its rows."""
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    pq.write_table(table, path, filesystem=fs, **PARQUET_PAGES)
    return int(table.num_rows)


def write_segments(
    ctx: TxnContext, seq: int, units: dict[int, list[dict[str, Any]]], record: pa.Schema
) -> list[Segment]:
    """Write each unit's updates as its time's segment (:func:`write_time_tables`)."""
    schema = pa.schema([*record, pa.field("diff", pa.int64())])
    tables = {ctx.cp.next + u: pa.Table.from_pylist(rows, schema) for u, rows in units.items()}
    return write_time_tables(ctx, seq, tables)


def write_time_tables(ctx: TxnContext, seq: int, tables: dict[int, pa.Table]) -> list[Segment]:
    """Write each time's updates (record columns and ``diff``) as its segment: staged,
    then installed under the epoch's names (:func:`feed.txn.segments.install_segments`);
    in a feed of packs, one pack holding every time (:mod:`feed.txn.packs`)."""
    fl, cp = ctx.feedlog, ctx.cp
    if ctx.config.layout == "packs":
        return write_pack(fl, seq, cp.epoch, tables)
    staging = staging_folder(fl, seq)
    staged = []
    for time, table in sorted(tables.items()):
        path = f"{staging}/time={time}/part-{uuid.uuid4().hex}.parquet"
        staged.append((time, path, write_parquet(fl.fs, path, table)))
    segments = install_segments(ctx, staged, cp.epoch)
    fl.delete_dir(staging)
    return segments
