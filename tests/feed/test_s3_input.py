"""Input in an S3 bucket: listed and sampled through pyarrow, named for Spark as s3a://.

The bucket is served by moto's S3 server on 127.0.0.1 (a real S3 API over HTTP, as MinIO
or AWS would answer pyarrow). A small transaction's input is read through pyarrow by the
driver engine, and the feed is made. Spark's own readers cannot read s3a:// here (the
pyspark wheel has no hadoop-aws jars): a transaction in Spark reads the objects in its
tasks through pyarrow, and a log in the bucket is written, and its keyed state read
back, the same way.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pyarrow.fs as pafs
import pytest
from moto import server as moto_server

from feed.demo.data import ACCOUNTS_SCHEMA
from feed.sources.debezium_schema import debezium_table
from feed.sources.file_text import input_lines
from feed.sources.inputs import (
    InputWindow,
    edge_txn,
    input_bytes,
    list_files,
    spark_file_path,
    spark_input,
)
from feed.sources.registry import KINDS
from protocol import SourceError

ROOT = Path(__file__).resolve().parents[2]


def _event(i: int, txid: int) -> bytes:
    after = {"id": i, "owner": f"o{i}", "balance": i}
    source = {"lsn": 100 + i, "txId": txid, "schema": "public", "table": "accounts"}
    return orjson.dumps({"before": None, "after": after, "op": "c", "source": source})


@pytest.fixture(scope="module")
def bucket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """The URI of a folder in a bucket holding three Debezium files (and two that do not
    count: a hidden one and one being written), and the environment that reaches it."""
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    mp = pytest.MonkeyPatch()
    for k, v in env.items():
        mp.setenv(k, v)
    uri = f"s3://inbox/cdc?endpoint_override={host}:{port}&scheme=http&region=us-east-1"
    fs, _ = pafs.FileSystem.from_uri(uri + "&allow_bucket_creation=true")
    fs.create_dir("inbox")
    files = {
        "b-002.json": [_event(3, 11), _event(4, 12)],
        "a-001.json": [b"null", _event(1, 10), _event(2, 10), b"null"],
        "c-003.json": [_event(5, 12)],
        ".c-004.json": [_event(6, 13)],
        "_tmp-005.json": [_event(7, 13)],
    }
    for name, lines in files.items():
        with fs.open_output_stream(f"inbox/cdc/{name}") as f:
            f.write(b"\n".join(lines) + b"\n")
    try:
        yield uri, env
    finally:
        mp.undo()
        server.stop()


def test_a_prefix_is_listed_in_name_order_and_its_files_read_through_pyarrow(bucket):
    uri, _ = bucket
    files = list_files(uri)
    assert files == [f"s3://inbox/cdc/{n}" for n in ("a-001.json", "b-002.json", "c-003.json")]
    assert [orjson.loads(x) for x in input_lines(files[1]) if x] == [
        orjson.loads(_event(3, 11)),
        orjson.loads(_event(4, 12)),
    ]
    # the first and last source transaction of a file (tombstones passed over)
    assert edge_txn(KINDS["debezium"], files[0], last=False) == "10"
    assert edge_txn(KINDS["debezium"], files[0], last=True) == "10"
    assert edge_txn(KINDS["debezium"], files[1], last=False) == "11"
    assert edge_txn(KINDS["debezium"], files[1], last=True) == "12"
    assert debezium_table(files) == "public.accounts"
    assert input_bytes(files) == sum(len(b"\n".join(x)) + 1 for x in _lines_of(files))
    # a window never ends inside a source transaction: b ends in 12, which c goes on with
    assert InputWindow.first(files, 2, kind=KINDS["debezium"], whole_txns=True) == files
    assert InputWindow(uri, None).pending({"file": "a-001.json"}) == files[1:]


def _lines_of(files: list[str]) -> list[list[bytes]]:
    return [[x for x in input_lines(f) if x] for f in files]


def test_spark_reads_s3_as_s3a_under_the_name_its_file_path_shows():
    assert spark_input("s3://inbox/cdc/a 1.json") == "s3a://inbox/cdc/a 1.json"
    assert spark_file_path("s3://inbox/cdc/a 1.json") == "s3a://inbox/cdc/a%201.json"
    assert spark_file_path("/data/in x/a.json") == "/data/in%20x/a.json"
    assert spark_input("file:///data/a.json") == "/data/a.json"


def test_a_missing_prefix_is_an_error_naming_it(bucket):
    uri, _ = bucket
    missing = uri.replace("inbox/cdc", "inbox/nothing-here")
    with pytest.raises(SourceError, match="inbox/nothing-here"):
        list_files(missing)


def _emit(
    uri: str, env: dict[str, str], tmp_path: Path, *extra: str, kind: str = "debezium"
) -> Any:
    tmp_path.mkdir(exist_ok=True)
    schema = tmp_path / "schema.avsc"
    schema.write_bytes(orjson.dumps(ACCOUNTS_SCHEMA))
    return subprocess.run(
        [
            *(sys.executable, "-m", "feed.cli.main", "emit", "--source", f"{kind}:{uri}"),
            *("--feed", "t", "--log", str(tmp_path / "log"), "--key", "id"),
            *("--schema", str(schema), *extra),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**_base_env(), **env},
    )


@pytest.mark.process
def test_a_small_emit_from_s3_reads_through_pyarrow_without_hadoop_aws(bucket, tmp_path):
    """The driver engine reads a small transaction's input itself: no Spark, no s3a."""
    from feed.log.reader import FeedReader

    from .model import as_multiset, collection_of

    uri, env = bucket
    run = _emit(uri, env, tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "spark 4" not in run.stderr  # (Spark's start-up line: it never started)
    rows = [
        {"id": i, "owner": f"o{i}", "balance": i, "active": None, "note": None} for i in range(1, 6)
    ]
    assert collection_of(FeedReader(str(tmp_path / "log"), "t")) == as_multiset(rows)


@pytest.mark.process  # two tidefeed processes, one with its own JVM
def test_an_emit_from_s3_through_spark_reads_in_its_tasks_without_hadoop_aws(bucket, tmp_path):
    """Forced through Spark, the same input gives the same feed: Spark's tasks read the
    objects through pyarrow (feed/sources/store_lines.py), not Spark's s3a:// reader."""
    from feed.log.reader import FeedReader

    uri, env = bucket
    driver = _emit(uri, env, tmp_path / "driver", "--clock", "logical")
    spark = _emit(uri, env, tmp_path / "spark", "--clock", "logical", "--driver-txn-bytes", "0")
    assert driver.returncode == 0 and spark.returncode == 0, spark.stderr[-2000:]
    assert "spark 4" in spark.stderr and " driver=" not in spark.stderr  # (in Spark)

    def feed(log: Path) -> dict[int, list[Any]]:
        reader = FeedReader(str(log), "t")
        return {t: sorted(map(repr, reader.table(t).to_pylist())) for t in reader.times()}

    assert feed(tmp_path / "spark" / "log") == feed(tmp_path / "driver" / "log") != {}


@pytest.mark.process  # a tidefeed process with its own JVM
def test_a_parquet_input_in_s3_without_hadoop_aws_says_so_and_commits_nothing(bucket, tmp_path):
    """Parquet input is still read by Spark's own reader, as s3a://: without the
    hadoop-aws jars that is one line saying what to install, and nothing committed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    uri, env = bucket
    fs, _ = pafs.FileSystem.from_uri(uri)
    rows = pa.table({"id": [1, 2], "owner": ["a", "b"], "balance": [1, 2]})
    pq.write_table(rows, "inbox/parquet/part-1.parquet", filesystem=fs)
    log = tmp_path / "log"
    source = uri.replace("inbox/cdc", "inbox/parquet")
    run = _emit(source, env, tmp_path, "--order", "balance", kind="upsert")
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert "S3AFileSystem" in last and "hadoop-aws" in last, run.stderr[-2000:]
    # the epoch's claim is all the log holds: no time, no consumed file
    commits = sorted((log / "t" / "_commits").glob("*.json"))
    assert len(commits) == 1
    cp = orjson.loads(commits[0].read_bytes())
    assert cp["progress"]["counts"] == [] and not cp.get("source", {}).get("file")


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}


def test_spark_tasks_write_grouped_files_into_the_store(bucket, spark):
    """The segment and state writer's tasks reach an s3:// log through pyarrow, with the
    options (and here the credentials) of the log's URI."""
    import pyarrow.parquet as pq

    from feed.txn.grouped import strays, write_groups

    uri, _ = bucket
    query = uri.split("?", 1)[1]
    store = f"s3://test:test@inbox/log?{query}"
    rows = [(i % 3, i) for i in range(30)]
    df = spark.createDataFrame(rows, "t long, id long").repartition(2)
    written = write_groups(df, "t", store, "inbox/log/_staging/1", "time=")
    fs, _ = pafs.FileSystem.from_uri(store)
    got: dict[int, list[int]] = {}
    for g, path, n in written:
        assert path.startswith(f"inbox/log/_staging/1/time={g}/")
        ids = pq.read_table(path, filesystem=fs).column("id").to_pylist()
        assert len(ids) == n
        got.setdefault(g, []).extend(ids)
    assert {g: sorted(v) for g, v in got.items()} == {
        g: [i for t, i in rows if t == g] for g in range(3)
    }
    assert strays(fs, "inbox/log/_staging/1", written) == []


def _keyed_emit(spark: Any, src: Path, log: str, engines: Any = None, **extra: Any) -> list[Any]:
    """A batch emit of feed ``t`` (keyed on ``id``, a file per transaction) from the
    Debezium files in ``src`` into ``log``; its reports."""
    from feed.emit.emitter import Emitter, EmitterConfig
    from feed.txn.engine import ENGINES

    cfg = EmitterConfig(
        source_kind="debezium",
        source_path=str(src),
        feed="t",
        log=log,
        key=("id",),
        schema=ACCOUNTS_SCHEMA,
        clock="logical",
        max_files_per_txn=1,
        **extra,
    )
    e = Emitter(cfg, spark=spark, engines=engines or ENGINES)
    e.open()
    try:
        return e.run()
    finally:
        e.close()


def test_a_keyed_feed_in_an_s3_log_takes_small_transactions_on_the_driver(bucket, spark, tmp_path):
    """A log in the store: the first transaction is Spark's (its input is over
    ``driver_txn_bytes``; its tasks write through pyarrow), the next one is computed on
    the driver (feed/txn/driver.py), which reads the state's buckets Spark wrote and
    writes new ones and the segments in the store; the feed reads back as the table."""
    from feed.log.reader import FeedReader

    uri, _ = bucket
    query = uri.split("?", 1)[1]
    log = f"s3://test:test@inbox/log-driver?{query}"
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.json").write_bytes(b"\n".join(_event(i, 10) for i in range(1, 40)) + b"\n")
    update = {"id": 7, "owner": "o7", "balance": 700}
    gone = {"id": 8, "owner": "o8", "balance": 8}
    later = [
        {"before": None, "after": update, "op": "u", "source": {"lsn": 500, "txId": 20}},
        {"before": gone, "after": None, "op": "d", "source": {"lsn": 501, "txId": 20}},
    ]
    (src / "b.json").write_bytes(b"\n".join(orjson.dumps(e) for e in later) + b"\n")
    reports = _keyed_emit(spark, src, log, driver_txn_bytes=(src / "b.json").stat().st_size)
    assert ["driver" in r.seconds for r in reports] == [False, True]
    rows = FeedReader(log, "t").snapshot().to_pylist()
    table = {r["id"]: (r["balance"], r["count"]) for r in rows}
    assert table == {i: (700 if i == 7 else i, 1) for i in range(1, 40) if i != 8}


def test_a_keyed_feed_in_an_s3_log_reads_its_state_back_in_spark_without_hadoop_aws(
    bucket, spark, tmp_path
):
    """Every transaction in Spark, the log in the store: the second and third read the
    keyed state the first wrote. Spark's own reader would need s3a:// (hadoop-aws, not in
    the pyspark wheel); the tasks read the state's files through pyarrow instead."""
    from feed.log.reader import FeedReader
    from feed.txn.engine import SPARK

    uri, _ = bucket
    query = uri.split("?", 1)[1]
    log = f"s3://test:test@inbox/log-spark?{query}"
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.json").write_bytes(b"\n".join(_event(i, 10) for i in range(1, 20)) + b"\n")
    row = {"id": 7, "owner": "o7", "balance": 7}
    changes = [
        [
            {"before": row, "after": {**row, "balance": 700}, "op": "u"},
            {"before": {"id": 8, "owner": "o8", "balance": 8}, "after": None, "op": "d"},
        ],
        [
            {"before": {**row, "balance": 700}, "after": {**row, "balance": 70}, "op": "u"},
            {"before": {"id": 99, "owner": "x", "balance": 0}, "after": None, "op": "d"},
        ],
    ]
    for n, events in enumerate(changes):
        source = {"lsn": 500 + n, "txId": 20 + n}
        lines = [orjson.dumps({**e, "source": source}) for e in events]
        (src / f"{'bc'[n]}.json").write_bytes(b"\n".join(lines) + b"\n")
    reports = _keyed_emit(spark, src, log, engines=(SPARK,))
    assert [r.updates for r in reports] == [19, 3, 2]  # (an update is two, a delete one)
    rows = FeedReader(log, "t").snapshot().to_pylist()
    table = {r["id"]: (r["balance"], r["count"]) for r in rows}
    assert table == {i: (70 if i == 7 else i, 1) for i in range(1, 20) if i != 8}
    # the delete of a key the feed never held is quarantined, in the bucket too
    assert [r.bad_rows for r in reports] == [0, 0, 1]
    fs, root = pafs.FileSystem.from_uri(log)
    found = fs.get_file_info(pafs.FileSelector(f"{root}/t/quarantine/4", recursive=True))
    kept = [
        orjson.loads(line)
        for i in found
        if i.path.endswith(".json")
        for line in fs.open_input_stream(i.path).read().splitlines()
    ]
    assert [(k["file"].rsplit("/", 1)[-1], k["raw"][:30]) for k in kept] == [
        ("c.json", orjson.dumps(changes[1][1])[:30].decode())
    ]
    assert kept[0]["reason"] == 'delete of key {"id":99} that is not present'
