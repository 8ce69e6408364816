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

_CONTROL = r"[\x00-\x1f]"


def _text(arr: pa.Array, *, sort_keys: bool) -> pa.Array | None:
    """The JSON text of every value of ``arr`` (nulls as ``null``), or None."""
    t = arr.type
    if pa.types.is_integer(t):
        text = pc.cast(arr, pa.string())
    elif pa.types.is_boolean(t):
        text = pc.if_else(arr, "true", "false")
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        if arr.null_count < len(arr) and pc.any(pc.match_substring_regex(arr, _CONTROL)).as_py():
            return None  # orjson writes \n, \t, \u0001 ...: left to it
        escaped = pc.replace_substring(pc.replace_substring(arr, "\\", "\\\\"), '"', '\\"')
        text = pc.binary_join_element_wise('"', escaped, '"', "")
    elif pa.types.is_decimal(t) and t.scale >= 0:
        text = pc.binary_join_element_wise('"', pc.cast(arr, pa.string()), '"', "")
    elif pa.types.is_struct(t):
        return json_objects(arr, sort_keys=sort_keys)
    elif pa.types.is_null(t):
        return pa.array(["null"] * len(arr), pa.string())
    else:
        return None
    if pa.types.is_large_string(text.type):
        text = text.cast(pa.string())
    return pc.fill_null(text, "null") if arr.null_count else text


def json_objects(arr: pa.Array | pa.ChunkedArray, *, sort_keys: bool = False) -> pa.Array | None:
    """The JSON object text of every record of a struct column (``null`` for a null
    record), the fields in schema order or sorted by name; None for a type not taken."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    fields = list(arr.type)
    order = sorted(range(len(fields)), key=lambda i: fields[i].name) if sort_keys else None
    pieces: list[pa.Array | str] = []
    sep = "{"
    children = arr.flatten()  # the parent's nulls folded into each child
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


def span(text: pa.Array, start: int, stop: int) -> memoryview:
    """Rows ``start``..``stop`` of a string array as they lie back to back in its data
    buffer, without a copy (give rows a trailing separator to get them joined)."""
    if stop <= start:
        return memoryview(b"")
    first, last = text.offset + start, text.offset + stop
    offsets = np.frombuffer(text.buffers()[1], dtype=np.int32)
    return memoryview(text.buffers()[2])[int(offsets[first]) : int(offsets[last])]
