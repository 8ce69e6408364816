"""The consumer's durable side: the :class:`Store` interface a
:class:`~protocol.state.Consumer` commits through, and :class:`MemoryStore`, a store in
memory that accumulates the collection (for the feed checker and tests). The reference
receiver's store is :class:`~protocol.sqlite_store.SqliteStore`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa

from .messages import WireRow, record_key

__all__ = ["MemoryStore", "Store", "StoreState", "table_rows"]


@dataclass(frozen=True, slots=True)
class StoreState:
    frontier: int | None
    epoch: int


class Store(Protocol):
    """Durable state of a consumer. ``commit`` must be atomic: all of it or nothing."""

    def load(self) -> StoreState:
        """The last committed frontier and epoch (``None``, 0 for a new consumer)."""
        ...

    def commit(
        self,
        *,
        updates: list[pa.Table],
        frontier: int | None,
        epoch: int,
        pending: Sequence[pa.Table] = (),
    ) -> None:
        """Durably add ``updates`` (tables of ``data``, ``time``, ``diff``, all at completed
        times), set the frontier and the epoch.

        ``pending`` names the tables still pending after this call (at times at or above
        ``frontier``). They are not part of the committed state, but a store may write them
        ahead, so that the commit that later names them in ``updates`` has less to write;
        whatever it wrote ahead and a later call names in neither list was rolled back, and
        is dropped. A consumer calls this after every body that changed its state or its
        pending updates."""
        ...


def table_rows(tables: Iterable[pa.Table]) -> list[WireRow]:
    """The wire rows of update tables, in order."""
    return [row for t in tables for row in t.to_pylist(maps_as_pydicts="strict")]


class MemoryStore:
    """A :class:`Store` in memory, accumulating the collection (for checks and tests).
    With ``accumulate=False`` it keeps only the frontier and the epoch: a check that needs
    no multiplicities then spends nothing per committed update (a Python object and a
    record key each, most of a 1 M-update check's time)."""

    def __init__(self, *, accumulate: bool = True) -> None:
        self._state = StoreState(frontier=None, epoch=0)
        self._accumulate = accumulate
        self._counts: dict[bytes, list[Any]] = {}
        self.committed: list[WireRow] = []

    def load(self) -> StoreState:
        return self._state

    def commit(
        self,
        *,
        updates: list[pa.Table],
        frontier: int | None,
        epoch: int,
        pending: Sequence[pa.Table] = (),
    ) -> None:
        self._state = StoreState(frontier=frontier, epoch=epoch)
        if not self._accumulate:
            return
        rows = table_rows(updates)
        for row in rows:
            key = record_key(row["data"])
            slot = self._counts.setdefault(key, [row["data"], 0])
            slot[1] += row["diff"]
            if slot[1] == 0:
                del self._counts[key]
        self.committed.extend(rows)

    def collection(self) -> list[tuple[Mapping[str, Any], int]]:
        """Every record with a non-zero accumulated multiplicity, and that multiplicity."""
        return [(rec, n) for rec, n in self._counts.values()]

    def multiplicity(self, record: Mapping[str, Any]) -> int:
        slot = self._counts.get(record_key(record))
        return 0 if slot is None else int(slot[1])
