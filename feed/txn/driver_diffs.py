"""What :mod:`feed.txn.driver` does to a small transaction's events, row by row: the same
rules as the Spark path's :mod:`feed.sources.transactions` (positions, repeats, completeness),
:mod:`feed.txn.times` (units), :mod:`feed.txn.diffs` (unavailable values, keyed diffs,
consolidation), on events as dictionaries (a few thousand at most).

Each event is a dict of the parsed change columns plus ``o`` (its order), ``k`` (its key)
and ``unit`` once assigned; functions that fill those in say so.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pyarrow as pa

from feed.log.info import Granularity

__all__ = [
    "assign_units",
    "at_commit",
    "by_key",
    "consolidate",
    "fill_unavailable",
    "held_back",
    "keyed_diffs",
    "once",
    "unkeyed_diffs",
]


def once(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events with a repeat (the same transaction, position and op, and for a
    snapshot read the same row: an at-least-once redelivery) left out, keeping the first
    delivered (:data:`feed.sources.positions.EVENT`)."""
    first: dict[tuple[Any, ...], dict[str, Any]] = {}
    for e in sorted(events, key=lambda e: (e["ord_file"], e["ord_row"])):
        # (the reads of one snapshot share a position: the row tells them apart; repr
        # keeps -0.0 from 0.0 and every NaN alike, as the JSON text Spark compares does)
        row = repr(tuple(e["after"].values())) if e["op"] == "r" else ""
        first.setdefault((e["txn"], e["pos_lo"], e["pos_n"], e["op"], row), e)
    return list(first.values())


def _commit_lsns(ends: list[dict[str, Any]]) -> dict[Any, int]:
    """Each source transaction's commit LSN: the highest of its END records read."""
    commit: dict[Any, int] = {}
    for end in ends:
        commit[end["txn"]] = max(commit.get(end["txn"], end["pos_hi"]), end["pos_hi"])
    return commit


def at_commit(ends: list[dict[str, Any]], data: list[dict[str, Any]]) -> None:
    """Give each event of a transaction with metadata its END record's commit LSN as
    ``pos_hi``, or None while its END is not read (it has no commit position yet), as
    :func:`feed.sources.transactions.assemble` does. ``ends``: the END records read
    (``txn``, ``pos_hi``, ``tx_count``)."""
    commit = _commit_lsns(ends)
    for e in data:
        if e["tx_meta"]:
            e["pos_hi"] = commit.get(e["txn"])


def held_back(
    data: list[dict[str, Any]],
    kept: list[dict[str, Any]],
    ends: list[dict[str, Any]],
    committed_hi: int,
    *,
    hold_txns: frozenset[Any] = frozenset(),
    hold_at: tuple[int, int] | None = None,
) -> tuple[set[Any], int] | None:
    """The source transactions held back and how many are released, as
    :meth:`feed.sources.holdback.SecondPass.hold` decides: a transaction with metadata
    (a ``transaction`` block on an event read, or an END record past the committed
    position) is incomplete while its END is not read or fewer of its events are in than
    END counts, and the first incomplete one in delivery order holds back every one
    delivered after it. ``data``: every data event read; ``kept``: those past the
    committed position, each once. What a group or a change of shape holds is held too:
    the transactions ``hold_txns``, and everything delivered from the first event of one
    of them or from the place ``hold_at`` on. None when a transaction has more events
    than its END counts (Spark warns and releases it)."""
    meta = {e["txn"] for e in data if e["tx_meta"]}
    commit = _commit_lsns(ends)
    counts: dict[Any, int | None] = {}
    for end in ends:
        x = end["txn"]
        n = end["tx_count"]
        counts[x] = n if counts.get(x) is None else max(n or 0, counts[x] or 0)
    expected = {x: n for x, n in counts.items() if commit[x] > committed_hi}
    events = Counter(e["txn"] for e in kept)
    first: dict[Any, tuple[int, int]] = {}
    for e in kept:
        at = (e["ord_file"], e["ord_row"])
        first[e["txn"]] = min(first.get(e["txn"], at), at)
    opened = set()
    for x in set(events) | expected.keys():
        n, want = events.get(x, 0), expected.get(x)
        if x not in meta and want is None:
            continue  # no metadata: complete as read
        if want is not None and n > want:
            return None
        if (want is None and n > 0) or (want is not None and n < want):
            opened.add(x)
    held = opened | hold_txns
    starts = [first[x] for x in held if x in first]
    if hold_at is not None:
        starts.append(hold_at)
    if starts:
        held |= {x for x, at in first.items() if at >= min(starts)}
    return held, sum(1 for x in events if x not in held)


def assign_units(events: list[dict[str, Any]], granularity: Granularity | None) -> int:
    """Each event's ``unit`` (:func:`feed.txn.times.assign_units`); returns how many."""
    if granularity == "batch":
        for e in events:
            e["unit"] = 0
        return 1
    first: dict[Any, tuple[int, ...]] = {}
    for e in events:
        if e["txn"] not in first or e["o"] < first[e["txn"]]:
            first[e["txn"]] = e["o"]
    rank = {txn: i for i, txn in enumerate(sorted(first, key=first.__getitem__))}
    for e in events:
        e["unit"] = rank[e["txn"]]
    return len(rank)


def by_key(events: list[dict[str, Any]]) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    """The events of each key, in the order they apply: by unit, then source order."""
    out: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for e in sorted(events, key=lambda e: (e["unit"], e["o"])):
        out.setdefault(e["k"], []).append(e)
    return out


def fill_unavailable(
    events: list[dict[str, Any]], old: dict[tuple[Any, ...], dict[str, Any]]
) -> bool:
    """Fill Debezium's unavailable-value placeholders (``_toast`` names the columns) from
    the key's latest earlier value, an earlier change of the transaction or its state
    row, as :func:`feed.txn.diffs.fill_unavailable` does; False when one has none."""
    if not any(e["_toast"] for e in events):
        return True
    for k, evs in by_key(events).items():
        if not any(e["_toast"] for e in evs):
            continue
        known = dict(old.get(k) or {})
        for e in evs:
            if e["after"] is None:
                continue
            toasted = set(e["_toast"].split(",")) if e["_toast"] else set()
            if toasted - known.keys():
                return False
            raw = e["after"]
            e["after"] = {c: known[c] if c in toasted else v for c, v in raw.items()}
            known.update((c, v) for c, v in raw.items() if c not in toasted)
    return True


def keyed_diffs(
    events: list[dict[str, Any]], old: dict[tuple[Any, ...], dict[str, Any]]
) -> tuple[list[tuple[dict[str, Any], int, int]], dict[tuple[Any, ...], tuple[int, Any]]] | None:
    """Each key's diffs per unit, as :func:`feed.txn.diffs.keyed_diffs`: retract what the key
    held before the unit, emit its last image in the unit. Returns the diffs and, per key,
    its bucket and final image (None: deleted); None when a delete meets an absent key."""
    diffs: list[tuple[dict[str, Any], int, int]] = []
    final: dict[tuple[Any, ...], tuple[int, Any]] = {}
    for k, evs in by_key(events).items():
        prev = old.get(k)
        for unit, group in itertools.groupby(evs, key=lambda e: e["unit"]):
            in_unit = list(group)
            last = in_unit[-1]
            img = None if last["op"] == "d" else last["after"]
            if img is None and prev is None and all(e["op"] == "d" for e in in_unit):
                return None
            if prev is not None:
                diffs.append((prev, unit, -1))
            if img is not None:
                diffs.append((img, unit, 1))
            prev = img
        final[k] = (evs[0]["_bucket"], prev)
    return diffs, final


def unkeyed_diffs(events: list[dict[str, Any]]) -> list[tuple[dict[str, Any], int, int]]:
    """Each event's diffs in its unit, as :func:`feed.txn.diffs.unkeyed_diffs`: its before
    image retracted, its after image added (a Debezium event weighs 1)."""
    diffs: list[tuple[dict[str, Any], int, int]] = []
    for e in events:
        if e["before"] is not None:
            diffs.append((e["before"], e["unit"], -1))
        if e["after"] is not None:
            diffs.append((e["after"], e["unit"], 1))
    return diffs


def consolidate(
    diffs: list[tuple[dict[str, Any], int, int]], record: pa.Schema
) -> dict[int, list[dict[str, Any]]]:
    """Sum the diffs per (record, unit) and drop zeros: each unit's rows with ``diff``.
    Floating-point columns group as Spark groups them: every NaN alike and -0.0 as 0.0,
    which is also the value written (:func:`_normal`)."""
    names = record.names
    floats = [f.name for f in record if pa.types.is_floating(f.type)]
    sums: Counter[tuple[Any, ...]] = Counter()
    rows: dict[tuple[Any, ...], dict[str, Any]] = {}
    for data, unit, d in diffs:
        if floats:
            data = {**data, **{n: _normal(data[n]) for n in floats}}
        k = (unit, *(_NAN if data[n] != data[n] else data[n] for n in names))
        sums[k] += d
        rows.setdefault(k, data)
    out: dict[int, list[dict[str, Any]]] = {}
    for k, n in sums.items():
        if n:
            out.setdefault(k[0], []).append({**rows[k], "diff": n})
    return out


#: what every NaN groups as (NaN is not equal to itself)
_NAN = ("NaN",)


def _normal(v: float | None) -> float | None:
    """-0.0 as 0.0 (Spark's NormalizeFloatingNumbers on grouping keys); the rest as is."""
    return 0.0 if v == 0 else v
