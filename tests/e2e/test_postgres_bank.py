"""A bank on a real PostgreSQL, in the style of Jepsen's bank test: two tables captured by
real Debezium and emitted as a group (one time domain, feed/emit/group.py).

Three concurrent clients run about 300 transactions: transfers (two balances and a new
transfer row in one transaction), reversals (a transfer deleted and its amounts put back),
new accounts (accounts only) and notes on transfers (transfers only). At **every** time
below the frontiers, each account's balance equals its opening balance plus the transfers
in minus the transfers out, read from the two feeds at that time: a feed showing money
the other does not is a torn transaction. Both feeds end equal to their tables, with one
time per PostgreSQL transaction, in batch and in ``--follow`` with the emitter SIGKILLed
inside a group commit (between its two feeds' checkpoints) and started again.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter
from typing import Any

import pytest

from feed.demo.pgtemp import feed_multiset, feed_multisets, table_multiset
from feed.log.reader import FeedReader
from protocol import check_messages

from .helpers import start
from .test_postgres import cluster_and_capture

pytestmark = [pytest.mark.slow, pytest.mark.realsource, pytest.mark.timeout(900)]

ACCOUNTS, OPENING, CLIENTS, PER_CLIENT = 8, 1000, 3, 100
TABLES = "public.accounts,public.transfers"
FEEDS = "accounts,transfers"


def _client(dsn: str, seed: int, done: list[int], errors: list[BaseException]) -> None:
    """``PER_CLIENT`` committed transactions of the four kinds; counts them in ``done``."""
    import psycopg2
    import psycopg2.errors

    rng = random.Random(seed)
    conn = psycopg2.connect(dsn)
    try:
        committed = 0
        while committed < PER_CLIENT:
            kind = rng.choices(["transfer", "reverse", "open", "note"], [70, 10, 10, 10])[0]
            try:
                with conn, conn.cursor() as cur:
                    if kind == "transfer":
                        a, b = rng.sample(range(1, ACCOUNTS + 1), 2)
                        amount = rng.randint(1, 50)
                        for acc, delta in sorted([(a, -amount), (b, amount)]):  # lock order
                            cur.execute(
                                "UPDATE accounts SET balance = balance + %s WHERE id = %s",
                                (delta, acc),
                            )
                        cur.execute(
                            "INSERT INTO transfers (src, dst, amount) VALUES (%s, %s, %s)",
                            (a, b, amount),
                        )
                    elif kind == "reverse":
                        cur.execute(
                            "DELETE FROM transfers WHERE id = (SELECT min(id) FROM transfers) "
                            "RETURNING src, dst, amount"
                        )
                        row = cur.fetchone()
                        if row is None:
                            conn.rollback()
                            continue
                        src, dst, amount = row
                        for acc, delta in sorted([(src, amount), (dst, -amount)]):
                            cur.execute(
                                "UPDATE accounts SET balance = balance + %s WHERE id = %s",
                                (delta, acc),
                            )
                    elif kind == "open":
                        cur.execute(
                            "INSERT INTO accounts (id, balance, opening) "
                            "VALUES (1000 + %s * 1000 + %s, 0, 0)",
                            (seed, committed),
                        )
                    else:
                        cur.execute(
                            "UPDATE transfers SET note = %s WHERE id = "
                            "(SELECT max(id) FROM transfers)",
                            (f"c{seed}-{committed}",),
                        )
                        if cur.rowcount == 0:
                            conn.rollback()
                            continue
                committed += 1
                done[seed] += 1
            except (psycopg2.errors.DeadlockDetected, psycopg2.errors.SerializationFailure):
                continue  # rolled back by the `with`: try another
    except BaseException as e:  # reported by the test
        errors.append(e)
    finally:
        conn.close()


@pytest.fixture(scope="module")
def bank(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bank")
    with cluster_and_capture(tmp / "src", tmp, TABLES) as (capture, cur):
        cur.execute(
            "CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL, "
            "opening bigint NOT NULL)"
        )
        cur.execute(
            "CREATE TABLE transfers (id serial PRIMARY KEY, src int NOT NULL, dst int NOT NULL,"
            " amount bigint NOT NULL, note text)"
        )
        cur.execute(
            "INSERT INTO accounts SELECT g, %s, %s FROM generate_series(1, %s) g",
            (OPENING, OPENING, ACCOUNTS),
        )
        capture.start()
        capture.wait_for('"snapshot":"last"')
        done = [0] * CLIENTS
        errors: list[BaseException] = []
        clients = [
            threading.Thread(target=_client, args=(capture.pg.dsn, i, done, errors))
            for i in range(CLIENTS)
        ]
        for c in clients:
            c.start()
        for c in clients:
            c.join(timeout=300)
        assert not errors, errors
        assert sum(done) == CLIENTS * PER_CLIENT
        final = {t: table_multiset(cur, t) for t in ("accounts", "transfers")}
        capture.finish(ends=sum(done))
    return {"src": capture.out, "tmp": tmp, "txns": sum(done), "final": final}


def _as_dicts(multiset: Counter) -> list[dict[str, Any]]:
    out = []
    for row, n in multiset.items():
        assert n == 1, f"a row twice: {row}"
        out.append(dict(row))
    return out


def assert_bank(log, txns: int, final: dict[str, Counter] | None) -> int:
    """The invariant at every time below both feeds' frontiers; the number of times."""
    readers = {f: FeedReader(str(log), f) for f in FEEDS.split(",")}
    for r in readers.values():
        assert check_messages(r.messages(), non_negative=True, key=["id"]) == []
    upto = min(r.frontier for r in readers.values())
    at = zip(*(feed_multisets(readers[f]) for f in FEEDS.split(",")), strict=False)
    for (t, a), (_, b) in at:
        if not 0 < t < upto:
            continue
        accounts, transfers = _as_dicts(a), _as_dicts(b)
        moved: Counter = Counter()
        for x in transfers:
            moved[x["dst"]] += x["amount"]
            moved[x["src"]] -= x["amount"]
        for a in accounts:
            assert a["balance"] == a["opening"] + moved[a["id"]], f"time {t}: account {a}"
        assert set(moved) <= {a["id"] for a in accounts}, f"time {t}: unknown account"
    if final is not None:
        assert upto == 1 + 1 + txns, "one time for the snapshot and one per transaction"
        for f, r in readers.items():
            assert r.frontier == upto
            assert feed_multiset(r) == final[f], f
            # (the collections read in turn above end in the one read whole)
            assert list(feed_multisets(r))[-1][1] == final[f], f
    return upto


def _emit(bank, log, *more: str, env: dict[str, str] | None = None, name: str = "emit"):
    return start(
        "emit",
        "--source",
        f"debezium:{bank['src']}",
        "--log",
        str(log),
        "--table",
        TABLES,
        "--feed",
        FEEDS,
        "--key",
        "id",
        "--clock",
        "logical",
        *more,
        env=env,
        log=bank["tmp"] / f"{name}.log",
    )


def test_batch_group_keeps_the_bank_balanced_at_every_time(bank):
    log = bank["tmp"] / "batch-log"
    # windows of 40 files: transactions straddle them, and the group holds them back
    # together
    p = _emit(bank, log, "--max-files-per-txn", "40", name="batch")
    assert p.wait(timeout=600) == 0, (bank["tmp"] / "batch.log").read_text()[-3000:]
    assert_bank(log, bank["txns"], bank["final"])


def test_follow_group_killed_inside_a_group_commit_stays_balanced(bank):
    log = bank["tmp"] / "follow-log"
    killed = _emit(
        bank,
        log,
        "--follow",
        "--trigger",
        "0.5",
        "--max-files-per-txn",
        "3",
        env={"TIDEFEED_TEST_KILL_AT": "between_feed_commits:3"},
        name="follow-1",
    )
    assert killed.wait(timeout=600) == -signal.SIGKILL, (bank["tmp"] / "follow-1.log").read_text()[
        -3000:
    ]
    # torn between the two checkpoints: the accounts feed is one group commit ahead, and
    # every time below both frontiers is still balanced
    readers = [FeedReader(str(log), f) for f in FEEDS.split(",")]
    assert readers[0].frontier > readers[1].frontier > 0
    assert_bank(log, bank["txns"], None)
    follower = _emit(bank, log, "--follow", "--trigger", "0.5", name="follow-2")
    deadline = time.monotonic() + 400
    target = 1 + 1 + bank["txns"]
    while time.monotonic() < deadline:
        if min(FeedReader(str(log), f).frontier for f in FEEDS.split(",")) >= target:
            break
        assert follower.poll() is None, (bank["tmp"] / "follow-2.log").read_text()[-3000:]
        time.sleep(1)
    follower.send_signal(signal.SIGTERM)
    assert follower.wait(timeout=120) == 143, (bank["tmp"] / "follow-2.log").read_text()[-3000:]
    assert "finished group commit" in (bank["tmp"] / "follow-2.log").read_text()
    assert_bank(log, bank["txns"], bank["final"])
