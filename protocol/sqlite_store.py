"""The reference receiver's durable store: SQLite in WAL mode, one database for many feeds.

Contract (the :class:`~protocol.state.Store` interface): :meth:`SqliteStore.commit` writes a
completed time's updates, the new frontier and the epoch in **one** SQLite transaction with
``synchronous=FULL``, so once it returns they survive a crash (SIGKILL or power loss) and the
ACK "everything below F is kept" is true. Nothing else is ever written.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from typing import Any

import orjson

from .messages import WireRow, _json_default, record_key
from .state import StoreState

__all__ = ["SqliteDatabase", "SqliteStore"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS feeds (
    feed     TEXT PRIMARY KEY,
    frontier INTEGER,
    epoch    INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS updates (
    feed TEXT NOT NULL,
    time INTEGER NOT NULL,
    rkey BLOB NOT NULL,
    data BLOB NOT NULL,
    diff INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS updates_by_record ON updates (feed, rkey, time);
"""


class SqliteDatabase:
    """One SQLite file shared by the stores of every feed (one connection, one lock)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.executescript(SCHEMA)
        self.lock = threading.Lock()

    @property
    def conn(self) -> sqlite3.Connection:
        return self._conn

    def feeds(self) -> list[str]:
        with self.lock:
            return [r[0] for r in self._conn.execute("SELECT feed FROM feeds ORDER BY feed")]

    def close(self) -> None:
        with self.lock:
            self._conn.close()

    def store(self, feed: str) -> SqliteStore:
        return SqliteStore(self, feed)


class SqliteStore:
    """The durable state of one feed at the receiver."""

    def __init__(self, db: SqliteDatabase, feed: str) -> None:
        self.db = db
        self.feed = feed

    def load(self) -> StoreState:
        with self.db.lock:
            row = self.db.conn.execute(
                "SELECT frontier, epoch FROM feeds WHERE feed = ?", (self.feed,)
            ).fetchone()
        return StoreState(frontier=None, epoch=0) if row is None else StoreState(row[0], row[1])

    def commit(self, *, updates: list[WireRow], frontier: int | None, epoch: int) -> None:
        dumps = orjson.dumps
        rows = [
            (
                self.feed,
                u["time"],
                record_key(u["data"]),
                dumps(u["data"], default=_json_default),
                u["diff"],
            )
            for u in updates
        ]
        with self.db.lock:
            conn = self.db.conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                if rows:
                    conn.executemany(
                        "INSERT INTO updates (feed, time, rkey, data, diff) VALUES (?,?,?,?,?)",
                        rows,
                    )
                conn.execute(
                    "INSERT INTO feeds (feed, frontier, epoch) VALUES (?, ?, ?) "
                    "ON CONFLICT(feed) DO UPDATE SET frontier = excluded.frontier, "
                    "epoch = excluded.epoch",
                    (self.feed, frontier, epoch),
                )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    def collection(self, at: int | None = None) -> Iterator[tuple[Any, int]]:
        """``(record, count)`` of every record with a non-zero multiplicity at time ``at``
        (default: everything committed, i.e. the collection at the frontier)."""
        sql = "SELECT MIN(data), SUM(diff) FROM updates WHERE feed = ?"
        args: list[Any] = [self.feed]
        if at is not None:
            sql += " AND time <= ?"
            args.append(at)
        sql += " GROUP BY rkey HAVING SUM(diff) != 0 ORDER BY rkey"
        with self.db.lock:
            rows = self.db.conn.execute(sql, args).fetchall()
        for data, count in rows:
            yield orjson.loads(data), int(count)
