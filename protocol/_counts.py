"""Collections as Arrow count tables, for the reference receiver's store
(:mod:`protocol.sqlite_store`): the LZ4 Arrow IPC blobs its parts are kept in, the record
keys of update tables sorted with their diffs, and two sorted collections merged."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from .jsontext import json_objects
from .messages import record_keys

__all__ = ["FETCH_ROWS", "from_ipc", "ipc", "merged", "pairs", "record_keys_of", "sorted_counts"]

#: rows of a collection read per SQLite fetch (and made Python per chunk)
FETCH_ROWS = 10_000

#: LZ4 makes a blob ~3.5x smaller for ~1 ms per 10,000 updates, and the commit's fsync
#: (which waits for every byte) several ms shorter
_IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression="lz4")


def ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=_IPC_OPTIONS) as writer:
        writer.write_table(table)
    data: bytes = sink.getvalue().to_pybytes()
    return data


def record_keys_of(data: pa.ChunkedArray) -> pa.Array:
    """:func:`~protocol.messages.record_key` of every record of a ``data`` column (a
    binary array): built column-wise where :mod:`.jsontext` takes the record type (the
    same bytes), else one record at a time."""
    text = json_objects(data, sort_keys=True, skip_nulls=True)
    if text is not None:
        return text.cast(pa.binary())
    flat = all(not pa.types.is_nested(f.type) for f in data.type)
    rows = data.to_pylist(maps_as_pydicts="strict")
    return pa.array(record_keys(rows, nested=not flat), pa.binary())


def from_ipc(blob: bytes) -> pa.Table:
    """The table :func:`ipc` wrote."""
    return pa.ipc.open_stream(pa.py_buffer(blob)).read_all()


def merged(
    kept: Iterator[tuple[bytes, int]], pending: Iterator[tuple[bytes, int]]
) -> Iterator[tuple[bytes, int]]:
    """Two collections in key order as their sum, in key order, without the records whose
    count comes to 0."""
    nxt = next(pending, None)
    for rkey, count in kept:
        while nxt is not None and nxt[0] < rkey:
            if nxt[1]:
                yield nxt
            nxt = next(pending, None)
        if nxt is not None and nxt[0] == rkey:
            count += nxt[1]
            nxt = next(pending, None)
        if count:
            yield rkey, count
    while nxt is not None:
        if nxt[1]:
            yield nxt
        nxt = next(pending, None)


def pairs(counts: pa.Table) -> Iterator[tuple[bytes, int]]:
    """``(key, count)`` of a :func:`sorted_counts` table, a record's updates summed (they
    are next to each other), made Python a chunk at a time."""
    last: bytes | None = None
    total = 0
    for batch in counts.to_batches(max_chunksize=FETCH_ROWS):
        for key, n in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist(), strict=True):
            if key == last:
                total += n
                continue
            if last is not None:
                yield last, total
            last, total = key, n
    if last is not None:
        yield last, total


def sorted_counts(tables: list[pa.Table]) -> pa.Table:
    """The record keys of ``tables`` (update tables) with their diffs, sorted by key
    (columns ``k``, ``n``): a sort, not a hash aggregation, which would hold a table of
    every key besides. In key order the upserts of a fold touch the collection's B-tree
    pages one after another instead of at random."""
    keys = pa.chunked_array([record_keys_of(t.column("data")) for t in tables], pa.binary())
    diffs = pa.chunked_array([t.column("diff").combine_chunks() for t in tables], pa.int64())
    counts = pa.table({"k": keys, "n": diffs})
    return counts.take(pc.sort_indices(counts, sort_keys=[("k", "ascending")]))
