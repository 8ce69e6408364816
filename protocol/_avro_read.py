"""Avro bodies read column-wise: the updates of a CDCv2 container whose record schema is
flat (primitive fields, ``[null, T]`` unions of them) become Arrow columns with numpy,
never Python rows.

fastavro builds a dict per update and one per record, and those then become Arrow: about
3 µs an update, which bounded an Avro push. Here the items of an update array are found
as a chain: for *every* byte position of a block, where an item starting there would end
(one vectorised step per field: a varint's end, a string's length, a union's branch),
then the true starts are followed from the first item, one list index each. The values
are read at those starts only, again a vectorised step per field.

The reader takes only what it is sure of. Anything else (another record shape, a
logical type, a string longer than 1 MiB, a chain that leaves the block, invalid UTF-8,
an ``int`` out of range, a boolean byte other than 0 or 1, a time below 0...) makes it
answer ``None``, and the caller reads the body with fastavro as before, which also words
the error for a bad body. So the fast path decides nothing a body's validity depends on.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fastavro
import numpy as np
import pyarrow as pa

from ._avro_columns import avro_long_at
from .messages import Message, Progress, Updates, update_schema
from .schema import avro_to_arrow

__all__ = ["decode_columns"]

#: a block inflated past this goes to fastavro: the positions' arrays take about 44 bytes
#: per byte of a block at their peak, fastavro's dicts about 28 (a publisher writes a
#: block per 10 000 updates: 0.2 MiB of bench_push's records)
MAX_BLOCK = 8 << 20
_PAD = 16
_FIXED = {"float": 4, "double": 8}
_KINDS = {"boolean", "int", "long", "float", "double", "string", "bytes"}


class _Decline(Exception):
    """The body is not one this reader is sure of: fastavro reads it."""


@dataclass(frozen=True, slots=True)
class _Field:
    kind: str
    #: the union branch that is null (0 or 1), or -1 for a field that is not a union
    null_branch: int


def _field(schema: Any) -> _Field:
    if isinstance(schema, dict) and set(schema) == {"type"}:
        schema = schema["type"]
    if isinstance(schema, str):
        if schema not in _KINDS:
            raise _Decline
        return _Field(schema, -1)
    if isinstance(schema, list) and len(schema) == 2 and "null" in schema:
        inner = _field(schema[1 - schema.index("null")])
        if inner.null_branch != -1:
            raise _Decline
        return _Field(inner.kind, schema.index("null"))
    raise _Decline


def _plan(writer_schema: Any) -> tuple[list[_Field], pa.DataType]:
    """The record's fields, if the container is CDCv2 with a flat record schema."""
    try:
        update = writer_schema[0]["items"]
        names = [f["name"] for f in update["fields"]]
        record = update["fields"][0]["type"]
        if names != ["data", "time", "diff"] or record.get("type") != "record":
            raise _Decline
        if any(_field(f["type"]).kind != "long" for f in update["fields"][1:]):
            raise _Decline
        fields = [_field(f["type"]) for f in record["fields"]]
        return fields, avro_to_arrow(record)
    except (KeyError, IndexError, TypeError, AttributeError) as e:
        raise _Decline from e


class _Block:
    """One block's bytes and, for each kind of field, where a value of that kind starting
    at each position would end (``n + 1`` where it could not)."""

    def __init__(self, data: bytes, fields: list[_Field]) -> None:
        self.data = data
        self.n = len(data)
        if self.n >= 2**30:  # int32 positions, a length added
            raise _Decline
        self.b = np.frombuffer(data + bytes(_PAD), np.uint8)
        #: positions 0 to n + 1 (where an item could start, or past the block)
        self.at = np.arange(self.n + 2, dtype=np.int32)
        self._fields = fields
        self._ends: dict[_Field, np.ndarray] = {}
        self._next: memoryview | None = None
        idx = np.where(self.b[: self.n + 2] < 0x80, self.at, self.n + 1)
        #: the position after a varint that starts at each position
        self.vend = self._clip(np.minimum.accumulate(idx[::-1])[::-1] + 1)

    def _clip(self, p: np.ndarray) -> np.ndarray:
        clipped: np.ndarray = np.minimum(p, self.n + 1).astype(np.int32, copy=False)
        return clipped

    def _length(self, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A length's varint at each of ``p``, of up to 3 bytes: where the bytes start and
        how many. An impossible length (negative, of more bytes, past the end) gives a
        start past the block."""
        b0, b1, b2 = (self.b[p + i].astype(np.int32) for i in range(3))
        raw = (b0 & 0x7F) | ((b1 & 0x7F) << 7) | (b2 << 14)
        raw = np.where(b0 < 0x80, b0, np.where(b1 < 0x80, raw & 0x3FFF, raw))
        size = np.where(b0 < 0x80, 1, np.where(b1 < 0x80, 2, 3))
        bad = ((b0 >= 0x80) & (b1 >= 0x80) & (b2 >= 0x80)) | (raw & 1 == 1)
        start = np.where(bad, self.n + 1, p + size)
        return self._clip(start), raw >> 1

    def _string_ends(self) -> np.ndarray:
        """Where a string starting at each position ends: its length is most often one
        byte, read for every position at once; the others are read where they are."""
        b0 = self.b[: self.n + 2]
        end = self.at + 1 + (b0 >> 1)
        end[(b0 & 1) == 1] = self.n + 1  # a negative length
        longer = np.flatnonzero(b0 >= 0x80).astype(np.int32)
        start, length = self._length(longer)
        end[longer] = start + length
        return self._clip(end)

    def ends(self, f: _Field) -> np.ndarray:
        """Where a value of ``f`` starting at each position ends."""
        if f not in self._ends:
            self._ends[f] = self._union_ends(f) if f.null_branch >= 0 else self._kind_ends(f.kind)
        return self._ends[f]

    def _kind_ends(self, kind: str) -> np.ndarray:
        if kind in ("int", "long"):
            return self.vend
        if kind in _FIXED or kind == "boolean":
            return self._clip(self.at + _FIXED.get(kind, 1))
        return self._string_ends()

    def _union_ends(self, f: _Field) -> np.ndarray:
        value = np.append(self.ends(_Field(f.kind, -1))[1:], self.n + 1)
        code = self.b[: self.n + 2]
        null = code == 2 * f.null_branch
        ok = null | (code == 2 * (1 - f.null_branch))
        end = np.where(null, self._clip(self.at + 1), value)
        return np.where(ok, end, self.n + 1).astype(np.int32)

    def item_ends(self) -> np.ndarray:
        p = self.ends(self._fields[0]) if self._fields else self.at
        for f in self._fields[1:]:
            p = self.ends(f)[p]
        ends: np.ndarray = self.vend[self.vend[p]]  # time, diff
        return ends

    def chain(self, start: int, count: int) -> np.ndarray:
        """The starts of ``count`` items from ``start``, then the position after them."""
        if self._next is None:
            self._next = self.item_ends().data
        nxt, out, p = self._next, [start], start
        add = out.append
        for _ in range(count):
            p = nxt[p]
            add(p)
        starts = np.array(out, dtype=np.int32)
        if p > self.n:  # a position past the block leads only there
            raise _Decline
        return starts

    def long(self, pos: int) -> tuple[int, int]:
        return _long(self.data, pos)


def _long(data: bytes, pos: int) -> tuple[int, int]:
    """A long at ``pos`` (block counts, progress) and the position after it; one past
    64 bits declines."""
    value, pos = avro_long_at(data, pos, "")
    if not -(2**63) <= value < 2**63:
        raise _Decline
    return value, pos


def _varints(b: np.ndarray, p: np.ndarray, vend: np.ndarray) -> np.ndarray:
    """The zigzag longs at ``p``: int64."""
    size = vend[p] - p
    if len(p) and (size.max() > 10 or (b[p + 9][size == 10] > 1).any()):
        raise _Decline  # past 64 bits
    acc = np.zeros(len(p), dtype=np.uint64)
    for i in range(int(size.max()) if len(p) else 0):
        part = (b[p + i] & 0x7F).astype(np.uint64) << np.uint64(7 * i)
        acc |= np.where(i < size, part, np.uint64(0))
    return ((acc >> np.uint64(1)) ^ (np.uint64(0) - (acc & np.uint64(1)))).view(np.int64)


def _column(block: _Block, f: _Field, t: pa.DataType, p: np.ndarray) -> pa.Array:
    """The values of ``f`` at ``p``; their validity from the union's branch."""
    mask = None
    if f.null_branch >= 0:
        mask = block.b[p] == 2 * f.null_branch
        p = p + 1
    n, b = len(p), block.b
    if f.kind in ("int", "long"):
        if mask is None:
            values = _varints(b, p, block.vend)
        else:  # a null has no value to read
            values = np.zeros(n, dtype=np.int64)
            values[~mask] = _varints(b, p[~mask], block.vend)
        if f.kind == "int":
            if n and (values.min() < -(2**31) or values.max() >= 2**31):
                raise _Decline
            values = values.astype(np.int32)
        return pa.array(values, type=t, mask=mask)
    if f.kind == "boolean":
        raw = b[p]
        if (raw[~mask] if mask is not None else raw).max(initial=0) > 1:
            raise _Decline
        return pa.array(raw.astype(bool), type=t, mask=mask)
    if f.kind in _FIXED:
        width = _FIXED[f.kind]
        gathered = b[p[:, None] + np.arange(width)].reshape(-1)
        values = gathered.view("<f4" if width == 4 else "<f8")
        return pa.array(values, type=t, mask=mask)
    start, length = block._length(p)
    if mask is not None:
        length = np.where(mask, 0, length)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(length, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise _Decline
    index = np.repeat(start - offsets[:-1], length) + np.arange(offsets[-1])
    data = pa.py_buffer(b[index].tobytes())
    validity = None if mask is None else pa.array(~mask).buffers()[1]
    array = pa.Array.from_buffers(
        t, n, [validity, pa.py_buffer(offsets.astype(np.int32).tobytes()), data]
    )
    try:
        array.validate(full=True)  # UTF-8 for strings
    except pa.ArrowInvalid as e:
        raise _Decline from e
    return array


def _updates(block: _Block, starts: np.ndarray, fields: list[_Field], t: pa.DataType) -> Updates:
    p, columns = starts, []
    for f, ft in zip(fields, t, strict=True):
        columns.append(_column(block, f, ft.type, p))
        p = block.ends(f)[p]
    time = _varints(block.b, p, block.vend)
    diff = _varints(block.b, block.vend[p], block.vend)
    if len(time) and time.min() < 0:
        raise _Decline
    data = pa.Array.from_buffers(t, len(starts), [None], children=columns)
    table = pa.Table.from_arrays([data, pa.array(time), pa.array(diff)], schema=update_schema(t))
    return Updates.from_arrow(table)


def _array(block: _Block, pos: int, read: Any) -> tuple[list[Any], int]:
    """An Avro array at ``pos`` whose items ``read(pos)`` reads one at a time."""
    items: list[Any] = []
    while True:
        count, pos = block.long(pos)
        if count == 0:
            return items, pos
        if count < 0:
            count = -count
            _, pos = block.long(pos)
        if count > block.n:
            raise _Decline
        for _ in range(count):
            item, pos = read(pos)
            items.append(item)


def _progress(block: _Block, pos: int, where: str) -> tuple[Progress, int]:
    def pair(p: int) -> tuple[dict[str, int], int]:
        t, p = block.long(p)
        c, p = block.long(p)
        return {"time": t, "count": c}, p

    lower, pos = _array(block, pos, block.long)
    upper, pos = _array(block, pos, block.long)
    counts, pos = _array(block, pos, pair)
    wire = {"lower": lower, "upper": upper, "counts": counts}
    return Progress.from_wire(wire, fmt="avro", position=where), pos


def _datums(
    block: _Block, count: int, fields: list[_Field], t: pa.DataType, first: int
) -> list[Message]:
    messages: list[Message] = []
    pos = 0
    for i in range(count):
        branch, pos = block.long(pos)
        if branch == 1:
            progress, pos = _progress(block, pos, f"datum {first + i}")
            messages.append(progress)
            continue
        if branch != 0:
            raise _Decline
        parts: list[np.ndarray] = []
        while True:
            items, pos = block.long(pos)
            if items == 0:
                break
            if items < 0:
                items = -items
                _, pos = block.long(pos)
            if items > (block.n - pos) // 2:  # an update is at least two bytes (time, diff)
                raise _Decline
            starts = block.chain(pos, items)
            parts.append(starts[:-1])
            pos = int(starts[-1])
        starts = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        messages.append(_updates(block, starts, fields, t))
    if pos != block.n:
        raise _Decline
    return messages


def decode_columns(body: bytes, check: Callable[[Any], None]) -> list[Message] | None:
    """The messages of an Avro container, read column-wise; ``None`` when this reader is
    not sure of the body (the caller then reads it with fastavro, which words what is
    wrong). ``check(reader)`` raises for a writer schema that is not CDCv2's."""
    try:
        stream = io.BytesIO(body)
        reader = fastavro.reader(stream)
        check(reader)
        codec, sync = reader.codec, reader._header["sync"]
        if codec not in ("null", "deflate"):
            return None
        fields, t = _plan(reader.writer_schema)
        return _blocks(body, stream.tell(), codec, sync, fields, t)
    except Exception:  # whatever is wrong, fastavro reads it and says what
        return None


def _blocks(
    body: bytes, pos: int, codec: str, sync: bytes, fields: list[_Field], t: pa.DataType
) -> list[Message]:
    messages: list[Message] = []
    while pos < len(body):
        count, pos = _long(body, pos)
        size, pos = _long(body, pos)
        end = pos + size
        if count < 0 or size < 0 or end + 16 > len(body) or body[end : end + 16] != sync:
            raise _Decline
        if size > MAX_BLOCK:
            raise _Decline
        data = body[pos:end]
        if codec == "deflate":
            inflate = zlib.decompressobj(-15)
            data = inflate.decompress(data, MAX_BLOCK + 1)
            if len(data) > MAX_BLOCK or not inflate.eof:  # (trailing bytes: as zlib's)
                raise _Decline
        messages.extend(_datums(_Block(data, fields), count, fields, t, len(messages)))
        pos = end + 16
    return messages
