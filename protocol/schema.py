"""Record schemas: Avro JSON <-> Arrow types, the CDCv2 message schema, fingerprints.

A feed's record schema is an Avro record schema (JSON). Arrow (and so Spark) schemas are
derived from it and back, with nullable columns as ``["null", T]`` unions. Logical types
that matter for CDC rows map to their Arrow counterparts: timestamps (UTC and local),
dates, times, decimals, UUIDs, nested records, arrays and maps.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import fastavro.schema
import orjson
import pyarrow as pa

from .errors import CodecError

__all__ = [
    "CDC_NAMESPACE",
    "arrow_to_avro",
    "avro_name",
    "avro_to_arrow",
    "cdcv2_schema",
    "fingerprint",
    "record_schema_of",
]

CDC_NAMESPACE = "com.materialize.cdc"
AvroSchema = Any  # JSON value: str, list or dict

_PRIMITIVES: dict[str, pa.DataType] = {
    "null": pa.null(),
    "boolean": pa.bool_(),
    "int": pa.int32(),
    "long": pa.int64(),
    "float": pa.float32(),
    "double": pa.float64(),
    "bytes": pa.binary(),
    "string": pa.string(),
}


def avro_to_arrow(schema: AvroSchema) -> pa.DataType:
    """The Arrow type of an Avro schema (a record schema gives a struct type).

    Raises :class:`CodecError` for what Arrow cannot hold (unions other than ``[null, T]``).
    """
    return _to_arrow(schema, {})[0]


def _to_arrow(schema: AvroSchema, named: dict[str, pa.DataType]) -> tuple[pa.DataType, bool]:
    """Returns the type and whether it is nullable."""
    if isinstance(schema, str):
        if schema in _PRIMITIVES:
            return _PRIMITIVES[schema], schema == "null"
        if schema in named:
            return named[schema], False
        short = schema.rsplit(".", 1)[-1]
        for name, t in named.items():
            if name.rsplit(".", 1)[-1] == short:
                return t, False
        raise CodecError(f"unknown Avro type name {schema!r}", fmt="schema")
    if isinstance(schema, list):
        branches = [b for b in schema if b != "null"]
        if len(branches) != 1:
            raise CodecError(
                f"only [null, T] unions map to Arrow columns, got {orjson.dumps(schema).decode()}",
                fmt="schema",
            )
        t, _ = _to_arrow(branches[0], named)
        return t, len(branches) != len(schema)
    if not isinstance(schema, dict) or "type" not in schema:
        raise CodecError(f"not an Avro schema: {schema!r:.80}", fmt="schema")
    kind = schema["type"]
    logical = schema.get("logicalType")
    if logical is not None:
        t = _logical_to_arrow(kind, logical, schema)
        if t is not None:
            return t, False
    if kind == "record":
        fields = []
        for f in schema.get("fields", []):
            ft, nullable = _to_arrow(f["type"], named)
            fields.append(pa.field(f["name"], ft, nullable=nullable))
        t = pa.struct(fields)
        named[schema["name"]] = t
        return t, False
    if kind == "array":
        it, nullable = _to_arrow(schema["items"], named)
        return pa.list_(pa.field("item", it, nullable=nullable)), False
    if kind == "map":
        vt, nullable = _to_arrow(schema["values"], named)
        return pa.map_(pa.string(), pa.field("value", vt, nullable=nullable)), False
    if kind == "enum":
        named[schema["name"]] = pa.string()
        return pa.string(), False
    if kind == "fixed":
        t = pa.binary(int(schema["size"]))
        named[schema["name"]] = t
        return t, False
    return _to_arrow(kind, named)


def _logical_to_arrow(kind: Any, logical: str, schema: dict[str, Any]) -> pa.DataType | None:
    if logical == "decimal" and kind in ("bytes", "fixed"):
        precision = int(schema["precision"])
        scale = int(schema.get("scale", 0))
        return (
            pa.decimal128(precision, scale) if precision <= 38 else pa.decimal256(precision, scale)
        )
    table: dict[tuple[str, str], pa.DataType] = {
        ("int", "date"): pa.date32(),
        ("int", "time-millis"): pa.time32("ms"),
        ("long", "time-micros"): pa.time64("us"),
        ("long", "timestamp-millis"): pa.timestamp("ms", tz="UTC"),
        ("long", "timestamp-micros"): pa.timestamp("us", tz="UTC"),
        ("long", "local-timestamp-millis"): pa.timestamp("ms"),
        ("long", "local-timestamp-micros"): pa.timestamp("us"),
        ("string", "uuid"): pa.string(),
    }
    return table.get((kind, logical)) if isinstance(kind, str) else None


_NAME_BAD = re.compile(r"[^A-Za-z0-9_]")


def avro_name(name: str) -> str:
    """``name`` made a valid Avro name: other characters become ``_``, no leading digit."""
    cleaned = _NAME_BAD.sub("_", name) or "_"
    return cleaned if not cleaned[0].isdigit() else "_" + cleaned


def arrow_to_avro(t: pa.DataType, *, name: str = "data", namespace: str | None = None) -> Any:
    """The Avro schema of an Arrow type (a struct becomes a record called ``name``).

    Nested records are named after their path (``data_address``) so names never collide.
    Raises :class:`CodecError` for types Avro cannot hold (e.g. maps with non-string keys).
    """
    out = _to_avro(t, name)
    if isinstance(out, dict) and out.get("type") == "record" and namespace:
        out["namespace"] = namespace
    return out


def _nullable(avro: Any, nullable: bool) -> Any:
    return ["null", avro] if nullable else avro


def _to_avro(t: pa.DataType, path: str) -> Any:
    if pa.types.is_struct(t):
        fields = []
        for i in range(t.num_fields):
            f = t.field(i)
            ft = _to_avro(f.type, f"{path}_{avro_name(f.name)}")
            entry: dict[str, Any] = {"name": f.name, "type": _nullable(ft, f.nullable)}
            if f.nullable and ft != "null":
                entry["default"] = None
            fields.append(entry)
        return {"type": "record", "name": avro_name(path), "fields": fields}
    if pa.types.is_null(t):
        return "null"
    if pa.types.is_boolean(t):
        return "boolean"
    if pa.types.is_int8(t) or pa.types.is_int16(t) or pa.types.is_int32(t):
        return "int"
    if pa.types.is_uint8(t) or pa.types.is_uint16(t):
        return "int"
    if pa.types.is_integer(t):
        return "long"
    if pa.types.is_float16(t) or pa.types.is_float32(t):
        return "float"
    if pa.types.is_float64(t):
        return "double"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_fixed_size_binary(t):
        return {"type": "fixed", "name": avro_name(path), "size": t.byte_width}
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return "bytes"
    if pa.types.is_decimal(t):
        return {
            "type": "bytes",
            "logicalType": "decimal",
            "precision": t.precision,
            "scale": t.scale,
        }
    if pa.types.is_date(t):
        return {"type": "int", "logicalType": "date"}
    if pa.types.is_time32(t):
        return {"type": "int", "logicalType": "time-millis"}
    if pa.types.is_time64(t):
        return {"type": "long", "logicalType": "time-micros"}
    if pa.types.is_timestamp(t):
        unit = "millis" if t.unit in ("s", "ms") else "micros"
        prefix = "timestamp" if t.tz else "local-timestamp"
        return {"type": "long", "logicalType": f"{prefix}-{unit}"}
    if pa.types.is_map(t):
        if not (pa.types.is_string(t.key_type) or pa.types.is_large_string(t.key_type)):
            raise CodecError(f"Avro maps need string keys, got {t.key_type}", fmt="schema")
        vf = t.item_field
        return {"type": "map", "values": _nullable(_to_avro(vf.type, path + "_value"), vf.nullable)}
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        vf = t.value_field
        return {"type": "array", "items": _nullable(_to_avro(vf.type, path + "_item"), vf.nullable)}
    if pa.types.is_dictionary(t):
        return _to_avro(t.value_type, path)
    raise CodecError(f"no Avro type for Arrow type {t}", fmt="schema")


def record_schema_of(schema: AvroSchema) -> dict[str, Any]:
    """The record schema renamed as CDCv2 wants it: record ``data`` in ``com.materialize.cdc``.

    Accepts a record schema, or a whole CDCv2 union (whose ``data`` record is taken out).
    """
    if isinstance(schema, list):
        for branch in schema:
            if isinstance(branch, dict) and branch.get("type") == "array":
                items = branch["items"]
                for f in items.get("fields", []):
                    if f["name"] == "data":
                        return record_schema_of(f["type"])
        raise CodecError("a union schema must be the CDCv2 message schema", fmt="schema")
    if not isinstance(schema, dict) or schema.get("type") != "record":
        raise CodecError(
            f"a record schema must be an Avro record, got {schema!r:.80}", fmt="schema"
        )
    out = copy.deepcopy(schema)
    out["name"] = "data"
    out["namespace"] = CDC_NAMESPACE
    return out


def cdcv2_schema(record_schema: AvroSchema) -> list[Any]:
    """Materialize's CDCv2 message schema around ``record_schema`` (DESIGN §7)."""
    return [
        {
            "type": "array",
            "items": {
                "type": "record",
                "name": "update",
                "namespace": CDC_NAMESPACE,
                "fields": [
                    {"name": "data", "type": record_schema_of(record_schema)},
                    {"name": "time", "type": "long"},
                    {"name": "diff", "type": "long"},
                ],
            },
        },
        {
            "type": "record",
            "name": "progress",
            "namespace": CDC_NAMESPACE,
            "fields": [
                {"name": "lower", "type": {"type": "array", "items": "long"}},
                {"name": "upper", "type": {"type": "array", "items": "long"}},
                {
                    "name": "counts",
                    "type": {
                        "type": "array",
                        "items": {
                            "type": "record",
                            "name": "counts",
                            "fields": [
                                {"name": "time", "type": "long"},
                                {"name": "count", "type": "long"},
                            ],
                        },
                    },
                },
            ],
        },
    ]


def fingerprint(record_schema: AvroSchema) -> str:
    """SHA-256 of the Avro parsing canonical form of the record schema, as hex."""
    try:
        parsed = fastavro.schema.parse_schema(record_schema_of(record_schema), _write_hint=False)
        canonical = fastavro.schema.to_parsing_canonical_form(parsed)
    except (fastavro.schema.SchemaParseException, KeyError, TypeError, ValueError) as e:
        raise CodecError(f"invalid record schema: {e}", fmt="schema") from e
    return str(fastavro.schema.fingerprint(canonical, "SHA-256"))
