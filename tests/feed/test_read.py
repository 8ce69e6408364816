"""feed.log.read: the reading API, against the plain-Python truth, on a fresh and a compacted
feed (one time per source transaction, logical clock: time t holds transaction t)."""

from __future__ import annotations

from collections import Counter

import polars as pl
import pytest

from feed.log.compaction import compact
from feed.log.read import open_feed
from protocol import Compacted, record_key

from .model import as_multiset, debezium_truth
from .test_compaction import BANK, bank_log, log_copy  # noqa: F401 (fixtures)

FINAL, STATES = debezium_truth(BANK.events)
COLUMNS = ["id", "owner", "balance", "active", "note"]


def rows(table) -> list[dict]:
    return [{c: r[c] for c in COLUMNS} for r in table.to_pylist()]


def counted(table, weight: str) -> Counter:
    c: Counter = Counter()
    for r in table.to_pylist():
        c[record_key({k: r[k] for k in COLUMNS})] += r[weight]
    return Counter({k: v for k, v in c.items() if v})  # negative counts kept (deltas)


def truth_at(t: int) -> Counter:
    return as_multiset(STATES[t - 1].values())


@pytest.mark.parametrize("compacted", [False, True])
def test_updates_collections_deltas_history_and_progress(log_copy, compacted):  # noqa: F811
    f = open_feed(str(log_copy), "bank")
    times = sorted({t for t in f.updates().column("time").to_pylist()})
    if compacted:
        compact(str(log_copy), "bank", times[len(times) // 2])
        f.refresh()
        assert f.since == times[len(times) // 2]
    assert f.key == ("id",) and f.clock == "logical"
    kept = [t for t in times if t >= f.since]
    # the updates accumulate to the collection at every kept time, as the truth has it
    everything = f.updates()
    assert everything.column_names == ["time", "diff", *COLUMNS]
    assert counted(everything, "diff") == as_multiset(FINAL.values())
    for t in kept[:: max(1, len(kept) // 5)]:
        assert counted(f.collection(at=t), "count") == truth_at(t), t
        upto = everything.filter(everything.column("time").to_numpy() <= t)
        assert counted(upto, "diff") == truth_at(t)
    assert counted(f.collection(), "count") == as_multiset(FINAL.values())
    # deltas: collection(t2) - collection(t1), consolidated
    t1, t2 = kept[1], kept[-2]
    d = f.deltas(t1, t2)
    assert d.column_names == [*COLUMNS, "diff"] and 0 not in d.column("diff").to_pylist()
    want = Counter(truth_at(t2))
    want.subtract(truth_at(t1))
    assert counted(d, "diff") == Counter({k: v for k, v in want.items() if v})
    # after= and upto= select times; a start inside the folded range is refused
    mid = f.updates(after=t1, upto=t2)
    assert set(mid.column("time").to_pylist()) <= set(range(t1, t2))
    if compacted:
        # from since: exactly the kept times' updates; from the start: the collection first
        from_since = f.updates(after=f.since)
        assert set(from_since.column("time").to_pylist()) == set(kept)
        assert from_since.num_rows == sum(n for t, n in f.counts().items() if t >= f.since)
        with pytest.raises(Compacted):
            f.updates(after=1)
        with pytest.raises(Compacted):
            f.updates(after=0, upto=f.since)
        with pytest.raises(Compacted):
            f.deltas(0, t2)
    # one record's life: its rows in time order, ending in its final row (or gone)
    for k in [*list(FINAL)[:3], max(FINAL) + 1000]:
        h = f.history(id=k)
        assert h.column("time").to_pylist() == sorted(h.column("time").to_pylist())
        assert sum(h.column("diff").to_pylist()) == (1 if k in FINAL else 0)
        if k in FINAL:
            last = [r for r in rows(h.filter(h.column("diff").to_numpy() > 0))][-1]
            assert record_key(last) == record_key(FINAL[k])
    # progress: the kept commits, the last one at the frontier, times in UTC
    p = f.progress()
    assert p.column("upper").to_pylist()[-1] == f.frontier
    assert str(p.schema.field("committed_at").type) == "timestamp[ms, tz=UTC]"
    # Polars takes the tables as they are
    assert pl.from_arrow(everything).height == everything.num_rows
