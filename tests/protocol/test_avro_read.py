"""The column-wise Avro reader gives what fastavro's reading gives, message for message, or
declines (None) and fastavro reads the body; a damaged body comes out of the codec the
same either way: the same messages or a CodecError."""

from __future__ import annotations

import io
import os

import fastavro
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import CodecError, Progress, Updates, get_codec
from protocol._avro import check_reader, decode_rows
from protocol._avro_columns import avro_long
from protocol._avro_read import decode_columns
from protocol.schema import cdcv2_schema
from tests.protocol.test_avro_columns import record_schemas

FLAT = {"boolean", "int", "long", "float", "double", "string", "bytes"}


def _flat(schema: dict) -> bool:
    def leaf(t: object) -> bool:
        if isinstance(t, list):
            return len(t) == 2 and "null" in t and leaf(next(x for x in t if x != "null"))
        return isinstance(t, str) and t in FLAT

    return all(leaf(f["type"]) for f in schema["fields"])


@st.composite
def containers(draw) -> tuple[dict, bytes]:
    """A CDCv2 container: update arrays and progress in any order, in blocks of any size,
    deflated or not."""
    schema, values = draw(record_schemas())
    update = st.fixed_dictionaries(
        {
            "data": st.fixed_dictionaries(values),
            "time": st.integers(0, 2**63 - 1),
            "diff": st.integers(-(2**63), 2**63 - 1),
        }
    )
    progress = st.builds(
        lambda lo, n, counts: {
            "lower": [lo],
            "upper": [lo + n],
            "counts": [{"time": lo + i, "count": c} for i, c in enumerate(counts[:n])],
        },
        st.integers(0, 2**40),
        st.integers(0, 3),
        st.lists(st.integers(1, 99), max_size=3),
    )
    datums = draw(st.lists(st.lists(update, max_size=40) | progress, min_size=1, max_size=6))
    out = io.BytesIO()
    fastavro.writer(
        out,
        fastavro.parse_schema(cdcv2_schema(schema)),
        datums,
        codec=draw(st.sampled_from(["null", "deflate"])),
        sync_interval=draw(st.sampled_from([16, 300, 16_000])),
    )
    return schema, out.getvalue()


def _same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert type(g) is type(w)
        if isinstance(w, Updates):
            assert g.table().equals(w.table())
            assert g.table().to_pylist() == w.table().to_pylist()
        else:
            assert g == w


def _outcome(decode, body: bytes) -> list | type:
    try:
        return decode(body)
    except CodecError:
        return CodecError


@settings(max_examples=300, deadline=None)
@given(containers())
def test_a_flat_record_schema_is_read_column_wise_as_fastavro_reads_it(container):
    schema, body = container
    got = decode_columns(body, check_reader)
    if not _flat(schema):
        assert got is None
        return
    assert got is not None
    _same(got, decode_rows(body))


@settings(max_examples=300, deadline=None)
@given(containers(), st.data())
def test_a_damaged_body_comes_out_as_fastavro_alone_would_give_it(container, data):
    _, body = container
    body = bytearray(body)
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(body) - 1))
        body[at] = data.draw(st.integers(0, 255))
    body = bytes(body[: data.draw(st.integers(1, len(body)))])
    codec = get_codec("avro")
    got, want = _outcome(codec.decode, body), _outcome(decode_rows, body)
    if want is CodecError or got is CodecError:
        assert got is want
    else:
        _same(got, want)


def _body(schema: dict, datums: list) -> bytes:
    out = io.BytesIO()
    fastavro.writer(out, fastavro.parse_schema(cdcv2_schema(schema)), datums)
    return out.getvalue()


SCHEMA = {
    "type": "record",
    "name": "r",
    "fields": [{"name": "id", "type": "long"}, {"name": "s", "type": ["string", "null"]}],
}


def test_a_string_past_what_it_reads_is_left_to_fastavro():
    rows = [{"data": {"id": 1, "s": "x" * (1 << 21)}, "time": 1, "diff": 1}]
    body = _body(SCHEMA, [rows])
    assert decode_columns(body, check_reader) is None
    (got,) = get_codec("avro").decode(body)
    assert got.table().to_pylist() == rows


@pytest.mark.parametrize("why", ["invalid UTF-8", "a negative time"])
def test_what_it_is_not_sure_of_is_left_to_fastavro_which_words_it(why):
    if why == "invalid UTF-8":
        body = _body(SCHEMA, [[{"data": {"id": 1, "s": "é"}, "time": 1, "diff": 1}]])
        body = body.replace("é".encode(), b"\xff\xfe")
    else:
        body = _body(SCHEMA, [[{"data": {"id": 1, "s": None}, "time": 1, "diff": 1}]])
        at = body.rindex(b"\x02\x02")  # time 1, diff 1 at the end of the only update
        body = body[:at] + b"\x01" + body[at + 1 :]  # time -1
    assert decode_columns(body, check_reader) is None
    with pytest.raises(CodecError):
        get_codec("avro").decode(body)


def test_a_large_body_of_many_blocks_and_progress():
    rows = [  # (two datums of about 2.5 MB, a block each)
        {
            "data": {"id": i, "s": None if i % 7 == 0 else f"owner {i}" * (i % 30)},
            "time": 5,
            "diff": -1,
        }
        for i in range(60_000)
    ]
    body = _body(SCHEMA, [rows[:30_000], {"lower": [5], "upper": [5], "counts": []}, rows[30_000:]])
    got = decode_columns(body, check_reader)
    assert got is not None
    assert [type(m) for m in got] == [Updates, Progress, Updates]
    assert got[0].table().to_pylist() + got[2].table().to_pylist() == rows
    assert pa.concat_tables([got[0].table(), got[2].table()]).num_rows == 60_000


def _one_block(data: bytes, datums: int = 1) -> bytes:
    """A container of SCHEMA holding one block of ``data`` (bytes written by hand)."""
    valid = _body(SCHEMA, [])
    sync = valid[-16:]
    return valid + avro_long(datums) + avro_long(len(data)) + data + sync


def test_an_array_claiming_more_updates_than_its_bytes_is_refused_at_once():
    update = b"\x02\x02\x02\x02"  # id 1, s null (branch 1), time 1, diff 1
    assert len(get_codec("avro").decode(_one_block(b"\x00\x02" + update + b"\x00"))) == 1
    hostile = _one_block(b"\x00" + avro_long(2**62 - 1) + update + b"\x00")
    assert decode_columns(hostile, check_reader) is None
    with pytest.raises(CodecError):
        get_codec("avro").decode(hostile)


def test_a_block_larger_than_it_reads_is_left_to_fastavro():
    rows = [
        {"data": {"id": i, "s": os.urandom(48).hex()}, "time": 1, "diff": 1} for i in range(100_000)
    ]
    for codec in ("null", "deflate"):
        out = io.BytesIO()
        schema = fastavro.parse_schema(cdcv2_schema(SCHEMA))
        fastavro.writer(out, schema, [rows], codec=codec, sync_interval=1 << 30)
        body = out.getvalue()
        assert decode_columns(body, check_reader) is None
        (got,) = get_codec("avro").decode(body)
        assert got.table().to_pylist() == rows
