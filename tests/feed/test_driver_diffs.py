"""The driver engine's hold-back of incomplete source transactions, without Spark
(feed/txn/driver_diffs.py:held_back; tests/feed/test_driver_txn.py compares it with
Spark's on whole histories)."""

from __future__ import annotations

from feed.txn.driver_diffs import at_commit, held_back, once


def _event(txn: str, lsn: int, place: int, *, meta: bool = True, n: int = 1) -> dict:
    return {
        "txn": txn,
        "op": "u",
        "pos_hi": lsn,
        "pos_lo": lsn,
        "pos_n": n,
        "tx_meta": meta,
        "ord_file": place // 100,
        "ord_row": place % 100,
        "after": {"id": place},
    }


def _end(txn: str, lsn: int, count: int | None) -> dict:
    return {"txn": txn, "pos_hi": lsn, "tx_count": count}


def test_a_transaction_without_its_end_holds_back_every_one_delivered_after_it():
    data = [
        _event("a", 10, 1),
        _event("b", 20, 2),  # its END is not read
        _event("c", 30, 101, meta=False),  # delivered after b: held with it
    ]
    ends = [_end("a", 11, 1)]
    at_commit(ends, data)
    assert [e["pos_hi"] for e in data] == [11, None, 30]  # b has no commit position yet
    assert held_back(data, once(data), ends, committed_hi=0) == ({"b", "c"}, 1)


def test_fewer_events_than_the_end_counts_hold_it_back_and_more_go_to_spark():
    data = [_event("a", 10, 1, n=1), _event("a", 12, 2, n=2)]
    at_commit([_end("a", 13, 3)], data)
    assert held_back(data, data, [_end("a", 13, 3)], committed_hi=0) == ({"a"}, 0)
    assert held_back(data, data, [_end("a", 13, 2)], committed_hi=0) == (set(), 1)
    assert held_back(data, data, [_end("a", 13, 1)], committed_hi=0) is None


def test_without_metadata_and_for_a_committed_end_nothing_waits():
    plain = [_event("a", 10, 1, meta=False), _event("b", 20, 2, meta=False)]
    assert held_back(plain, plain, [], committed_hi=0) == (set(), 2)
    # a transaction turned into updates before, read again with its END: no event kept,
    # its END at or below the committed position; it waits for nothing
    again = [_event("a", 10, 1)]
    ends = [_end("a", 11, 1)]
    at_commit(ends, again)
    assert held_back(again, [], ends, committed_hi=11) == (set(), 0)
