"""Kafka Connect encodings: a Connect schema as an Avro record schema, and the raw JSON
text of a Connect value as a typed Spark column.

Debezium writes values the way Kafka Connect's JSON converter does: decimals as base64
big-endian unscaled integers (with the scale in the schema, or beside the value for
PostgreSQL ``numeric`` without one), times as numbers in a unit the logical type names.
:func:`typed_record` reads a struct of raw strings into the feed's record type with Spark's
native expressions, and names every field whose value does not fit.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql import types as T

__all__ = [
    "CONNECT_NAME",
    "CONNECT_SCALE",
    "DECIMAL",
    "NANO_UNITS",
    "TIME_UNITS",
    "TOAST_PLACEHOLDER",
    "VARIABLE_DECIMAL",
    "VARIABLE_DECIMAL_TYPE",
    "as_strings",
    "connect_names",
    "connect_scales",
    "connect_to_avro",
    "typed_record",
]

_CONNECT_TYPES = {
    "int8": "int",
    "int16": "int",
    "int32": "int",
    "int64": "long",
    "float32": "float",
    "float64": "double",
    # what the JSON converter writes for float32 and float64 (real, double precision)
    "float": "float",
    "double": "double",
    "boolean": "boolean",
    "string": "string",
    "bytes": "bytes",
}

#: the ``connect.name`` attribute a record field keeps: how its JSON value is encoded
CONNECT_NAME = "connect.name"
#: the scale of a decimal wider than 38 digits, which the feed holds as text (a feed made
#: before this attribute existed reads such a column at scale 0)
CONNECT_SCALE = "connect.scale"
DECIMAL = "org.apache.kafka.connect.data.Decimal"
VARIABLE_DECIMAL = "io.debezium.data.VariableScaleDecimal"
#: PostgreSQL ``numeric`` without a declared precision has no fixed scale: tidefeed holds it
#: as decimal(38, 18) (20 integer digits, 18 after the point); a value with more digits is
#: a type mismatch, quarantined, never rounded
VARIABLE_DECIMAL_TYPE = (38, 18)
#: Debezium's marker for an unchanged TOASTed column (REPLICA IDENTITY DEFAULT)
TOAST_PLACEHOLDER = "__debezium_unavailable_value"

# Kafka Connect / Debezium logical types -> Avro logical types
_CONNECT_LOGICAL: dict[str, dict[str, Any]] = {
    "io.debezium.time.ZonedTimestamp": {"type": "long", "logicalType": "timestamp-micros"},
    "io.debezium.time.MicroTimestamp": {"type": "long", "logicalType": "local-timestamp-micros"},
    "io.debezium.time.Timestamp": {"type": "long", "logicalType": "local-timestamp-micros"},
    "io.debezium.time.NanoTimestamp": {"type": "long", "logicalType": "local-timestamp-micros"},
    "org.apache.kafka.connect.data.Timestamp": {
        "type": "long",
        "logicalType": "local-timestamp-micros",
    },
    "io.debezium.time.Date": {"type": "int", "logicalType": "date"},
    "org.apache.kafka.connect.data.Date": {"type": "int", "logicalType": "date"},
    # Spark 4 cannot hold TIME columns yet: a time of day is its microseconds since midnight
    "io.debezium.time.MicroTime": {"type": "long"},
    "io.debezium.time.Time": {"type": "long"},
    "io.debezium.time.NanoTime": {"type": "long"},
    "org.apache.kafka.connect.data.Time": {"type": "long"},
    "io.debezium.data.Uuid": {"type": "string", "logicalType": "uuid"},
    "io.debezium.data.Json": {"type": "string"},
    "io.debezium.data.Xml": {"type": "string"},
    "io.debezium.data.Enum": {"type": "string"},
    "io.debezium.time.ZonedTime": {"type": "string"},
    "io.debezium.time.MicroDuration": {"type": "long"},
}


def _connect_field_type(f: dict[str, Any], name: str) -> Any:
    """The Avro type of one Kafka Connect schema field, logical types decoded."""
    kind = f.get("type")
    logical = f.get("name")
    if logical == DECIMAL:
        params = f.get("parameters") or {}
        scale = int(params.get("scale", 0))
        precision = int(params.get("connect.decimal.precision", 38))
        if precision > 38:
            # wider than Spark's decimals: keep the exact digits as text
            return {"type": "string", CONNECT_NAME: DECIMAL, CONNECT_SCALE: scale}
        return {
            "type": "bytes",
            "logicalType": "decimal",
            "precision": precision,
            "scale": scale,
            CONNECT_NAME: DECIMAL,
        }
    if logical == VARIABLE_DECIMAL:
        precision, scale = VARIABLE_DECIMAL_TYPE
        return {
            "type": "bytes",
            "logicalType": "decimal",
            "precision": precision,
            "scale": scale,
            CONNECT_NAME: VARIABLE_DECIMAL,
        }
    if isinstance(logical, str) and logical in _CONNECT_LOGICAL:
        return {**_CONNECT_LOGICAL[logical], CONNECT_NAME: logical}
    if kind == "struct":
        return connect_to_avro(f.get("fields", []), name)
    if kind == "array":
        items = f.get("items") or {}
        return {"type": "array", "items": _connect_field_type(items, f"{name}_item")}
    if kind == "map":
        values = f.get("values") or {}
        return {"type": "map", "values": _connect_field_type(values, f"{name}_value")}
    return _CONNECT_TYPES.get(str(kind), "string")


def connect_to_avro(fields: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """An Avro record schema from Kafka Connect struct fields, in their column order."""
    out = []
    for f in fields:
        avro = _connect_field_type(f, f"{name}_{f['field']}")
        entry: dict[str, Any] = {"name": f["field"], "type": avro}
        if f.get("optional"):
            entry = {"name": f["field"], "type": ["null", avro], "default": None}
        out.append(entry)
    return {"type": "record", "name": name, "fields": out}


def _top_level(schema: dict[str, Any], attribute: str, kind: type) -> dict[str, Any]:
    """Each top-level field's ``attribute`` (of type ``kind``) in its (nullable) type."""
    out = {}
    for f in schema.get("fields", []):
        t = f.get("type")
        if isinstance(t, list):
            t = next((b for b in t if b != "null"), None)
        if isinstance(t, dict) and isinstance(t.get(attribute), kind):
            out[f["name"]] = t[attribute]
    return out


def connect_names(schema: dict[str, Any]) -> dict[str, str]:
    """Each top-level field's ``connect.name`` (how Debezium encodes its value), if any."""
    return _top_level(schema, CONNECT_NAME, str)


def connect_scales(schema: dict[str, Any]) -> dict[str, int]:
    """Each top-level field's :data:`CONNECT_SCALE` (a decimal held as text), if any."""
    return _top_level(schema, CONNECT_SCALE, int)


def as_strings(t: T.StructType) -> T.StructType:
    """The same fields, all as strings: Spark's JSON reader then keeps each value's raw text
    (objects and arrays as JSON), so a line is parsed once and typed by casts."""
    return T.StructType([T.StructField(f.name, T.StringType()) for f in t.fields])


def _be_integer(b: Column) -> Column:
    """A big-endian two's-complement byte string as decimal(38, 0) (null past 38 digits)."""

    def value(h: Column) -> Column:
        pairs = F.filter(F.split(F.regexp_replace(h, "(..)", "$1,"), ","), lambda x: x != "")
        negative = F.conv(F.substring(h, 1, 2), 16, 10).cast("int") >= 128
        # a negative number is its bitwise complement's -(c + 1): accumulating -c from 0
        # stays in range all the way to -(10^38 - 1), where accumulating from -1 (the
        # usual way) left it on the way to values near there
        minus_c = F.aggregate(
            pairs,
            F.lit(0).cast(_UNSCALED),
            lambda acc, x: F.try_add(
                F.try_multiply(acc, F.lit(256)),
                F.when(negative, F.conv(x, 16, 10).cast("int") - 255).otherwise(
                    F.conv(x, 16, 10).cast("int")
                ),
            ).cast(_UNSCALED),
        )
        # (-10^38 and below do not fit: null, as any value past 38 digits)
        return F.when(~negative, minus_c).when(
            minus_c > F.lit("-" + _LARGEST).cast(_UNSCALED), minus_c - F.lit(1)
        )

    return F.transform(F.array(F.hex(b)), value)[0]


_UNSCALED = T.DecimalType(38, 0)
_LARGEST = "9" * 38  # the largest decimal(38, 0)


def _scaled_text(unscaled: Column, scale: Column) -> Column:
    """The exact decimal text of ``unscaled * 10^-scale``. (Each input is bound once, as
    a lambda variable: the expression stays small however often it is used.)"""

    def text(u: Column, s: Column) -> Column:
        # (not abs(u): Spark negates a decimal through 34 significant digits, which
        # rounds 38 nines up past decimal(38, 0))
        t = F.ltrim(u.cast("string"), F.lit("-"))
        # lpad also cuts longer strings: pad only the short ones
        digits = F.when(F.length(t) <= s, F.lpad(t, s + 1, "0")).otherwise(t)
        whole = F.substring(digits, F.lit(1), F.length(digits) - s)
        frac = F.substring(digits, F.length(digits) - s + 1, s)
        sign = F.when(u < 0, F.lit("-")).otherwise(F.lit(""))
        return F.when(s > 0, F.concat(sign, whole, F.lit("."), frac)).otherwise(
            F.concat(sign, whole)
        )

    pair = F.array(F.struct(unscaled.alias("u"), scale.alias("s")))
    return F.transform(pair, lambda p: text(p["u"], p["s"]))[0]


TIME_UNITS = {  # Debezium/Connect numeric time encodings -> factor to microseconds
    "io.debezium.time.MicroTimestamp": 1,
    "io.debezium.time.Timestamp": 1000,
    "org.apache.kafka.connect.data.Timestamp": 1000,
    "io.debezium.time.MicroTime": 1,
    "io.debezium.time.Time": 1000,
    "org.apache.kafka.connect.data.Time": 1000,
}
#: the nanosecond encodings, floored to microseconds (in doubles, as Spark divides)
NANO_UNITS = ("io.debezium.time.NanoTimestamp", "io.debezium.time.NanoTime")


def _micros(r: Column, enc: str) -> Column:
    n = r.try_cast("long")
    return F.floor(n / 1000).cast("long") if enc in NANO_UNITS else n * TIME_UNITS[enc]


def _wide_text(unscaled: pd.Series, scale: pd.Series) -> pd.Series:
    """Exact decimal text of big-endian two's-complement integers at a scale: Spark's
    decimals stop at 38 digits, Python's integers do not."""

    def one(b: bytes | None, s: int) -> str | None:
        if b is None:
            return None
        u = int.from_bytes(b, "big", signed=True)
        digits = str(abs(u)).rjust(s + 1, "0")
        text = f"{digits[:-s]}.{digits[-s:]}" if s > 0 else digits
        return "-" + text if u < 0 else text

    return pd.Series([one(b, int(s)) for b, s in zip(unscaled, scale, strict=True)])


def _wide_decimal_text(raw: Column, scale: Column) -> Column:
    """:func:`_wide_text` as a column (a vectorized UDF: only decimals wider than 38
    digits, which no Spark expression can hold, take this path)."""
    from pyspark.sql.pandas.functions import pandas_udf

    udf: Any = pandas_udf(_wide_text, T.StringType())  # type: ignore[call-overload]
    out: Column = udf(raw, scale)
    return out


def _decode(r: Column, t: T.DataType, enc: str | None, scale: int = 0) -> Column:
    """A raw JSON value (as text) read as type ``t``; ``enc`` is the field's Connect logical
    type when the value is encoded (base64 decimals, epoch numbers), else plain text."""
    if isinstance(t, T.StringType):
        if enc == DECIMAL:  # wider than 38 digits: keep the exact text
            return _wide_decimal_text(F.unbase64(r), F.lit(scale))
        return r
    if isinstance(t, T.DecimalType):
        if enc == DECIMAL:
            text = _scaled_text(_be_integer(F.unbase64(r)), F.lit(t.scale))
            return text.try_cast(t)
        if enc == VARIABLE_DECIMAL:
            v = F.from_json(r, "scale int, value string")
            text = _scaled_text(_be_integer(F.unbase64(v["value"])), v["scale"])
            # more fractional digits than the column holds would be rounded: a mismatch
            return F.when(v["scale"] <= t.scale, text.try_cast(t))
        return r.try_cast(t)
    if isinstance(t, T.TimestampType | T.TimestampNTZType) and enc in (*TIME_UNITS, *NANO_UNITS):
        ts = F.timestamp_micros(_micros(r, enc))
        return ts.cast(t) if isinstance(t, T.TimestampNTZType) else ts
    if isinstance(t, T.DateType) and enc in (
        "io.debezium.time.Date",
        "org.apache.kafka.connect.data.Date",
    ):
        return F.date_from_unix_date(r.try_cast("int"))
    if isinstance(t, T.LongType) and enc in (*TIME_UNITS, *NANO_UNITS):
        return _micros(r, enc)
    if isinstance(t, T.StructType | T.ArrayType | T.MapType):
        return F.from_json(r, t)
    if isinstance(t, T.BinaryType):
        return F.try_to_binary(r, F.lit("base64"))
    return r.try_cast(t)


def typed_record(
    raw: Column,
    record: T.StructType,
    label: str,
    encodings: dict[str, str] | None = None,
    scales: dict[str, int] | None = None,
) -> tuple[Column, list[Column]]:
    """``raw`` (a struct of strings) cast to ``record``, and one column per field naming it
    (``label`` + name) when its raw value does not fit the field's type. ``encodings`` maps
    a field to its Kafka Connect logical type (see :func:`connect_names`), ``scales`` a
    decimal held as text to its scale (:func:`connect_scales`)."""
    values, mismatches = [], []
    for f in record.fields:
        r = raw[f.name]
        v = _decode(r, f.dataType, (encodings or {}).get(f.name), (scales or {}).get(f.name, 0))
        values.append(v.alias(f.name))
        mismatches.append(F.when(r.isNotNull() & v.isNull(), F.lit(label + f.name)))
    value = F.when(raw.isNull(), F.lit(None).cast(record)).otherwise(F.struct(*values))
    return value, mismatches
