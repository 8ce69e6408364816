"""Which of a small transaction's events the driver engine (:mod:`feed.txn.driver`) lets
go of now, for one feed or for every feed of a group, as
:meth:`feed.sources.holdback.SecondPass.hold` decides it in Spark: past the committed
position, each once, in the source transactions not held back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from feed.sources.positions import DATA_OPS
from feed.txn.context import GroupHold
from feed.txn.driver_diffs import held_back

__all__ = ["Events", "Release", "release", "released_together"]


@dataclass(frozen=True, slots=True)
class Release:
    """What :func:`release` lets go of the events read."""

    kept: list[dict[str, Any]]  # to turn into updates now, with their order and key
    redelivered: int  # events dropped as done already or repeated
    held: set[Any]  # the source transactions held back
    ready: int  # how many are released
    files: set[str]  # the input files holding the held ones' events and END records
    held_at: tuple[int, int] | None  # the first place of a held one's event, or the hold's


@dataclass(frozen=True, slots=True)
class Events:
    """A read's parts the release needs: every row parsed (``t``), its data events
    (``data``), those past the committed position, each once (``fresh``), its END records
    (``ends``), the committed commit LSN and the feed's key columns."""

    t: pa.Table
    data: list[dict[str, Any]]
    fresh: list[dict[str, Any]]
    ends: list[dict[str, Any]]
    committed_hi: int
    key: tuple[str, ...]


def release(ev: Events, hold: GroupHold | None = None) -> Release | str:
    """The data events to turn into updates (past the committed position, each once, in
    the source transactions not held back, with their order ``o`` and key ``k``), or
    why the transaction goes to Spark. A group's ``hold`` holds back its transactions too,
    and everything delivered from its place or from the first event of one of them on
    (:meth:`feed.sources.holdback.SecondPass.hold`)."""
    t, fresh = ev.t, ev.fresh
    found = held_back(
        ev.data,
        fresh,
        ev.ends,
        ev.committed_hi,
        hold_txns=hold.txns if hold is not None else frozenset(),
        hold_at=hold.at if hold is not None else None,
    )
    if found is None:
        return "a source transaction with more events than its END record counts"
    held, ready = found
    places = [(e["ord_file"], e["ord_row"]) for e in fresh if e["txn"] in held]
    if hold is not None and hold.at is not None:
        places.append(hold.at)
    files: set[str] = set()
    if held:
        theirs = pc.and_(
            pc.is_in(t.column("op"), pa.array([*DATA_OPS, "E"])),
            pc.is_in(t.column("txn"), pa.array(sorted(held, key=str), t.schema.field("txn").type)),
        )
        files = set(pc.unique(t.filter(theirs).column("_file")).to_pylist())
    kept = [e for e in fresh if e["txn"] not in held]
    for e in kept:
        e["o"] = (e["pos_hi"], e["pos_lo"], e["pos_n"], e["ord_file"], e["ord_row"])
        img = e["before"] if e["op"] == "d" else e["after"]
        e["k"] = tuple(img[c] for c in ev.key)
    return Release(kept, len(ev.data) - len(fresh), held, ready, files, min(places, default=None))


def released_together(reads: Sequence[Events]) -> list[Release] | str:
    """Each feed's release under the group's hold: the source transactions any feed holds
    back, and every one delivered after the first of them, held in all (a fixed point:
    the hold only grows)."""
    hold = GroupHold()
    for _ in range(len(reads) + 2):
        out = []
        for ev in reads:
            r = release(ev, hold)
            if isinstance(r, str):
                return r
            out.append(r)
        places = [r.held_at for r in out if r.held_at is not None]
        found = GroupHold(frozenset().union(*(r.held for r in out)), min(places, default=None))
        if found == hold:
            return out
        hold = found
    return "the feeds' held-back transactions disagree"
