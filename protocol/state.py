"""The consumer state machine of DESIGN §3, over a small durable-store interface.

State: the durable frontier ``F`` (``None`` for a consumer that has seen nothing), the
durable epoch ``E``, and the pending updates at times ``>= F`` (in memory only).

* An update at a time below ``F`` is already complete and ignored. A pending ``(record,
  time)`` seen again with the same diff is a duplicate and ignored; with another diff it is a
  :class:`~protocol.errors.Conflict`. A zero diff is a :class:`~protocol.errors.ProtocolError`.
* A progress with ``upper <= F`` is a rollback: every pending update is dropped. A progress
  with ``lower > F`` is a :class:`~protocol.errors.Gap`. Otherwise the pending count of every
  time in ``[F, upper)`` must equal the stated count (:class:`~protocol.errors.CountMismatch`);
  then those times commit durably in one step and ``F`` becomes ``upper``.
* An epoch below ``E`` is :class:`~protocol.errors.StaleEpoch`; a higher one is adopted
  durably and starts with a rollback.

:meth:`Consumer.apply` takes a whole body of messages and is atomic: when it raises, neither
the store nor the pending updates changed. A consumer that has seen nothing adopts the first
progress' ``lower`` as its frontier (a feed may start above 0 after compaction).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import Conflict, CountMismatch, Gap, ProtocolError, StaleEpoch
from .messages import Message, Progress, Updates, WireRow, record_key, record_keys

__all__ = ["ApplyResult", "Consumer", "MemoryStore", "Store", "StoreState"]

#: How many example rows an :class:`ApplyResult` keeps of ignored updates.
EXAMPLES_KEPT = 3


@dataclass(frozen=True, slots=True)
class StoreState:
    frontier: int | None
    epoch: int


class Store(Protocol):
    """Durable state of a consumer. ``commit`` must be atomic: all of it or nothing."""

    def load(self) -> StoreState:
        """The last committed frontier and epoch (``None``, 0 for a new consumer)."""
        ...

    def commit(self, *, updates: list[WireRow], frontier: int | None, epoch: int) -> None:
        """Durably add ``updates`` (all at completed times), set the frontier and epoch."""
        ...


class MemoryStore:
    """A :class:`Store` in memory, accumulating the collection (for checks and tests)."""

    def __init__(self) -> None:
        self._state = StoreState(frontier=None, epoch=0)
        self._counts: dict[bytes, list[Any]] = {}
        self.committed: list[WireRow] = []

    def load(self) -> StoreState:
        return self._state

    def commit(self, *, updates: list[WireRow], frontier: int | None, epoch: int) -> None:
        for row in updates:
            key = record_key(row["data"])
            slot = self._counts.setdefault(key, [row["data"], 0])
            slot[1] += row["diff"]
            if slot[1] == 0:
                del self._counts[key]
        self.committed.extend(updates)
        self._state = StoreState(frontier=frontier, epoch=epoch)

    def collection(self) -> list[tuple[Mapping[str, Any], int]]:
        """Every record with a non-zero accumulated multiplicity, and that multiplicity."""
        return [(rec, n) for rec, n in self._counts.values()]

    def multiplicity(self, record: Mapping[str, Any]) -> int:
        slot = self._counts.get(record_key(record))
        return 0 if slot is None else int(slot[1])


@dataclass(slots=True)
class ApplyResult:
    """What one :meth:`Consumer.apply` did."""

    frontier: int | None
    pending: int
    committed: list[WireRow] = field(default_factory=list)
    late: list[WireRow] = field(default_factory=list)
    duplicates: list[WireRow] = field(default_factory=list)
    rollbacks: int = 0
    late_count: int = 0
    duplicate_count: int = 0


# pending: time -> record key -> wire row
_Pending = dict[int, dict[bytes, WireRow]]


class Consumer:
    """The DESIGN §3 state machine in front of a durable :class:`Store`."""

    def __init__(self, store: Store, *, feed: str = "") -> None:
        self._store = store
        self.feed = feed
        state = store.load()
        self._frontier = state.frontier
        self._epoch = state.epoch
        self._pending: _Pending = {}

    @property
    def frontier(self) -> int | None:
        return self._frontier

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def pending(self) -> int:
        return sum(len(v) for v in self._pending.values())

    def apply(self, messages: Iterable[Message], *, epoch: int | None = None) -> ApplyResult:
        """Apply one body of messages atomically; raise a ProtocolError and change nothing."""
        tx = _Txn(self)
        if epoch is not None:
            tx.adopt_epoch(epoch)
        for message in messages:
            match message:
                case Updates():
                    tx.updates(message)
                case Progress():
                    tx.progress(message)
                case _:
                    raise TypeError(f"not a message: {type(message).__name__}")
        return tx.finish()

    def force(self, p: Progress) -> ApplyResult:
        """Commit what is pending in ``[F, p.upper)`` whatever the counts, and set ``F``.

        For the feed checker, which reports a mismatch and then carries on from the stream's
        own view of the frontier. A receiver never calls this.
        """
        tx = _Txn(self)
        tx.progress(p, force=True)
        return tx.finish()


class _Txn:
    """Staged changes of one :meth:`Consumer.apply`, merged only when all of it succeeded."""

    def __init__(self, consumer: Consumer) -> None:
        self.c = consumer
        self.frontier = consumer._frontier
        self.epoch = consumer._epoch
        self.cleared = False  # a rollback happened: the consumer's pending no longer counts
        self.added: _Pending = {}
        self.done_times: set[int] = set()
        self.result = ApplyResult(frontier=self.frontier, pending=0)

    def _where(self, t: int | None = None) -> str:
        feed = f"feed {self.c.feed!r}: " if self.c.feed else ""
        return feed + (f"time {t}: " if t is not None else "")

    def adopt_epoch(self, epoch: int) -> None:
        if epoch < self.epoch:
            raise StaleEpoch(
                f"{self._where()}push from epoch {epoch}, but epoch {self.epoch} was adopted"
            )
        if epoch > self.epoch:
            self.epoch = epoch
            self._rollback()

    def _rollback(self) -> None:
        self.cleared = True
        self.added = {}
        self.result.rollbacks += 1

    def _base(self, t: int) -> dict[bytes, WireRow]:
        if self.cleared or t in self.done_times:
            return {}
        return self.c._pending.get(t, {})

    def updates(self, batch: Updates) -> None:
        rows = batch.rows()
        keys = record_keys([r["data"] for r in rows])
        f = self.frontier
        res = self.result
        for key, row in zip(keys, rows, strict=True):
            t = row["time"]
            if f is not None and t < f:
                res.late_count += 1
                if len(res.late) < EXAMPLES_KEPT:
                    res.late.append(row)
                continue
            if row["diff"] == 0:
                raise ProtocolError(f"{self._where(t)}update with diff 0 for {row['data']!r:.200}")
            have = self.added.get(t, {}).get(key) or self._base(t).get(key)
            if have is None:
                self.added.setdefault(t, {})[key] = row
            elif have["diff"] == row["diff"]:
                res.duplicate_count += 1
                if len(res.duplicates) < EXAMPLES_KEPT:
                    res.duplicates.append(row)
            else:
                raise Conflict(
                    f"{self._where(t)}record {row['data']!r:.200} is pending with diff "
                    f"{have['diff']}, now sent with diff {row['diff']}"
                )

    def _pending_times(self) -> Iterator[int]:
        seen = set(self.added)
        yield from self.added
        if not self.cleared:
            yield from (t for t in self.c._pending if t not in seen and t not in self.done_times)

    def _count(self, t: int) -> int:
        return len(self.added.get(t, ())) + len(self._base(t))

    def progress(self, p: Progress, *, force: bool = False) -> None:
        if p.upper < p.lower and not force:
            raise ProtocolError(f"{self._where()}progress upper {p.upper} is below lower {p.lower}")
        stated: dict[int, int] = {}
        for t, n in p.counts:
            if force:
                stated[t] = n
                continue
            if not p.lower <= t < p.upper:
                raise ProtocolError(
                    f"{self._where(t)}count outside the progress range [{p.lower}, {p.upper})"
                )
            if n <= 0:
                raise ProtocolError(f"{self._where(t)}count {n} must be positive")
            if t in stated:
                raise ProtocolError(f"{self._where(t)}counted twice in one progress")
            stated[t] = n
        if self.frontier is None:
            self.frontier = p.lower
        f = self.frontier
        if p.upper <= f:
            self._rollback()
            return
        if p.lower > f and not force:
            raise Gap(
                f"{self._where()}progress [{p.lower}, {p.upper}) starts above the frontier {f}: "
                f"times [{f}, {p.lower}) were never closed"
            )
        closing = sorted(t for t in self._pending_times() if f <= t < p.upper)
        if not force:
            problems = []
            for t in sorted(set(closing) | {t for t in stated if t >= f}):
                have, want = self._count(t), stated.get(t, 0)
                if have != want:
                    problems.append(f"time {t}: {have} pending, {want} stated")
            if problems:
                raise CountMismatch(
                    f"{self._where()}progress [{p.lower}, {p.upper}) does not match the pending "
                    f"updates ({'; '.join(problems[:5])}"
                    f"{'; …' if len(problems) > 5 else ''}); nothing committed"
                )
        for t in closing:
            rows = list(self._base(t).values()) + list(self.added.pop(t, {}).values())
            self.result.committed.extend(rows)
            self.done_times.add(t)
        self.frontier = p.upper

    def finish(self) -> ApplyResult:
        c = self.c
        changed = self.result.committed or self.frontier != c._frontier or self.epoch != c._epoch
        if changed:
            c._store.commit(updates=self.result.committed, frontier=self.frontier, epoch=self.epoch)
        # the store has it durably: now the in-memory view may follow
        if self.cleared:
            c._pending = {}
        for t in self.done_times:
            c._pending.pop(t, None)
        for t, rows in self.added.items():
            c._pending.setdefault(t, {}).update(rows)
        c._frontier, c._epoch = self.frontier, self.epoch
        self.result.frontier = self.frontier
        self.result.pending = c.pending
        return self.result
