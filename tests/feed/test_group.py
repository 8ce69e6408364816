"""Groups of feeds (feed/emit/group.py): the tables of one Debezium folder in one time domain,
on hand-written events. tests/e2e/test_postgres_bank.py runs a real PostgreSQL bank."""

from __future__ import annotations

import os
import subprocess

import orjson
import pytest

from feed.emit.emitter import Emitter, EmitterConfig
from feed.emit.group import GroupEmitter
from feed.log.reader import FeedReader
from feed.txn.engine import ENGINES, SPARK
from protocol import CheckpointError, SourceError, check_messages

from ..e2e.helpers import TIDEFEED
from .model import as_multiset, collection_of
from .test_debezium import CONNECT_COLUMNS, SCHEMA, end, event, wrapped, write

FEEDS = ("accounts", "transfers")


def configs(tmp_path, **kw):
    return [
        EmitterConfig(
            source_kind="debezium",
            source_path=str(tmp_path / "in"),
            feed=f,
            log=str(tmp_path / "log"),
            key=("id",),
            schema=SCHEMA,
            table=f"public.{f}",
            clock="logical",
            granularity="transaction",
            **kw,
        )
        for f in FEEDS
    ]


def open_group(spark, tmp_path, engines=ENGINES, **kw):
    g = GroupEmitter(configs(tmp_path, **kw), engines=engines)
    for m in g.members:
        m._spark = spark
    g.open()
    return g


def row(i, owner):
    return {"id": i, "owner": owner, "doc": None}


def rows(*items):
    return as_multiset(row(i, o) for i, o in items)


def last_part(src):
    write(
        src,
        "part-3.json",
        [
            event("c", row(4, "t4"), 501, xid=14, order=2, commit=405, table="transfers"),
            end(14, 505, {"accounts": 1, "transfers": 1}),
        ],
    )


def bank_input(src, *, whole=True):
    """A snapshot of both tables, then transactions touching both, one, the other, and a
    last one whose events straddle two files (its END in the second)."""
    write(
        src,
        "part-0.json",
        [
            event("r", row(1, "a1"), 100, xid=1),
            event("r", row(2, "a2"), 100, xid=1),
            event("r", row(1, "t1"), 100, xid=1, table="transfers"),
        ],
    )
    write(
        src,
        "part-1.json",
        [
            event("u", row(1, "a1+"), 200, xid=11, order=1, commit=150, before=row(1, "a1")),
            event("c", row(2, "t2"), 201, xid=11, order=2, commit=150, table="transfers"),
            end(11, 205, {"accounts": 1, "transfers": 1}),
            event("d", row(2, "a2"), 300, xid=12, order=1, commit=205),
            end(12, 305, {"accounts": 1}),
            event("c", row(3, "t3"), 400, xid=13, order=1, commit=305, table="transfers"),
            end(13, 405, {"transfers": 1}),
        ],
    )
    write(
        src,
        "part-2.json",
        [event("c", row(4, "a4"), 500, xid=14, order=1, commit=405)],
    )
    if whole:
        last_part(src)


#: each feed's collection after each time (1: the snapshot, 2..5: transactions 11..14)
TRUTH = {
    "accounts": {
        1: rows((1, "a1"), (2, "a2")),
        2: rows((1, "a1+"), (2, "a2")),
        3: rows((1, "a1+")),
        4: rows((1, "a1+")),
        5: rows((1, "a1+"), (4, "a4")),
    },
    "transfers": {
        1: rows((1, "t1")),
        2: rows((1, "t1"), (2, "t2")),
        3: rows((1, "t1"), (2, "t2")),
        4: rows((1, "t1"), (2, "t2"), (3, "t3")),
        5: rows((1, "t1"), (2, "t2"), (3, "t3"), (4, "t4")),
    },
}


def assert_group_log(log, upto, truth=TRUTH):
    for feed in FEEDS:
        reader = FeedReader(str(log), feed)
        assert reader.frontier == upto + 1, feed
        assert check_messages(reader.messages(), non_negative=True, key=["id"]) == []
        for t in range(1, upto + 1):
            assert collection_of(reader, at=t) == truth[feed][t], (feed, t)


@pytest.mark.parametrize("driver", [True, False], ids=["driver", "spark"])
def test_a_group_gives_each_source_transaction_one_time_in_every_feed(
    spark, tmp_path, driver, caplog
):
    """The same history through the driver engine's group path (feed/txn/driver.py:
    run_group) and through Spark's alone: the same feeds, the same truth."""
    caplog.set_level("INFO", logger="tidefeed")
    src = tmp_path / "in"
    bank_input(src, whole=False)
    g = open_group(spark, tmp_path, engines=ENGINES if driver else (SPARK,), max_files_per_txn=1)
    reports = []
    # the first file alone: the snapshot of both tables, one time in both feeds
    reports.append(g.step())
    assert reports[-1] is not None
    assert_group_log(tmp_path / "log", 1)
    # the rest: a transaction of each kind; the last one's accounts event is held back
    # (its END is in the next file) in both feeds, though transfers has nothing of it yet
    reports.append(g.step())
    assert_group_log(tmp_path / "log", 4)
    assert g.step() is None  # part-2: transaction 14 is incomplete, in both feeds
    assert_group_log(tmp_path / "log", 4)
    assert g.held_back() == [str(src / "part-2.json")]
    last_part(src)
    reports += g.run()
    assert_group_log(tmp_path / "log", 5)
    assert g.pending_files() == []
    # complete in accounts, not in transfers (its event comes later): held in both, with
    # the accounts-only transaction delivered after it
    write(
        src,
        "part-4.json",
        [
            event("u", row(4, "a4+"), 600, xid=15, order=1, commit=505, before=row(4, "a4")),
            end(15, 605, {"accounts": 1, "transfers": 1}),
            event("d", row(1, "a1+"), 700, xid=16, order=1, commit=605),
            end(16, 705, {"accounts": 1}),
        ],
    )
    reports += g.run()
    assert_group_log(tmp_path / "log", 5)
    write(
        src,
        "part-5.json",
        [event("d", row(1, "t1"), 601, xid=15, order=2, commit=505, table="transfers")],
    )
    reports += g.run()
    g.close()
    # every transaction was the engines' to compute: the driver's when it is offered
    assert len(reports) == 4
    assert all(("driver" in r.seconds) == driver for r in reports), [r.seconds for r in reports]
    # each feed's own line says where its part was computed, and how long it took
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("feed ")]
    member = [m for m in lines if " txn " in m and "input_rows=" in m]
    assert len(member) == 2 * len(reports), lines
    stage = " driver=" if driver else " write="
    assert all(stage in m for m in member), member
    later = rows((2, "t2"), (3, "t3"), (4, "t4"))
    truth = {
        "accounts": {**TRUTH["accounts"], 6: rows((1, "a1+"), (4, "a4+")), 7: rows((4, "a4+"))},
        "transfers": {**TRUTH["transfers"], 6: later, 7: later},
    }
    assert_group_log(tmp_path / "log", 7, truth)
    assert g.pending_files() == []
    # the group's commit point names both feeds' checkpoints
    group_dir = tmp_path / "log" / "_groups" / "accounts+transfers"
    last = orjson.loads(sorted(group_dir.glob("*.json"))[-1].read_bytes())
    assert sorted(last["members"]) == list(FEEDS)
    assert {m["upper"] for m in last["members"].values()} == {8}


def test_a_table_of_a_group_that_changes_shape_takes_a_version_at_a_time_of_its_own(
    spark, tmp_path
):
    """accounts gains a column with a default between two transactions that touch both
    tables: the transaction before is committed, then one time in both feeds for the
    ALTER (accounts' rows rewritten with the default, transfers empty), then the
    transaction after through the new version; the feeds keep one time domain."""
    more = [*CONNECT_COLUMNS, {"field": "qty", "type": "int64", "optional": True, "default": 7}]
    src = tmp_path / "in"
    write(
        src,
        "part-0.json",
        [
            wrapped(event("r", row(1, "a1"), 100, xid=1)),
            wrapped(event("r", row(1, "t1"), 100, xid=1, table="transfers")),
            wrapped(
                event("u", row(1, "a1+"), 200, xid=11, order=1, commit=150, before=row(1, "a1"))
            ),
            wrapped(event("c", row(2, "t2"), 201, xid=11, order=2, commit=150, table="transfers")),
            end(11, 205, {"accounts": 1, "transfers": 1}),
            wrapped(event("c", {**row(2, "a2"), "qty": 3}, 300, xid=12, order=1, commit=205), more),
            wrapped(event("c", row(3, "t3"), 301, xid=12, order=2, commit=205, table="transfers")),
            end(12, 305, {"accounts": 1, "transfers": 1}),
        ],
    )
    g = open_group(spark, tmp_path)
    g.run()
    g.close()
    accounts = FeedReader(str(tmp_path / "log"), "accounts")
    transfers = FeedReader(str(tmp_path / "log"), "transfers")
    # the snapshot (1), transaction 11 (2), the ALTER (3), transaction 12 (4)
    assert accounts.frontier == transfers.frontier == 5
    assert [(v.start, v.added) for v in accounts.info.history()] == [(0, ()), (3, ("qty",))]
    assert len(transfers.info.history()) == 1
    assert accounts.counts() == {1: 1, 2: 2, 3: 2, 4: 1}  # at 3: -a1+ +a1+ with qty 7
    assert transfers.counts() == {1: 1, 2: 1, 4: 1}
    for reader in (accounts, transfers):
        assert check_messages(reader.messages(), non_negative=True, key=["id"]) == []
    at = {t: {r["id"]: r.get("qty") for r in accounts.snapshot(t).to_pylist()} for t in (2, 3, 4)}
    assert at == {2: {1: None}, 3: {1: 7}, 4: {1: 7, 2: 3}}
    assert sorted(r["id"] for r in transfers.snapshot(4).to_pylist()) == [1, 2, 3]


def test_a_feed_of_a_group_is_not_emitted_alone(spark, tmp_path):
    src = tmp_path / "in"
    bank_input(src)
    g = open_group(spark, tmp_path)
    g.run()
    g.close()
    alone = Emitter(configs(tmp_path)[0], spark=spark)
    with pytest.raises(SourceError, match="group accounts,transfers"):
        alone.open()
    # nor in a group of other feeds, nor in the group in another order
    other = GroupEmitter(list(reversed(configs(tmp_path))))
    with pytest.raises((SourceError, CheckpointError)):
        other.open()
    assert_group_log(tmp_path / "log", 5)


def test_cli_refuses_a_group_it_cannot_make(tmp_path):
    src = tmp_path / "in"
    bank_input(src)
    cases = [
        (["--table", "public.a,public.b", "--feed", "a"], "one feed name per table"),
        (["--table", "public.a,public.a", "--feed", "a,b"], "each name once"),
        (["--table", "public.a,public.b", "--feed", "a,b", "--granularity", "batch"], "batch"),
        (
            ["--table", "public.a,public.b", "--feed", "a,b", "--push", "http://127.0.0.1:1/"],
            "serve",
        ),
    ]
    for extra, said in cases:
        out = subprocess.run(
            [
                *TIDEFEED,
                "emit",
                "--source",
                f"debezium:{src}",
                "--log",
                str(tmp_path / "log"),
                *extra,
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        assert out.returncode != 0, extra
        assert said in out.stderr, (extra, out.stderr)
    assert not (tmp_path / "log").exists()


@pytest.mark.slow
@pytest.mark.parametrize("at", ["after_group_commit", "between_feed_commits"])
def test_sigkill_inside_the_group_commit_is_finished_at_the_next_start(tmp_path, at):
    """A real process killed between the group's commit point and its feeds'
    checkpoints: the next start rolls the missing checkpoints forward, and no reader ever
    saw one feed's frontier ahead of the other's data."""
    src = tmp_path / "in"
    bank_input(src)
    log = tmp_path / "log"
    cmd = [
        *TIDEFEED,
        "emit",
        "--source",
        f"debezium:{src}",
        "--log",
        str(log),
        "--table",
        "public.accounts,public.transfers",
        "--feed",
        "accounts,transfers",
        "--key",
        "id",
        "--clock",
        "logical",
        "--schema",
        str(tmp_path / "schema.avsc"),
    ]
    (tmp_path / "schema.avsc").write_bytes(orjson.dumps(SCHEMA))
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "TIDEFEED_TEST_KILL_AT": f"{at}:1"}
    killed = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr[-2000:]
    frontiers = {f: FeedReader(str(log), f).frontier for f in FEEDS}
    # the accounts checkpoint may be written (between_feed_commits), transfers' is not
    assert frontiers["transfers"] == 0
    env.pop("TIDEFEED_TEST_KILL_AT")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "finished group commit" in done.stderr
    assert_group_log(log, 5)
