"""Consolidation: differential dataflow's ``consolidate_updates`` rule.

Sum the diffs of equal ``(record, time)`` pairs and drop the pairs whose sum is zero. The
result holds each record at most once per time, ordered by time, then by first appearance.
Arrow-backed and large batches are consolidated column-wise with Arrow's hash group-by;
small row batches (and records holding lists or maps, which Arrow cannot group by) take a
dictionary path keyed by :func:`protocol.messages.record_key`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .messages import Update, Updates, WireRow, record_keys

__all__ = ["by_time", "consolidate"]

#: Row batches at least this long go through Arrow even when they arrived as rows.
COLUMNAR_THRESHOLD = 50_000


def consolidate(updates: Updates | Iterable[Update]) -> Updates:
    """Consolidate ``updates``: one update per ``(record, time)``, no zero diffs."""
    batch = updates if isinstance(updates, Updates) else Updates.of(updates)
    if batch.has_table() or len(batch) >= COLUMNAR_THRESHOLD:
        try:
            return Updates.from_arrow(_consolidate_table(batch.table()))
        except (pa.ArrowNotImplementedError, pa.ArrowTypeError, pa.ArrowInvalid):
            pass  # a key column Arrow cannot hash (list, map): use the row path
    return Updates.from_rows(_consolidate_rows(batch.rows()))


def _consolidate_rows(rows: list[WireRow]) -> list[WireRow]:
    keys = record_keys([r["data"] for r in rows])
    acc: dict[tuple[int, bytes], list[Any]] = {}
    for key, row in zip(keys, rows, strict=True):
        slot = acc.get((row["time"], key))
        if slot is None:
            acc[(row["time"], key)] = [row["data"], row["diff"]]
        else:
            slot[1] += row["diff"]
    # dicts keep insertion order, and the sort is stable: by time, then first appearance
    out = [{"data": data, "time": t, "diff": d} for (t, _), (data, d) in acc.items() if d != 0]
    out.sort(key=lambda r: r["time"])
    return out


def _key_columns(col: pa.ChunkedArray | pa.Array, out: list[Any]) -> None:
    """Flatten a struct column into hashable leaf columns (plus validity of nested structs)."""
    t = col.type
    for i in range(t.num_fields):
        child = pc.struct_field(col, [i])
        if pa.types.is_struct(child.type):
            if child.null_count:
                out.append(pc.is_valid(child))
            _key_columns(child, out)
        else:
            out.append(child)


def _consolidate_table(table: pa.Table) -> pa.Table:
    n = table.num_rows
    if n == 0:
        return table
    keys: list[Any] = []
    _key_columns(table.column("data"), keys)
    names = [f"k{i}" for i in range(len(keys))]
    work = pa.table(
        dict(zip(names, keys, strict=True))
        | {"time": table.column("time"), "diff": table.column("diff"), "row": pa.array(range(n))}
    )
    grouped = work.group_by([*names, "time"], use_threads=False).aggregate(
        [("diff", "sum"), ("row", "min")]
    )
    grouped = grouped.filter(pc.not_equal(grouped.column("diff_sum"), 0))
    order = pc.sort_indices(grouped, [("time", "ascending"), ("row_min", "ascending")])
    grouped = grouped.take(order)
    picked = table.take(grouped.column("row_min"))
    return picked.set_column(2, "diff", grouped.column("diff_sum"))


def by_time(table: pa.Table) -> Iterator[tuple[int, pa.Table]]:
    """Split an update table into one table per time, in time order."""
    if not table.num_rows:
        return
    times = table.column("time")
    lo, hi = pc.min_max(times).values()
    if lo == hi:
        yield lo.as_py(), table
        return
    table = table.take(pc.sort_indices(times))
    sorted_times = table.column("time").to_numpy()
    starts = np.flatnonzero(np.diff(sorted_times)) + 1
    bounds = [0, *starts.tolist(), len(sorted_times)]
    for a, b in itertools.pairwise(bounds):
        yield int(sorted_times[a]), table.slice(a, b - a)
