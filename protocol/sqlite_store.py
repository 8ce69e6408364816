"""The reference receiver's durable store: SQLite in WAL mode, one database for many feeds.

Contract (the :class:`~protocol.stores.Store` interface): :meth:`SqliteStore.commit` writes the
updates of the completed times, the new frontier and the epoch in **one** SQLite transaction
with ``synchronous=FULL``, so once it returns they survive a crash (SIGKILL or power loss) and
the ACK "everything below F is kept" is true.

Updates are kept columnar: each committed piece of a time is one row of ``parts`` holding an
LZ4-compressed Arrow IPC stream (columns ``data``, ``time``, ``diff``), so a commit costs
one insert per piece, not one per update.

Pending updates are written ahead: after each body, a background thread (one per database)
inserts the new pending pieces as parts, each batch its own durable transaction. A part
counts as committed only below the feed's frontier, so a part at or above it is pending
and read by nothing; the commit that completes its time then only moves the frontier,
instead of writing (and waiting for the disk to take) the whole time at once. A rollback
deletes the parts written ahead; so does loading a feed, for any a killed receiver left.

The accumulated collection at the frontier is kept in ``collection`` (record -> count, the
record as its canonical JSON), folded in from the parts committed since the last fold
(``feeds.folded``, a ``parts`` rowid): the receiver folds after each commit, off the
ACK's path, and a read folds what is left first. Each part is one SQLite transaction, so
commits wait for one part at most, and memory holds one part at a time. Reading it streams
from SQLite in key order, in bounded memory, however large the collection.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import sqlite3
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import pyarrow as pa

from ._counts import FETCH_ROWS, from_ipc, ipc, merged, pairs, sorted_counts
from .errors import CheckpointError, TidefeedError
from .messages import record_key
from .stores import StoreState

__all__ = ["FoldGaveWay", "SqliteDatabase", "SqliteStore"]

log = logging.getLogger("tidefeed.receive")

SCHEMA = """
CREATE TABLE IF NOT EXISTS feeds (
    feed     TEXT PRIMARY KEY,
    frontier INTEGER,
    epoch    INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS parts (
    feed TEXT NOT NULL,
    time INTEGER NOT NULL,
    rows INTEGER NOT NULL,
    ipc  BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS parts_by_time ON parts (feed, time);
CREATE TABLE IF NOT EXISTS collection (
    feed  TEXT NOT NULL,
    rkey  BLOB NOT NULL,
    count INTEGER NOT NULL,
    PRIMARY KEY (feed, rkey)
) WITHOUT ROWID;
-- the records a fold brought to 0, found without a scan of the collection
CREATE INDEX IF NOT EXISTS collection_zero ON collection (feed) WHERE count = 0;
"""
#: a part is committed when its time is below its feed's frontier (SQL, one parameter: the
#: feed; NULL, so false, for a feed that has committed nothing)
_COMMITTED = "time < (SELECT frontier FROM feeds WHERE feeds.feed = ?)"
#: records of a fold round written between two questions whether it should give way
GIVE_WAY_ROWS = 5_000
#: SQLite's page cache for the receiver's connection, in KiB
CACHE_KIB = 64 << 10
#: how the collection's record keys are made (``PRAGMA user_version``): 1, a null column
#: counts as absent; 2, a null field of a nested record too
#: (:func:`protocol.messages.record_key`)
KEY_FORMAT = 2
#: updates folded into the collection per SQLite transaction (whole parts; one part more
#: if it alone is larger): each transaction rewrites the B-tree pages its records land on
FOLD_ROWS = 50_000
#: a read of the collection merges up to this many updates not folded yet in memory; with
#: more, it folds them first
MERGE_ROWS = 2_000_000


class FoldGaveWay(Exception):
    """A fold round was rolled back to let something else have the database."""


@contextlib.contextmanager
def _storage_errors(path: str) -> Iterator[None]:
    """SQLite failures (a locked or full disk, an I/O error) as a storage error: the
    receiver answers 503 with Retry-After, and nothing was committed."""
    try:
        yield
    except sqlite3.Error as e:
        raise CheckpointError(f"receiver database {path}: {e}") from e


@contextlib.contextmanager
def _immediate(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction (``BEGIN IMMEDIATE`` … ``COMMIT``), rolled back on any error."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


class SqliteDatabase:
    """One SQLite file shared by the stores of every feed (one connection, one lock)."""

    def __init__(self, path: str, *, busy_timeout: float = 5.0) -> None:
        self.path = path
        # a folder that does not exist, a file that is not a database: named, not a traceback
        with _storage_errors(path):
            self._conn = sqlite3.connect(
                path, check_same_thread=False, isolation_level=None, timeout=busy_timeout
            )
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            # a fold writes records all over the collection's B-tree: with SQLite's 2 MiB page
            # cache it rereads pages from the file; 64 MiB halves a 1M-record fold
            self._conn.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
            old = self._conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'updates'"
            ).fetchone()
            if old:
                self._conn.close()
                raise TidefeedError(
                    f"{path}: this receiver database was written by an older tidefeed (one row "
                    "per update); start the receiver on a new --db and let the publisher resend"
                )
            self._conn.executescript(SCHEMA)
            columns = {r[1] for r in self._conn.execute("PRAGMA table_info(feeds)")}
            if "folded" not in columns:  # a database from before the kept collection
                self._conn.execute("ALTER TABLE feeds ADD COLUMN folded INTEGER NOT NULL DEFAULT 0")
            if self._conn.execute("PRAGMA user_version").fetchone()[0] < KEY_FORMAT:
                # its collection is keyed with null fields in (null columns before a
                # feed's schema could grow, nested ones before 2026-11-29): fold it again
                # from the parts, which are all kept
                with _immediate(self._conn):
                    self._conn.execute("DELETE FROM collection")
                    self._conn.execute("UPDATE feeds SET folded = 0")
                    self._conn.execute(f"PRAGMA user_version = {KEY_FORMAT}")
        self.lock = threading.Lock()
        #: writes pending updates ahead of their commit (one thread: in the order asked)
        self.ahead = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="ahead"
        )
        # per feed: held by a fold round, and by a read of the collection from its start to
        # its end (a fold in between would count the parts it merges twice)
        self._fold_locks: dict[str, threading.Lock] = {}

    def fold_lock(self, feed: str) -> threading.Lock:
        with self.lock:
            return self._fold_locks.setdefault(feed, threading.Lock())

    @property
    def conn(self) -> sqlite3.Connection:
        return self._conn

    def feeds(self) -> list[str]:
        with self.lock:
            return [r[0] for r in self._conn.execute("SELECT feed FROM feeds ORDER BY feed")]

    def close(self) -> None:
        self.ahead.shutdown(wait=True)
        with self.lock:
            self._conn.close()

    def store(self, feed: str) -> SqliteStore:
        return SqliteStore(self, feed)


class SqliteStore:
    """The durable state of one feed at the receiver."""

    def __init__(self, db: SqliteDatabase, feed: str) -> None:
        self.db = db
        self.feed = feed
        self._state = StoreState(frontier=None, epoch=0)
        #: pending tables handed to the write-ahead thread, by ``id`` (the table is kept,
        #: so that the id stays its own)
        self._asked: dict[int, pa.Table] = {}
        #: of those, the ones written: the rowids of their parts (filled in by the thread;
        #: read once :meth:`_settle` has waited for it)
        self._ahead: dict[int, list[int]] = {}
        self._writing: list[concurrent.futures.Future[None]] = []

    def load(self) -> StoreState:
        """The committed frontier and epoch. Parts at or above the frontier were written
        ahead by a receiver that stopped before their commit: they are deleted."""
        with self.db.lock, _storage_errors(self.db.path):
            conn = self.db.conn
            row = conn.execute(
                "SELECT frontier, epoch FROM feeds WHERE feed = ?", (self.feed,)
            ).fetchone()
            state = StoreState(None, 0) if row is None else StoreState(row[0], row[1])
            where = "feed = ?" + (" AND time >= ?" if state.frontier is not None else "")
            args = (self.feed,) if state.frontier is None else (self.feed, state.frontier)
            if conn.execute(f"SELECT 1 FROM parts WHERE {where} LIMIT 1", args).fetchone():
                with _immediate(conn):
                    conn.execute(f"DELETE FROM parts WHERE {where}", args)
        self._state = state
        return state

    def commit(
        self,
        *,
        updates: list[pa.Table],
        frontier: int | None,
        epoch: int,
        pending: Sequence[pa.Table] = (),
    ) -> None:
        named = {id(t) for t in updates} | {id(t) for t in pending}
        dropped = [k for k in self._asked if k not in named]  # rolled back
        state = StoreState(frontier=frontier, epoch=epoch)
        if updates or dropped or state != self._state:
            self._settle()  # (a body that only adds pending updates does not wait)
            parts = [p for t in updates if id(t) not in self._ahead for p in self._parts(t)]
            with self.db.lock, _storage_errors(self.db.path), _immediate(self.db.conn) as conn:
                gone = [(r,) for k in dropped for r in self._ahead.get(k, ())]
                if gone:
                    conn.executemany("DELETE FROM parts WHERE rowid = ?", gone)
                if parts:
                    conn.executemany(
                        "INSERT INTO parts (feed, time, rows, ipc) VALUES (?, ?, ?, ?)", parts
                    )
                conn.execute(
                    "INSERT INTO feeds (feed, frontier, epoch) VALUES (?, ?, ?) "
                    "ON CONFLICT(feed) DO UPDATE SET frontier = excluded.frontier, "
                    "epoch = excluded.epoch",
                    (self.feed, frontier, epoch),
                )
            self._state = state
            for k in [*dropped, *(id(t) for t in updates)]:
                self._asked.pop(k, None)
                self._ahead.pop(k, None)
        new = [t for t in pending if id(t) not in self._asked and t.num_rows]
        if new:
            self._asked.update((id(t), t) for t in new)
            self._writing.append(self.db.ahead.submit(self._write_ahead, new))

    def _parts(self, table: pa.Table) -> list[tuple[str, int, int, bytes]]:
        """The ``parts`` rows of an update table at one time: a large time in parts of a
        fold round each, so that no fold holds the database for longer than a round."""
        if not table.num_rows:
            return []
        time = table.column("time")[0].as_py()
        return [
            (self.feed, time, part.num_rows, ipc(part))
            for part in (
                table.slice(start, FOLD_ROWS) for start in range(0, table.num_rows, FOLD_ROWS)
            )
        ]

    def _write_ahead(self, tables: list[pa.Table]) -> None:
        """Insert pending tables as parts (in the background thread), in one transaction."""
        rows = [self._parts(t) for t in tables]
        with self.db.lock, _storage_errors(self.db.path), _immediate(self.db.conn) as conn:
            rowids = [
                [
                    conn.execute(
                        "INSERT INTO parts (feed, time, rows, ipc) VALUES (?, ?, ?, ?)", part
                    ).lastrowid
                    for part in parts
                ]
                for parts in rows
            ]
        for table, ids in zip(tables, rowids, strict=True):
            self._ahead[id(table)] = [int(i) for i in ids if i is not None]

    def _settle(self) -> None:
        """Wait for the write-aheads under way. One that failed (a full disk, say) wrote
        nothing: its tables are written by the commit that names them."""
        writing, self._writing = self._writing, []
        for future in writing:
            try:
                future.result()
            except TidefeedError as e:
                log.warning("feed %s: writing pending updates ahead failed: %s", self.feed, e)

    def tables(self, at: int | None = None) -> Iterator[pa.Table]:
        """The committed update tables at times ``<= at`` (default: all), in time order."""
        sql = f"SELECT ipc FROM parts WHERE feed = ? AND {_COMMITTED}"
        args: list[Any] = [self.feed, self.feed]
        if at is not None:
            sql += " AND time <= ?"
            args.append(at)
        sql += " ORDER BY time, rowid"
        with self.db.lock:
            blobs = [r[0] for r in self.db.conn.execute(sql, args)]
        for blob in blobs:
            yield from_ipc(blob)

    def fold(
        self, max_rounds: int | None = None, *, give_way: Callable[[], bool] | None = None
    ) -> int:
        """Fold the parts committed since the last fold into ``collection``, in rounds of
        whole parts up to :data:`FOLD_ROWS` updates (at most ``max_rounds`` rounds); return
        how many parts were folded. A round is one SQLite transaction (its parts' rows and
        the new ``folded`` mark together), so a crash leaves every part folded exactly
        once. Rounds are written with ``synchronous=NORMAL``: the collection is derived
        from the parts, and a round lost with the power is lost with its mark, so it is
        folded again; commits stay ``FULL``.

        ``give_way`` is asked every :data:`GIVE_WAY_ROWS` records of a round: when it
        answers true the round is rolled back and :class:`FoldGaveWay` raised, so that
        whatever waits for the database (a push) waits for that many records, not for a
        whole round."""
        folded = rounds = 0
        while max_rounds is None or rounds < max_rounds:
            with self.db.fold_lock(self.feed), self.db.lock, _storage_errors(self.db.path):
                conn = self.db.conn
                cur = self._unfolded()  # as many as make a round: the first whatever its size
                parts: list[tuple[int, bytes]] = []
                rows = 0
                for rowid, n, blob, committed in cur:
                    if not committed:
                        break  # pending: the folded mark stays below it
                    if parts and rows + n > FOLD_ROWS:
                        break
                    parts.append((rowid, blob))
                    rows += n
                cur.close()
                if not parts:
                    return folded
                conn.execute("PRAGMA synchronous=NORMAL")
                try:
                    with _immediate(conn):
                        summed = pairs(sorted_counts([from_ipc(b) for _, b in parts]))
                        while chunk := list(itertools.islice(summed, GIVE_WAY_ROWS)):
                            conn.executemany(
                                "INSERT INTO collection (feed, rkey, count) VALUES (?, ?, ?) "
                                "ON CONFLICT(feed, rkey) DO UPDATE "
                                "SET count = count + excluded.count",
                                ((self.feed, k, n) for k, n in chunk),
                            )
                            if give_way is not None and give_way():
                                raise FoldGaveWay(f"feed {self.feed}: a fold round gave way")
                        conn.execute(  # the planner would rather scan the whole collection
                            "DELETE FROM collection INDEXED BY collection_zero "
                            "WHERE feed = ? AND count = 0",
                            (self.feed,),
                        )
                        conn.execute(
                            "UPDATE feeds SET folded = ? WHERE feed = ?", (parts[-1][0], self.feed)
                        )
                finally:
                    conn.execute("PRAGMA synchronous=FULL")
                folded += len(parts)
                rounds += 1
        return folded

    def current(self) -> Generator[tuple[bytes, int], None, None]:
        """The collection at the frontier as ``(canonical record JSON, count)`` in key
        order: the kept collection, read from SQLite :data:`FETCH_ROWS` at a time, merged
        with the net counts of the parts not folded into it yet (held in memory; beyond
        :data:`MERGE_ROWS` of them they are folded first). No fold runs until the reader
        is done or closed (close it: ``contextlib.closing``)."""
        lock = self.db.fold_lock(self.feed)
        if self._unfolded_rows() > MERGE_ROWS:
            self.fold()
        lock.acquire()
        try:
            with self.db.lock, _storage_errors(self.db.path):
                blobs = [b for _, _, b, committed in self._unfolded() if committed]
            tables = [from_ipc(b) for b in blobs]
            del blobs
            pending = pairs(sorted_counts(tables)) if tables else iter(())
            del tables
            yield from merged(self._kept(), pending)
        finally:
            lock.release()

    def _folded_mark(self) -> int:
        """The rowid of the last part folded into the collection (call under the lock)."""
        mark = self.db.conn.execute(
            "SELECT folded FROM feeds WHERE feed = ?", (self.feed,)
        ).fetchone()
        return int(mark[0]) if mark else 0

    def _unfolded(self) -> sqlite3.Cursor:
        """``(rowid, rows, ipc, committed)`` of the parts not folded yet, in the order they
        were written (call under the database lock). A fold stops at the first pending
        part: its mark never passes a part that may still be committed or rolled back."""
        # by rowid from the mark on (the planner would rather scan all the feed's parts)
        return self.db.conn.execute(
            f"SELECT rowid, rows, ipc, coalesce({_COMMITTED}, 0) FROM parts NOT INDEXED "
            "WHERE rowid > ? AND feed = ? ORDER BY rowid",
            (self.feed, self._folded_mark(), self.feed),
        )

    def _unfolded_rows(self) -> int:
        with self.db.lock, _storage_errors(self.db.path):
            row = self.db.conn.execute(
                "SELECT sum(rows) FROM parts NOT INDEXED WHERE rowid > ? AND feed = ? "
                f"AND {_COMMITTED}",
                (self._folded_mark(), self.feed, self.feed),
            ).fetchone()
        return int(row[0] or 0)

    def _kept(self) -> Iterator[tuple[bytes, int]]:
        """The kept (folded) collection in key order, :data:`FETCH_ROWS` at a time."""
        last: bytes | None = None
        while True:
            sql = "SELECT rkey, count FROM collection WHERE feed = ?"
            args: list[Any] = [self.feed]
            if last is not None:
                sql += " AND rkey > ?"
                args.append(last)
            sql += " ORDER BY rkey LIMIT ?"
            args.append(FETCH_ROWS)
            with self.db.lock, _storage_errors(self.db.path):
                rows = self.db.conn.execute(sql, args).fetchall()
            yield from rows
            if len(rows) < FETCH_ROWS:
                return
            last = rows[-1][0]

    def collection(self, at: int | None = None) -> Iterator[tuple[Any, int]]:
        """``(record, count)`` of every record with a non-zero multiplicity at time ``at``
        (default: everything committed, i.e. the collection at the frontier), in the order
        of the records' canonical keys. Accumulated in memory from the parts: use
        :meth:`fold` and :meth:`current` for the collection at the frontier."""
        counts: dict[bytes, list[Any]] = {}
        for table in self.tables(at):
            for row in table.select(["data", "diff"]).to_pylist(maps_as_pydicts="strict"):
                slot = counts.setdefault(record_key(row["data"]), [row["data"], 0])
                slot[1] += row["diff"]
        for key in sorted(counts):
            data, n = counts[key]
            if n:
                yield data, n
