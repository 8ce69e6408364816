"""Source transactions with metadata in the one-pass engine (:mod:`feed.txn.onepass`).

With Debezium's transaction metadata a data event's position is its END record's commit
LSN, and its source transaction is complete once that END record and as many events as
it counts have been read (:mod:`feed.sources.transactions`). The one pass takes such input
when every source transaction read is complete, nothing held back: then, as without
metadata, every kept event is released at the transaction's one time.

A file's task places the data events of the transactions whose END record it holds at
their commit LSN (:func:`at_commit`) and counts each transaction's kept events. A
transaction it can judge alone (its END in the file, as many of its events as the END
counts, none elsewhere: a plain file of a connector holds most of them so) leaves no
trace; the others leave an :data:`Open` entry in the file's figures: the events counted
here, the END record's count and commit LSN when it is here, the highest of the events'
own places. Those are the transactions that straddle files, a few in each. The driver
adds them up across files (:func:`complete`): every one must be complete, else the
engine declines (nothing written) and the Spark path holds back what it must. An event
of a transaction whose END is in another file is kept (its commit LSN is not known to the
task: the position filter keeps it, as the Spark path keeps an event without one) and
the driver then requires that END's commit LSN to lie past the committed position.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from feed.sources.positions import DATA_OPS

__all__ = ["MAX_OPEN", "Open", "at_commit", "complete", "last_of", "open_transactions"]

#: a file leaving more transactions than this open is declined (the figures travel to
#: the driver; a connector's files leave one or two)
MAX_OPEN = 10_000


class Open(NamedTuple):
    """A source transaction one file's task could not judge alone."""

    txn: str
    events: int  # its kept data events in the file
    expected: int | None  # its END record's count, when the END is in the file
    commit: int | None  # and that END's commit LSN
    top: tuple[int, int] | None  # the highest (``pos_lo``, ``pos_n``) of those events


def at_commit(t: pa.Table) -> pa.Table:
    """The parsed rows ``t`` (:func:`~feed.sources.debezium_arrow.parse_flat`) with each
    data event that carries a transaction block at its END record's commit LSN
    (``pos_hi``), null where that END is not in the file."""
    meta = _meta_events(t)
    if not pc.any(meta).as_py():
        return t
    ends = _ends(t)
    commit = pc.take(ends["pos_hi"], pc.index_in(t["txn"], value_set=ends["txn"].combine_chunks()))
    hi = pc.if_else(meta, commit, t["pos_hi"])
    return t.set_column(t.schema.get_field_index("pos_hi"), "pos_hi", hi)


def open_transactions(
    t: pa.Table, events: pa.Table, committed_hi: int
) -> tuple[tuple[Open, ...], str | None]:
    """The source transactions of ``t`` (placed by :func:`at_commit`; ``events``: its
    data events past the committed position) that the file cannot judge alone, or why
    the file is not taken (an END record twice, too many open)."""
    is_end = pc.fill_null(pc.equal(t["op"], "E"), False)
    has_meta = pc.any(_meta_events(t)).as_py()
    if not has_meta and not pc.any(is_end).as_py():
        return (), None
    ends = _ends(t)
    if len(pc.unique(ends["txn"])) != ends.num_rows:
        return (), "a source transaction's END record read twice"
    # (an END at or below the committed position is done with, as the Spark path's)
    live = ends.filter(pc.greater(ends["pos_hi"], committed_hi))
    counts = events.group_by("txn").aggregate([("pos_n", "count"), ("tx_meta", "any")])
    txns = counts["txn"]
    at = pc.index_in(txns, value_set=live["txn"].combine_chunks())
    expected = pc.take(live["tx_count"], at)
    with_meta = pc.or_(pc.fill_null(counts["tx_meta_any"], False), pc.is_valid(at))
    alone = pc.fill_null(pc.equal(counts["pos_n_count"], expected), False)
    judged = pc.or_(pc.invert(with_meta), alone)
    unjudged = counts.filter(pc.invert(judged))
    done = txns.filter(judged).combine_chunks()
    ends_open = live.filter(pc.invert(pc.is_in(live["txn"], value_set=done)))
    if unjudged.num_rows + ends_open.num_rows > MAX_OPEN:
        return (), f"more than {MAX_OPEN} source transactions open at the file's ends"
    tops = _tops(events.filter(pc.is_in(events["txn"], value_set=unjudged["txn"].combine_chunks())))
    found: dict[str, Open] = {}
    for txn, n in zip(
        unjudged["txn"].to_pylist(), unjudged["pos_n_count"].to_pylist(), strict=True
    ):
        found[txn] = Open(txn, n, None, None, tops.get(txn))
    for txn, hi, count in zip(
        *(ends_open[c].to_pylist() for c in ("txn", "pos_hi", "tx_count")), strict=True
    ):
        seen = found.get(txn)
        found[txn] = Open(txn, seen.events if seen else 0, count, hi, seen.top if seen else None)
    return tuple(found[k] for k in sorted(found)), None


def complete(
    opened: Iterable[Open], committed_hi: int
) -> tuple[str | None, list[tuple[int, int, int]]]:
    """Whether the files' open transactions (``opened``, every file's) are all complete
    once added up: why not (None: they are), and the highest position of each one's
    events, at its commit LSN."""
    merged: dict[str, list[Any]] = {}
    for o in opened:
        m = merged.setdefault(o.txn, [0, None, None, None])
        m[0] += o.events
        if o.expected is not None:
            if m[1] is not None:
                return f"source transaction {o.txn}'s END record read twice", []
            m[1], m[2] = o.expected, o.commit
        if o.top is not None and (m[3] is None or o.top > m[3]):
            m[3] = o.top
    tops = []
    for txn, (events, expected, commit, top) in sorted(merged.items()):
        if expected is None:
            return f"source transaction {txn} without its END record (held back)", []
        if events != expected:
            return f"source transaction {txn}: {events} events read, its END counts {expected}", []
        if commit <= committed_hi:
            return f"source transaction {txn} committed at or below the committed position", []
        if top is not None:
            tops.append((commit, *top))
    return None, tops


def _meta_events(t: pa.Table) -> pa.Array:
    is_data = pc.is_in(t["op"], pa.array(DATA_OPS))
    return pc.and_(is_data, pc.fill_null(t["tx_meta"], False))


def _ends(t: pa.Table) -> pa.Table:
    """The file's END records: ``txn``, ``pos_hi`` (the commit LSN) and ``tx_count``."""
    is_end = pc.fill_null(pc.equal(t["op"], "E"), False)
    return t.select(["txn", "pos_hi", "tx_count"]).filter(is_end)


def _tops(events: pa.Table) -> dict[str, tuple[int, int]]:
    """The highest (``pos_lo``, ``pos_n``) of each source transaction's ``events``."""
    if events.num_rows == 0:
        return {}
    at, _ = last_of([events["txn"]], events.select(["pos_lo", "pos_n"]))
    rows = events.take(at)
    columns = (rows[c].to_pylist() for c in ("txn", "pos_lo", "pos_n"))
    return {txn: (lo, n) for txn, lo, n in zip(*columns, strict=True)}


def last_of(keys: Sequence[Any], order: pa.Table, up: Any = None, rows: bool = False) -> Any:
    """Which row is each key's last by ``order`` (its columns, ascending; a null sorts
    after every number), and the highest ``up`` of each key's rows (None without ``up``):
    the rows' indices and those highs; with ``rows``, each key's rows' indices too (a
    list per key)."""
    by = pc.sort_indices(order, [(c, "ascending") for c in order.column_names])
    names = [f"k{i}" for i in range(len(keys))]
    columns = {n: a.take(by) for n, a in zip(names, keys, strict=True)}
    columns["_i"] = pa.array(np.arange(len(by), dtype=np.int64))
    figures = [("_i", "max")]
    if up is not None:
        columns["up"] = up.take(by)
        figures.append(("up", "max"))
    if rows:
        figures.append(("_i", "list"))
    last = pa.table(columns).group_by(names).aggregate(figures)
    at = by.take(last["_i_max"].combine_chunks())
    ups = last["up_max"] if up is not None else None
    if not rows:
        return at, ups
    each = last["_i_list"].combine_chunks()
    listed = pa.ListArray.from_arrays(each.offsets, by.take(each.values))
    return at, ups, listed
