"""The feed checker finds every §2/§3 violation and passes every valid feed."""

from __future__ import annotations

import pytest
from hypothesis import given

from protocol import FeedChecker, Progress, Update, Updates, announcement, check_messages, progress

from ..strategies import valid_feeds


@given(valid_feeds())
def test_valid_feeds_pass(feed):
    messages, _ = feed
    assert check_messages(messages) == []


def U(*triples):
    return Updates.of([Update(r, t, d) for r, t, d in triples])


CASES = {
    "zero-diff": [announcement(0), U(({"a": 1}, 1, 0)), Progress(0, 2, ())],
    "consolidated": [
        announcement(0),
        U(({"a": 1}, 1, 1), ({"a": 1}, 1, 1)),
        Progress(0, 2, ((1, 1),)),
    ],
    "late-update": [announcement(0), Progress(0, 2, ()), U(({"a": 1}, 1, 1))],
    "uncounted": [U(({"a": 1}, 5, 1)), Progress(10, 11, ())],
    "chained": [announcement(0), Progress(3, 4, ())],
    "exact-counts": [announcement(0), U(({"a": 1}, 1, 1)), Progress(0, 2, ((1, 2),))],
    "progress-shape": [announcement(0), Progress(0, 2, ((5, 1),))],
    "unclosed": [announcement(0), U(({"a": 1}, 1, 1))],
    "non-negative": [announcement(0), U(({"a": 1}, 1, -1)), Progress(0, 2, ((1, 1),))],
    "one-row-per-key": [
        announcement(0),
        U(({"id": 1, "v": "x"}, 1, 1), ({"id": 1, "v": "y"}, 1, 1)),
        Progress(0, 2, ((1, 2),)),
    ],
}


@pytest.mark.parametrize("rule", sorted(CASES))
def test_each_rule_is_detected(rule):
    violations = check_messages(
        CASES[rule], non_negative=True, key=["id"] if "key" in rule else None
    )
    assert [v.rule for v in violations] == [rule], violations


def test_conflicting_diffs_name_the_record():
    msgs = [announcement(0), U(({"a": 1}, 1, 1), ({"a": 1}, 1, -2)), Progress(0, 2, ((1, 1),))]
    [v] = check_messages(msgs)
    assert v.rule == "consolidated" and v.time == 1 and "'a': 1" in v.detail


def test_overlapping_lower_is_a_chain_violation_but_counts_still_check():
    msgs = [
        announcement(0),
        U(({"a": 1}, 1, 1)),
        Progress(0, 2, ((1, 1),)),
        U(({"a": 2}, 3, 1)),
        Progress(1, 4, ((3, 1),)),
    ]
    [v] = check_messages(msgs)
    assert v.rule == "chained" and "lower is not 2" in v.detail


def test_one_mistake_is_reported_once():
    msgs = [announcement(0), U(({"a": 1}, 1, 1)), Progress(0, 2, ())]
    msgs += [U(({"a": 2}, 2, 1)), progress(2, 1), U(({"a": 3}, 3, 1)), progress(3, 1)]
    assert msgs[4] == Progress(2, 3, ((2, 1),))
    assert [v.rule for v in check_messages(msgs)] == ["exact-counts"]


def test_violation_names_position_and_message_index():
    checker = FeedChecker()
    checker.check(announcement(0), position="line 1")
    checker.check(Progress(2, 3, ()), position="line 2")
    [v] = checker.finish()
    assert (v.index, v.position, v.rule) == (1, "line 2", "chained")
    assert str(v).startswith("line 2 (message 1): chained at time 2:")


def test_rollback_is_legal_anywhere():
    """A re-announcement drops what is pending; what follows it is counted afresh."""
    msgs = [
        announcement(0),
        U(({"a": 1}, 1, 1)),
        announcement(0),
        U(({"a": 2}, 1, 1)),
        Progress(0, 2, ((1, 1),)),
    ]
    checker = FeedChecker(non_negative=True)  # (its store then keeps what was committed)
    assert checker.check_all(msgs) == []
    assert [r["data"] for r in checker.store.committed] == [{"a": 2}]


def test_multiplicity_rules_over_several_times_name_the_record_the_time_and_the_key():
    """Records and key columns are keyed column-wise: a retraction cancels its insert
    in a later time, and a record without the key column counts under the empty key."""
    msgs = [
        announcement(0),
        U(({"id": 1, "v": "x"}, 1, 1), ({"id": 2, "v": "x"}, 1, 1)),
        Progress(0, 2, ((1, 2),)),
        U(({"id": 1, "v": "x"}, 2, -1), ({"id": 1, "v": "y"}, 2, 1)),  # an update: fine
        Progress(2, 3, ((2, 2),)),
        U(({"id": 1, "v": "z"}, 3, 1), ({"id": 3, "v": "w"}, 3, -1)),
        Progress(3, 4, ((3, 2),)),
        U(({"v": "q"}, 4, 1), ({"v": "r"}, 4, 1)),  # no id: both under the key {}
        Progress(4, 5, ((4, 2),)),
    ]
    found = [(v.rule, v.time, v.detail) for v in check_messages(msgs, key=["id"])]
    assert [(rule, t) for rule, t, _ in found] == [
        ("non-negative", 3),
        ("one-row-per-key", 4),
        ("one-row-per-key", 5),
    ]
    assert "{'id': 3, 'v': 'w'}" in found[0][2] and "multiplicity -1" in found[0][2]
    assert 'key {"id":1} has 2 live rows' in found[1][2]
    assert "key {} has 2 live rows" in found[2][2]


def test_a_key_updated_across_two_messages_of_one_time_has_one_live_row():
    """A time's updates may come in several messages (a reader's batches): a key's new
    row in one and its old row's retraction in a later one is an update, whichever
    comes first. A second new row in a later message is still found."""
    head = [announcement(0), U(({"id": 1, "v": "x"}, 1, 1)), Progress(0, 2, ((1, 1),))]
    new_first = [U(({"id": 1, "v": "y"}, 2, 1)), U(({"id": 1, "v": "x"}, 2, -1))]
    retract_first = list(reversed(new_first))
    for body in (new_first, retract_first):
        assert check_messages([*head, *body, Progress(2, 3, ((2, 2),))], key=["id"]) == []
    two_new = [*new_first, U(({"id": 1, "v": "z"}, 2, 1))]
    found = check_messages([*head, *two_new, Progress(2, 3, ((2, 3),))], key=["id"])
    assert [v.rule for v in found] == ["one-row-per-key"]
    assert 'key {"id":1} has 2 live rows' in found[0].detail
