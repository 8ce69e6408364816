"""The column-wise Avro encoding is fastavro's, byte for byte, or is declined (None); the
codec's containers read back whole with fastavro either way."""

from __future__ import annotations

import datetime
import decimal
import io

import fastavro
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import Progress, Updates, get_codec
from protocol._avro_columns import encode_update_array
from protocol.messages import update_schema
from protocol.schema import avro_to_arrow, cdcv2_schema

UTC = datetime.UTC
LEAVES: dict[str, tuple[object, st.SearchStrategy]] = {
    "boolean": ("boolean", st.booleans()),
    "int": ("int", st.integers(-(2**31), 2**31 - 1)),
    "long": ("long", st.integers(-(2**63), 2**63 - 1)),
    "float": ("float", st.floats(width=32, allow_nan=False)),
    "double": ("double", st.floats(allow_nan=False)),
    "string": ("string", st.text()),
    "bytes": ("bytes", st.binary()),
    "date": ({"type": "int", "logicalType": "date"}, st.dates()),
    "ts": (
        {"type": "long", "logicalType": "timestamp-micros"},
        st.datetimes(
            min_value=datetime.datetime(1900, 1, 1), max_value=datetime.datetime(2200, 1, 1)
        ).map(lambda d: d.replace(tzinfo=UTC)),
    ),
    "local_ts": (
        {"type": "long", "logicalType": "local-timestamp-micros"},
        st.datetimes(
            min_value=datetime.datetime(1900, 1, 1), max_value=datetime.datetime(2200, 1, 1)
        ),
    ),
    "time": ({"type": "long", "logicalType": "time-micros"}, st.times()),
    "uuid": ({"type": "string", "logicalType": "uuid"}, st.uuids().map(str)),
}


@st.composite
def record_schemas(draw, depth: int = 0, name: str = "r") -> tuple[dict, dict]:
    """An Avro record schema and, per field, a strategy for its values."""
    names = draw(
        st.lists(st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True), max_size=6, unique=True)
    )
    fields, values = [], {}
    for i, n in enumerate(names):
        if depth == 0 and draw(st.integers(0, 5)) == 0:
            t, v = draw(record_schemas(depth + 1, name=f"{name}_{i}"))
            values[n] = st.fixed_dictionaries(v)
        else:
            t, v = LEAVES[draw(st.sampled_from(sorted(LEAVES)))]
            values[n] = v
        nullable = draw(st.integers(0, 2))
        if nullable:
            t = ["null", t] if nullable == 1 else [t, "null"]
            values[n] = st.none() | values[n]
        fields.append({"name": n, "type": t})
    return {"type": "record", "name": name, "fields": fields}, values


@st.composite
def batches(draw) -> tuple[dict, pa.Table]:
    schema, values = draw(record_schemas())
    rows = draw(
        st.lists(
            st.fixed_dictionaries(
                {
                    "data": st.fixed_dictionaries(values),
                    "time": st.integers(0, 2**62),
                    "diff": st.integers(-(2**40), 2**40),
                }
            ),
            min_size=1,
            max_size=25,
        )
    )
    table = pa.Table.from_pylist(rows, schema=update_schema(avro_to_arrow(schema)))
    start = draw(st.integers(0, table.num_rows - 1))  # also a slice at an offset
    return schema, table.slice(start)


def fastavro_bytes(schema: dict, table: pa.Table) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(cdcv2_schema(schema)), table.to_pylist())
    return out.getvalue()


@settings(max_examples=250, deadline=None)
@given(batches())
def test_the_encoding_is_fastavros_byte_for_byte(batch):
    schema, table = batch
    got = encode_update_array(table, schema)
    assert got is not None
    assert got == fastavro_bytes(schema, table)


def test_types_it_does_not_encode_are_declined_and_still_written_by_the_codec():
    schema = {
        "type": "record",
        "name": "r",
        "fields": [
            {"name": "id", "type": "long"},
            {
                "name": "amount",
                "type": {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2},
            },
            {"name": "tags", "type": {"type": "array", "items": "string"}},
        ],
    }
    rows = [
        {
            "data": {"id": i, "amount": decimal.Decimal(i) / 4, "tags": ["a"] * i},
            "time": 1,
            "diff": 1,
        }
        for i in range(5)
    ]
    table = pa.Table.from_pylist(rows, schema=update_schema(avro_to_arrow(schema)))
    assert encode_update_array(table, schema) is None
    assert _read_back(schema, table) == rows


def test_a_container_of_encoded_batches_and_progress_reads_back_whole():
    schema = {
        "type": "record",
        "name": "r",
        "fields": [{"name": "id", "type": "long"}, {"name": "s", "type": ["null", "string"]}],
    }
    rows = [
        {"data": {"id": i, "s": None if i % 3 else "x" * (i % 50)}, "time": i % 4, "diff": 1}
        for i in range(30_000)
    ]
    table = pa.Table.from_pylist(rows, schema=update_schema(avro_to_arrow(schema)))
    assert _read_back(schema, table) == rows


def _read_back(schema: dict, table: pa.Table) -> list[dict]:
    """Encode ``table`` with a progress before and after it; read the container with
    fastavro and return the updates (after checking the progress messages)."""
    out = io.BytesIO()
    enc = get_codec("avro").encoder(out, schema=schema)
    enc.write(Progress(0, 0, ()))
    enc.write(Updates.from_arrow(table))
    enc.write(Progress(0, 4, ((1, 5),)))
    enc.close()
    datums = list(fastavro.reader(io.BytesIO(out.getvalue())))
    assert datums[0] == {"lower": [0], "upper": [0], "counts": []}
    assert datums[-1] == {"lower": [0], "upper": [4], "counts": [{"time": 1, "count": 5}]}
    return [r for d in datums[1:-1] for r in d]


def test_a_column_of_nulls_only_is_declined_and_still_written():
    """A column that was null in every row has Arrow type null, which the derived record
    schema writes as a union of nulls: no Arrow type maps back from it."""
    rows = [{"data": {"id": i, "gone": None}, "time": 1, "diff": 1} for i in range(3)]
    table = pa.Table.from_pylist(rows)
    out = io.BytesIO()
    enc = get_codec("avro").encoder(out)  # the record schema is derived from the batch
    enc.write(Updates.from_arrow(table))
    enc.close()
    assert [r for d in fastavro.reader(io.BytesIO(out.getvalue())) for r in d] == rows
