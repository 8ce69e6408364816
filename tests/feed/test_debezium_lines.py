"""The driver's parse of Debezium lines (feed/sources/debezium_lines.py) against Spark's
(feed/sources/debezium.py), line for line, and Spark's xxhash64 against ours."""

from __future__ import annotations

import datetime as dt
import decimal
import random
from base64 import b64encode
from pathlib import Path

import orjson
import pytest
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import to_arrow_type

from feed.sources.connect import connect_names, connect_to_avro
from feed.sources.debezium_lines import Declined, parse_lines
from feed.sources.kinds import read_changes
from feed.sources.rows import spark_record_type
from feed.sources.sparkhash import spark_xxhash64
from feed.txn.state import bucket_of

from .test_debezium import SCHEMA, TOAST, end, event, write

SAMPLES = Path(__file__).parents[3] / "shared" / "samples" / "debezium"
_SKIPPED_ONLY = ("before", "after", "_bucket")  # (null here for a skipped line: see the module)


def _both(spark, files, schema, key, table, buckets=None):
    """Each parse's rows, in file and line order (the line's number left out: Spark's is
    its own id)."""
    files = [str(f) for f in files]
    record = spark_record_type(schema)
    ours = parse_lines(
        files, to_arrow_type(record, timezone="UTC"), connect_names(schema), key, table, buckets
    )
    options = {"table": table, "schema": schema}
    changes = read_changes(spark, "debezium", files, record, key, options)
    cols = [c for c in ours.column_names if c != "_bucket"]
    if buckets is not None:
        image = F.when(F.col("op") == "d", F.col("before")).otherwise(F.col("after"))
        theirs = changes.select(*cols, bucket_of(image, key, buckets).alias("_bucket"))
    else:
        theirs = changes.select(*cols)
    theirs = theirs.toArrow()
    assert ours.schema == theirs.schema
    out = []
    for t in (ours, theirs):
        rows = sorted(t.to_pylist(), key=lambda r: (r["ord_file"], r["ord_row"]))
        for r in rows:
            del r["ord_row"]
            if r["op"] == "x":
                for c in _SKIPPED_ONLY:
                    r.pop(c, None)
        out.append(rows)
    return out


def test_the_shipped_samples_parse_as_spark_parses_them(spark):
    files = sorted(SAMPLES.glob("*.json"))
    if not files:  # (as test_debezium.py: a clone without shared/ beside it)
        pytest.skip(f"no samples at {SAMPLES}")
    schema = connect_to_avro(
        orjson.loads(files[0].read_bytes().split(b"\n")[0])["schema"]["fields"][1]["fields"], "r"
    )
    ours, theirs = _both(spark, files, schema, ["id"], "public.accounts", buckets=4)
    assert ours == theirs
    assert {r["op"] for r in ours} >= {"r", "c", "u", "d"}
    assert any(r["_shape"] is not None for r in ours)  # (some are wrapped)


def every_kind(row: dict) -> list:
    """Flat lines of every kind a connector writes: a snapshot's reads with their marks,
    BEGIN and END records, a transaction's events (one with a TOAST placeholder, one of
    another table), a heartbeat, a tombstone and a delete."""
    return [
        event("r", row, 100, xid=1, snap="first"),
        event("r", {**row, "id": 2}, 100, xid=1, snap="last"),
        {"status": "BEGIN", "id": "7:200", "event_count": None, "data_collections": None},
        event("c", {**row, "id": 3}, 190, xid=7, order=1, commit=200),
        event("u", {**row, "doc": TOAST}, 195, xid=7, order=2, commit=200, before=row),
        event("c", {"id": 9}, 196, xid=7, order=1, commit=200, table="other"),
        end(7, 200, {"accounts": 2, "other": 1}),
        {"ts_ms": 5},
        None,
        event("d", {**row, "id": 3}, 300, xid=8),
    ]


def test_hand_written_lines_of_every_kind_parse_as_spark_parses_them(spark, tmp_path):
    src = tmp_path / "in"
    row = {"id": 1, "owner": "a", "doc": "d"}
    write(src, "a.json", every_kind(row))
    (src / "b.json").write_bytes(
        b"\r\n".join(orjson.dumps(event("c", {**row, "id": i}, 400 + i, xid=9)) for i in (5, 6))
        + b"\r\n\n   \n"
    )
    files = sorted(src.glob("*.json"))
    for key, buckets in ((["id"], 3), ([], None)):
        ours, theirs = _both(spark, files, SCHEMA, key, "public.accounts", buckets)
        assert ours == theirs
        assert len(ours) == 12
    # (without a table every event is the feed's, and an END counts all its events)
    ours, theirs = _both(spark, files, SCHEMA, ["id"], None, 5)
    assert ours == theirs


def _b64(unscaled: int) -> str:
    size = max(1, (unscaled.bit_length() + 8) // 8)
    return b64encode(unscaled.to_bytes(size, "big", signed=True)).decode()


_CONNECT = [
    {"field": "id", "type": "int64"},
    {"field": "name", "type": "string"},
    {"field": "small", "type": "int16"},
    {"field": "ok", "type": "boolean", "optional": True},
    {"field": "x", "type": "double", "optional": True},
    {
        "field": "price",
        "type": "bytes",
        "optional": True,
        "name": "org.apache.kafka.connect.data.Decimal",
        "parameters": {"scale": "2", "connect.decimal.precision": "10"},
    },
    {
        "field": "amount",
        "type": "struct",
        "optional": True,
        "name": "io.debezium.data.VariableScaleDecimal",
    },
    {"field": "day", "type": "int32", "name": "io.debezium.time.Date"},
    {"field": "at", "type": "int64", "optional": True, "name": "io.debezium.time.MicroTimestamp"},
    {"field": "ms", "type": "int64", "optional": True, "name": "io.debezium.time.Timestamp"},
    {"field": "ns", "type": "int64", "optional": True, "name": "io.debezium.time.NanoTimestamp"},
    {"field": "tod", "type": "int64", "optional": True, "name": "io.debezium.time.MicroTime"},
    {"field": "tz", "type": "string", "optional": True, "name": "io.debezium.time.ZonedTimestamp"},
]


def _zoned(rng: random.Random) -> str:
    """A timestamptz as Debezium writes it (UTC, or another offset; 0 to 6 digits)."""
    at = dt.datetime(2000, 1, 1) + dt.timedelta(microseconds=rng.randint(-(10**16), 10**16))
    text = at.strftime("%Y-%m-%dT%H:%M:%S")
    digits = rng.randint(0, 6)
    if digits:
        text += "." + f"{at.microsecond:06d}"[:digits]
    offset = rng.choice(["Z", "+01:00", "-05:30", "+00:00"])
    return text + offset


def _typed_row(rng: random.Random, i: int) -> dict:
    maybe = lambda v: None if rng.random() < 0.15 else v  # noqa: E731
    scale = rng.randint(0, 18)
    return {
        "id": rng.randint(-(2**63), 2**63 - 1) if i % 3 else i,
        "name": "".join(rng.choice('aé€😀 z"\\') for _ in range(rng.randint(0, 12))),
        "small": rng.randint(-(2**15), 2**15 - 1),
        "ok": maybe(rng.random() < 0.5),
        "x": maybe(rng.choice([rng.uniform(-1e9, 1e9), rng.randint(-5, 5), 1e-300, 0.1])),
        "price": maybe(_b64(rng.randint(-(10**10) + 1, 10**10 - 1))),
        "amount": maybe({"scale": scale, "value": _b64(rng.randint(-(10**19), 10**19) // 10)}),
        "day": rng.randint(-700_000, 2_900_000),
        "at": maybe(rng.randint(-(6 * 10**16), 6 * 10**16)),
        "ms": maybe(rng.randint(-(6 * 10**13), 6 * 10**13)),
        "ns": maybe(rng.randint(-(2**62), 2**62)),
        "tod": maybe(rng.randint(0, 86_400_000_000)),
        "tz": maybe(_zoned(rng)),
    }


def test_connect_encoded_values_of_every_handled_type_parse_as_spark_parses_them(spark, tmp_path):
    rng = random.Random(33)
    schema = connect_to_avro(_CONNECT, "record")
    wrapper = {"fields": [{"field": f, "fields": _CONNECT} for f in ("before", "after")]}
    lines = []
    for i in range(150):
        row = _typed_row(rng, i)
        op = rng.choice("cur")
        ev = event(op, row, 1000 + i, xid=i, order=1, before=row if op == "u" else None)
        lines.append({"schema": wrapper, "payload": ev})
    write(tmp_path / "in", "a.json", lines)
    files = [tmp_path / "in" / "a.json"]
    for key, buckets in ((["id", "name"], 7), (["name", "small", "day"], 11), ([], None)):
        ours, theirs = _both(spark, files, schema, key, "public.accounts", buckets)
        assert ours == theirs
    assert all(r["_shape"] is not None for r in ours)


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (b'{"op": "c", "after": {"id": 1}', "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"op": "t", "source": {"lsn": 5}}', "op 't'"),
        (b'{"op": "c", "after": {"id": "one"}, "source": {"lsn": 5}}', "column id"),
        (b'{"op": "c", "after": {"owner": "a"}, "source": {"lsn": 5}}', "key"),
        (b'{"op": "c", "after": {"id": 1}}', "source.lsn"),
        (b'{"op": "c", "after": {"id": 1}, "source": {"lsn": 5}, "transaction": 3}', "transaction"),
        (b'{"status": "END", "event_count": 1}', "'id'"),
    ],
)
def test_a_line_spark_finds_bad_is_declined_with_where_and_why(spark, tmp_path, line, why):
    f = tmp_path / "bad.json"
    f.write_bytes(b'{"ts_ms": 1}\n' + line + b"\n")
    record = spark_record_type(SCHEMA)
    with pytest.raises(Declined, match=why) as e:
        parse_lines([str(f)], to_arrow_type(record, timezone="UTC"), {}, ["id"], None)
    assert f"{f}:2:" in str(e.value)
    # (each of them is a bad row to Spark: declining lets Spark's parse say so)
    errors = read_changes(spark, "debezium", [str(f)], record, ["id"], {}).select("_error")
    assert [r["_error"] for r in errors.collect()][1] is not None


def test_spark_xxhash64_of_rows_of_every_hashed_type(spark):
    rng = random.Random(7)
    rows = [
        (
            rng.randint(-(2**31), 2**31 - 1),
            rng.randint(-(2**63), 2**63 - 1),
            "".join(rng.choice("abé€😀") for _ in range(rng.randint(0, 80))),
            rng.random() < 0.5,
            dt.date(1970, 1, 1) + dt.timedelta(days=rng.randint(-5000, 30000)),
            dt.datetime(2020, 1, 1, tzinfo=dt.UTC)
            + dt.timedelta(microseconds=rng.randint(-(10**15), 10**15)),
            decimal.Decimal(rng.randint(-(10**17), 10**17)).scaleb(-4),
            None if i % 5 == 0 else rng.randint(-100, 100),
        )
        for i in range(200)
    ]
    schema = "i int, l long, s string, b boolean, d date, t timestamp, m decimal(18,4), n short"
    df = spark.createDataFrame(rows, schema)
    cols = df.columns
    hashed = df.select(F.xxhash64(*cols).alias("h"), F.xxhash64("n", "s").alias("ns")).toArrow()
    t = df.toArrow()
    kinds = {c: str(t.schema.field(c).type) for c in cols}
    for r, h in zip(t.to_pylist(), hashed.to_pylist(), strict=True):
        assert spark_xxhash64([(r[c], kinds[c]) for c in cols]) == h["h"]
        assert spark_xxhash64([(r["n"], kinds["n"]), (r["s"], kinds["s"])]) == h["ns"]


def test_compressed_input_parses_as_spark_parses_it(spark, tmp_path):
    """A gzip, bzip2 or zstd file is read as its text by both parses (Spark by its codecs,
    the driver through pyarrow)."""
    import bz2
    import gzip

    import pyarrow as pa

    from feed.demo.data import ACCOUNTS_SCHEMA, generate_bank

    text = b"\n".join(generate_bank(transactions=20, seed=5).events) + b"\n"
    (tmp_path / "a.json.gz").write_bytes(gzip.compress(text))
    (tmp_path / "b.json.bz2").write_bytes(bz2.compress(text))
    with pa.CompressedOutputStream(str(tmp_path / "c.json.zst"), "zstd") as out:
        out.write(text)
    files = sorted(tmp_path.glob("*.json.*"))
    ours, theirs = _both(spark, files, ACCOUNTS_SCHEMA, ["id"], "public.accounts", buckets=4)
    assert ours == theirs
    assert len(ours) == 3 * text.count(b"\n")
