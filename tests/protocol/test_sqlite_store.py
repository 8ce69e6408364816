"""The receiver's kept collection: folded from committed parts, streamed in key order;
pending updates written ahead of their commit."""

from __future__ import annotations

import random
import sqlite3
import threading

import orjson
import pyarrow as pa
import pytest

import protocol.sqlite_store as sqlite_store
from protocol.messages import Progress, Updates, record_key
from protocol.sqlite_store import SqliteDatabase
from protocol.state import Consumer

RECORD = pa.struct([("id", pa.int64()), ("name", pa.string()), ("v", pa.float64())])
#: a record type protocol.jsontext takes (no float): its keys are built column-wise
COLUMNAR = pa.struct([("id", pa.int64()), ("name", pa.string()), ("v", pa.int32())])


def part(time: int, updates: list[tuple[dict, int]], record: pa.DataType = RECORD) -> pa.Table:
    return pa.table(
        {
            "data": pa.array([r for r, _ in updates], record),
            "time": pa.array([time] * len(updates), pa.int64()),
            "diff": pa.array([d for _, d in updates], pa.int64()),
        }
    )


def kept(store) -> dict[bytes, int]:
    store.fold()
    return {record_key(orjson.loads(k)): n for k, n in store.current()}


def accumulated(store) -> dict[bytes, int]:
    return {record_key(r): n for r, n in store.collection()}


@pytest.mark.parametrize("record", [RECORD, COLUMNAR], ids=["orjson keys", "columnar keys"])
def test_the_kept_collection_follows_every_commit_and_survives_a_reopen(
    tmp_path, monkeypatch, record
):
    monkeypatch.setattr(sqlite_store, "FETCH_ROWS", 7)  # several fetches per read
    monkeypatch.setattr(sqlite_store, "FOLD_ROWS", 10)  # rounds of a few parts
    rnd = random.Random(3)
    path = str(tmp_path / "r.db")
    db = SqliteDatabase(path)
    store = db.store("f")
    live: dict[int, dict] = {}
    for t in range(1, 40):
        updates = []
        for _ in range(rnd.randint(1, 12)):
            i = rnd.randint(0, 30)
            if i in live and rnd.random() < 0.5:
                updates.append((live.pop(i), -1))  # a retraction: its count goes to 0
            elif i not in live:
                v = rnd.random() if record == RECORD else rnd.randint(-5, 5)
                live[i] = {"id": i, "name": f'n{i} "é"', "v": v}
                updates.append((live[i], 1))
        store.commit(updates=[part(t, updates, record)] if updates else [], frontier=t + 1, epoch=1)
        if t % 5 == 0:  # read now and then: each read folds only what is new
            assert kept(store) == accumulated(store)
    truth = {record_key(r): 1 for r in live.values()}
    assert kept(store) == truth == accumulated(store)
    keys = [k for k, _ in store.current()]
    assert keys == sorted(keys) and len(keys) == len(truth)
    assert store.fold() == 0  # nothing new: folding again changes nothing
    db.close()
    again = SqliteDatabase(path).store("f")
    assert kept(again) == truth


def test_a_read_merges_the_parts_not_folded_yet_and_a_fold_waits_for_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sqlite_store, "FETCH_ROWS", 5)
    monkeypatch.setattr(sqlite_store, "FOLD_ROWS", 8)
    rnd = random.Random(11)
    db = SqliteDatabase(str(tmp_path / "r.db"))
    store = db.store("f")
    live: dict[int, dict] = {}
    for t in range(1, 30):
        updates = []
        for _ in range(rnd.randint(1, 9)):
            i = rnd.randint(0, 25)
            if i in live:
                updates.append((live.pop(i), -1))
            else:
                live[i] = {"id": i, "name": f"n{i}", "v": rnd.randint(0, 3)}
                updates.append((live[i], 1))
        store.commit(updates=[part(t, updates, COLUMNAR)], frontier=t + 1, epoch=1)
        if rnd.random() < 0.4:
            store.fold(max_rounds=1)  # some parts folded, the later ones not
        read = {record_key(orjson.loads(k)): n for k, n in store.current()}  # no fold first
        assert read == {record_key(r): 1 for r in live.values()}, t
    # a fold started while a read is under way waits for the read to end
    reader = store.current()
    first = next(reader)
    folding = threading.Thread(target=store.fold)
    folding.start()
    folding.join(timeout=0.5)
    assert folding.is_alive()  # waiting, and the read goes on unaffected
    rest = [first, *reader]
    folding.join(timeout=10)
    assert not folding.is_alive()
    assert {record_key(orjson.loads(k)): n for k, n in rest} == {
        record_key(r): 1 for r in live.values()
    }
    assert store.fold() == 0


def test_a_large_time_is_kept_in_parts_of_a_fold_round_each(tmp_path, monkeypatch):
    """A time of more updates than a fold round takes is stored in parts of at most a
    round: a background fold never holds the database for more than a round."""
    monkeypatch.setattr(sqlite_store, "FOLD_ROWS", 4)
    db = SqliteDatabase(str(tmp_path / "r.db"))
    store = db.store("f")
    records = [{"id": i, "name": f"n{i}", "v": i % 3} for i in range(11)]
    store.commit(updates=[part(1, [(r, 1) for r in records], COLUMNAR)], frontier=2, epoch=1)
    parts = db.conn.execute("SELECT rows FROM parts WHERE feed = 'f' ORDER BY rowid")
    sizes = [n for (n,) in parts]
    assert sizes == [4, 4, 3]
    assert store.fold(max_rounds=1) == 1  # one round: one part of the time
    truth = {record_key(r): 1 for r in records}
    assert {record_key(orjson.loads(k)): n for k, n in store.current()} == truth
    assert accumulated(store) == truth == {record_key(r): n for r, n in store.collection(at=1)}
    assert store.fold() == 2


def _pending_rows(db: SqliteDatabase, feed: str = "f") -> int:
    """Updates in parts at or above the feed's frontier: written ahead, not committed."""
    row = db.conn.execute(
        "SELECT coalesce(sum(rows), 0) FROM parts WHERE feed = ? AND NOT coalesce("
        "time < (SELECT frontier FROM feeds WHERE feeds.feed = parts.feed), 0)",
        (feed,),
    ).fetchone()
    return int(row[0])


def _written_ahead(db: SqliteDatabase) -> None:
    """Wait for the background write-ahead of what is pending."""
    db.ahead.submit(lambda: None).result(timeout=30)


def _updates(t: int, records: list[dict], diff: int = 1) -> Updates:
    return Updates.from_arrow(part(t, [(r, diff) for r in records], COLUMNAR))


def test_pending_updates_are_written_ahead_and_count_only_once_committed(tmp_path, monkeypatch):
    """Pending pieces reach the database before their commit, are read by nothing until
    it, and a rollback deletes them: a time resent after one counts once. A fold never
    passes a pending part, so one committed after a later time still gets folded."""
    monkeypatch.setattr(sqlite_store, "FOLD_ROWS", 3)
    path = str(tmp_path / "r.db")
    db = SqliteDatabase(path)
    store = db.store("f")
    c = Consumer(store, feed="f")
    rec = [{"id": i, "name": f"n{i}", "v": i % 4} for i in range(20)]
    c.apply([Progress(0, 0, ())], epoch=1)
    c.apply([_updates(0, rec[:5])], epoch=1)
    c.apply([_updates(1, rec[5:9])], epoch=1)  # time 1's piece written before time 0's next
    c.apply([_updates(0, rec[9:12])], epoch=1)
    _written_ahead(db)
    assert _pending_rows(db) == 12  # on disk ahead of any commit
    assert kept(store) == {} == accumulated(store)  # and counted nowhere
    c.apply([Progress(0, 1, ((0, 8),))], epoch=1)  # time 0 commits, time 1 stays pending
    assert _pending_rows(db) == 4
    truth = {record_key(r): 1 for r in rec[:5] + rec[9:12]}
    assert kept(store) == truth == accumulated(store)  # the fold stopped at time 1's part
    c.apply([_updates(2, rec[12:14]), Progress(1, 2, ((1, 4),))], epoch=1)
    truth |= {record_key(r): 1 for r in rec[5:9]}
    _written_ahead(db)
    assert _pending_rows(db) == 2
    assert kept(store) == truth == accumulated(store)
    # the session breaks; the next one's announcement rolls time 2 back, and it is resent
    # with other records
    c.apply([Progress(2, 2, ())], epoch=1)
    assert _pending_rows(db) == 0
    c.apply([_updates(2, rec[14:17])], epoch=1)
    c.apply([_updates(2, rec[17:20]), Progress(2, 3, ((2, 6),))], epoch=1)
    truth |= {record_key(r): 1 for r in rec[14:20]}
    assert _pending_rows(db) == 0
    assert kept(store) == truth == accumulated(store)
    assert store.fold() == 0
    db.close()
    again = SqliteDatabase(path)
    assert kept(again.store("f")) == truth


def test_updates_below_a_new_feeds_first_lower_are_dropped_not_kept(tmp_path):
    """Updates at time 5, then a first progress [10, 11): no progress ever counted them,
    so they are dropped, in memory and on disk, and stay dropped after a reopen."""
    path = str(tmp_path / "r.db")
    db = SqliteDatabase(path)
    store = db.store("f")
    c = Consumer(store, feed="f")
    rec = [{"id": i, "name": f"n{i}", "v": 0} for i in range(4)]
    c.apply([_updates(5, rec[:2])], epoch=1)
    _written_ahead(db)
    assert _pending_rows(db) == 2
    result = c.apply([_updates(10, rec[2:3]), Progress(10, 11, ((10, 1),))], epoch=1)
    assert result.uncounted == 2
    assert (c.frontier, c.pending, _pending_rows(db)) == (11, 0, 0)
    truth = {record_key(rec[2]): 1}
    assert kept(store) == truth == accumulated(store)
    db.close()
    again = SqliteDatabase(path)
    assert kept(again.store("f")) == truth


def test_updates_written_ahead_by_a_receiver_that_stopped_are_dropped_on_load(tmp_path):
    path = str(tmp_path / "r.db")
    db = SqliteDatabase(path)
    c = Consumer(db.store("f"), feed="f")
    rec = [{"id": i, "name": f"n{i}", "v": 0} for i in range(10)]
    c.apply([Progress(0, 0, ()), _updates(0, rec[:3]), Progress(0, 1, ((0, 3),))], epoch=1)
    c.apply([_updates(1, rec[3:7])], epoch=1)
    _written_ahead(db)
    assert _pending_rows(db) == 4
    db.close()  # stopped before time 1 committed
    db = SqliteDatabase(path)
    store = db.store("f")
    c = Consumer(store, feed="f")
    assert (c.frontier, c.pending, _pending_rows(db)) == (1, 0, 0)
    c.apply([Progress(1, 1, ()), _updates(1, rec[7:10]), Progress(1, 2, ((1, 3),))], epoch=1)
    truth = {record_key(r): 1 for r in rec[:3] + rec[7:10]}
    assert kept(store) == truth == accumulated(store)


def test_a_failed_write_ahead_leaves_the_commit_to_write_the_updates(tmp_path, monkeypatch):
    db = SqliteDatabase(str(tmp_path / "r.db"))
    store = db.store("f")
    c = Consumer(store, feed="f")
    rec = [{"id": i, "name": f"n{i}", "v": 0} for i in range(6)]

    def full_disk(self, tables):
        raise sqlite_store.CheckpointError("database or disk is full")

    monkeypatch.setattr(sqlite_store.SqliteStore, "_write_ahead", full_disk)
    c.apply([Progress(0, 0, ()), _updates(0, rec)], epoch=1)
    _written_ahead(db)
    assert _pending_rows(db) == 0
    monkeypatch.undo()
    c.apply([Progress(0, 1, ((0, 6),))], epoch=1)
    assert kept(store) == {record_key(r): 1 for r in rec} == accumulated(store)


def test_a_fold_round_that_gives_way_is_rolled_back_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(sqlite_store, "GIVE_WAY_ROWS", 2)
    db = SqliteDatabase(str(tmp_path / "r.db"))
    store = db.store("f")
    records = [{"id": i, "name": f"n{i}", "v": i % 3} for i in range(9)]
    store.commit(updates=[part(1, [(r, 1) for r in records], COLUMNAR)], frontier=2, epoch=1)
    asked = []

    def after_two_chunks() -> bool:
        asked.append(1)
        return len(asked) == 2

    with pytest.raises(sqlite_store.FoldGaveWay):
        store.fold(give_way=after_two_chunks)
    assert db.conn.execute("SELECT count(*) FROM collection").fetchone()[0] == 0
    assert db.conn.execute("SELECT folded FROM feeds").fetchone()[0] == 0
    assert store.fold(give_way=lambda: False) == 1
    assert kept(store) == {record_key(r): 1 for r in records} == accumulated(store)


def test_a_database_that_cannot_be_opened_is_an_error_naming_it(tmp_path):
    missing = str(tmp_path / "no such folder" / "r.db")
    with pytest.raises(sqlite_store.CheckpointError, match=r"no such folder/r\.db"):
        SqliteDatabase(missing)
    not_sqlite = tmp_path / "notes.db"
    not_sqlite.write_bytes(b"these are not the pages of a database " * 200)
    with pytest.raises(sqlite_store.CheckpointError, match=r"notes\.db"):
        SqliteDatabase(str(not_sqlite))


@pytest.mark.parametrize("record", [RECORD, COLUMNAR], ids=["orjson keys", "columnar keys"])
def test_a_row_read_through_a_grown_schema_is_the_same_record(tmp_path, record):
    # a feed's schema grows: rows kept before the change come back with the new column
    # null, and their retraction must meet what was kept
    grown = pa.struct([*record, ("qty", pa.int32())])
    db = SqliteDatabase(str(tmp_path / "r.db"))
    store = db.store("f")
    old = {"id": 1, "name": "a", "v": 2.0 if record == RECORD else 2}
    store.commit(updates=[part(1, [(old, 1)], record)], frontier=2, epoch=1)
    store.commit(
        updates=[part(2, [({**old, "qty": None}, -1), ({**old, "qty": 0}, 1)], grown)],
        frontier=3,
        epoch=1,
    )
    assert kept(store) == {record_key({**old, "qty": 0}): 1} == accumulated(store)


def test_a_collection_keyed_before_null_columns_counted_as_absent_is_folded_again(tmp_path):
    path = str(tmp_path / "r.db")
    db = SqliteDatabase(path)
    store = db.store("f")
    rec = {"id": 1, "name": None, "v": 3}
    store.commit(updates=[part(1, [(rec, 1)], COLUMNAR)], frontier=2, epoch=1)
    store.fold()
    db.close()
    # as an older receiver left it: the key with its null column, and no key format
    conn = sqlite3.connect(path)
    conn.execute("UPDATE collection SET rkey = ?", (b'{"id":1,"name":null,"v":3}',))
    conn.execute("PRAGMA user_version = 0")
    conn.commit()
    conn.close()
    again = SqliteDatabase(path).store("f")
    assert [k for k, _ in again.current()] == [b'{"id":1,"v":3}']
    again.commit(updates=[part(2, [(rec, -1)], COLUMNAR)], frontier=3, epoch=1)
    assert kept(again) == {} == accumulated(again)


def test_a_collection_keyed_before_nested_nulls_counted_as_absent_is_folded_again(tmp_path):
    """A database whose keys kept a nested record's null fields (key format 1) is keyed
    again when opened: a retraction of the record in another shape then cancels it."""
    nested = pa.struct([("id", pa.int64()), ("addr", pa.struct([("city", pa.string())]))])
    wider = pa.struct(
        [("id", pa.int64()), ("addr", pa.struct([("city", pa.string()), ("zip", pa.string())]))]
    )
    path = str(tmp_path / "r.db")
    db = SqliteDatabase(path)
    store = db.store("f")
    store.commit(
        updates=[part(1, [({"id": 1, "addr": {"city": "X"}}, 1)], wider)], frontier=2, epoch=1
    )
    store.fold()
    # as the code before key format 2 wrote it: the nested null in the key
    with db.conn:
        db.conn.execute(
            "UPDATE collection SET rkey = ?", (b'{"addr":{"city":"X","zip":null},"id":1}',)
        )
        db.conn.execute("PRAGMA user_version = 1")
    db.close()
    db = SqliteDatabase(path)
    store = db.store("f")
    store.load()
    store.commit(
        updates=[part(2, [({"id": 1, "addr": {"city": "X"}}, -1)], nested)], frontier=3, epoch=1
    )
    assert kept(store) == {} == accumulated(store)
    assert db.conn.execute("PRAGMA user_version").fetchone()[0] == sqlite_store.KEY_FORMAT
    db.close()
