"""Real PostgreSQL -> real Debezium (``tidefeed capture postgres``) -> ``tidefeed emit``.

A throwaway cluster on 127.0.0.1 runs a workload of transactions with every shape a real
table sees (initial snapshot, multi-row transactions, deletes with tombstones, delete and
re-insert, a primary-key update, a change undone inside its transaction, NULLs, unicode,
numeric/timestamp/timestamptz/date/uuid/json/time columns, an unchanged TOASTed column
under REPLICA IDENTITY DEFAULT, a second table with REPLICA IDENTITY FULL captured into
the same folder). The capture is SIGKILLed inside a large transaction and restarted, so
Debezium delivers part of it twice; later its offsets are lost while it is down, so it
snapshots both tables again, and the feed moves to that snapshot in one time. The feed
must equal ``SELECT * FROM`` the table after each PostgreSQL transaction, one time per
transaction (the transactions made while the capture was down: one time, the snapshot's),
in batch and in ``--follow``.

Skipped only where PostgreSQL or the postgres extra is absent; ``.ci/run`` sets
``TIDEFEED_REQUIRE_POSTGRES=1``, which turns that skip into a failure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from feed.demo.pgtemp import (
    TempPostgres,
    feed_multiset,
    feed_multisets,
    find_pg_bin,
    table_multiset,
)
from feed.log.reader import FeedReader
from protocol import check_messages

from .helpers import start

# a real cluster, a JVM for Debezium and two Spark emitters: generous on a loaded machine
pytestmark = [pytest.mark.slow, pytest.mark.realsource, pytest.mark.timeout(900)]


def _require() -> None:
    missing = []
    if find_pg_bin() is None:
        missing.append("PostgreSQL (apt-get install postgresql)")
    try:
        import psycopg2  # noqa: F401
        import pydbzengine  # noqa: F401
    except ImportError as e:
        missing.append(f"the postgres extra ({e.name})")
    if missing:
        reason = "needs " + " and ".join(missing)
        if os.environ.get("TIDEFEED_REQUIRE_POSTGRES"):
            pytest.fail(reason + " (TIDEFEED_REQUIRE_POSTGRES is set)")
        pytest.skip(reason)


SCHEMA_SQL = """
CREATE TABLE accounts (
    id bigint PRIMARY KEY,
    owner text NOT NULL,
    balance numeric(12, 2),
    rate numeric,
    opened timestamptz,
    seen timestamp,
    born date,
    ref uuid,
    meta jsonb,
    at_time time,
    active boolean,
    doc text
);
ALTER TABLE accounts REPLICA IDENTITY DEFAULT;
CREATE TABLE ledger (id int PRIMARY KEY, account bigint, amount numeric(12, 2), note text);
ALTER TABLE ledger REPLICA IDENTITY FULL;
"""

# random hex does not compress to below the TOAST threshold: the value is stored out of line
BIG_DOC = "(SELECT string_agg(md5(random()::text || g::text), '') FROM generate_series(1, 300) g)"


def _row_sql(i: int) -> str:
    return (
        f"({i}, 'owner {i}', {i * 10.25}, {i}.{i:03d}1, "
        f"'2024-03-{1 + i % 28:02d} 10:{i % 60:02d}:00.123456+02', "
        f"'2024-03-{1 + i % 28:02d} 11:00:00.5', '2000-01-01'::date + {i}, "
        f'gen_random_uuid(), \'{{"n": {i}, "tags": ["a"]}}\', \'12:34:56.{i:06d}\', '
        f"{'true' if i % 2 else 'NULL'}, "
        f"{BIG_DOC if i % 5 == 0 else repr(f'doc {i}')})"
    )


# each entry is one PostgreSQL transaction on accounts (and maybe ledger)
WORKLOAD = [
    # multi-row insert with NULLs and unicode
    [
        f"INSERT INTO accounts VALUES {_row_sql(101)}, {_row_sql(102)}",
        "INSERT INTO accounts (id, owner) VALUES (103, 'Zoë 😀 – ünïcödé')",  # noqa: RUF001
    ],
    # updates of several rows, and the second table in the same transaction
    [
        "UPDATE accounts SET balance = balance + 1.01 WHERE id BETWEEN 1 AND 5",
        "INSERT INTO ledger VALUES (1, 1, 1.01, 'deposit'), (2, 2, 1.01, NULL)",
    ],
    # deletes (tombstones follow each)
    ["DELETE FROM accounts WHERE id IN (6, 7)"],
    # delete and re-insert of the same key
    ["DELETE FROM accounts WHERE id = 8", f"INSERT INTO accounts VALUES {_row_sql(8)}"],
    # a primary-key update
    ["UPDATE accounts SET id = 1000 WHERE id = 9"],
    # a change undone inside its transaction
    [
        "UPDATE accounts SET owner = 'temporary' WHERE id = 11",
        "UPDATE accounts SET owner = 'owner 11' WHERE id = 11",
    ],
    # an unchanged TOASTed column (id 10 and 15 hold out-of-line docs)
    ["UPDATE accounts SET balance = 0.5, active = false WHERE id IN (10, 15)"],
    # NULLs and negative numbers
    ["UPDATE accounts SET rate = -0.000001, meta = NULL, seen = NULL WHERE id = 12"],
]
BIG = ["UPDATE accounts SET balance = balance + 1 WHERE id < 1000"] * 7
AFTER_CRASH = [
    ["UPDATE accounts SET doc = 'short now' WHERE id = 10"],
    ["UPDATE ledger SET note = 'changed' WHERE id = 1", "DELETE FROM ledger WHERE id = 2"],
    [f"INSERT INTO accounts VALUES {_row_sql(999)}"],
]
# while the capture is down with its offsets lost: Debezium snapshots again on restart,
# and the feed moves to that snapshot in one time (a row gone, one new, one changed)
WHILE_DOWN = [
    ["DELETE FROM accounts WHERE id = 3", f"INSERT INTO accounts VALUES {_row_sql(777)}"],
    ["UPDATE accounts SET owner = 'while down' WHERE id = 4", "DELETE FROM ledger WHERE id = 1"],
]
AFTER_RESNAPSHOT = [["UPDATE accounts SET owner = 'streamed again' WHERE id = 777"]]


class Capture:
    def __init__(
        self,
        pg: TempPostgres,
        out: Path,
        logs: Path,
        tables: str = "public.accounts,public.ledger",
    ) -> None:
        self.pg, self.out, self.logs, self.tables = pg, out, logs, tables
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *debezium: str) -> None:
        """Start the capture; ``debezium``: more ``KEY=VALUE`` connector settings."""
        more = [a for kv in debezium for a in ("--debezium", kv)]
        self.proc = start(
            "capture",
            "postgres",
            "--dsn",
            self.pg.dsn,
            "--table",
            self.tables,
            "--out",
            str(self.out),
            # small batches: a large transaction spans many files, so a kill lands inside it
            "--debezium",
            "max.batch.size=10",
            *more,
            log=self.logs / "capture.log",
        )

    def files(self) -> list[Path]:
        return sorted(self.out.glob("events-*.json"))

    def text(self) -> str:
        return "".join(p.read_text() for p in self.files())

    def wait_for(self, needle: str, timeout: float = 120, times: int = 1) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.out.exists() and self.text().count(needle) >= times:
                return
            assert self.proc is not None and self.proc.poll() is None, (
                self.logs / "capture.log"
            ).read_text()[-3000:]
            time.sleep(0.3)
        raise TimeoutError(f"capture never wrote {needle!r}")

    def wait_for_offsets(self, needle: bytes, timeout: float = 120) -> None:
        """Until Debezium's flushed offsets hold ``needle``."""
        path = self.out / "_offsets.dat"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists() and needle in path.read_bytes():
                return
            time.sleep(0.2)
        raise TimeoutError(f"Debezium's offsets never held {needle!r}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)

    def finish(self, ends: int) -> None:
        """Once ``ends`` END records are written (and a moment for the batch holding the
        last), stop the capture."""
        self.wait_for('"status":"END"', times=ends)
        time.sleep(1)
        assert self.stop() in (0, 143)


@contextlib.contextmanager
def cluster_and_capture(out: Path, logs: Path, tables: str) -> Iterator[tuple[Capture, Any]]:
    """A throwaway cluster, a capture of ``tables`` into ``out`` (the caller starts it) and
    an autocommit cursor; the capture and the cluster are gone afterwards."""
    _require()
    import psycopg2

    pg = TempPostgres().start()
    capture = Capture(pg, out, logs, tables=tables)
    try:
        conn = psycopg2.connect(pg.dsn)
        conn.autocommit = True
        yield capture, conn.cursor()
        conn.close()
    finally:
        if capture.proc is not None and capture.proc.poll() is None:
            capture.proc.kill()
        root = pg.root
        pg.stop()
    assert not os.path.exists(root)  # the cluster's folder is gone with it


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """Run the workload under capture; return the source folder, the truths of both tables
    after each transaction that touched them, and the follow-mode emitter's log."""
    _require()
    import psycopg2

    tmp = tmp_path_factory.mktemp("pg")
    pg = TempPostgres().start()
    capture = Capture(pg, tmp / "src", tmp)
    follower = None
    try:
        conn = psycopg2.connect(pg.dsn)
        conn.autocommit = True
        cur = conn.cursor()
        cur.execute(SCHEMA_SQL)
        cur.execute("INSERT INTO accounts VALUES " + ", ".join(_row_sql(i) for i in range(1, 46)))
        truths = [table_multiset(cur, "accounts")]  # the snapshot is the first transaction
        ledger_truths: list[Counter] = []
        capture.start()
        capture.wait_for('"snapshot":"last"')
        # the offsets record the finished snapshot (flushed after every batch): a restart
        # streams on instead of snapshotting again
        capture.wait_for_offsets(b'"snapshot_completed":true')
        assert capture.stop() in (0, 143)
        # streaming with offsets flushed only at a clean stop, so that the kill below makes
        # Debezium deliver what it streamed again
        capture.start("offset.flush.interval.ms=3600000")
        follower = start(
            "emit",
            "--source",
            f"debezium:{capture.out}",
            "--feed",
            "accounts",
            "--log",
            str(tmp / "follow-log"),
            "--key",
            "id",
            "--table",
            "public.accounts",
            "--granularity",
            "transaction",
            "--clock",
            "logical",
            "--follow",
            "--trigger",
            "1",
            log=tmp / "follow.log",
        )

        def run(txn: list[str]) -> None:
            conn.autocommit = False
            for sql in txn:
                cur.execute(sql)
            conn.commit()
            conn.autocommit = True
            if any("accounts" in s for s in txn):
                truths.append(table_multiset(cur, "accounts"))
            if any("ledger" in s for s in txn):
                ledger_truths.append(table_multiset(cur, "ledger"))

        for txn in WORKLOAD:
            run(txn)
        before = len(capture.files())
        run(BIG)
        # SIGKILL while the large transaction's files are being written
        deadline = time.monotonic() + 60
        while len(capture.files()) < before + 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        capture.kill()
        written_before_kill = len(capture.files()) - before
        capture.start()
        for txn in AFTER_CRASH:
            run(txn)
        capture.wait_for('"owner":"owner 999"')
        capture.wait_for('"status":"END"', timeout=5)
        time.sleep(2)  # the END record of the last transaction
        assert capture.stop() in (0, 143)
        # the offsets are lost: the restarted capture snapshots both tables again
        (capture.out / "_offsets.dat").unlink()
        for txn in WHILE_DOWN:
            conn.autocommit = False
            for sql in txn:
                cur.execute(sql)
            conn.commit()
            conn.autocommit = True
        truths.append(table_multiset(cur, "accounts"))  # one time: the new snapshot
        ledger_truths.append(table_multiset(cur, "ledger"))
        capture.start()
        capture.wait_for('"snapshot":"last"', times=2)
        for txn in AFTER_RESNAPSHOT:
            run(txn)
        capture.wait_for('"owner":"streamed again"')
        time.sleep(2)  # the END record of the last transaction
        assert capture.stop() in (0, 143)
        yield {
            "src": capture.out,
            "tmp": tmp,
            "truths": truths,
            "ledger_truths": ledger_truths,
            "final_ledger": table_multiset(cur, "ledger"),
            "follower": follower,
            "written_before_kill": written_before_kill,
        }
        conn.close()
    finally:
        if follower is not None and follower.poll() is None:
            follower.kill()
        if capture.proc is not None and capture.proc.poll() is None:
            capture.proc.kill()
        pg.stop()


JSON_COLS = {"meta"}


def _assert_each_time(reader: FeedReader, truths: list[Counter]) -> None:
    key = ["id"]
    assert check_messages(reader.messages(), non_negative=True, key=key) == []
    assert reader.frontier == 1 + len(truths), "one time per PostgreSQL transaction"
    every = dict(feed_multisets(reader, JSON_COLS))
    assert every[len(truths)] == feed_multiset(reader, len(truths), JSON_COLS)
    for i, truth in enumerate(truths):
        assert every[1 + i] == truth, f"after PostgreSQL transaction {i} (time {1 + i})"


def _batch(spark, captured, table: str, **kw):
    """Run a batch emitter over the captured folder for one table; its reports."""
    from tests.feed.model import run_emitter

    e, reports = run_emitter(
        spark,
        source_kind="debezium",
        source_path=str(captured["src"]),
        feed=table.split(".")[1],
        log=str(captured["tmp"] / "batch-log"),
        key=("id",),
        table=table,
        granularity="transaction",
        clock="logical",
        **kw,
    )
    e.close()
    assert sum(r.bad_rows for r in reports) == 0
    return reports


def test_batch_feed_equals_the_table_after_every_transaction(spark, captured):
    tmp = captured["tmp"]
    # the large transaction went through the capture more than once
    assert captured["written_before_kill"] >= 1
    # four files a transaction at first: source transactions straddle the windows
    reports = _batch(spark, captured, "public.accounts", max_files_per_txn=4)
    skipped = Counter()
    for r in reports:
        skipped.update(r.skipped)
    assert skipped["tombstone"] >= 3 and skipped["other table"] >= 3
    assert sum(r.redelivered for r in reports) > 0
    # real streaming input (transaction metadata, tombstones, two tables in one folder):
    # windows of complete transactions are computed on the driver (feed/txn/driver.py)
    assert any("driver" in r.seconds for r in reports), [r.line() for r in reports]
    _assert_each_time(FeedReader(str(tmp / "batch-log"), "accounts"), captured["truths"])
    quarantine = tmp / "batch-log" / "accounts" / "quarantine"
    assert not quarantine.exists() or not any(quarantine.rglob("*.json"))


def test_follow_feed_equals_the_table_after_every_transaction(captured):
    tmp, truths = captured["tmp"], captured["truths"]
    follower = captured["follower"]
    reader = FeedReader(str(tmp / "follow-log"), "accounts")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        reader.refresh()
        if reader.frontier >= 1 + len(truths):
            break
        assert follower.poll() is None, (tmp / "follow.log").read_text()[-3000:]
        time.sleep(1)
    follower.send_signal(signal.SIGTERM)
    assert follower.wait(timeout=120) == 143, (tmp / "follow.log").read_text()[-3000:]
    reader.refresh()
    _assert_each_time(reader, truths)


def test_second_table_from_the_same_folder(spark, captured):
    tmp = captured["tmp"]
    _batch(spark, captured, "public.ledger")
    reader = FeedReader(str(tmp / "batch-log"), "ledger")
    assert check_messages(reader.messages(), non_negative=True, key=["id"]) == []
    ledger = captured["ledger_truths"]
    assert reader.frontier == 1 + len(ledger)
    every = dict(feed_multisets(reader))
    for i, truth in enumerate(ledger):
        assert every[1 + i] == truth, f"ledger transaction {i}"
