"""The DESIGN §3 consumer state machine: against a naive model, rollbacks, atomicity, epochs."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import (
    Conflict,
    Consumer,
    CountMismatch,
    Gap,
    MemoryStore,
    Progress,
    ProtocolError,
    StaleEpoch,
    Update,
    Updates,
    announcement,
    progress,
    record_key,
    state,
)

from ..strategies import valid_feeds


class NaiveConsumer:
    """DESIGN §3 read literally, with lists and no cleverness."""

    def __init__(self):
        self.F = None
        self.E = 0
        self.pending = []  # (key, record, t, d)
        self.committed = []

    def body(self, messages, epoch=None):
        saved = (self.F, self.E, list(self.pending), list(self.committed))
        try:
            if epoch is not None:
                if epoch < self.E:
                    raise StaleEpoch("stale")
                if epoch > self.E:
                    self.E = epoch
                    self.pending = []
            for m in messages:
                if isinstance(m, Updates):
                    for u in m:
                        self._update(u)
                else:
                    self._progress(m)
        except ProtocolError:
            self.F, self.E, self.pending, self.committed = saved
            raise

    def _update(self, u):
        if self.F is not None and u.time < self.F:
            return
        if u.diff == 0:
            raise ProtocolError("zero")
        k = record_key(u.record)
        for pk, _, pt, pd in self.pending:
            if pk == k and pt == u.time:
                if pd == u.diff:
                    return
                raise Conflict("conflict")
        self.pending.append((k, u.record, u.time, u.diff))

    def _progress(self, p):
        if p.upper < p.lower:
            raise ProtocolError("shape")
        ts = [t for t, _ in p.counts]
        if len(set(ts)) != len(ts) or any(
            not p.lower <= t < p.upper or n <= 0 for t, n in p.counts
        ):
            raise ProtocolError("shape")
        if self.F is None:
            self.F = p.lower
            # never counted by any progress: dropped, never kept
            self.pending = [x for x in self.pending if x[2] >= p.lower]
        if p.upper <= self.F:
            self.pending = []
            return
        if p.lower > self.F:
            raise Gap("gap")
        stated = dict(p.counts)
        for t in range(self.F, p.upper) if p.upper - self.F < 10_000 else []:
            have = sum(1 for x in self.pending if x[2] == t)
            if have != (stated.get(t, 0) if t >= self.F else 0):
                raise CountMismatch("count")
        closing = [x for x in self.pending if self.F <= x[2] < p.upper]
        self.committed += [(x[0], x[2], x[3]) for x in closing]
        self.pending = [x for x in self.pending if not self.F <= x[2] < p.upper]
        self.F = p.upper


REC = st.fixed_dictionaries({"k": st.integers(0, 2)})
UPD = st.builds(Update, REC, st.integers(0, 6), st.sampled_from([-1, 0, 1, 2]))
PROG = st.builds(
    lambda lo, span, counts: Progress(lo, lo + span, tuple(counts)),
    st.integers(0, 6),
    st.integers(-1, 3),
    st.lists(st.tuples(st.integers(0, 8), st.integers(0, 3)), max_size=3),
)
MSG = st.one_of(st.lists(UPD, min_size=1, max_size=4).map(Updates.of), PROG)
BODY = st.tuples(st.lists(MSG, min_size=1, max_size=4), st.none() | st.integers(0, 3))


@given(st.lists(BODY, max_size=25))
def test_state_machine_equals_naive_model(bodies):
    _check_against_model(bodies)


@given(st.lists(BODY, max_size=25))
def test_state_machine_equals_naive_model_when_every_hash_collides(bodies):
    """Record hashes only filter: with all of them equal, exact comparison decides alone."""
    with mock.patch.object(state, "row_hashes", lambda data: np.zeros(len(data), np.uint64)):
        _check_against_model(bodies)


def _as_arrow(bodies):
    """The same bodies with every update batch held as Arrow, as a decoded body's are: a
    body's batches are then hashed together, in one call."""
    return [
        ([Updates.from_arrow(m.table()) if isinstance(m, Updates) else m for m in ms], e)
        for ms, e in bodies
    ]


@given(st.lists(BODY, max_size=25))
def test_state_machine_equals_naive_model_with_arrow_batches(bodies):
    _check_against_model(_as_arrow(bodies))


@given(st.lists(BODY, max_size=25))
def test_arrow_batches_when_every_hash_collides(bodies):
    with mock.patch.object(state, "row_hashes", lambda data: np.zeros(len(data), np.uint64)):
        _check_against_model(_as_arrow(bodies))


def _check_against_model(bodies):
    store = MemoryStore()
    real = Consumer(store)
    model = NaiveConsumer()
    for messages, epoch in bodies:
        try:
            model.body(messages, epoch)
            expected = None
        except ProtocolError as e:
            expected = type(e)
        before = (real.frontier, real.epoch, real.pending, len(store.committed))
        if expected is None:
            real.apply(messages, epoch=epoch)
        else:
            with pytest.raises(expected):
                real.apply(messages, epoch=epoch)
            # a rejected body changes nothing
            assert (real.frontier, real.epoch, real.pending, len(store.committed)) == before
        assert real.frontier == model.F
        assert real.epoch == model.E
        assert real.pending == len(model.pending)
        assert sorted((record_key(r["data"]), r["time"], r["diff"]) for r in store.committed) == (
            sorted(model.committed)
        )


@given(valid_feeds(), st.data())
def test_redelivery_with_duplicates_and_rollbacks_ends_at_the_truth(feed, data):
    """A transport that repeats bodies and restarts sessions still commits each time once."""
    messages, truth = feed
    store = MemoryStore()
    c = Consumer(store)
    i = 0
    while i < len(messages):
        step = data.draw(st.integers(1, 3))
        body = messages[i : i + step]
        c.apply(body)
        if data.draw(st.booleans()):
            c.apply(body)  # a retried body: duplicates are ignored, late updates too
        if data.draw(st.integers(0, 4)) == 0:
            # a new session: the announcement drops the pending updates; resend from F
            c.apply([announcement(c.frontier)])
            while i > 0 and not (
                isinstance(messages[i - 1], Progress) and messages[i - 1].upper <= c.frontier
            ):
                i -= 1
            continue
        i += step
    expected = sorted(
        (record_key(r["data"]), r["time"], r["diff"]) for rows in truth.values() for r in rows
    )
    got = sorted((record_key(r["data"]), r["time"], r["diff"]) for r in store.committed)
    assert got == expected
    assert c.pending == 0


@given(valid_feeds())
def test_a_rollback_drops_exactly_the_pending_updates(feed):
    messages, _ = feed
    c = Consumer(MemoryStore())
    c.apply(messages)
    f = c.frontier
    extra = Updates.of([Update({"k": 99}, f, 1), Update({"k": 98}, f + 5, -1)])
    res = c.apply([extra])
    assert res.pending == 2
    res = c.apply([announcement(f)])
    assert res.pending == 0 and res.rollbacks == 1
    assert c.frontier == f


def test_progress_at_time1_then_updates_at_time2_then_time1_again_drops_time2():
    store = MemoryStore()
    c = Consumer(store)
    c.apply([announcement(0), Updates.of([Update({"a": 1}, 1, 1)]), Progress(0, 2, ((1, 1),))])
    c.apply([Updates.of([Update({"a": 2}, 2, 1)])])
    assert c.pending == 1
    c.apply([Progress(0, 2, ((1, 1),))])
    assert c.pending == 0
    with pytest.raises(CountMismatch):
        c.apply([progress(2, 1)])
    assert [r["data"] for r in store.committed] == [{"a": 1}]


def test_epochs_fence_and_adopt():
    store = MemoryStore()
    c = Consumer(store, feed="bank")
    c.apply([announcement(0), Updates.of([Update({"a": 1}, 1, 1)])], epoch=2)
    with pytest.raises(StaleEpoch, match=r"epoch 1.*epoch 2"):
        c.apply([progress(1, 1)], epoch=1)
    assert c.pending == 1 and c.frontier == 0
    res = c.apply([announcement(0)], epoch=3)  # a new producer: rollback
    assert res.pending == 0 and store.load().epoch == 3


def test_errors_name_the_feed_and_time():
    c = Consumer(MemoryStore(), feed="bank")
    c.apply([announcement(10), Updates.of([Update({"a": 1}, 11, 1)])])
    with pytest.raises(Conflict, match=r"feed 'bank': time 11: .*diff 1, now sent with diff -1"):
        c.apply([Updates.of([Update({"a": 1}, 11, -1)])])
    with pytest.raises(Gap, match=r"\[12, 13\) starts above the frontier 10"):
        c.apply([progress(12, 0)])
    with pytest.raises(CountMismatch, match="time 11: 1 pending, 2 stated"):
        c.apply([Progress(10, 12, ((11, 2),))])


def test_a_body_fails_whole_even_after_a_commit_inside_it():
    store = MemoryStore()
    c = Consumer(store)
    c.apply([announcement(0)])
    body = [Updates.of([Update({"a": 1}, 1, 1)]), progress(1, 1), progress(5, 1)]  # last: gap
    with pytest.raises(Gap):
        c.apply(body)
    assert store.committed == [] and c.frontier == 0 and c.pending == 0


def test_new_consumer_starts_at_the_first_lower():
    c = Consumer(MemoryStore())
    c.apply(
        [announcement(500), Updates.of([Update({"a": 1}, 501, 1)]), Progress(500, 502, ((501, 1),))]
    )
    assert c.frontier == 502
