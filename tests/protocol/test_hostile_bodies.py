"""Bodies built to hurt a decoder: each is a CodecError naming what is wrong, never a
crash, a hang or a value taken as something else (issue 29)."""

from __future__ import annotations

import io

import fastavro
import orjson
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import CodecError, Progress, Update, Updates, cdcv2_schema, get_codec

RECORD = {"type": "record", "name": "data", "fields": [{"name": "id", "type": "long"}]}


def _avro(rows, *, schema=None, codec="null") -> bytes:
    buf = io.BytesIO()
    fastavro.writer(buf, fastavro.parse_schema(schema or cdcv2_schema(RECORD)), rows, codec=codec)
    return buf.getvalue()


def _arrow(time: pa.Array, diff: pa.Array, data: pa.Array | None = None) -> bytes:
    data = data if data is not None else pa.array([{"id": i} for i in range(len(time))])
    batch = pa.record_batch([data, time, diff], names=["data", "time", "diff"])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize(
    ("time", "diff", "says"),
    [
        (-1, 1, "time -1"),
        (-(2**63), 1, "outside the 64-bit range"),
        (5, 2**63, None),  # not representable as a long: fastavro refuses to write it
    ],
)
def test_avro_times_and_diffs_out_of_range(time, diff, says):
    if says is None:
        with pytest.raises((ValueError, OverflowError)):
            _avro([[{"data": {"id": 1}, "time": time, "diff": diff}]])
        return
    body = _avro([[{"data": {"id": 1}, "time": time, "diff": diff}]])
    with pytest.raises(CodecError, match=says):
        get_codec("avro").decode(body)


def test_avro_recursive_writer_schema_is_refused():
    node = {
        "type": "record",
        "name": "node",
        "fields": [{"name": "next", "type": ["null", "node"]}],
    }
    record = {"type": "record", "name": "data", "fields": [{"name": "n", "type": node}]}
    deep: dict = {"next": None}
    for _ in range(50):
        deep = {"next": deep}
    body = _avro([[{"data": {"n": deep}, "time": 1, "diff": 1}]], schema=cdcv2_schema(record))
    with pytest.raises(CodecError, match="contains itself"):
        get_codec("avro").decode(body)


@pytest.mark.parametrize("codec", ["bzip2", "xz"])
def test_avro_codecs_that_inflate_cheaply_are_refused(codec):
    body = _avro([[{"data": {"id": 1}, "time": 1, "diff": 1}]], codec=codec)
    with pytest.raises(CodecError, match="not accepted"):
        get_codec("avro").decode(body)


def test_avro_deflate_and_null_still_decode():
    rows = [
        [{"data": {"id": 1}, "time": 1, "diff": 1}],
        {"lower": [0], "upper": [2], "counts": [{"time": 1, "count": 1}]},
    ]
    for codec in ("null", "deflate"):
        messages = get_codec("avro").decode(_avro(rows, codec=codec))
        assert [len(m) if isinstance(m, Updates) else m for m in messages] == [
            1,
            Progress(0, 2, ((1, 1),)),
        ]


@pytest.mark.parametrize(
    ("time", "diff", "says"),
    [
        (pa.array([3, -1], pa.int64()), pa.array([1, 1], pa.int64()), "'time' from -1"),
        (pa.array([2**63], pa.uint64()), pa.array([1], pa.int64()), "'time'"),
        (pa.array([1], pa.int64()), pa.array([2**63], pa.uint64()), "'diff'"),
    ],
)
def test_arrow_times_and_diffs_out_of_range(time, diff, says):
    with pytest.raises(CodecError, match=says):
        get_codec("arrow").decode(_arrow(time, diff))


def test_arrow_batch_whose_buffers_do_not_match_its_counts_is_refused():
    """A string column whose offsets, patched in the body, point past its data: reading
    it would run past the body; full validation refuses it first."""
    data = pa.array([{"id": 1, "s": "ab"}, {"id": 2, "s": "cd"}])
    body = _arrow(pa.array([1, 1], pa.int64()), pa.array([1, 1], pa.int64()), data)
    offsets = pa.array([0, 2, 4], pa.int32()).buffers()[1].to_pybytes()
    assert body.count(offsets) == 1
    patched = body.replace(offsets, pa.array([0, 2, 4000], pa.int32()).buffers()[1].to_pybytes())
    with pytest.raises(CodecError, match="invalid batch"):
        get_codec("arrow").decode(patched)


def test_a_valid_arrow_body_still_decodes():
    messages = get_codec("arrow").decode(
        get_codec("arrow").encode(
            [Updates.of([Update({"id": 1}, 4, 1)]), Progress(0, 5, ((4, 1),))],
            schema=RECORD,
        )
    )
    assert [len(m) if isinstance(m, Updates) else m for m in messages] == [
        1,
        Progress(0, 5, ((4, 1),)),
    ]


def test_arrow_record_types_are_read_as_the_feed_will_read_them():
    """A large_string, a timestamp in a zone no database knows, a small int: each arrives
    as the type its Avro type reads back as (string, an instant in UTC, int), so parts of
    two pushes always concatenate (kept as sent, the receiver's collection read failed)."""
    ts = (
        pa.array([1_000], pa.int64()).cast(pa.timestamp("s")).cast(pa.timestamp("s", "Mars/Phobos"))
    )
    data = pa.StructArray.from_arrays(
        [pa.array(["x"], pa.large_string()), ts, pa.array([7], pa.int8())], ["s", "ts", "n"]
    )
    one = pa.array([1], pa.int64())
    (m,) = get_codec("arrow").decode(_arrow(one, one, data))
    got = m.table().column("data").type
    assert got == pa.struct(
        [("s", pa.string()), ("ts", pa.timestamp("ms", "UTC")), ("n", pa.int32())]
    ), got
    assert m.rows()[0]["data"]["s"] == "x" and m.rows()[0]["data"]["n"] == 7


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (
            pa.array(
                [{"m": [("a", 1), ("a", 2)]}], pa.struct([("m", pa.map_(pa.string(), pa.int64()))])
            ),
            "key twice",
        ),
        (pa.array([{"n": 1 << 63}], pa.struct([("n", pa.uint64())])), "does not read as"),
    ],
)
def test_arrow_records_no_reader_would_read_the_same_are_refused(data, says):
    one = pa.array([1], pa.int64())
    with pytest.raises(CodecError, match=says):
        get_codec("arrow").decode(_arrow(one, one, data))


def test_ndjson_nested_too_deep_is_refused_before_any_parser_sees_it():
    deep = (
        b'{"updates": [{"data": {"a": '
        + b"[" * 30_000
        + b"]" * 30_000
        + b'}, "time": 1, "diff": 1}]}\n'
    )
    ok = b'{"progress": {"lower": [0], "upper": [1], "counts": []}}\n'
    with pytest.raises(CodecError, match="nested deeper than 64") as e:
        get_codec("ndjson").decode(ok + deep)
    assert "line 2" in str(e.value)


def test_ndjson_brackets_and_escaped_quotes_inside_strings_do_not_count():
    text = '\\"' + "[" * 200 + "\\\\"  # an escaped quote, brackets, an escaped backslash
    body = (
        b'{"updates": [{"data": {"s": '
        + orjson.dumps(text)
        + b'}, "time": 1, "diff": 1}]}\n{"progress": {"lower": [0], "upper": [2], '
        b'"counts": [{"time": 1, "count": 1}]}}\n'
    )
    messages = get_codec("ndjson").decode(body)
    assert next(iter(messages[0])).record == {"s": text}
    assert messages[1] == Progress(0, 2, ((1, 1),))


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1 << 20])
def test_ndjson_nesting_scan_is_the_same_whatever_its_chunks(monkeypatch, chunk):
    from protocol import _text_checks

    monkeypatch.setattr(_text_checks, "_CHUNK", chunk)
    tricky = orjson.dumps({"s": '\\"[[[' * 40 + "\\\\", "t": ["]" * 70]})
    _text_checks.nesting_check(tricky * 3)  # no structure deeper than 2
    flat = b"[" * 64 + b"]" * 64
    _text_checks.nesting_check(flat)  # exactly at the limit
    with pytest.raises(CodecError, match="line 3"):
        _text_checks.nesting_check(tricky + b"\n" + tricky + b"\n[" + flat + b"]\n")


@given(st.binary(min_size=1, max_size=60).map(lambda b: b.replace(b"\r", b"\n")), st.integers(1, 9))
def test_the_longest_line_is_found_in_steps_as_whole(body, chunk):
    """The longest line (its newline counted; a last line without one as if it had one),
    which sizes pyarrow's blocks, is the same in steps of a few bytes as over the whole."""
    from protocol import _text_checks

    expected = max(len(line) + 1 for line in body.removesuffix(b"\n").split(b"\n"))
    size = _text_checks._CHUNK
    _text_checks._CHUNK = chunk
    try:
        assert _text_checks.longest_line(body) == expected
    finally:
        _text_checks._CHUNK = size


def test_ndjson_without_escapes_brackets_in_strings_do_not_count():
    from protocol import _text_checks

    body = orjson.dumps({"s": "[" * 100, "t": "", "u": ["]]]", {"v": "{{{" * 30}]}) + b"\n"
    assert b"\\" not in body
    _text_checks.nesting_check(body * 5)
    deep = b'{"s": "]]]]", "a": ' + b"[" * 65 + b"]" * 65 + b"}\n"
    with pytest.raises(CodecError, match="line 2"):
        _text_checks.nesting_check(body + deep)


@given(
    st.lists(
        st.sampled_from(
            [b"{", b"}", b"[", b"]", b'"', b'""', b'"]]"', b'"}"', b'"[{"', b"a", b"\n"]
        ),
        max_size=300,
    ),
    st.integers(1, 4),
    st.sampled_from([1, 2, 3, 7, 1 << 22]),
)
def test_ndjson_nesting_fast_path_agrees_with_the_full_scan(tokens, depth, chunk):
    """Bodies without escapes take a shortcut over their brackets and quotes, in chunks;
    it must refuse exactly what the byte-by-byte scan refuses (with the limit lowered, so
    that short bodies reach it, and chunks of a few bytes, so that they cross)."""
    from protocol import _text_checks

    body = b"".join(tokens)
    limit, size = _text_checks.MAX_DEPTH, _text_checks._CHUNK
    _text_checks.MAX_DEPTH = depth
    try:
        scanned = _refusal(_text_checks._scan, body)
        _text_checks._CHUNK = chunk
        checked = _refusal(_text_checks.nesting_check, body)
    finally:
        _text_checks.MAX_DEPTH, _text_checks._CHUNK = limit, size
    assert checked == scanned


def _refusal(check, body: bytes) -> str | None:
    """What ``check`` says of ``body``: its refusal's message, or None if it takes it."""
    try:
        check(body)
    except CodecError as e:
        return str(e)
    return None


@given(
    st.lists(st.sampled_from([b"{", b"}", b"[", b"]", b'"']), max_size=200),
    st.integers(1, 4),
    st.sampled_from([1, 2, 3, 7, 1 << 22]),
)
def test_ndjson_nesting_shortcut_is_exact_on_brackets_and_quotes(tokens, depth, chunk):
    """The shortcut itself, against a walk one mark at a time: yes exactly when no
    bracket is inside a string and no bracket opens deeper than the limit."""
    from protocol import _text_checks

    marks = b"".join(tokens)
    inside, level, expected = False, 0, True
    for c in marks:
        if c == 0x22:
            inside = not inside
        elif inside:
            expected = False
            break
        else:
            level += 1 if c in b"[{" else -1
            if level > depth:
                expected = False
                break
    limit, size = _text_checks.MAX_DEPTH, _text_checks._CHUNK
    _text_checks.MAX_DEPTH, _text_checks._CHUNK = depth, chunk
    try:
        assert _text_checks._shallow(marks) is expected
    finally:
        _text_checks.MAX_DEPTH, _text_checks._CHUNK = limit, size


@given(
    st.lists(st.sampled_from([b"{", b"}", b"[", b"]", b'"', b'""']), max_size=200),
    st.sampled_from([1, 2, 3, 7, 1 << 22]),
)
def test_ndjson_even_quote_runs_mean_no_bracket_in_a_string(tokens, chunk):
    """The first shortcut: among brackets and quotes, every run of quotes is even exactly
    when no bracket stands inside a string; then the brackets alone give the depth (in
    chunks too), as a walk one mark at a time finds it."""
    from protocol import _text_checks

    marks = b"".join(tokens)
    inside, level, deepest, in_string = False, 0, 0, False
    for c in marks:
        if c == 0x22:
            inside = not inside
        elif inside:
            in_string = True
        else:
            level += 1 if c in b"[{" else -1
            deepest = max(deepest, level)
    assert (2 * marks.count(b'""') == marks.count(b'"')) is (not in_string and not inside)
    if not in_string:
        size = _text_checks._CHUNK
        _text_checks._CHUNK = chunk
        try:
            assert _text_checks._deepest(marks.translate(None, b'"')) == deepest
        finally:
            _text_checks._CHUNK = size


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (b"12345678901234567890123", "beyond 64 bits"),
        (b"-9223372036854775809", "beyond 64 bits"),
        (b"NaN", "NaN is not JSON"),
        (b"-Infinity", "Infinity is not JSON"),
    ],
)
@pytest.mark.parametrize("typed", [False, True], ids=["inferred", "typed"])
def test_ndjson_values_no_reader_may_change_are_refused(value, says, typed):
    """Whether the body is read with types inferred, or with the record type of the body
    before it (which skips the scan for such numbers: that read fails on them)."""
    from protocol._ndjson import NdjsonCodec

    codec = NdjsonCodec()
    ok = b'{"progress": {"lower": [0], "upper": [0], "counts": []}}\n'
    if typed:  # a first body of integer records gives the codec their type
        first = b'{"updates": [{"data": {"a": 7}, "time": 1, "diff": 1}]}\n'
        assert [len(m) for m in codec.decode(first)] == [1]
    body = ok + b'{"updates": [{"data": {"a": ' + value + b'}, "time": 1, "diff": 1}]}\n'
    with pytest.raises(CodecError, match=says) as e:
        codec.decode(body)
    assert "line 2" in str(e.value)
    # the same values inside strings are text like any other
    quoted = b'{"updates": [{"data": {"a": 8, "s": "' + value + b'"}, "time": 1, "diff": 1}]}\n'
    quoted = ok + quoted
    (_, updates) = codec.decode(quoted)
    assert next(iter(updates)).record == {"a": 8, "s": value.decode()}


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (b'{"updates": [{"data": {"a": 1}, "time": NaN, "diff": 1}]}', "NaN is not JSON"),
        (b'{"updates": [{"data": {"a": 1}, "time": 1, "diff": 99999999999999999999}]}', "64 bits"),
        (b'{"progress": {"lower": [0], "upper": [Infinity], "counts": []}}', "Infinity is not"),
        (b'{"updates": [{"data": {"a": [1, NaN]}, "time": 1, "diff": 1}]}', "NaN is not JSON"),
    ],
)
def test_ndjson_such_values_outside_the_records_are_refused_too(line, says):
    """The scan for them runs when a read with inferred types found a float anywhere (a
    record's column, a time, a diff, a progress): those values are refused wherever they
    are, naming the line."""
    ok = b'{"progress": {"lower": [0], "upper": [0], "counts": []}}\n'
    with pytest.raises(CodecError, match=says) as e:
        get_codec("ndjson").decode(ok + line + b"\n")
    assert "line 2" in str(e.value)


def test_ndjson_invalid_utf8_is_refused_naming_the_line():
    body = b'{"progress": {"lower": [0], "upper": [0], "counts": []}}\n'
    body += b'{"updates": [{"data": {"a": "\xff\xfe"}, "time": 1, "diff": 1}]}\n'
    with pytest.raises(CodecError, match="invalid UTF-8") as e:
        get_codec("ndjson").decode(body)
    assert "line 2" in str(e.value)


class _Endless(io.RawIOBase):
    """A stream of one first line, then bytes without a newline for ever (a broken or
    hostile feed server); it counts what was read of it."""

    def __init__(self, first: bytes) -> None:
        self.first, self.served = first, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        chunk = (self.first + b"x" * len(b))[: len(b)]
        self.first = self.first[len(chunk) :]
        b[: len(chunk)] = chunk
        self.served += len(chunk)
        return len(chunk)


def test_ndjson_stream_line_beyond_the_limit_is_refused_without_reading_it_all(monkeypatch):
    from protocol import _ndjson

    monkeypatch.setattr(_ndjson.NdjsonDecoder, "max_line_bytes", 4096)
    first = b'{"progress": {"lower": [0], "upper": [1], "counts": []}}\n'
    raw = _Endless(first)
    decoder = get_codec("ndjson").decoder(io.BufferedReader(raw, buffer_size=1024))
    messages = []
    with pytest.raises(CodecError, match="longer than 4096 bytes") as e:
        messages.extend(decoder)
    assert "line 2" in str(e.value)
    assert [type(m) for m in messages] == [Progress]  # the line before it came through
    assert raw.served < 4096 + 2 * 1024 + len(first)
    # a line of exactly the limit is a line like any other
    line = b'{"progress": {"lower": [0], "upper": [1], "counts": []}}'
    padded = line[:-1] + b" " * (4096 - len(line)) + b"}\n"
    assert len(padded) == 4097
    assert [type(m) for m in get_codec("ndjson").decoder(io.BytesIO(padded))] == [Progress]


def test_ndjson_edge_values_that_are_fine_still_decode():
    body = (
        b'{"updates": [{"data": {"a": 9223372036854775807, "b": -9223372036854775808, '
        b'"s": "NaN, Infinity and 123456789012345678901234 in a string", "u": "\xc3\xa9"}, '
        b'"time": 1, "diff": 1}]}\n'
    )
    (updates,) = get_codec("ndjson").decode(body)
    assert next(iter(updates)).record == {
        "a": 2**63 - 1,
        "b": -(2**63),
        "s": "NaN, Infinity and 123456789012345678901234 in a string",
        "u": "é",
    }


def test_avro_deflate_bomb_is_refused_before_it_is_inflated():
    """A deflate block of zeros: 160 KB that would inflate to 160 MiB. The walk over the
    blocks counts the inflated bytes in 1 MiB steps and stops past the cap."""
    import zlib

    from protocol._avro import check_container

    honest = _avro([[{"data": {"id": i}, "time": 1, "diff": 1} for i in range(2000)]])
    header_end = honest.index(b"\x00", 4)  # (the header is short; the sync follows it)
    sync = honest[-16:]
    blob = zlib.compressobj(9, zlib.DEFLATED, -15)
    data = blob.compress(b"\x00" * (160 << 20)) + blob.flush()
    header = honest[:header_end]
    # rebuild the header with the deflate codec, then one block of the zeros
    meta = {"avro.schema": orjson.dumps(cdcv2_schema(RECORD)), "avro.codec": b"deflate"}
    from protocol._avro_columns import avro_long

    out = bytearray(b"Obj\x01")
    out += avro_long(len(meta))
    for k, v in meta.items():
        out += avro_long(len(k)) + k.encode() + avro_long(len(v)) + v
    out += avro_long(0) + sync
    out += avro_long(1000) + avro_long(len(data)) + data + sync
    assert len(out) < 400_000 and header
    with pytest.raises(CodecError, match="inflate to more than"):
        check_container(bytes(out))
    with pytest.raises(CodecError, match="inflate to more than"):
        get_codec("avro").decode(bytes(out))


def test_a_deflated_block_of_more_than_one_inflate_step_is_read():
    """fastavro writes a deflate block with three bytes of its checksum after the stream.
    When the stream ended just as a 1 MiB step of the inflate count did, those bytes
    stayed the decompressor's unconsumed tail and the count looped for ever: a receiver's
    thread spun, holding the feed, on an honest body."""
    import os

    rows = [
        {"data": {"id": i, "s": os.urandom(48).hex()}, "time": 1, "diff": 1} for i in range(20_000)
    ]
    record = {
        "type": "record",
        "name": "r",
        "fields": [{"name": "id", "type": "long"}, {"name": "s", "type": "string"}],
    }
    out = io.BytesIO()
    schema = fastavro.parse_schema(cdcv2_schema(record))
    fastavro.writer(out, schema, [rows], codec="deflate", sync_interval=1 << 30)
    (got,) = get_codec("avro").decode(out.getvalue())
    assert got.table().to_pylist() == rows


def test_avro_blocks_that_claim_more_than_they_hold_are_refused():
    from protocol._avro_columns import avro_long

    body = _avro([[{"data": {"id": 1}, "time": 1, "diff": 1}]])
    sync = body[-16:]
    head = body[: body.index(sync) + 16]
    lying = head + avro_long(16_000_000) + avro_long(4) + b"\x02\x00\x00\x00" + sync
    with pytest.raises(CodecError, match="cannot hold 16000000 datums"):
        get_codec("avro").decode(lying)
    eleven = head + b"\x82" + b"\x80" * 9 + b"\x00" + avro_long(1) + b"\x00" + sync
    with pytest.raises(CodecError, match="longer than 10 bytes"):
        get_codec("avro").decode(eleven)
    short = head + avro_long(1) + avro_long(999) + b"\x00" + sync
    with pytest.raises(CodecError, match="does not fit the body"):
        get_codec("avro").decode(short)


def test_avro_update_items_without_time_and_diff_longs_are_refused():
    """Items of an empty record take no bytes: a tiny body could declare millions."""
    schema = cdcv2_schema(RECORD)
    schema[0]["items"] = {"type": "record", "name": "empty", "fields": []}
    body = _avro([[{}] * 3], schema=schema)
    with pytest.raises(CodecError, match="CDCv2 message schema"):
        get_codec("avro").decode(body)
