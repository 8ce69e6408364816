"""Spark's ``xxhash64`` in plain Python, for the values the driver engine hashes.

Two things in a feed depend on Spark's 64-bit xxHash (seed 42): the bucket of a key in
the keyed state (:func:`feed.txn.state.bucket_of`) and the hash of a table's shape
(:func:`feed.sources.debezium_schema.shape_of`). The driver engine computes both for a
few hundred rows without Spark, so it needs the very same numbers: this is XXH64 as
Spark applies it column by column (each column's hash is the seed of the next; a null
leaves the seed as it was), for the types whose bytes Spark hashes plainly. tests/feed/
test_sparkhash.py compares it with Spark's own function.
"""

from __future__ import annotations

import datetime as dt
import decimal
from collections.abc import Iterable
from typing import Any

__all__ = ["SEED", "hashable", "signed", "spark_xxhash64", "xxh64"]

SEED = 42
_M = (1 << 64) - 1
_P1 = 0x9E3779B185EBCA87
_P2 = 0xC2B2AE3D27D4EB4F
_P3 = 0x165667B19E3779F9
_P4 = 0x85EBCA77C2B2AE63
_P5 = 0x27D4EB2F165667C5


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _M


def _round(acc: int, lane: int) -> int:
    acc = (acc + lane * _P2) & _M
    return (_rotl(acc, 31) * _P1) & _M


def _merge(acc: int, val: int) -> int:
    acc ^= _round(0, val)
    return (acc * _P1 + _P4) & _M


def xxh64(data: bytes, seed: int) -> int:
    """XXH64 of ``data`` with ``seed`` (both as unsigned 64-bit), as an unsigned int."""
    seed &= _M
    n, i = len(data), 0
    if n >= 32:
        v1, v2 = (seed + _P1 + _P2) & _M, (seed + _P2) & _M
        v3, v4 = seed, (seed - _P1) & _M
        while i + 32 <= n:
            v1 = _round(v1, int.from_bytes(data[i : i + 8], "little"))
            v2 = _round(v2, int.from_bytes(data[i + 8 : i + 16], "little"))
            v3 = _round(v3, int.from_bytes(data[i + 16 : i + 24], "little"))
            v4 = _round(v4, int.from_bytes(data[i + 24 : i + 32], "little"))
            i += 32
        h = (_rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)) & _M
        for v in (v1, v2, v3, v4):
            h = _merge(h, v)
    else:
        h = (seed + _P5) & _M
    h = (h + n) & _M
    while i + 8 <= n:
        h ^= _round(0, int.from_bytes(data[i : i + 8], "little"))
        h = (_rotl(h, 27) * _P1 + _P4) & _M
        i += 8
    if i + 4 <= n:
        h ^= (int.from_bytes(data[i : i + 4], "little") * _P1) & _M
        h = (_rotl(h, 23) * _P2 + _P3) & _M
        i += 4
    while i < n:
        h ^= (data[i] * _P5) & _M
        h = (_rotl(h, 11) * _P1) & _M
        i += 1
    h ^= h >> 33
    h = (h * _P2) & _M
    h ^= h >> 29
    h = (h * _P3) & _M
    h ^= h >> 32
    return h


def signed(h: int) -> int:
    """An unsigned 64-bit hash as the signed long Spark shows."""
    return h - (1 << 64) if h >= 1 << 63 else h


_EPOCH = dt.date(1970, 1, 1)
_EPOCH_TS = dt.datetime(1970, 1, 1)


def hashable(kind: str) -> bool:
    """Whether :func:`spark_xxhash64` hashes a column of Arrow type ``kind`` (its
    ``str()``) as Spark does."""
    return (
        kind in ("int8", "int16", "int32", "int64", "bool", "string", "large_string")
        or kind == "date32[day]"
        or kind.startswith("timestamp[us")
        or (kind.startswith("decimal128(") and int(kind[11:].split(",")[0]) <= 18)
    )


def _bytes(value: Any, kind: str) -> bytes:
    """The bytes Spark hashes for ``value`` of Arrow type ``kind``."""
    if kind in ("string", "large_string"):
        return str(value).encode()
    if kind in ("int8", "int16", "int32", "bool"):
        return _le(int(value), 4)
    if kind == "int64":
        return _le(int(value), 8)
    if kind == "date32[day]":
        return _le((value - _EPOCH).days, 4)
    if kind.startswith("timestamp[us"):
        naive = value if value.tzinfo is None else value.astimezone(dt.UTC).replace(tzinfo=None)
        return _le((naive - _EPOCH_TS) // dt.timedelta(microseconds=1), 8)
    if kind.startswith("decimal128("):  # precision <= 18: its unscaled long
        scale = int(kind[:-1].split(",")[1])
        return _le(int(decimal.Decimal(value).scaleb(scale)), 8)
    raise TypeError(f"Spark's xxhash64 of a {kind} is not computed here")


def _le(n: int, size: int) -> bytes:
    """``n`` as ``size`` little-endian two's-complement bytes."""
    return (n & ((1 << (8 * size)) - 1)).to_bytes(size, "little")


def spark_xxhash64(values: Iterable[tuple[Any, str]]) -> int:
    """Spark's ``xxhash64(c1, c2, …)`` of one row: ``values`` are (value, Arrow type) in
    column order; the signed 64-bit result Spark gives."""
    h = SEED
    for value, kind in values:
        if value is not None:
            h = xxh64(_bytes(value, kind), h)
    return signed(h & _M)
