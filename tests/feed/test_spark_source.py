"""``format("tidefeed")``: Spark's batch and streaming reads of a feed equal ``tidefeed
inspect`` on the same feed, a streaming query restarted from its checkpoint reads every
update once, and a compacted feed reads as its collection plus the kept times."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from feed.demo.data import generate_bank
from protocol import Updates, get_codec

from ..e2e.helpers import write_parts_at_transactions
from .model import emit_bank

COLUMNS = ("id", "owner", "balance", "active", "note")
BANK = generate_bank(transactions=40, seed=83)


def inspected(log: Path, *args: str) -> Counter:
    """``tidefeed inspect``'s updates as a multiset of (time, diff, record columns...)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "feed.cli.main",
            "inspect",
            "--log",
            str(log),
            "--feed",
            "accounts",
            "--format",
            "ndjson",
            *args,
        ],
        capture_output=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr.decode()
    found: Counter = Counter()
    for m in get_codec("ndjson").decode(out.stdout):
        if isinstance(m, Updates):
            for u in m:
                found[(u.time, u.diff, *(u.record[c] for c in COLUMNS))] += 1
    return found


def reader(spark, log: Path):
    """A new reader each time: a DataFrameReader keeps the options set on it."""
    return spark.read.format("tidefeed").option("log", str(log))


def rows(df) -> Counter:
    return Counter((r["time"], r["diff"], *(r[c] for c in COLUMNS)) for r in df.collect())


@pytest.fixture(scope="module")
def registered(spark):
    import feed

    feed.register_spark(spark)
    return spark


@pytest.fixture()
def two_parts(tmp_path):
    """The bank's events cut into two files at a transaction boundary; only the first is
    in the input folder."""
    staged = tmp_path / "staged"
    staged.mkdir()
    parts = write_parts_at_transactions(staged, BANK.events, 2)
    src = tmp_path / "in"
    src.mkdir()
    parts[0].rename(src / parts[0].name)
    return src, parts[1]


def test_batch_reads_equal_inspect(registered, tmp_path, two_parts):
    spark = registered
    src, rest = two_parts
    rest.rename(src / rest.name)
    log = tmp_path / "log"
    emit_bank(spark, src, log)
    every = inspected(log)
    assert rows(reader(spark, log).load("accounts")) == every and sum(every.values()) > 40
    times = sorted({k[0] for k in every})
    lo, hi = times[5], times[20]
    sliced = reader(spark, log).option("startingTime", lo).option("endingTime", hi)
    sliced = sliced.load("accounts")
    assert rows(sliced) == Counter({k: n for k, n in every.items() if lo <= k[0] < hi})
    # the collection at a time: inspect --at
    at = times[12]
    got = reader(spark, log).option("at", at).load("accounts").collect()
    expect = Counter()
    for (t, diff, *record), n in every.items():
        if t <= at:
            expect[tuple(record)] += diff * n
    assert Counter({tuple(r[c] for c in COLUMNS): r["count"] for r in got}) == +expect
    latest = reader(spark, log).option("at", "latest").load("accounts")
    assert latest.count() == len(BANK.final)


def test_a_restarted_stream_reads_every_update_once(registered, tmp_path, two_parts):
    spark = registered
    src, rest = two_parts
    log, out, ck = tmp_path / "log", tmp_path / "out", tmp_path / "ck"
    emit_bank(spark, src, log)

    def run_stream() -> None:
        q = (
            spark.readStream.format("tidefeed")
            .option("log", str(log))
            .load("accounts")
            .writeStream.format("parquet")
            .option("checkpointLocation", str(ck))
            .trigger(availableNow=True)
            .start(str(out))
        )
        q.awaitTermination(120)
        assert q.exception() is None

    run_stream()
    first = rows(spark.read.parquet(str(out)))
    assert first == inspected(log)
    rest.rename(src / rest.name)
    emit_bank(spark, src, log)  # more commits; the query starts again from its checkpoint
    run_stream()
    every = inspected(log)
    assert rows(spark.read.parquet(str(out))) == every and len(every) > len(first)


def test_a_compacted_feed_reads_as_its_collection_then_the_kept_times(
    registered, tmp_path, two_parts
):
    from feed.log.compaction import compact
    from feed.log.read import open_feed

    spark = registered
    src, rest = two_parts
    rest.rename(src / rest.name)
    log = tmp_path / "log"
    emit_bank(spark, src, log)
    f = open_feed(str(log), "accounts")
    since = sorted(f.counts())[10]
    compact(str(log), "accounts", since)
    assert rows(reader(spark, log).load("accounts")) == inspected(log)
    got = rows(reader(spark, log).option("startingTime", since).load("accounts"))
    assert got == inspected(log, "--after", str(since))
    with pytest.raises(Exception, match="compacted up to time"):
        reader(spark, log).option("startingTime", since - 1).load("accounts").collect()


def test_options_are_checked_with_clear_errors(registered, tmp_path):
    spark = registered
    with pytest.raises(Exception, match="relative path"):
        reader(spark, "some/log").load("accounts").collect()
    with pytest.raises(Exception, match=r"option\(\"log\""):
        spark.read.format("tidefeed").load("accounts").collect()
    with pytest.raises(Exception, match=r"startingTime='soon' is not a time"):
        reader(spark, tmp_path).option("startingTime", "soon").load("x").collect()
    with pytest.raises(Exception, match=r"no feed 'x'"):
        reader(spark, tmp_path).load("x").collect()


def test_pyspark_finds_the_source_by_itself():
    # PySpark registers DefaultSource of top-level pyspark_* modules on every session
    import pyspark_tidefeed
    from feed.spark_source import TidefeedDataSource

    assert pyspark_tidefeed.DefaultSource is TidefeedDataSource
    assert TidefeedDataSource.name() == "tidefeed"


def test_a_new_schema_version_reads_whole_and_ends_a_running_stream_at_it(registered, tmp_path):
    """spark.read reads every time through the newest version; a stream started on the
    older schema reads up to the new version's time, then asks for a restart, and the
    restarted query reads the rest with the new schema."""
    from feed.log.reader import FeedReader
    from feed.spark_source import TidefeedDataSource

    from .test_debezium import CONNECT_COLUMNS, end, event, open_emitter, snapshot, wrapped
    from .test_debezium import write as write_lines

    spark = registered
    src, log = tmp_path / "in", tmp_path / "log"
    write_lines(src, "part-0.json", [wrapped(e) for e in snapshot(2)])
    e = open_emitter(spark, tmp_path)
    e.run()
    source = TidefeedDataSource({"log": str(log), "path": "t"})
    stream = source.streamReader(source.schema())
    more = [*CONNECT_COLUMNS, {"field": "qty", "type": "int64", "optional": True}]
    row = {"id": 5, "owner": "n", "doc": None, "qty": 2**40}
    write_lines(src, "part-1.json", [wrapped(event("c", row, 400, xid=8, order=1), more)])
    write_lines(src, "part-2.json", [end(8, 410, {"accounts": 1})])
    e.run()
    e.close()
    feed = FeedReader(str(log), "t")
    version = feed.info.history()[1].start
    assert feed.frontier == version + 2
    # a batch read: every record through the newest schema, the new column null before
    got = {r["id"]: r["qty"] for r in reader(spark, log).option("at", "latest").load("t").collect()}
    assert got == {0: None, 1: None, 5: 2**40}
    # the stream on the older schema stops short of the version, then asks for a restart
    assert stream.latestOffset({"time": 0}) == {"time": version}
    with pytest.raises(ValueError, match="Restart the query"):
        stream.latestOffset({"time": version})
    restarted = TidefeedDataSource({"log": str(log), "path": "t"})
    assert "qty" in restarted.schema().fieldNames()
    assert restarted.streamReader(restarted.schema()).latestOffset({"time": version}) == {
        "time": feed.frontier
    }


def test_workers_that_cannot_import_tidefeed_are_named_before_any_read(spark, tmp_path):
    """A session whose Python workers are another interpreter (a plain SparkSession in a
    virtual environment that is not activated): register_spark says so, naming the
    interpreter and the fix. The shared session's workers are this Python: no warning."""
    import sys
    import warnings
    from types import SimpleNamespace

    import feed
    from feed.spark_source import worker_python_problem

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        feed.register_spark(spark)  # this Python: nothing to say
    # a real interpreter that has no tidefeed: a fresh virtual environment
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "v")], check=True)
    other = str(tmp_path / "v" / "bin" / "python")
    conf = {"spark.pyspark.python": other}
    elsewhere = SimpleNamespace(
        sparkContext=SimpleNamespace(master="local[2]"),
        conf=SimpleNamespace(get=lambda key, default=None: conf.get(key, default)),
    )
    problem = worker_python_problem(elsewhere)
    assert problem is not None
    assert other in problem and f"PYSPARK_PYTHON={sys.executable}" in problem
    on_a_cluster = SimpleNamespace(sparkContext=SimpleNamespace(master="spark://m:7077"))
    assert worker_python_problem(on_a_cluster) is None  # (its workers are other machines)
