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


def run_emitter(spark, **config):
    """Open an emitter with this config on the shared session, run it to the end of its
    input; return it (its ``cp`` is the last commit) and the transactions' reports."""
    from feed.emitter import Emitter, EmitterConfig

    e = Emitter(EmitterConfig(**config), spark=spark)
    e.open()
    return e, e.run()
