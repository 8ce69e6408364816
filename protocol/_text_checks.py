"""Checks of a JSON text body made before any JSON reader sees it: what pyarrow's reader
(and orjson) would take quietly as something else, or crash on. :func:`utf8_check`:
bytes that are not UTF-8. :func:`number_check`: ``NaN``/``Infinity`` and integers beyond
64 bits. :func:`nesting_check`: objects and arrays nested
deeper than :data:`MAX_DEPTH`. They scan at C speed (bytes.translate, numpy) and read
Python-side only the lines that need it."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from .errors import CodecError
from .messages import INT64_MAX, INT64_MIN

__all__ = ["MAX_DEPTH", "longest_line", "nesting_check", "number_check", "utf8_check"]


#: a run of this many digits may be an integer beyond 64 bits (2^63 has 19 digits)
_LONG_DIGITS = b"1" * 19
#: digits as b"1", every other byte as b"0"
_DIGITS = bytes(0x31 if 0x30 <= c <= 0x39 else 0x30 for c in range(256))


def utf8_check(body: bytes) -> None:
    """Raise :class:`CodecError`, naming the line, for bytes that are not UTF-8 (pyarrow's
    reader replaces them with U+FFFD)."""
    if not body.isascii():
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CodecError(
                f"invalid UTF-8 at byte {e.start}", fmt="ndjson", position=_line_at(body, e.start)
            ) from None


def number_check(body: bytes) -> None:
    """Raise :class:`CodecError`, naming the line, for the non-JSON ``NaN`` and
    ``Infinity`` (pyarrow's reader takes them as floats when it infers types) and integers
    beyond 64 bits (both readers make them floats). Bodies that can hold none of these (no
    such word, no run of 19 digits) pass after a few scans at C speed; the others are read
    line by line with Python's own JSON reader, which says exactly. A body that pyarrow
    read whole with a given type of integers, strings and booleans needs no such scan
    (that read fails on any of them), nor one whose inferred types hold no float (that
    read makes a double of each of them)."""
    words = b"NaN" in body or b"Infinity" in body
    if not words and _LONG_DIGITS not in body.translate(_DIGITS):
        return
    for lineno, line in enumerate(body.splitlines(), start=1):
        try:
            json.loads(line, parse_int=_int64, parse_constant=_no_constant)
        except ValueError as e:
            raise CodecError(str(e), fmt="ndjson", position=f"line {lineno}") from None


def _int64(text: str) -> int:
    v = int(text)
    if not INT64_MIN <= v <= INT64_MAX:
        raise ValueError(f"integer {text[:40]} is beyond 64 bits")
    return v


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (a number must be finite)")


def longest_line(body: bytes) -> int:
    """The bytes of ``body``'s longest line, its newline counted (the last line's, if it
    has none, as if it had). In steps of :data:`_CHUNK` bytes: a mask of the whole body
    is as large as the body, and fresh memory of that size costs more to touch than the
    search."""
    raw = np.frombuffer(body, dtype=np.uint8)
    longest, start = 0, 0  # (start: where the line under way began)
    for at in range(0, len(raw), _CHUNK):
        ends = np.flatnonzero(raw[at : at + _CHUNK] == 10) + at
        if len(ends):
            longest = max(longest, int(ends[0]) - start + 1, int(np.max(np.diff(ends), initial=0)))
            start = int(ends[-1]) + 1
    return max(longest, len(raw) - start + 1) if start < len(raw) else longest


def _line_at(body: bytes, at: int) -> str:
    newline = b"\n"
    return f"line {body.count(newline, 0, at) + 1}"


#: the deepest nesting of objects and arrays a body may have: a record's own columns
#: (structs in lists in maps …) come far below it; pyarrow's JSON reader crashed the
#: process on bodies nested some 20,000 deep
MAX_DEPTH = 64


_CHUNK = 1 << 22  # bytes a nesting scan looks at at once: its memory stays bounded


def nesting_check(body: bytes) -> None:
    """Raise :class:`CodecError` when ``body`` nests objects and arrays deeper than
    :data:`MAX_DEPTH`, naming the line. Columnar, over the positions of brackets and
    quotes only, in chunks of :data:`_CHUNK` bytes: brackets inside strings do not count,
    nor quotes escaped by an odd run of backslashes."""
    if b"\\" not in body:
        # no escapes: only brackets and quotes matter, and deleting every other byte (at C
        # speed) leaves a far shorter text to scan; a body found too deep is scanned again
        # whole, to name the line
        marks = body.translate(None, _NOT_STRUCTURAL)
        if 2 * marks.count(b'""') == marks.count(b'"'):
            # every run of quotes among the marks is even: each string's two quotes stand
            # next to each other, so no string holds a bracket and the brackets alone
            # give the depth (the usual case: 8 ms less than the scan below for 15 MB)
            if _deepest(marks.translate(None, b'"')) <= MAX_DEPTH:
                return
        elif _shallow(marks):
            return
        try:
            _scan(marks)
            return
        except CodecError:
            pass
    _scan(body)


def _deepest(brackets: bytes) -> int:
    """The deepest nesting of a text of brackets alone, in chunks of :data:`_CHUNK`."""
    b = np.frombuffer(brackets, dtype=np.uint8)
    deepest, depth = 0, 0
    for at in range(0, len(b), _CHUNK):
        levels = depth + np.cumsum(_STEP[b[at : at + _CHUNK]], dtype=np.int64)
        deepest = max(deepest, int(levels.max()))
        depth = int(levels[-1])
    return deepest


def _shallow(marks: bytes) -> bool:
    """Whether ``marks`` (the brackets and quotes of a body without escapes) has no bracket
    inside a string and nests at most :data:`MAX_DEPTH` deep. Every mark before a bracket
    that is not a bracket is a quote: a bracket is outside every string when the number of
    marks before it, less the brackets before it, is even. In chunks of :data:`_CHUNK`
    marks, so that a body of brackets alone needs no more memory than the scan."""
    m = np.frombuffer(marks, dtype=np.uint8)
    brackets, depth = 0, 0  # carried from chunk to chunk
    for at in range(0, len(m), _CHUNK):
        chunk = m[at : at + _CHUNK]
        found = np.flatnonzero(chunk != 0x22)
        quotes_before = found + (at - brackets) - np.arange(len(found))
        if np.any(quotes_before & 1):
            return False
        if len(found):
            levels = np.cumsum(_STEP[chunk[found]], dtype=np.int64)
            if depth + int(levels.max()) > MAX_DEPTH:
                return False
            depth += int(levels[-1])
        brackets += len(found)
    return True


#: every byte but brackets and quotes (deleted before a scan of a body without escapes)
_NOT_STRUCTURAL = bytes(c for c in range(256) if c not in b'[]{}"')


def _scan(body: bytes) -> None:
    """:func:`nesting_check` on ``body`` as it is."""
    b = np.frombuffer(body, dtype=np.uint8)
    depth, inside = 0, 0  # carried from chunk to chunk
    for at in range(0, len(b), _CHUNK):
        kind = _KIND[b[at : at + _CHUNK]]  # one pass: what each byte is to this scan
        marks = np.flatnonzero(kind)
        kinds = kind[marks]
        real = _real_quotes(b, marks[kinds == 3], at)
        if inside:
            real = np.concatenate(([-1], real))  # a string open since an earlier chunk
        opens, closes = marks[kinds == 1], marks[kinds == 2]
        opens = opens[np.searchsorted(real, opens) % 2 == 0]
        closes = closes[np.searchsorted(real, closes) % 2 == 0]
        # the depth after each open: the opens up to it less the closes before it
        levels = depth + np.arange(1, len(opens) + 1) - np.searchsorted(closes, opens)
        if len(levels) and int(levels.max()) > MAX_DEPTH:
            where = at + int(opens[int(np.argmax(levels > MAX_DEPTH))])
            line = int(np.count_nonzero(b[:where] == 10)) + 1
            raise CodecError(
                f"nested deeper than {MAX_DEPTH} levels of objects and arrays",
                fmt="ndjson",
                position=f"line {line}",
            )
        depth += len(opens) - len(closes)
        inside = len(real) % 2


#: what a byte is to :func:`nesting_check`: 1 an opening bracket, 2 a closing one, 3 a quote
_KIND = np.zeros(256, dtype=np.uint8)
_KIND[[0x7B, 0x5B]] = 1
_KIND[[0x7D, 0x5D]] = 2
_KIND[0x22] = 3
#: a bracket's step in depth
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[0x7B, 0x5B]] = 1
_STEP[[0x7D, 0x5D]] = -1


def _real_quotes(b: np.ndarray, quotes: np.ndarray, at: int) -> np.ndarray:
    """The quotes (positions in the chunk at ``at``) that are not escaped: a quote is
    escaped by an odd run of backslashes just before it (rare: looked at one by one)."""
    if not len(quotes):
        return quotes
    glob = quotes + at
    after_bs = glob > 0
    after_bs[after_bs] = b[glob[after_bs] - 1] == 0x5C
    if not after_bs.any():
        return quotes
    keep = np.ones(len(quotes), dtype=bool)
    for i in np.flatnonzero(after_bs):
        j = int(glob[i]) - 1
        while j >= 0 and b[j] == 0x5C:
            j -= 1
        keep[i] = (int(glob[i]) - 1 - j) % 2 == 0
    return quotes[keep]
