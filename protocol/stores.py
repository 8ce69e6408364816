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

from ._counts import record_keys_of
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
    no multiplicities then spends nothing per committed update. Record keys are built
    column-wise (:func:`~protocol._counts.record_keys_of`) and rows only when asked for."""

    def __init__(self, *, accumulate: bool = True) -> None:
        self._state = StoreState(frontier=None, epoch=0)
        self._accumulate = accumulate
        #: record key -> [multiplicity, the table and row of the record's first update]
        self._counts: dict[bytes, list[Any]] = {}
        self._tables: list[pa.Table] = []

    @property
    def committed(self) -> list[WireRow]:
        """Every committed update, in order, as wire rows."""
        return table_rows(self._tables)

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
        for table in updates:
            keys = record_keys_of(table.column("data")).to_pylist()
            diffs = table.column("diff").to_pylist()
            for i, (key, diff) in enumerate(zip(keys, diffs, strict=True)):
                slot = self._counts.setdefault(key, [0, table, i])
                slot[0] += diff
                if slot[0] == 0:
                    del self._counts[key]
            self._tables.append(table)

    def collection(self) -> list[tuple[Mapping[str, Any], int]]:
        """Every record with a non-zero accumulated multiplicity, and that multiplicity."""
        return [(_record(t, i), n) for n, t, i in self._counts.values()]

    def multiplicity(self, record: Mapping[str, Any]) -> int:
        return self.multiplicity_of(record_key(record))

    def multiplicity_of(self, key: bytes) -> int:
        """:meth:`multiplicity` of the record whose :func:`~protocol.messages.record_key`
        is ``key``."""
        slot = self._counts.get(key)
        return 0 if slot is None else int(slot[0])


def _record(table: pa.Table, i: int) -> Mapping[str, Any]:
    row: Mapping[str, Any] = table.column("data")[i].as_py(maps_as_pydicts="strict")
    return row
