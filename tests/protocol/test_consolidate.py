"""consolidate(): differential dataflow's rule, on the row path and the Arrow path."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from protocol import Update, Updates, consolidate, record_key

from ..strategies import json_records

small_records = st.fixed_dictionaries(
    {
        "k": st.integers(0, 3),
        "s": st.none() | st.sampled_from(["", "é", "x"]),
        "n": st.none() | st.fixed_dictionaries({"z": st.none() | st.integers(0, 1)}),
    }
)
updates = st.lists(
    st.builds(Update, small_records, st.integers(0, 3), st.integers(-3, 3).filter(bool)),
    max_size=40,
)


def naive(ups):
    acc = Counter()
    recs = {}
    for u in ups:
        k = (u.time, record_key(u.record))
        acc[k] += u.diff
        recs[k] = u.record
    return {k: v for k, v in acc.items() if v}


def as_map(batch):
    return {(u.time, record_key(u.record)): u.diff for u in batch}


@given(updates)
def test_matches_the_naive_rule(ups):
    out = consolidate(ups)
    assert as_map(out) == naive(ups)
    assert len(out) == len(as_map(out))  # each (record, time) at most once
    assert all(u.diff != 0 for u in out)
    assert [u.time for u in out] == sorted(u.time for u in out)


@given(updates)
def test_arrow_path_equals_row_path(ups):
    rows = consolidate(Updates.of(ups))
    columnar = consolidate(Updates.from_arrow(Updates.of(ups).table())) if ups else rows
    assert as_map(columnar) == as_map(rows)


@given(updates, st.randoms())
def test_idempotent_and_order_independent(ups, rnd):
    once = consolidate(ups)
    assert as_map(consolidate(once)) == as_map(once)
    shuffled = list(ups)
    rnd.shuffle(shuffled)
    assert as_map(consolidate(shuffled)) == as_map(once)


@given(
    st.lists(
        st.builds(Update, json_records, st.integers(0, 2), st.integers(-2, 2).filter(bool)),
        max_size=15,
    )
)
def test_records_with_lists_fall_back_to_rows(ups):
    """Lists cannot be Arrow group keys: the result is still right."""
    if ups:
        assert as_map(consolidate(Updates.from_arrow(Updates.of(ups).table()))) == naive(ups)


def test_null_nested_struct_differs_from_struct_of_nulls():
    a = Update({"k": 1, "n": None}, 1, 1)
    b = Update({"k": 1, "n": {"z": None}}, 1, -1)
    out = consolidate(Updates.from_arrow(Updates.of([a, b]).table()))
    assert sorted(u.diff for u in out) == [-1, 1]


def test_big_batch_goes_columnar_and_cancels():
    ups = [Update({"k": i % 1000}, i % 3, 1 if i % 2 else -1) for i in range(60_000)]
    assert as_map(consolidate(ups)) == naive(ups)


def test_by_time_splits_an_update_table_into_times_in_order():
    import pyarrow as pa

    from protocol._consolidate import by_time

    table = pa.table({"data": ["a", "b", "c", "d"], "time": [5, 2, 5, 3], "diff": [1, 1, -1, 2]})
    got = [(t, part.column("data").to_pylist()) for t, part in by_time(table)]
    assert [t for t, _ in got] == [2, 3, 5]
    assert sorted(got[2][1]) == ["a", "c"] and got[0][1] == ["b"] and got[1][1] == ["d"]
    assert list(by_time(table.slice(0, 0))) == []
    assert [t for t, _ in by_time(table.slice(0, 1))] == [5]
