"""The columnar JSON text equals orjson's, byte for byte, or is declined (None)."""

from __future__ import annotations

import decimal

import orjson
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.jsontext import json_objects, span
from protocol.messages import _json_default, _without_nulls, record_keys

INTS = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint32(), pa.uint64()]


def _values(t: pa.DataType) -> st.SearchStrategy:
    if pa.types.is_integer(t):
        info = (t.bit_width, pa.types.is_signed_integer(t))
        lo = -(1 << (info[0] - 1)) if info[1] else 0
        hi = (1 << (info[0] - 1)) - 1 if info[1] else (1 << info[0]) - 1
        return st.integers(lo, hi)
    if pa.types.is_boolean(t):
        return st.booleans()
    if pa.types.is_string(t):
        return st.text()
    if pa.types.is_decimal(t):
        return st.decimals(
            min_value=-(10 ** (t.precision - t.scale)) + 1,
            max_value=10 ** (t.precision - t.scale) - 1,
            places=t.scale,
            allow_nan=False,
            allow_infinity=False,
        )
    if pa.types.is_floating(t):
        return st.floats(allow_nan=False)
    return st.fixed_dictionaries({f.name: st.none() | _values(f.type) for f in t})


DECIMALS = [pa.decimal128(12, 2), pa.decimal128(20, 0), pa.decimal128(30, 10)]
LEAF = st.sampled_from([*INTS, pa.bool_(), pa.string(), pa.float64(), *DECIMALS])
NAMES = st.text(min_size=1, max_size=8)


@st.composite
def struct_types(draw, depth: int = 0) -> pa.DataType:
    names = draw(st.lists(NAMES, min_size=0, max_size=5, unique=True))
    fields = []
    for name in names:
        nested = depth < 1 and draw(st.booleans()) and draw(st.booleans())
        t = draw(struct_types(depth + 1)) if nested else draw(LEAF)
        fields.append(pa.field(name, t))
    return pa.struct(fields)


@st.composite
def columns(draw) -> pa.Array:
    t = draw(struct_types())
    rows = draw(st.lists(st.none() | _values(t), max_size=30))
    return pa.array(rows, t)


@settings(max_examples=300, deadline=None)
@given(columns(), st.booleans(), st.booleans())
def test_the_text_is_orjsons_or_declined(col, sort_keys, skip_nulls):
    got = json_objects(col, sort_keys=sort_keys, skip_nulls=skip_nulls)
    rows = col.to_pylist()
    if sort_keys and skip_nulls:  # the record identity: null fields left out, at any depth
        want = [b"null" if r is None else k for r, k in zip(rows, record_keys(rows), strict=True)]
    else:
        opt = orjson.OPT_NON_STR_KEYS | (orjson.OPT_SORT_KEYS if sort_keys else 0)
        if skip_nulls:
            rows = [r if r is None else _without_nulls(r) for r in rows]
        want = [orjson.dumps(r, option=opt, default=_json_default) for r in rows]
    if got is None:  # declined: only for what it says it leaves to orjson
        assert _has_declined_type(col.type) or any(
            any(ord(c) < 0x20 for c in s) for s in _strings(rows)
        )
        return
    assert [x.encode() for x in got.to_pylist()] == want


def _has_declined_type(t: pa.DataType) -> bool:
    if pa.types.is_struct(t):
        return any(_has_declined_type(f.type) for f in t)
    return pa.types.is_floating(t)


def _strings(v):
    if isinstance(v, str):
        yield v
    elif isinstance(v, dict):
        for x in v.values():
            yield from _strings(x)
    elif isinstance(v, list):
        for x in v:
            yield from _strings(x)


def test_the_examples_a_reader_would_check():
    col = pa.array(
        [
            {"id": 1, "owner": 'a "b" \\ c', "balance": decimal.Decimal("-0.50"), "ok": True},
            {"id": None, "owner": "ünïcode ✓", "balance": None, "ok": False},
            None,
        ],
        pa.struct(
            [
                ("id", pa.int64()),
                ("owner", pa.string()),
                ("balance", pa.decimal128(10, 2)),
                ("ok", pa.bool_()),
            ]
        ),
    )
    text = json_objects(col)
    assert text is not None
    assert [orjson.loads(x) for x in text.to_pylist()] == [
        {"id": 1, "owner": 'a "b" \\ c', "balance": "-0.50", "ok": True},
        {"id": None, "owner": "ünïcode ✓", "balance": None, "ok": False},
        None,
    ]
    # a control character, a float: left to orjson
    assert json_objects(pa.array([{"s": "a\nb"}])) is None
    assert json_objects(pa.array([{"x": 0.5}])) is None


@pytest.mark.parametrize("start, stop", [(0, 3), (1, 2), (2, 2)])
def test_span_is_the_rows_back_to_back(start, stop):
    text = pa.array(["ab,", "c,", "def,"]).slice(0)
    assert bytes(span(text, start, stop)) == "".join(["ab,", "c,", "def,"][start:stop]).encode()
    sliced = pa.array(["x,", "ab,", "c,", "def,"]).slice(1)
    assert bytes(span(sliced, start, stop)) == "".join(["ab,", "c,", "def,"][start:stop]).encode()


@settings(max_examples=100, deadline=None)
@given(columns())
def test_an_ndjson_line_built_by_columns_reads_as_orjsons(col):
    """The NDJSON encoder's column-wise line for an Arrow-held batch holds the same JSON
    as the line orjson writes for the same updates as rows."""
    import io

    from protocol import Updates, get_codec

    n = len(col)
    if pa.types.is_struct(col.type) and col.null_count:
        col = pa.array([r or {} for r in col.to_pylist()], col.type)
    table = pa.table(
        {"data": col, "time": pa.array(range(n), pa.int64()), "diff": pa.array([1] * n, pa.int64())}
    )
    outs = []
    for batch in (Updates.from_arrow(table), Updates.from_rows(table.to_pylist())):
        sink = io.BytesIO()
        enc = get_codec("ndjson").encoder(sink)
        enc.write(batch)
        enc.close()
        outs.append([orjson.loads(line) for line in sink.getvalue().splitlines()])
    assert outs[0] == outs[1]
