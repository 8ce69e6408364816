"""The decisions about whole-table snapshots (feed/sources/snapshots.py), on figures as
Spark would give them, without Spark; tests/feed/test_debezium.py runs the same rules
through the emitter."""

from __future__ import annotations

from feed.sources.snapshots import Settled, classify, one_lsn_each, settle, superseded


def snap(lsn, first, last=None, *, end=False, txn="t", files=("a",), txns=None):
    return {
        "lsn": lsn,
        "s_first": first,
        "s_last": last,
        "s_end": end,
        "s_txn": txn,
        "s_txns": list(txns) if txns is not None else [txn] if txn is not None else [],
        "s_files": list(files),
    }


def test_the_first_snapshot_of_a_new_feed_is_its_own_and_the_rest_are_new_in_delivery_order():
    rows = [snap(90, (2, 0), (2, 5)), snap(50, (1, 0), (1, 9), end=True), snap(70, None)]
    found = classify(rows, own=None, new_feed=True, committed_hi=0, latest=(2, 5))
    assert [r["lsn"] for r in found.all] == [50, 90]  # (70: an end marker's row only)
    assert [r["lsn"] for r in found.fresh] == [90]
    assert found.whole == {50}  # 90: its end not read, nothing delivered after its last read


def test_a_snapshot_is_whole_once_an_event_comes_after_its_last_read():
    rows = [snap(50, (1, 0), (1, 9)), snap(90, (3, 0), (3, 4))]
    found = classify(rows, own=50, new_feed=False, committed_hi=60, latest=(3, 7))
    assert found.whole == {50, 90}
    assert [r["lsn"] for r in found.fresh] == [90]


def test_a_snapshot_at_or_below_the_committed_position_is_not_new():
    rows = [snap(40, (1, 0), (1, 3), end=True), snap(90, (2, 0), (2, 3), end=True)]
    found = classify(rows, own=10, new_feed=False, committed_hi=40, latest=None)
    assert [r["lsn"] for r in found.fresh] == [90]


def test_a_new_snapshot_supersedes_what_opened_before_it_and_unfinished_snapshots():
    new = snap(90, (5, 0), (5, 3), end=True, txn="s90")
    opened = [
        {"txn": "a", "first": (4, 2)},  # opened before it: moot
        {"txn": "b", "first": (6, 0)},  # after it: held, not dropped
        {"txn": "c", "first": None},  # no event kept: nothing to drop
    ]
    snaps = [
        snap(50, (1, 0), (1, 3), end=False, txn="s50"),  # unfinished, before: moot
        snap(60, (2, 0), (2, 3), end=True, txn="s60"),  # finished: kept
        snap(70, (3, 0), None, end=False, txn=None),  # another table's marker: no txn
        new,
    ]
    assert superseded(new, opened, snaps) == {"a", "s50"}


def test_a_whole_new_snapshot_goes_now_unless_something_before_it_waits():
    first = snap(90, (5, 0), (5, 3), end=True, txn="s90")
    second = snap(95, (7, 0), (7, 1), txn="s95")
    assert settle([first], earlier_waits=False, latest=None) == Settled((90, "s90"), False, None)
    assert settle([first, second], earlier_waits=False, latest=None) == Settled(
        (90, "s90"), False, (7, 0)
    )
    assert settle([first], earlier_waits=True, latest=None) == Settled(None, False, (5, 0))


def test_a_new_snapshot_not_known_whole_is_held_from_its_first_read():
    unfinished = snap(90, (5, 0), (5, 3), txn="s90")
    assert settle([unfinished], earlier_waits=False, latest=(5, 3)) == Settled(None, False, (5, 0))
    # an event delivered after its last read: whole
    assert settle([unfinished], earlier_waits=False, latest=(6, 0)).replaces == (90, "s90")


def test_a_new_snapshot_without_rows_of_the_table_replaces_it_with_nothing():
    empty = snap(90, (5, 0), None, end=True, txn=None)
    assert settle([empty], earlier_waits=False, latest=None) == Settled(
        (90, "snapshot:90"), True, None
    )


def test_rows_of_one_snapshot_transaction_move_to_one_lsn():
    """A snapshot is its transaction: rows of one transaction at several LSNs move to the
    lowest, or to the feed's own snapshot's LSN when they are of its transaction; one LSN
    per transaction moves nothing."""
    rows = [snap(50, (1, 0), txn="7"), snap(58, (1, 1), txn="7"), snap(90, (2, 0), txn="9")]
    assert one_lsn_each(rows, own_txn=None, own_lsn=None) == {"7": (50, [50, 58])}
    # another table's end marker of the same transaction at its own LSN moves too
    marker = snap(66, (1, 2), end=True, txn=None, txns=["7"])
    assert one_lsn_each([*rows, marker], own_txn=None, own_lsn=None) == {"7": (50, [50, 58, 66])}
    # the rest of the feed's own snapshot, read later, at other LSNs: to its LSN
    later = [snap(58, (3, 0), txn="7"), snap(66, (3, 1), txn="7")]
    assert one_lsn_each(later, own_txn="7", own_lsn=50) == {"7": (50, [58, 66])}
    assert one_lsn_each([snap(50, (3, 0), txn="7")], own_txn="7", own_lsn=50) == {}
    assert (
        one_lsn_each(
            [snap(50, (1, 0), txn="7"), snap(90, (2, 0), txn="9")], own_txn=None, own_lsn=None
        )
        == {}
    )
    # a new snapshot (another transaction) stays where it is
    assert one_lsn_each([snap(90, (2, 0), txn="9")], own_txn="7", own_lsn=50) == {}
