"""Delta change data feeds: equal to the table at every version, whatever the row order.

A real Delta table (delta-rs) goes through insert, update, delete, merge, replaceWhere,
overwrite and append. Its change data feed is read directly (``delta:``) and as exported
JSON lines and Parquet files whose rows are shuffled inside each version: the feed's
collection at time ``1 + v`` must equal the table at version ``v`` every time.
"""

from __future__ import annotations

import datetime as dt
import decimal
import random
from collections import Counter

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from feed.log.reader import FeedReader
from protocol import check_messages

from .model import run_emitter

deltalake = pytest.importorskip("deltalake")

UTC = dt.UTC


def _rows(ids, amount, when, tag):
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "amount": pa.array([decimal.Decimal(amount) + i for i in ids], pa.decimal128(12, 2)),
            "at": pa.array([when] * len(ids), pa.timestamp("us", tz="UTC")),
            "tag": pa.array([f"{tag}{i}" if i % 4 else None for i in ids], pa.string()),
        }
    )


@pytest.fixture(scope="module")
def delta_table(tmp_path_factory):
    """A table through seven versions; returns its URI and the rows at each version."""
    from deltalake import DeltaTable, write_deltalake

    uri = str(tmp_path_factory.mktemp("delta") / "accounts")
    t0 = dt.datetime(2024, 1, 1, 12, 0, 0, 123456, tzinfo=UTC)
    write_deltalake(
        uri,
        _rows(range(1, 9), "10.05", t0, "a"),
        configuration={"delta.enableChangeDataFeed": "true"},
    )  # v0: insert
    d = DeltaTable(uri)
    d.update(updates={"tag": "'updated'", "amount": "amount + 1"}, predicate="id <= 3")  # v1
    d.delete("id = 4")  # v2
    src = _rows([2, 5, 20, 21], "99.99", dt.datetime(2024, 2, 1, tzinfo=UTC), "m")
    (
        d.merge(source=src, predicate="t.id = s.id", source_alias="s", target_alias="t")
        .when_matched_update_all()
        .when_not_matched_insert_all()
        .execute()
    )  # v3: merge
    write_deltalake(
        uri,
        _rows([20], "0.01", dt.datetime(2024, 3, 1, tzinfo=UTC), "rw"),
        mode="overwrite",
        predicate="id = 20",
    )  # v4: replaceWhere (delete and insert of one key)
    write_deltalake(uri, _rows(range(30, 36), "-5.50", t0, "o"), mode="overwrite")  # v5
    write_deltalake(uri, _rows([40, 41], "1.00", t0, "ap"), mode="append")  # v6
    versions = [DeltaTable(uri, version=v).to_pyarrow_table() for v in range(7)]
    return uri, versions


def _norm(row):
    out = []
    for k, v in sorted(row.items()):
        if isinstance(v, decimal.Decimal):
            v = format(v.normalize(), "f")
        elif isinstance(v, dt.datetime):
            v = (v if v.tzinfo else v.replace(tzinfo=UTC)).astimezone(UTC).isoformat()
        out.append((k, v))
    return tuple(out)


def _truth(table: pa.Table) -> Counter:
    return Counter(_norm(r) for r in table.to_pylist())


def _check(log, versions, key):
    reader = FeedReader(log, "t")
    assert check_messages(reader.messages(), non_negative=bool(key), key=key or None) == []
    assert reader.frontier == 1 + len(versions)
    for v, table in enumerate(versions):
        got = Counter()
        for row in reader.snapshot(1 + v).to_pylist():
            n = row.pop("count")
            got[_norm(row)] += n
        assert got == _truth(table), f"version {v}"
    info = reader.info if hasattr(reader, "info") else None
    return info


@pytest.mark.parametrize("key", [("id",), ()])
def test_delta_source_equals_the_table_at_every_version(spark, tmp_path, delta_table, key):
    uri, versions = delta_table
    log = str(tmp_path / "log")
    e, reports = run_emitter(
        spark,
        source_kind="delta",
        source_path=uri,
        feed="t",
        log=log,
        key=key,
        granularity="transaction",
        clock="logical",
    )
    assert sum(r.bad_rows for r in reports) == 0
    assert e.cp.source["version"] == 6
    e.close()
    _check(log, versions, list(key))
    # the record schema keeps the table's types
    import orjson as _o

    fields = {
        f["name"]: f["type"]
        for f in _o.loads((tmp_path / "log/t/feed.json").read_bytes())["schema"]["fields"]
    }
    assert "decimal" in str(fields["amount"]) and "timestamp-micros" in str(fields["at"])


def _cdf_rows(uri):
    from deltalake import DeltaTable

    from feed.sources.delta import plain_types

    reader = DeltaTable(uri).load_cdf(starting_version=0)
    table = pa.RecordBatchReader.from_stream(reader).read_all()
    schema = pa.schema([f.with_type(plain_types(f.type)) for f in table.schema])
    return table.cast(schema).drop_columns(["_commit_timestamp"])


@pytest.mark.parametrize("fmt", ["json", "parquet"])
@pytest.mark.parametrize("seed", [1, 2])
def test_cdf_files_in_any_row_order_equal_the_table(spark, tmp_path, delta_table, fmt, seed):
    from feed.sources.delta import DeltaSource

    uri, versions = delta_table
    rows = _cdf_rows(uri).to_pylist()
    random.Random(seed).shuffle(rows)  # no order inside a version (nor across)
    src = tmp_path / "in"
    src.mkdir()
    half = len(rows) // 2
    for n, part in enumerate((rows[:half], rows[half:])):
        if fmt == "json":
            lines = [orjson.dumps(r, default=str) for r in part]
            (src / f"part-{n}.json").write_bytes(b"\n".join(lines))
        else:
            pq.write_table(
                pa.Table.from_pylist(part, schema=_cdf_rows(uri).schema), src / f"part-{n}.parquet"
            )
    schema = DeltaSource(uri).record_schema()
    log = str(tmp_path / "log")
    e, reports = run_emitter(
        spark,
        source_kind="cdf",
        source_path=str(src),
        feed="t",
        log=log,
        key=("id",),
        schema=schema if fmt == "json" else None,
        granularity="transaction",
        clock="logical",
    )
    e.close()
    assert sum(r.bad_rows for r in reports) == 0
    _check(log, versions, ["id"])
