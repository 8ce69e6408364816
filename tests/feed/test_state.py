"""Bucketed keyed state: a transaction rewrites only the buckets its keys fall in; a feed
whose state is one whole folder (written before buckets) is migrated on its next run."""

from __future__ import annotations

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

import feed.txn.state as state
from feed.log.checkpoint import CheckpointStore
from feed.log.reader import FeedReader
from feed.log.store import FeedLog

from .model import as_multiset, collection_of, run_emitter

SCHEMA = {
    "type": "record",
    "name": "record",
    "fields": [{"name": "id", "type": "long"}, {"name": "v", "type": "long"}],
}


def write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(
        pa.Table.from_pylist(
            rows, schema=pa.schema([("id", pa.int64()), ("v", pa.int64()), ("seq", pa.int64())])
        ),
        path,
    )


def emit(spark, tmp_path):
    e, _ = run_emitter(
        spark,
        source_kind="upsert",
        source_path=str(tmp_path / "in"),
        feed="t",
        log=str(tmp_path / "log"),
        key=("id",),
        schema=SCHEMA,
        order="seq",
        clock="logical",
    )
    e.close()
    return e


def manifest(tmp_path, ref):
    return orjson.loads((tmp_path / "log" / "t" / ref).read_bytes())


def bucket_dirs(tmp_path, ref):
    """The bucket folders of the state written with manifest ``ref`` (state/<seq>-<r>.json)."""
    d = tmp_path / "log" / "t" / ref.removesuffix(".json")
    return (
        sorted(p.name for p in d.iterdir() if p.name.startswith("_bucket=")) if d.exists() else []
    )


def test_a_small_transaction_rewrites_only_its_buckets(spark, tmp_path, monkeypatch):
    monkeypatch.setattr(state, "ROWS_PER_BUCKET", 40)
    write(tmp_path / "in" / "a.parquet", [{"id": i, "v": 0, "seq": 1} for i in range(5000)])
    e = emit(spark, tmp_path)
    first = e.cp.state
    # 5000 input rows: 128 buckets of ~40 rows, every one of them written
    assert manifest(tmp_path, first)["buckets"] == 128
    assert len(bucket_dirs(tmp_path, first)) == 128
    assert sum(manifest(tmp_path, first)["rows"].values()) == 5000
    write(
        tmp_path / "in" / "b.parquet", [{"id": 7, "v": 1, "seq": 2}, {"id": 4000, "v": 1, "seq": 2}]
    )
    e = emit(spark, tmp_path)
    assert len(bucket_dirs(tmp_path, e.cp.state)) == 2  # only the two touched buckets
    truth = {i: 0 for i in range(5000)} | {7: 1, 4000: 1}
    reader = FeedReader(str(tmp_path / "log"), "t")
    assert collection_of(reader) == as_multiset({"id": i, "v": v} for i, v in truth.items())
    # a third run reads the state back through the manifests: untouched buckets from the
    # first transaction, the two rewritten ones from the second
    write(tmp_path / "in" / "c.parquet", [{"id": 7, "v": 2, "seq": 3}, {"id": 1, "v": 2, "seq": 3}])
    emit(spark, tmp_path)
    truth |= {7: 2, 1: 2}
    reader = FeedReader(str(tmp_path / "log"), "t")
    assert collection_of(reader) == as_multiset({"id": i, "v": v} for i, v in truth.items())
    assert bucket_dirs(tmp_path, first), "buckets still named by the manifests are kept"


def test_a_whole_folder_state_from_before_buckets_is_migrated(spark, tmp_path):
    write(tmp_path / "in" / "a.parquet", [{"id": i, "v": 0, "seq": 1} for i in range(50)])
    e = emit(spark, tmp_path)
    log = FeedLog(str(tmp_path / "log"), "t")
    store = CheckpointStore(log)
    cp = store.latest()
    # rewrite the state as the old layout had it: one folder with every row
    rows = pa.Table.from_pylist([{"id": i, "v": 0} for i in range(50)])
    legacy = tmp_path / "log" / "t" / "state" / str(cp.seq + 1)
    legacy.mkdir(parents=True)
    pq.write_table(rows, legacy / "part-0.parquet")
    store.commit(cp.successor(state=f"state/{cp.seq + 1}"))
    write(tmp_path / "in" / "b.parquet", [{"id": 3, "v": 9, "seq": 2}])
    e = emit(spark, tmp_path)
    assert e.cp.state.endswith(".json")
    truth = {i: 0 for i in range(50)} | {3: 9}
    # every row was rewritten into this transaction's buckets
    folder = tmp_path / "log" / "t" / e.cp.state.removesuffix(".json")
    schema = pa.schema([("id", pa.int64()), ("v", pa.int64())])
    migrated = pa.concat_tables(
        pq.read_table(d, schema=schema) for d in folder.iterdir() if d.name.startswith("_bucket=")
    )
    assert sorted(migrated.to_pylist(), key=lambda r: r["id"]) == [
        {"id": i, "v": v} for i, v in sorted(truth.items())
    ]
    reader = FeedReader(str(tmp_path / "log"), "t")
    assert collection_of(reader) == as_multiset({"id": i, "v": v} for i, v in truth.items())


def test_the_bucket_count_grows_with_the_table(spark, tmp_path, monkeypatch):
    """A state that outgrows its buckets is rewritten whole into more of them, once; the
    transactions after it rewrite only their buckets again. A manifest from before row
    counts has its rows counted from the files."""
    monkeypatch.setattr(state, "ROWS_PER_BUCKET", 4)
    truth: dict[int, int] = {}

    def step(name, rows):
        write(tmp_path / "in" / name, rows)
        truth.update({r["id"]: r["v"] for r in rows})
        e = emit(spark, tmp_path)
        reader = FeedReader(str(tmp_path / "log"), "t")
        assert collection_of(reader) == as_multiset({"id": i, "v": v} for i, v in truth.items())
        m = manifest(tmp_path, e.cp.state)
        assert sum(m["rows"].values()) == len(truth)
        return e.cp.state, m

    ref, m = step("a.parquet", [{"id": i, "v": 0, "seq": 1} for i in range(20)])
    assert m["buckets"] == state.MIN_BUCKETS  # 20 rows: 5 buckets' worth, at least 8
    # 200 more keys: 220 rows over 8 buckets, not rebucketed yet (the load saw 20)
    ref, m = step("b.parquet", [{"id": i, "v": 1, "seq": 2} for i in range(20, 220)])
    assert m["buckets"] == 8
    # as an older tidefeed wrote it: no row counts in the manifest
    path = tmp_path / "log" / "t" / ref
    path.write_bytes(orjson.dumps({k: v for k, v in m.items() if k != "rows"}))
    # 220 > 4 * 4 * 8: the next transaction rewrites everything into 64 buckets
    ref, m = step("c.parquet", [{"id": 3, "v": 2, "seq": 3}])
    assert m["buckets"] == 64
    assert len(bucket_dirs(tmp_path, ref)) == len(m["files"]) > 50  # all in this attempt
    # and then a small transaction is small again
    ref, m = step("d.parquet", [{"id": 100, "v": 3, "seq": 4}])
    assert m["buckets"] == 64 and len(bucket_dirs(tmp_path, ref)) == 1
