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

Pending updates stay columnar: each accepted piece of a body is an Arrow table (``data``,
``time``, ``diff``) with a vectorised 64-bit hash per record (:mod:`protocol.rowhash`).
Distinct hashes prove distinct records, so a body whose hashes meet neither each other nor
the pending ones is accepted without a Python object per update; only records whose hashes
collide are compared exactly, one by one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ._consolidate import by_time
from .errors import Conflict, CountMismatch, Gap, ProtocolError, StaleEpoch
from .messages import UPDATE_COLUMNS, Message, Progress, Updates, WireRow, record_key
from .rowhash import PendingHashes, row_hashes
from .stores import Store

__all__ = ["ApplyResult", "Consumer"]

#: the column the record hashes of a batch travel in while it is split by time
_HASHES = "_hashes"

#: How many example rows an :class:`ApplyResult` keeps of ignored updates.
EXAMPLES_KEPT = 3


@dataclass(slots=True)
class ApplyResult:
    """What one :meth:`Consumer.apply` did."""

    frontier: int | None
    pending: int
    #: the update tables made durable, one or more per completed time
    committed: list[pa.Table] = field(default_factory=list)
    late: list[WireRow] = field(default_factory=list)
    duplicates: list[WireRow] = field(default_factory=list)
    rollbacks: int = 0
    late_count: int = 0
    duplicate_count: int = 0
    #: updates dropped because a first progress started above their time (no progress
    #: ever counted them)
    uncounted: int = 0


@dataclass(frozen=True, slots=True)
class _Piece:
    """Pending updates at one time: distinct records, with their hashes."""

    table: pa.Table
    hashes: np.ndarray
    #: ``hashes`` sorted
    ordered: np.ndarray

    def __len__(self) -> int:
        return int(self.table.num_rows)


# pending: time -> pieces (the records of all pieces at one time are distinct)
_Pending = dict[int, list[_Piece]]

_INT64 = pa.int64()


class Consumer:
    """The DESIGN §3 state machine in front of a durable :class:`Store`."""

    def __init__(self, store: Store, *, feed: str = "") -> None:
        self._store = store
        self.feed = feed
        state = store.load()
        self._frontier = state.frontier
        self._epoch = state.epoch
        self._pending: _Pending = {}
        #: per pending time, the hashes of all its pieces in a few sorted runs behind a
        #: map of their top bits (:class:`~protocol.rowhash.PendingHashes`): a new body's
        #: records are looked up in them (one set or one array, rebuilt per body, was
        #: quadratic in a time spread over many bodies: a stream's lines of 2 000 updates)
        self._sorted: dict[int, PendingHashes] = {}

    @property
    def frontier(self) -> int | None:
        return self._frontier

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def pending(self) -> int:
        return sum(len(p) for pieces in self._pending.values() for p in pieces)

    def apply(self, messages: Iterable[Message], *, epoch: int | None = None) -> ApplyResult:
        """Apply one body of messages atomically; raise a ProtocolError and change nothing."""
        messages = list(messages)
        tx = _Txn(self)
        if epoch is not None:
            tx.adopt_epoch(epoch)
        tx.hashes = _body_hashes(messages)  # (after the epoch: a stale body is not hashed)
        run: list[Updates] = []  # consecutive update batches are judged as one
        for message in messages:
            match message:
                case Updates():
                    run.append(message)
                    continue
                case Progress():
                    tx.updates(run)
                    run = []
                    tx.progress(message)
                case _:
                    raise TypeError(f"not a message: {type(message).__name__}")
        tx.updates(run)
        return tx.finish()

    def force(self, p: Progress) -> ApplyResult:
        """Commit what is pending in ``[F, p.upper)`` whatever the counts, and set ``F``.

        For the feed checker, which reports a mismatch and then carries on from the stream's
        own view of the frontier. A receiver never calls this.
        """
        tx = _Txn(self)
        tx.progress(p, force=True)
        return tx.finish()


def _body_hashes(messages: list[Message]) -> dict[int, np.ndarray]:
    """The record hashes of every update batch of a body (by the batch's ``id``), from
    one :func:`row_hashes` call over all of them. A body of many small times (a feed
    server's 20 times of 10 000 updates) otherwise paid a call's fixed cost per time:
    82 ms of a 1M-update push's 230 ms apply, against 31 ms for five batches of 200 000.
    Empty when the batches' record types differ or one is held as Python rows: each is
    then hashed on its own, where the body reaches it."""
    batches = [m for m in messages if isinstance(m, Updates) and len(m)]
    if len(batches) < 2 or not all(b.has_table() for b in batches):
        return {}
    columns = [b.table().column("data") for b in batches]
    if any(c.type != columns[0].type for c in columns):
        return {}
    every = row_hashes(pa.chunked_array([k for c in columns for k in c.chunks], columns[0].type))
    out, at = {}, 0
    for b in batches:
        out[id(b)] = every[at : at + len(b)]
        at += len(b)
    return out


def _examples(table: pa.Table) -> list[WireRow]:
    rows: list[WireRow] = table.slice(0, EXAMPLES_KEPT).to_pylist(maps_as_pydicts="strict")
    return rows


class _Txn:
    """Staged changes of one :meth:`Consumer.apply`, merged only when all of it succeeded."""

    def __init__(self, consumer: Consumer) -> None:
        self.c = consumer
        #: record hashes of the body's update batches, by batch (see _body_hashes)
        self.hashes: dict[int, np.ndarray] = {}
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

    def _base(self, t: int) -> list[_Piece]:
        if self.cleared or t in self.done_times:
            return []
        return self.c._pending.get(t, [])

    def _pieces(self, t: int) -> list[_Piece]:
        return self._base(t) + self.added.get(t, [])

    def updates(self, batches: list[Updates]) -> None:
        batches = [b for b in batches if len(b)]
        tables = [b.table().select(list(UPDATE_COLUMNS)) for b in batches]
        hashes = [self.hashes.get(id(b)) for b in batches]
        if len(tables) > 1:
            # record types may differ between batches: then they go one at a time
            with contextlib.suppress(pa.ArrowInvalid):
                tables = [pa.concat_tables(tables)]
                known = [h for h in hashes if h is not None]
                hashes = [np.concatenate(known) if len(known) == len(batches) else None]
        for table, h in zip(tables, hashes, strict=True):
            self._updates(table, h)

    def _updates(self, table: pa.Table, hashes: np.ndarray | None = None) -> None:
        for name in ("time", "diff"):
            if table.schema.field(name).type != _INT64:
                table = table.set_column(
                    table.schema.get_field_index(name), name, table.column(name).cast(_INT64)
                )
        zero = pc.equal(table.column("diff"), 0)
        if self.frontier is not None:  # a late update is ignored whatever its diff
            zero = pc.and_(zero, pc.greater_equal(table.column("time"), self.frontier))
        if pc.any(zero).as_py():
            # the updates before the first zero diff are judged first, as if one at a time
            first = int(pc.index(zero, True).as_py())
            self._accept(table.slice(0, first), None if hashes is None else hashes[:first])
            row = _examples(table.slice(first))[0]
            raise ProtocolError(
                f"{self._where(row['time'])}update with diff 0 for {row['data']!r:.200}"
            )
        self._accept(table, hashes)

    def _accept(self, table: pa.Table, hashes: np.ndarray | None = None) -> None:
        """Stage the updates of ``table`` (whose records hash to ``hashes``, when known)."""
        if not table.num_rows:
            return
        if self.frontier is not None:
            late = pc.less(table.column("time"), self.frontier)
            n_late = pc.sum(late).as_py() or 0
            if n_late:
                res = self.result
                res.late_count += n_late
                if len(res.late) < EXAMPLES_KEPT:
                    res.late.extend(_examples(table.filter(late))[: EXAMPLES_KEPT - len(res.late)])
                table = table.filter(pc.invert(late))
                if hashes is not None:
                    hashes = hashes[~np.asarray(late.to_numpy(zero_copy_only=False))]
                if not table.num_rows:
                    return
        # (the records hashed once for the batch, whatever its times: a call per time
        # costs its own overhead, a tenth of a 100-time push's apply)
        if hashes is None:
            hashes = row_hashes(table.column("data"))
        table = table.append_column(_HASHES, pa.array(hashes))
        for t, part in by_time(table):
            self._add(t, part.drop_columns([_HASHES]), part.column(_HASHES).to_numpy())

    def _add(self, t: int, table: pa.Table, hashes: np.ndarray) -> None:
        """Stage ``table`` (updates at time ``t``, whose records hash to ``hashes``)."""
        # sorted once: for the lookups, for the repeats within the batch (neighbours) and
        # for the consumer's sorted hashes of the time (merged in by finish())
        ordered = np.sort(hashes)
        pieces = self._pieces(t)
        held = self.c._sorted.get(t) if self._base(t) else None
        staged = self.added.get(t, [])
        # (the usual batch meets nothing: only then is it worth knowing which rows did)
        met = bool(held is not None and held.meets(ordered)) or bool(
            staged and np.isin(ordered, np.concatenate([p.hashes for p in staged])).any()
        )
        repeated = bool(np.any(ordered[1:] == ordered[:-1]))
        if repeated or met:
            found = np.zeros(len(hashes), dtype=bool)
            if met:
                if held is not None:
                    found |= held.found(np.argsort(hashes), ordered)
                if staged:  # this body's earlier batches at t: few, looked up directly
                    found |= np.isin(hashes, np.concatenate([p.hashes for p in staged]))
            hv = pa.array(hashes)
            table, kept = self._exact(t, table, hashes, hv, pieces, hashes[found], repeated)
            if not len(kept):
                return
            if len(kept) != len(hashes):
                hashes, ordered = kept, np.sort(kept)
        self.added.setdefault(t, []).append(_Piece(table, hashes, ordered))

    def _exact(
        self,
        t: int,
        table: pa.Table,
        hashes: np.ndarray,
        hv: pa.Array,
        pieces: list[_Piece],
        met: np.ndarray,
        repeated: bool,
    ) -> tuple[pa.Table, np.ndarray]:
        """Compare exactly the records whose hashes collide; drop duplicates, raise on a
        conflict. Returns the rows to keep."""
        suspects = []
        if repeated:
            counts = pc.value_counts(hv)
            many = pc.greater(counts.field("counts"), 1)
            suspects.append(counts.field("values").filter(many))
        if len(met):  # hashes of this batch also found among the pending pieces
            suspects.append(pa.array(met))
        suspect = pa.concat_arrays(suspects)
        known: dict[bytes, int] = {}
        for p in pieces:
            hit = pc.is_in(pa.array(p.hashes), value_set=suspect)
            for row in p.table.filter(hit).to_pylist(maps_as_pydicts="strict"):
                known[record_key(row["data"])] = row["diff"]
        mask = pc.is_in(hv, value_set=suspect).to_numpy(zero_copy_only=False)
        keep = np.ones(len(hashes), dtype=bool)
        idx = np.flatnonzero(mask)
        res = self.result
        rows = table.take(pa.array(idx)).to_pylist(maps_as_pydicts="strict")
        for i, row in zip(idx.tolist(), rows, strict=True):
            key = record_key(row["data"])
            diff = known.get(key)
            if diff is None:
                known[key] = row["diff"]
            elif diff == row["diff"]:
                keep[i] = False
                res.duplicate_count += 1
                if len(res.duplicates) < EXAMPLES_KEPT:
                    res.duplicates.append(row)
            else:
                raise Conflict(
                    f"{self._where(t)}record {row['data']!r:.200} is pending with diff "
                    f"{diff}, now sent with diff {row['diff']}"
                )
        if keep.all():
            return table, hashes
        return table.filter(pa.array(keep)), hashes[keep]

    def _pending_times(self) -> Iterator[int]:
        seen = set(self.added)
        yield from self.added
        if not self.cleared:
            yield from (t for t in self.c._pending if t not in seen and t not in self.done_times)

    def _count(self, t: int) -> int:
        return sum(len(p) for p in self._pieces(t))

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
            # a consumer that has seen nothing adopts the first lower (a feed may start
            # above 0); updates pending below it were never counted by any progress: they
            # are dropped, never kept (a store counts what is below the frontier as kept)
            self.frontier = p.lower
            for t in [t for t in self._pending_times() if t < p.lower]:
                self.result.uncounted += self._count(t)
                self.added.pop(t, None)
                self.done_times.add(t)
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
            pieces = self._base(t) + self.added.pop(t, [])
            self.result.committed.extend(piece.table for piece in pieces)
            self.done_times.add(t)
        self.frontier = p.upper

    def finish(self) -> ApplyResult:
        c = self.c
        changed = (
            self.result.committed
            or self.added
            or self.cleared
            or self.frontier != c._frontier
            or self.epoch != c._epoch
        )
        if changed:
            # what stays pending: the store may write it ahead of the commit that names it
            pending = [p.table for t in self._pending_times() for p in self._pieces(t)]
            c._store.commit(
                updates=self.result.committed,
                frontier=self.frontier,
                epoch=self.epoch,
                pending=pending,
            )
        # the store has it durably: now the in-memory view may follow
        if self.cleared:
            c._pending, c._sorted = {}, {}
        for t in self.done_times:
            c._pending.pop(t, None)
            c._sorted.pop(t, None)
        for t, pieces in self.added.items():
            c._pending[t] = c._pending.get(t, []) + pieces
            runs = [p.ordered for p in pieces]
            new = np.sort(np.concatenate(runs), kind="stable") if len(runs) > 1 else runs[0]
            c._sorted.setdefault(t, PendingHashes()).add(new)
        c._frontier, c._epoch = self.frontier, self.epoch
        self.result.frontier = self.frontier
        self.result.pending = c.pending
        return self.result
