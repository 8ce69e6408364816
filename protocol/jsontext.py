"""JSON text for whole Arrow columns at once, byte for byte what orjson writes.

Encoding a record per Python call costs ~1-2 µs (building a dict, then dumping it); a column
of a million records is then seconds of one core. Here a record column becomes its JSON
text with Arrow compute kernels: every value is turned to text column by column, and the
pieces are joined row-wise in C.

Only types whose text is certain to equal orjson's are taken: integers, booleans, strings
without control characters, decimals (as strings, like :func:`messages._json_default`),
nulls, and structs of those. :func:`json_objects` returns ``None`` for anything else (a
float, a timestamp, a list, a string holding a control character), and callers fall back
to orjson. ``tests/protocol/test_jsontext.py`` checks the equality on generated records.
"""

from __future__ import annotations

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["json_objects", "span"]


def _text(arr: pa.Array, *, sort_keys: bool, skip_nulls: bool = False) -> pa.Array | None:
    """The JSON text of every value of ``arr`` (nulls as ``null``), or None; ``skip_nulls``
    as in :func:`json_objects`, for a nested record."""
    t = arr.type
    if pa.types.is_integer(t):
        text = pc.cast(arr, pa.string())
    elif pa.types.is_boolean(t):
        text = pc.if_else(arr, "true", "false")
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        # one scan of the values' bytes (a null's bytes too: at worst a needless
        # fallback or replacement) instead of a regex and two replacements per value
        raw = _value_bytes(arr)
        if np.any(raw < 0x20):
            return None  # orjson writes \n, \t, \u0001 ...: left to it
        escaped = arr
        if np.any((raw == 0x5C) | (raw == 0x22)):  # a backslash or a double quote
            escaped = pc.replace_substring(pc.replace_substring(arr, "\\", "\\\\"), '"', '\\"')
        text = pc.binary_join_element_wise('"', escaped, '"', "")
    elif pa.types.is_decimal(t) and t.scale >= 0:
        text = pc.binary_join_element_wise('"', pc.cast(arr, pa.string()), '"', "")
    elif pa.types.is_struct(t):
        return json_objects(arr, sort_keys=sort_keys, skip_nulls=skip_nulls)
    elif pa.types.is_null(t):
        return pa.array(["null"] * len(arr), pa.string())
    else:
        return None
    if pa.types.is_large_string(text.type):
        text = text.cast(pa.string())
    return pc.fill_null(text, "null") if arr.null_count else text


def _value_bytes(arr: pa.Array) -> np.ndarray:
    """The bytes of a string array's values, back to back, as numpy (no copy)."""
    width = np.int64 if pa.types.is_large_string(arr.type) else np.int32
    offsets_buf, data_buf = arr.buffers()[1:3]
    if data_buf is None or not len(arr):
        return np.zeros(0, np.uint8)
    offsets = np.frombuffer(offsets_buf, dtype=width)
    lo, hi = int(offsets[arr.offset]), int(offsets[arr.offset + len(arr)])
    return np.frombuffer(data_buf, dtype=np.uint8)[lo:hi]


def json_objects(
    arr: pa.Array | pa.ChunkedArray, *, sort_keys: bool = False, skip_nulls: bool = False
) -> pa.Array | None:
    """The JSON object text of every record of a struct column (``null`` for a null
    record), the fields in schema order or sorted by name; None for a type not taken.
    ``skip_nulls`` leaves out every field whose value is null, in nested records too (the
    record identity of :func:`protocol.messages.record_key`)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    fields = list(arr.type)
    order = sorted(range(len(fields)), key=lambda i: fields[i].name) if sort_keys else None
    children = arr.flatten()  # the parent's nulls folded into each child
    if skip_nulls:
        return _without_nulls(arr, fields, children, order, sort_keys=sort_keys)
    pieces: list[pa.Array | str] = []
    sep = "{"
    for i in order if order is not None else range(len(fields)):
        text = _text(children[i], sort_keys=sort_keys)
        if text is None:
            return None
        pieces.append(sep + orjson.dumps(fields[i].name).decode() + ":")
        pieces.append(text)
        sep = ","
    if not pieces:
        obj = pa.array(["{}"] * len(arr), pa.string())
    else:
        obj = pc.binary_join_element_wise(*pieces, "}", "")
    if arr.null_count:
        obj = pc.if_else(pc.is_valid(arr), obj, "null")
    return obj


def _without_nulls(
    arr: pa.Array,
    fields: list[pa.Field],
    children: list[pa.Array],
    order: list[int] | None,
    *,
    sort_keys: bool,
) -> pa.Array | None:
    """:func:`json_objects` with ``skip_nulls``: each field is ``,"name":value`` or
    nothing, and the first comma becomes the brace."""
    pieces: list[pa.Array] = []
    for i in order if order is not None else range(len(fields)):
        text = _text(children[i], sort_keys=sort_keys, skip_nulls=True)
        if text is None:
            return None
        named = pc.binary_join_element_wise(
            "," + orjson.dumps(fields[i].name).decode() + ":", text, ""
        )
        pieces.append(pc.if_else(pc.is_valid(children[i]), named, ""))
    if not pieces:
        body = pa.array([""] * len(arr), pa.string())
    else:
        body = pc.utf8_slice_codeunits(pc.binary_join_element_wise(*pieces, ""), 1)
    obj = pc.binary_join_element_wise("{", body, "}", "")
    if arr.null_count:
        obj = pc.if_else(pc.is_valid(arr), obj, "null")
    return obj


def span(text: pa.Array, start: int, stop: int) -> memoryview:
    """Rows ``start``..``stop`` of a string array as they lie back to back in its data
    buffer, without a copy (give rows a trailing separator to get them joined)."""
    if stop <= start:
        return memoryview(b"")
    first, last = text.offset + start, text.offset + stop
    offsets = np.frombuffer(text.buffers()[1], dtype=np.int32)
    return memoryview(text.buffers()[2])[int(offsets[first]) : int(offsets[last])]
