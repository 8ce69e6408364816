"""``tidefeed demo --postgres``: a real database end to end.

A throwaway PostgreSQL cluster on 127.0.0.1 gets an ``accounts`` table (numeric, timestamptz,
date, uuid, jsonb and a TOASTed text column) and an initial 40 rows. ``tidefeed capture
postgres`` (Debezium's embedded connector) snapshots and streams it while a workload runs
inserts, updates, deletes, a primary-key update and a change undone inside its
transaction. Then ``tidefeed emit`` (local Spark) turns the captured events into a keyed
feed with one time per PostgreSQL transaction and pushes every commit to the reference
receiver. The demo ends by comparing the receiver's collection and the feed with
``SELECT * FROM accounts``.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from feed.demo.pgtemp import TempPostgres, feed_multiset, table_multiset
from protocol import SourceError, check_messages, record_key

__all__ = ["run_postgres_demo"]

_SCHEMA = """
CREATE TABLE accounts (
    id bigint PRIMARY KEY,
    owner text NOT NULL,
    balance numeric(12, 2) NOT NULL,
    opened timestamptz,
    born date,
    ref uuid DEFAULT gen_random_uuid(),
    meta jsonb,
    doc text
);
INSERT INTO accounts
SELECT g, 'owner ' || g, g * 12.5, '2024-01-01 09:00+01'::timestamptz + g * interval '1 day',
       '1990-01-01'::date + g, gen_random_uuid(), jsonb_build_object('tier', g % 3),
       CASE WHEN g % 10 = 0
            THEN (SELECT string_agg(md5(random()::text || s::text), '')
                  FROM generate_series(1, 300) s)
            ELSE 'doc ' || g END
FROM generate_series(1, 40) g;
"""


def _workload(rng: random.Random, transactions: int) -> list[list[str]]:
    txns: list[list[str]] = []
    next_id = 41
    for n in range(transactions):
        kind = n % 6
        a, b = rng.sample(range(1, 41), 2)
        if kind == 0:
            txns.append(
                [
                    f"UPDATE accounts SET balance = balance - 5 WHERE id = {a}",
                    f"UPDATE accounts SET balance = balance + 5 WHERE id = {b}",
                ]
            )
        elif kind == 1:
            txns.append(
                [
                    f"INSERT INTO accounts (id, owner, balance, opened, meta) VALUES "
                    f"({next_id}, 'new {next_id} ünïcödé', 0.01, now(), '{{\"new\": true}}')"
                ]
            )
            next_id += 1
        elif kind == 2:
            txns.append([f"DELETE FROM accounts WHERE id = {a}"])
        elif kind == 3:
            # an unchanged TOASTed doc on rows 10, 20, 30, 40
            txns.append(["UPDATE accounts SET balance = balance * 1.01 WHERE id % 10 = 0"])
        elif kind == 4:
            txns.append(
                [
                    f"UPDATE accounts SET owner = 'temporary' WHERE id = {b}",
                    f"UPDATE accounts SET owner = 'owner {b}' WHERE id = {b}",
                ]
            )
        else:
            txns.append([f"UPDATE accounts SET id = {next_id} WHERE id = {a}"])
            next_id += 1
    return txns


def _wait_for(folder: Path, needle: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in sorted(folder.glob("events-*.json")):
            if needle in p.read_text(encoding="utf-8"):
                return
        if proc.poll() is not None:
            raise SourceError(f"tidefeed capture stopped (exit {proc.returncode})")
        time.sleep(0.5)
    raise SourceError(f"tidefeed capture wrote no {needle!r} within {timeout:.0f}s")


def _start_capture(dsn: str, src: Path, log_file: Path) -> subprocess.Popen[bytes]:
    """``tidefeed capture postgres`` of public.accounts into ``src``, in the background."""
    with open(log_file, "ab") as capture_log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "feed.cli.main",
                "capture",
                "postgres",
                "--dsn",
                dsn,
                "--table",
                "public.accounts",
                "--out",
                str(src),
            ],
            stdout=capture_log,
            stderr=capture_log,
        )


def _run_workload(conn: Any, transactions: int, src: Path, capture: Any) -> list[list[str]]:
    """The bank's workload, one database transaction at a time, then a last row whose
    capture says everything before it was captured too."""
    cur = conn.cursor()
    txns = _workload(random.Random(7), transactions)
    conn.autocommit = False
    for txn in txns:
        for sql in txn:
            cur.execute(sql)
        conn.commit()
    conn.autocommit = True
    cur.execute("INSERT INTO accounts (id, owner, balance) VALUES (99999, 'the end', 0)")
    _wait_for(src, '"owner":"the end"', capture, timeout=120)
    time.sleep(2)  # the last transaction's END record
    return txns


def _emit_and_push(src: Path, log: Path, push_url: str, say: Callable[..., None]) -> list[Any]:
    """The captured events emitted into the feed, each commit pushed to the receiver."""
    from feed.demo.main import narrated
    from feed.emit.emitter import Emitter, EmitterConfig
    from feed.serve.publisher import deliver_log

    def push(cp: Any) -> None:
        acked = deliver_log(str(log), "accounts", push_url, epoch=cp.epoch, give_up_after=60)
        say(
            f"   commit {cp.seq}: times [{cp.progress.lower}, {cp.progress.upper}), "
            f"{sum(n for _, n in cp.progress.counts)} updates; receiver ACKed {acked}"
        )

    emitter = Emitter(
        EmitterConfig(
            source_kind="debezium",
            source_path=str(src),
            feed="accounts",
            log=str(log),
            key=("id",),
            table="public.accounts",
            clock="logical",
            granularity="transaction",
        ),
        on_commit=push,
    )
    with narrated():
        emitter.open()
        reports = emitter.run()
        emitter.close()
    return reports


def run_postgres_demo(
    *, workdir: str | None = None, transactions: int = 30, out: Any = None
) -> int:
    """Run the demo; 0 when the receiver's collection equals the table."""
    try:
        import psycopg2
    except ImportError as e:
        raise SourceError(
            "tidefeed demo --postgres needs the postgres extra: pip install 'tidefeed[postgres]'"
        ) from e
    from feed.demo.main import _Receiver, new_run_dir
    from feed.log.reader import FeedReader

    def say(s: str = "") -> None:
        print(s, file=out, flush=True)

    started = time.monotonic()
    work = new_run_dir(workdir, "tidefeed-pg-demo-")
    src, log = work / "pg-events", work / "pg-log"
    pg = TempPostgres().start()
    capture = None
    receiver = None
    try:
        say(f"1. a throwaway PostgreSQL on 127.0.0.1:{pg.port} (wal_level=logical)")
        conn = psycopg2.connect(pg.dsn)
        conn.autocommit = True
        cur = conn.cursor()
        cur.execute(_SCHEMA)
        say("   accounts: 40 rows (numeric, timestamptz, date, uuid, jsonb, TOASTed text)")
        say(f"2. tidefeed capture postgres --dsn {pg.dsn} --table public.accounts --out {src}")
        capture = _start_capture(pg.dsn, src, work / "capture.log")
        _wait_for(src, '"snapshot":"last"', capture, timeout=180)
        say("   initial snapshot captured; running the workload…")
        txns = _run_workload(conn, transactions, src, capture)
        capture.send_signal(signal.SIGTERM)
        capture.wait(timeout=60)
        files = len(list(src.glob("events-*.json")))
        say(f"   {len(txns) + 1} transactions captured into {files} files; capture stopped")

        receiver = _Receiver(str(work / "pg-receiver.db"))
        push_url = f"{receiver.url}/v1/push/accounts"
        say(
            f"3. tidefeed emit --source debezium:{src} --feed accounts --log {log} --key id "
            f"--table public.accounts --granularity transaction --clock logical "
            f"--push {push_url}   (local Spark; starting…)"
        )

        reports = _emit_and_push(src, log, push_url, say)
        same = _compare(reports, FeedReader(str(log), "accounts"), cur, receiver, say)
        conn.close()
        if same:
            elapsed = time.monotonic() - started
            say(f"OK: the receiver's collection equals SELECT * FROM accounts [{elapsed:.0f}s]")
            return 0
        say("MISMATCH: the feed differs from SELECT * FROM accounts")
        return 1
    finally:
        if capture is not None and capture.poll() is None:
            capture.kill()
        if receiver is not None:
            receiver.stop()
        pg.stop()


def _compare(reports: list[Any], reader: Any, cur: Any, receiver: Any, say: Any) -> bool:
    """Say what the emitter skipped and quarantined, check the feed, and compare the
    table, the feed and the receiver's collection; True when all three agree."""
    skipped: Counter[str] = Counter()
    for r in reports:
        skipped.update(r.skipped)
    bad = sum(r.bad_rows for r in reports)
    say(
        f"   skipped (no row change): {dict(skipped)}; quarantined: {bad}; "
        f"redelivered events dropped: {sum(r.redelivered for r in reports)}"
    )
    problems = check_messages(reader.messages(), non_negative=True, key=["id"])
    say(f"4. tidefeed check: {'valid' if not problems else 'INVALID'}, frontier {reader.frontier}")
    truth = table_multiset(cur, "accounts")
    feed = feed_multiset(reader, json_columns=("meta",))
    fed: Counter[bytes] = Counter()
    for row in reader.snapshot().to_pylist():
        fed[record_key({k: v for k, v in row.items() if k != "count"})] += row["count"]
    received = receiver.collection()
    say(
        f"5. SELECT * FROM accounts: {sum(truth.values())} rows; the feed: "
        f"{sum(feed.values())}; the receiver: {sum(received.values())}"
    )
    return feed == truth and received == fed and not problems and not bad
