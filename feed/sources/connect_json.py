"""Kafka Connect values of a parsed JSON line, typed as Spark's parse of it types them.

The driver's Debezium parse (:mod:`feed.sources.debezium_lines`) takes each column of an
image from its raw JSON value (orjson's) to the Python value Spark's ``from_json`` and
:func:`feed.sources.connect._decode` would give, for the types and encodings a connector
writes. A value Spark would cast from another JSON type, or quarantine, raises
:class:`Declined`, and the caller leaves the input to Spark.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from base64 import b64decode
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pyarrow as pa

from feed.sources.connect import (
    DECIMAL,
    NANO_UNITS,
    TIME_UNITS,
    TOAST_PLACEHOLDER,
    VARIABLE_DECIMAL,
)

__all__ = ["Declined", "RecordDecoder", "json_long", "json_number", "json_object", "json_text"]


class Declined(Exception):
    """The input is not one the driver's parse gives exactly as Spark does: the reason."""


Decode = Callable[[Any], Any]

_INT = re.compile(r"-?\d+")
_LONG_RANGE = (-(1 << 63), (1 << 63) - 1)
_INT_RANGES = {
    "int8": (-(1 << 7), (1 << 7) - 1),
    "int16": (-(1 << 15), (1 << 15) - 1),
    "int32": (-(1 << 31), (1 << 31) - 1),
    "int64": _LONG_RANGE,
}
_DATES = ("io.debezium.time.Date", "org.apache.kafka.connect.data.Date")
#: PostgreSQL's timestamptz as Debezium writes it: ISO 8601 text with its offset (Spark's
#: cast of the text reads it; other shapes of text are declined)
_ZONED = "io.debezium.time.ZonedTimestamp"
_ISO_ZONED = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,6})?(Z|[+-]\d\d:\d\d)")
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
#: the days and microseconds since 1970 of years 1 to 9999, all Python's dates hold
_DAYS = (-719_162, 2_932_896)
_MICROS = (-62_135_596_800_000_000, 253_402_300_799_999_999)


def json_text(v: Any, what: str) -> str | None:
    """A JSON value as Spark's reader keeps it in a string field (its raw text)."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    raise Declined(f"{what}: a {type(v).__name__} where text is read")


def json_long(text: str | None, what: str) -> int | None:
    """Spark's ``try_cast(text as long)`` for the text of a plain integer."""
    if text is None:
        return None
    if not _INT.fullmatch(text) or not _LONG_RANGE[0] <= int(text) <= _LONG_RANGE[1]:
        raise Declined(f"{what}: {text[:40]!r} is not a plain 64-bit integer")
    return int(text)


def json_number(v: Any, what: str) -> int | None:
    """A JSON number in a long field (Spark's reader refuses other types there)."""
    if v is None or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    raise Declined(f"{what}: not an integer")


def json_object(v: Any, what: str) -> dict[str, Any] | None:
    if v is None or isinstance(v, dict):
        return v
    raise Declined(f"{what}: not an object")


def _unscaled(b64: Any, what: str) -> int:
    """A base64 big-endian two's-complement integer (Connect's decimal encoding)."""
    if not isinstance(b64, str):
        raise Declined(f"{what}: a decimal that is not base64 text")
    try:
        raw = b64decode(b64, validate=True)
    except ValueError as e:
        raise Declined(f"{what}: {e}") from None
    return int.from_bytes(raw, "big", signed=True)


def _fits(u: int, precision: int) -> int:
    if len(str(abs(u))) > precision:
        raise Declined("a decimal wider than its column")
    return u


def _integer(kind: pa.DataType, enc: str | None, what: str) -> Decode:
    lo, hi = _INT_RANGES[str(kind)]
    factor = TIME_UNITS.get(enc or "") if str(kind) == "int64" else None
    nanos = str(kind) == "int64" and enc in NANO_UNITS

    def integer(v: Any) -> Any:
        n = json_number(v, what)
        if n is None:
            return None
        if nanos:
            return math.floor(float(n) / 1000.0)  # (Spark divides in doubles)
        if factor is not None:
            n *= factor
        if not lo <= n <= hi:
            raise Declined(f"{what}: {n} out of range")
        return n

    return integer


def _boolean(what: str) -> Decode:
    def boolean(v: Any) -> Any:
        if v is None or isinstance(v, bool):
            return v
        raise Declined(f"{what}: not true or false")

    return boolean


def _double(what: str) -> Decode:
    def double(v: Any) -> Any:
        if v is None or (isinstance(v, int | float) and not isinstance(v, bool)):
            return None if v is None else float(v)
        raise Declined(f"{what}: not a number")

    return double


def _decimal(kind: pa.Decimal128Type, enc: str | None, what: str) -> Decode:
    precision, scale = kind.precision, kind.scale

    def dec(v: Any) -> Any:
        if v is None:
            return None
        if enc == DECIMAL:
            return Decimal(_fits(_unscaled(v, what), precision)).scaleb(-scale)
        v = json_object(v, what) or {}
        s = v.get("scale")
        if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s <= scale:
            raise Declined(f"{what}: a variable-scale decimal's scale")
        u = _unscaled(v.get("value"), what) * 10 ** (scale - s)
        return Decimal(_fits(u, precision)).scaleb(-scale)

    return dec


def _date(what: str) -> Decode:
    def date(v: Any) -> Any:
        n = json_number(v, what)
        if n is None:
            return None
        if not _DAYS[0] <= n <= _DAYS[1]:
            raise Declined(f"{what}: a date Python does not hold")
        return pa.scalar(n, pa.date32()).as_py()

    return date


def _timestamp(kind: pa.TimestampType, enc: str | None, what: str) -> Decode:
    factor = TIME_UNITS.get(enc or "", 1)

    def timestamp(v: Any) -> Any:
        n = json_number(v, what)
        if n is None:
            return None
        us = math.floor(float(n) / 1000.0) if enc in NANO_UNITS else n * factor
        if not _MICROS[0] <= us <= _MICROS[1]:
            raise Declined(f"{what}: a timestamp Python does not hold")
        return pa.scalar(us, kind).as_py()

    return timestamp


def _zoned(kind: pa.TimestampType, what: str) -> Decode:
    def zoned(v: Any) -> Any:
        if v is None:
            return None
        if not isinstance(v, str) or not _ISO_ZONED.fullmatch(v):
            raise Declined(f"{what}: not an ISO timestamp with its offset")
        at = dt.datetime.fromisoformat(v).astimezone(dt.UTC)
        us = (at - _EPOCH) // dt.timedelta(microseconds=1)
        return pa.scalar(us, kind).as_py()

    return zoned


def decoder(kind: pa.DataType, enc: str | None, name: str) -> Decode:
    """How a raw JSON value of column ``name`` becomes its typed value, as
    :func:`feed.sources.connect._decode` has it; declines a type it does not handle."""
    what = f"column {name}"
    if pa.types.is_string(kind) and enc != DECIMAL:
        return lambda v: json_text(v, what)
    if pa.types.is_integer(kind) and str(kind) in _INT_RANGES:
        return _integer(kind, enc, what)
    if pa.types.is_boolean(kind):
        return _boolean(what)
    if pa.types.is_float64(kind):
        return _double(what)
    if pa.types.is_decimal(kind) and enc in (DECIMAL, VARIABLE_DECIMAL):
        return _decimal(kind, enc, what)
    if pa.types.is_date32(kind) and enc in _DATES:
        return _date(what)
    timed = enc in TIME_UNITS or enc in NANO_UNITS
    if pa.types.is_timestamp(kind) and kind.unit == "us" and timed:
        return _timestamp(kind, enc, what)
    if pa.types.is_timestamp(kind) and kind.unit == "us" and kind.tz and enc == _ZONED:
        return _zoned(kind, what)
    raise Declined(f"{what}: its type {kind} (encoded {enc}) is parsed by Spark")


class RecordDecoder:
    """How the images of one record type are typed: a decoder per column."""

    def __init__(self, record: pa.StructType, encodings: dict[str, str]) -> None:
        self.type = record
        self.fields = [(f.name, decoder(f.type, encodings.get(f.name), f.name)) for f in record]
        self.text = [f.name for f in record if pa.types.is_string(f.type)]
        self.kinds = {f.name: str(f.type) for f in record}

    def typed(self, image: Any, what: str) -> dict[str, Any] | None:
        image = json_object(image, what)
        if image is None:
            return None
        return {name: decode(image.get(name)) for name, decode in self.fields}

    def toast(self, after: Any) -> str | None:
        """The text columns of the raw after-image holding the unavailable-value marker."""
        if not isinstance(after, dict):
            return None
        names = [n for n in self.text if after.get(n) == TOAST_PLACEHOLDER]
        return ",".join(names) if names else None
