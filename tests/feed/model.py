"""Plain-Python ground truth for the emitter's tests: apply change events to a dict."""

from __future__ import annotations

from collections import Counter
from typing import Any

import orjson

from protocol import record_key


def debezium_truth(lines: list[bytes], key: str = "id") -> tuple[dict[Any, dict], list[dict]]:
    """Final table by key, and the table after each source transaction (in delivery order).

    Events whose LSN was already seen (redelivery) are skipped, like the emitter must.
    """
    table: dict[Any, dict] = {}
    states: list[dict] = []
    seen: set[int] = set()
    current_tx = None
    for line in lines:
        e = orjson.loads(line)
        p = e.get("payload", e)
        lsn = p["source"]["lsn"]
        if lsn in seen:
            continue
        seen.add(lsn)
        tx = p["source"]["txId"]
        if current_tx is not None and tx != current_tx:
            states.append(dict(table))
        current_tx = tx
        if p["op"] == "d":
            table.pop(p["before"][key], None)
        else:
            table[p["after"][key]] = p["after"]
    if current_tx is not None:
        states.append(dict(table))
    return table, states


def as_multiset(rows) -> Counter:
    """A collection as a multiset of canonical record keys."""
    c: Counter = Counter()
    for r in rows:
        c[record_key(r)] += 1
    return c


def collection_of(reader, at=None) -> Counter:
    """The feed's accumulated collection as a multiset (counts expanded)."""
    snap = reader.snapshot(at)
    c: Counter = Counter()
    for row in snap.to_pylist():
        n = row.pop("count")
        c[record_key(row)] += n
    return c


#: a record with a double: NaN, -0.0 and 0.0 in consolidation
MEASURES = {
    "type": "record",
    "name": "measures",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "x", "type": ["null", "double"], "default": None},
    ],
}


def run_emitter(spark, engines=None, **config):
    """Open an emitter with this config on the shared session (offering its transactions
    to ``engines``, by default the emitter's), run it to the end of its input; return it
    (its ``cp`` is the last commit) and the transactions' reports."""
    from feed.emit.emitter import Emitter, EmitterConfig

    extra = {} if engines is None else {"engines": engines}
    e = Emitter(EmitterConfig(**config), spark=spark, **extra)
    e.open()
    return e, e.run()


def emit_bank(spark, src, log, feed: str = "accounts", **config):
    """:func:`run_emitter` on bank Debezium input the way most tests feed it: keyed on
    ``id``, the accounts schema, logical clock, one time per source transaction."""
    from feed.demo.data import ACCOUNTS_SCHEMA

    settings = dict(
        source_kind="debezium",
        source_path=str(src),
        feed=feed,
        log=str(log),
        key=("id",),
        schema=ACCOUNTS_SCHEMA,
        clock="logical",
        granularity="transaction",
    )
    return run_emitter(spark, **{**settings, **config})


class DDReader:
    """A model of differential dataflow's CDCv2 reader (``capture.rs``), holding nothing at
    the start: its frontier begins at time 0; every progress takes one from each ``lower``
    time and adds one to each ``upper`` time (so order does not matter); updates are
    de-duplicated by (data, time, diff); a time is complete once the updates received
    there equal the counts stated for it. The frontier is the least time that is either
    still held by the progress counts or not yet complete."""

    def __init__(self) -> None:
        self.bounds: Counter = Counter({0: 1})
        self.expected: Counter = Counter()
        self.received: Counter = Counter()
        self.seen: set[tuple[Any, int, int]] = set()
        self.updates: list[tuple[Any, int, int]] = []

    def read(self, messages) -> DDReader:
        from protocol import Progress, Updates

        for m in messages:
            if isinstance(m, Updates):
                for u in m:
                    k = (record_key(u.record), u.time, u.diff)
                    if k not in self.seen:
                        self.seen.add(k)
                        self.received[u.time] += 1
                        self.updates.append(k)
            elif isinstance(m, Progress):
                self.bounds[m.lower] -= 1
                self.bounds[m.upper] += 1
                for t, n in m.counts:
                    self.expected[t] += n
        return self

    @property
    def frontier(self) -> int:
        held = [t for t, n in self.bounds.items() if n > 0]
        assert all(n >= 0 for n in self.bounds.values()), f"progress below 0: {self.bounds}"
        bound = min(held) if held else 1 << 63
        open_times = [t for t in self.expected if self.expected[t] != self.received[t]]
        open_times += [t for t in self.received if self.received[t] > self.expected[t]]
        return min([bound, *open_times])

    def collection(self) -> Counter:
        """The accumulated collection below the frontier."""
        f = self.frontier
        c: Counter = Counter()
        for rec, t, d in self.updates:
            if t < f:
                c[rec] += d
        return +c


def with_metadata(events: list[bytes]) -> list[bytes]:
    """The events as a connector with ``provide.transaction.metadata`` delivers them: each
    transaction between a BEGIN and an END record, its events numbered."""
    out: list[bytes] = []
    group: list[dict] = []

    def close() -> None:
        xid, commit = group[0]["source"]["txId"], group[-1]["source"]["lsn"] + 1
        out.append(orjson.dumps({"status": "BEGIN", "id": f"{xid}:{commit}"}))
        for i, e in enumerate(group):
            e["transaction"] = {"id": f"{xid}:{e['source']['lsn']}", "total_order": i + 1}
            out.append(orjson.dumps(e))
        counts = [{"data_collection": "public.accounts", "event_count": len(group)}]
        end = {"status": "END", "id": f"{xid}:{commit}", "event_count": len(group)}
        out.append(orjson.dumps({**end, "data_collections": counts}))
        group.clear()

    for line in events:
        e = orjson.loads(line)
        e = e.get("payload", e)
        if group and group[0]["source"]["txId"] != e["source"]["txId"]:
            close()
        group.append(e)
    close()
    return out
