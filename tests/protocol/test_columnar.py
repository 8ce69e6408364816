"""The columnar paths: record hashes, whole-body decoding straight into Arrow."""

from __future__ import annotations

import io
import itertools
from unittest import mock

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import CodecError, Progress, Updates, get_codec
from protocol.messages import record_keys
from protocol.rowhash import row_hashes

from ..strategies import RICH_SCHEMA, json_records, rich_records, updates_of


def _rows(messages):
    return [m.rows() if isinstance(m, Updates) else m for m in messages]


@given(st.lists(json_records, min_size=1, max_size=30))
def test_equal_records_hash_equal_whatever_the_layout(records):
    base = pa.array(records)
    h = row_hashes(base)
    # fields in another order
    reordered = pa.array([dict(reversed(list(r.items()))) for r in records])
    assert np.array_equal(row_hashes(reordered), h)
    # a slice of a bigger array, and a chunked column
    padded = pa.array(records + records)
    assert np.array_equal(row_hashes(padded.slice(len(records))), h)
    chunked = pa.chunked_array([base.slice(0, 1), base.slice(1)])
    assert np.array_equal(row_hashes(chunked), h)
    # the same record twice hashes twice the same
    assert row_hashes(pa.array([records[0], records[0]])).tolist()[0] == h[0]


def test_hashes_ignore_integer_width_and_the_type_of_a_null():
    wide = pa.array([{"a": 1, "s": None}], pa.struct([("a", pa.int64()), ("s", pa.string())]))
    narrow = pa.array([{"a": 1, "s": None}], pa.struct([("a", pa.int16()), ("s", pa.null())]))
    floats = pa.array([{"a": 1.0, "s": None}], pa.struct([("a", pa.float64()), ("s", pa.null())]))
    assert row_hashes(wide)[0] == row_hashes(narrow)[0] == row_hashes(floats)[0]


@given(rich_records.map(lambda r: [r]))
def test_records_with_logical_types_hash(records):
    from protocol.schema import avro_to_arrow

    arr = pa.array(records, avro_to_arrow(RICH_SCHEMA))
    assert np.array_equal(row_hashes(arr), row_hashes(pa.array(records + records, arr.type))[:1])


def test_distinct_records_get_distinct_hashes():
    records = [{"id": i, "owner": f"o{i % 97}", "note": "x" * (i % 7)} for i in range(20_000)]
    records += [{"id": i, "owner": f"o{i % 97}", "note": None} for i in range(20_000)]
    assert len(np.unique(row_hashes(pa.array(records)))) == len(records)


@given(updates_of(json_records))
def test_ndjson_whole_body_decode_equals_the_line_decoder(ups):
    codec = get_codec("ndjson")
    body = codec.encode([Updates.of(ups), Progress(0, 1, ())])
    whole = codec.decode(body)
    lines = list(codec.decoder(io.BytesIO(body)))
    assert _rows(whole) == _rows(lines)


def test_ndjson_whole_body_goes_to_arrow_in_one_pass():
    body = (
        b'{"updates": [{"data": {"id": 1, "s": "x"}, "time": 3, "diff": 1}]}\n'
        b'{"updates": [{"data": {"id": 2, "s": null}, "time": 3, "diff": -1}]}\n'
        b'{"progress": {"lower": [0], "upper": [4], "counts": [{"time": 3, "count": 2}]}}\n'
    )
    messages = get_codec("ndjson").decode(body)
    assert [type(m) for m in messages] == [Updates, Updates, Progress]
    assert messages[0].has_table() and messages[1].has_table()
    assert messages[1].rows() == [{"data": {"id": 2, "s": None}, "time": 3, "diff": -1}]


@pytest.mark.parametrize(
    "text",
    [
        # (beyond 64 bits is refused: tests/protocol/test_hostile_bodies.py)
        '"2024-01-01"',  # pyarrow's reader would make a timestamp of it
        "9007199254740993",  # 2**53 + 1: a double cannot hold it
    ],
)
def test_ndjson_whole_body_decode_reads_values_as_the_line_decoder(text):
    body = b'{"updates": [{"data": {"a": %s}, "time": 1, "diff": 1}]}\n' % text.encode()
    codec = get_codec("ndjson")
    (updates,) = codec.decode(body)
    assert _rows([updates]) == _rows(codec.decoder(io.BytesIO(body)))
    if text.isdigit() and int(text) < 2**63:
        assert updates.rows()[0]["data"]["a"] == int(text)


@given(updates_of(rich_records))
def test_avro_whole_body_decode_is_typed_arrow_with_the_same_values(ups):
    codec = get_codec("avro")
    body = codec.encode([Updates.of(ups)], schema=RICH_SCHEMA)
    whole = codec.decode(body)
    assert all(m.has_table() for m in whole)
    assert _rows(whole) == _rows(codec.decoder(io.BytesIO(body)))


def test_low_cardinality_strings_hash_the_same_through_their_dictionary():
    """Big columns with few distinct strings are hashed via a dictionary: same numbers as
    the plain path (small slices take it), nulls and sliced arrays included."""
    n = 20_000
    records = [
        {
            "id": i,
            "owner": None if i % 11 == 0 else f"owner-{i % 37}",
            "note": None,
            "tag": ["a", "b", ""][i % 3],
        }
        for i in range(n + 500)
    ]
    big = pa.array(records).slice(500)  # a non-zero offset too
    whole = row_hashes(big)
    pieces = np.concatenate([row_hashes(big.slice(i, 1000)) for i in range(0, n, 1000)])
    assert np.array_equal(whole, pieces)
    assert len(np.unique(whole)) == n


def test_the_same_bytes_hash_alike_alone_in_a_column_and_in_any_string_or_binary_type():
    rng = np.random.default_rng(5)
    words = ["".join(chr(97 + c) for c in rng.integers(0, 26, n)) for n in rng.integers(0, 40, 300)]
    words += ["", "é" * 3, words[0]]
    whole = row_hashes(pa.array([{"s": w} for w in words]))
    one_by_one = [row_hashes(pa.array([{"s": w}]))[0] for w in words]
    assert np.array_equal(np.array(one_by_one, dtype=np.uint64), whole)
    assert whole[-1] == whole[0]
    assert len(np.unique(whole)) == len(set(words))
    for t in (pa.large_string(), pa.binary(), pa.large_binary()):
        column = pa.array([w.encode() for w in words], t if t != pa.large_string() else None)
        if t == pa.large_string():
            column = pa.array(words, t)
        other = row_hashes(pa.StructArray.from_arrays([column], ["s"]))
        assert np.array_equal(other, whole), t


def _long_lines(records: list[dict]) -> bytes:
    """A stream of two lines of updates (each well over 16 KB, read by pyarrow) and a
    progress, written by hand as a feed server would."""
    import orjson

    half = len(records) // 2
    lines = [
        orjson.dumps({"updates": [{"data": r, "time": 1, "diff": 1} for r in part]})
        for part in (records[:half], records[half:])
    ]
    counts = b'[{"time": 1, "count": %d}]' % len(records)
    progress = b'{"progress": {"lower": [0], "upper": [2], "counts": %s}}' % counts
    return b"\n".join([*lines, progress]) + b"\n"


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"when": "2024-01-01"},  # pyarrow would read a timestamp: orjson reads that line
        {"big": 2**53 + 1},  # a double cannot hold it: orjson reads that line
        {"x": 1.5, "deep": {"a": {"b": [1, 2]}}},
    ],
    ids=["plain", "timestamp-like", "beyond-doubles", "floats-and-nesting"],
)
def test_ndjson_stream_lines_of_many_updates_decode_as_orjson_reads_them(extra):
    import orjson

    # every record carries every column, as a feed's records do (a column a record of a
    # line lacks reads as null from pyarrow's reader, as from a pushed body's)
    records = [
        {"id": i, "s": f'é "{i}" \\ x', "ok": i % 3 == 0, "n": None if i % 5 else i}
        | dict.fromkeys(extra)
        for i in range(1_000)
    ]
    records[700] |= extra  # in the second line only
    body = _long_lines(records)
    decoded = list(get_codec("ndjson").decoder(io.BytesIO(body), tables=True))
    expected = [orjson.loads(line) for line in body.splitlines()]
    assert [m.rows() for m in decoded[:2]] == [e["updates"] for e in expected[:2]]
    assert decoded[2] == Progress(0, 2, ((1, 1_000),))
    # the first line went through pyarrow's reader, straight into Arrow; for a caller that
    # wants Python rows, through orjson
    assert decoded[0].has_table()
    assert not next(iter(get_codec("ndjson").decoder(io.BytesIO(body)))).has_table()


def test_ndjson_stream_refuses_a_broken_long_line_by_its_number_after_the_good_ones():
    records = [{"id": i, "s": "x" * 40} for i in range(1_000)]
    body = _long_lines(records)
    first, second, _ = body.split(b"\n", 2)
    broken = first + b"\n" + second[: len(second) // 2] + b"\n"
    decoder = get_codec("ndjson").decoder(io.BytesIO(broken), tables=True)
    it = iter(decoder)
    assert len(next(it)) == 500
    with pytest.raises(CodecError, match="invalid JSON") as e:
        next(it)
    assert "line 2" in str(e.value)


def test_ndjson_stream_long_line_nested_past_the_body_limit_reads_as_before():
    """A stream line nested deeper than a pushed body may be (64) but within orjson's
    limit is read as it was before lines went to pyarrow: by orjson."""
    deep: dict = {"v": 1}
    for _ in range(80):
        deep = {"d": deep}
    records = [{"id": i, "s": "y" * 40, "deep": deep if i == 3 else None} for i in range(1_000)]
    (first, *_) = list(get_codec("ndjson").decoder(io.BytesIO(_long_lines(records)), tables=True))
    assert first.rows()[3]["data"]["deep"] == deep


@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=60),
    st.randoms(),
    # (when the map starts, its largest size): never, from 64 hashes, and held at 1 024
    # slots, where most new hashes find their slot taken by another and are searched for
    st.sampled_from([(1 << 40, 27), (64, 27), (64, 10)]),
)
def test_pending_hashes_hold_every_hash_in_few_runs_and_find_each(sizes, rnd, marks):
    from protocol import rowhash

    with (
        mock.patch.object(rowhash, "MARK_FROM", marks[0]),
        mock.patch.object(rowhash, "_MAX_SLOTS_LOG2", marks[1]),
    ):
        held = rowhash.PendingHashes()
        added: list[np.ndarray] = []
        first = 0
        for n in sizes:
            # distinct hashes, in no order: consecutive numbers times an odd number (mod 2**64)
            new = np.arange(first, first + n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            new = new[np.array(rnd.sample(range(n), n))]
            first += n
            order = np.argsort(new)
            # every hash added before is found, a new one is not
            assert not held.found(order, new[order]).any()
            assert not held.meets(np.sort(new))
            if added:
                old = added[rnd.randrange(len(added))]
                o = np.argsort(old)
                assert held.found(o, old[o]).all()
                # one old hash among new ones is met and found where it stands
                at = rnd.randrange(n + 1)
                mixed = np.insert(new, at, old[rnd.randrange(len(old))])
                m = np.argsort(mixed)
                assert held.meets(mixed[m])
                assert np.flatnonzero(held.found(m, mixed[m])).tolist() == [at]
            held.add(np.sort(new))
            added.append(new)
            runs = held.runs
            assert all(np.all(r[:-1] <= r[1:]) for r in runs)
            # few runs: merged as they come (each at least twice the next), or, behind a
            # map, only past 8 runs; either way O(log n) of them
            if held.size < rowhash.MARK_FROM:
                assert all(len(a) >= 2 * len(b) for a, b in itertools.pairwise(runs))
            assert len(runs) <= rowhash._MAX_RUNS + held.size.bit_length()
            assert np.array_equal(np.sort(np.concatenate(runs)), np.sort(np.concatenate(added)))
            assert held.size == first


def test_a_nested_null_field_hashes_and_keys_as_an_absent_one():
    """One record in two Arrow types (a body with other records gives its nested record
    their fields, as nulls): one hash, one key. A value in that field is another record."""
    from protocol._counts import record_keys_of

    narrow = pa.array([{"id": 1, "addr": {"city": "X"}}])
    geo = pa.struct([("lat", pa.int64())])
    addr = pa.struct([("city", pa.string()), ("zip", pa.string()), ("geo", geo)])
    wide = pa.array(
        [
            {"id": 1, "addr": {"city": "X", "zip": None, "geo": None}},
            {"id": 1, "addr": {"city": "X", "zip": None, "geo": {"lat": None}}},
            {"id": 1, "addr": {"city": "X", "zip": "9", "geo": None}},
        ],
        pa.struct([("id", pa.int64()), ("addr", addr)]),
    )
    hashes = row_hashes(wide).tolist()
    keys = record_keys_of(pa.chunked_array([wide])).to_pylist()
    assert hashes[0] == row_hashes(narrow)[0] and keys[0] == b'{"addr":{"city":"X"},"id":1}'
    # an empty nested record is a value: not the same as none
    assert keys[1] == b'{"addr":{"city":"X","geo":{}},"id":1}' and hashes[1] != hashes[0]
    assert keys[2] != keys[0] and hashes[2] != hashes[0]
    assert keys == record_keys(wide.to_pylist())


def _sparse(depth: int) -> st.SearchStrategy[dict]:
    """JSON-like records whose fields come and go: ints in ``a`` and ``b``, a string in
    ``s``, a nested record (of the same kind) in ``n``, any of them left out or null."""
    fields: dict[str, st.SearchStrategy] = {
        "a": st.none() | st.integers(-3, 3),
        "b": st.none() | st.integers(-3, 3),
        "s": st.none() | st.sampled_from(["", "x", "null", ":null"]),
    }
    if depth:
        fields["n"] = st.none() | _sparse(depth - 1)
    return st.fixed_dictionaries({}, optional=fields)


@given(st.lists(_sparse(2).map(lambda r: {"id": 1, **r}), min_size=1, max_size=8))
def test_a_records_key_and_hash_do_not_depend_on_the_records_beside_it(records):
    """Read together, records get one Arrow type (each one's nested records get the
    fields the others have, as nulls); read alone, only their own: the key and the hash
    are the same either way, and the key is record_key's of the Python record."""
    from protocol._counts import record_keys_of
    from protocol.messages import record_key

    together = pa.array(records)
    keys = record_keys_of(pa.chunked_array([together])).to_pylist()
    hashes = row_hashes(together).tolist()
    for i, r in enumerate(records):
        alone = pa.array([r])
        assert keys[i] == record_key(r) == record_keys_of(pa.chunked_array([alone]))[0].as_py()
        assert hashes[i] == row_hashes(alone)[0]
