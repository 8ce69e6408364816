"""The feed checker: does a message stream keep the feed semantics of DESIGN §2 and §3?

It runs the stream through the same :class:`~protocol.state.Consumer` a receiver uses, so
the checker and the receiver cannot disagree about what a stream means, and adds the
stricter checks a *producer's* output must pass on top of what a consumer tolerates:

==================  =========================================================================
rule                what is reported
==================  =========================================================================
zero-diff           an update whose diff is 0 (§1, §2.1)
consolidated        a record twice at one time, with the same diff or another (§2.1)
late-update         an update at a time the frontier has already passed (§2.4)
uncounted           updates below the stream's first progress, which no progress counts (§2.3)
progress-shape      upper below lower, a count outside [lower, upper), a count <= 0, a time
                    counted twice (§1)
chained             an advancing progress whose lower is not the frontier before it (§2.2)
exact-counts        pending updates differ from the stated counts (§2.3)
non-negative        an accumulated multiplicity below 0 (§2.6, with ``non_negative``)
one-row-per-key     more than one live row for a key at a complete time (§2.6, with ``key``)
unclosed            updates at the end of the stream that no progress closed
==================  =========================================================================

Every violation carries the message index, its place in the input (line, datum, batch),
the time involved and what was expected. After a count or chain violation the checker
takes the progress at its word and carries on, so one mistake is reported once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pyarrow as pa

from ._counts import record_keys_of
from .errors import Conflict, CountMismatch, Gap, ProtocolError
from .messages import Message, Progress, Updates
from .state import ApplyResult, Consumer
from .stores import MemoryStore

__all__ = ["FeedChecker", "Violation", "check_messages"]


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken rule: where (message index and input position), which rule, what."""

    index: int
    position: str
    rule: str
    time: int | None
    detail: str

    def __str__(self) -> str:
        where = (
            f"{self.position} (message {self.index})"
            if self.position
            else (f"message {self.index}")
        )
        at = f" at time {self.time}" if self.time is not None else ""
        return f"{where}: {self.rule}{at}: {self.detail}"


class FeedChecker:
    """Feed messages one at a time with :meth:`check`; call :meth:`finish` at the end."""

    def __init__(
        self, *, non_negative: bool = False, key: Sequence[str] | None = None, feed: str = ""
    ) -> None:
        self.non_negative = non_negative or bool(key)
        # (multiplicities are only asked for by the non-negative and one-row-per-key rules)
        self.store = MemoryStore(accumulate=self.non_negative)
        self.consumer = Consumer(self.store, feed=feed)
        self.key = tuple(key) if key else None
        self.violations: list[Violation] = []
        self.messages = 0
        self.updates = 0
        self._index = 0
        self._position = ""
        # key tuple -> record key -> multiplicity, for the one-row-per-key rule
        self._live: dict[bytes, dict[bytes, int]] = {}

    @property
    def frontier(self) -> int | None:
        return self.consumer.frontier

    def _report(self, rule: str, time: int | None, detail: str) -> None:
        self.violations.append(Violation(self._index, self._position, rule, time, detail))

    def check(self, message: Message, *, position: str = "") -> None:
        """Check one message and remember what it changed."""
        self._position = position
        self._index = self.messages
        self.messages += 1
        match message:
            case Updates():
                self.updates += len(message)
                self._check_updates(message)
            case Progress():
                self._check_progress(message)

    def check_all(self, messages: Iterable[Message]) -> list[Violation]:
        """Check a whole stream (a :class:`~protocol.codecs.Decoder` gives positions)."""
        for m in messages:
            self.check(m, position=getattr(messages, "position", ""))
        return self.finish()

    def _check_updates(self, batch: Updates) -> None:
        try:
            self._after(self.consumer.apply([batch]))
        except ProtocolError:
            # one row at a time, to name every bad row and keep the good ones
            for row in batch.rows():
                try:
                    self._after(self.consumer.apply([Updates.from_rows([row])]))
                except Conflict as e:
                    self._report("consolidated", row["time"], str(e))
                except ProtocolError as e:
                    self._report("zero-diff", row["time"], str(e))

    def _after(self, res: ApplyResult) -> None:
        if res.late_count:
            ex = res.late[0]
            self._report(
                "late-update",
                ex["time"],
                f"{res.late_count} update(s) below the frontier {self.consumer.frontier}, "
                f"e.g. {ex['data']!r:.200}",
            )
        if res.uncounted:
            self._report(
                "uncounted",
                None,
                f"{res.uncounted} update(s) below the stream's first progress, which no "
                "progress counts",
            )
        if res.duplicate_count:
            ex = res.duplicates[0]
            self._report(
                "consolidated",
                ex["time"],
                f"{res.duplicate_count} record(s) repeated at the same time, "
                f"e.g. {ex['data']!r:.200}",
            )
        if res.committed and self.non_negative:
            self._check_multiplicities(res.committed)

    def _check_progress(self, p: Progress) -> None:
        f = self.consumer.frontier
        if f is not None and p.upper > f and p.lower < f:
            self._report(
                "chained",
                p.lower,
                f"progress [{p.lower}, {p.upper}) advances the frontier {f} "
                f"but its lower is not {f}",
            )
        try:
            self._after(self.consumer.apply([p]))
            return
        except Gap as e:
            self._report("chained", p.lower, str(e))
        except CountMismatch as e:
            self._report("exact-counts", p.lower, str(e))
        except ProtocolError as e:
            self._report("progress-shape", p.lower, str(e))
        self._after(self.consumer.force(p))

    def _check_multiplicities(self, committed: Sequence[pa.Table]) -> None:
        """The non-negative and one-row-per-key rules over the records a commit touched
        (their keys built column-wise; a row is made Python only to be reported). A
        commit's updates may come in several tables (one per message): a key's live
        rows are counted once all of them are taken, so a retraction in a later
        message than its key's new row is not a second live row."""
        keys_touched: set[bytes] = set()
        for table in committed:
            keys_touched |= self._take_multiplicities(table)
        for kk in keys_touched:
            live = self._live[kk]
            total = sum(n for n in live.values() if n > 0)
            if total > 1:
                self._report(
                    "one-row-per-key",
                    self.consumer.frontier,
                    f"key {kk.decode(errors='replace')} has {total} live rows below "
                    f"frontier {self.consumer.frontier}; expected at most 1",
                )
            if not live:
                del self._live[kk]

    def _take_multiplicities(self, committed: pa.Table) -> set[bytes]:
        """The non-negative rule over one table of a commit, each of its records' live
        multiplicity noted under its key; the keys it touched."""
        data = committed.column("data")
        keys = record_keys_of(data).to_pylist()
        touched: dict[bytes, int] = {}  # record key -> the row of its first update here
        for i, rk in enumerate(keys):
            touched.setdefault(rk, i)
        by_key = None if self.key is None else _key_records(data, self.key).to_pylist()
        times = committed.column("time")
        keys_touched: set[bytes] = set()
        for rk, i in touched.items():
            n = self.store.multiplicity_of(rk)
            if n < 0:
                record = data[i].as_py(maps_as_pydicts="strict")
                self._report(
                    "non-negative",
                    times[i].as_py(),
                    f"record {record!r:.200} accumulates to multiplicity {n}",
                )
            if by_key is not None:
                kk = by_key[i]
                live = self._live.setdefault(kk, {})
                if n:
                    live[rk] = n
                else:
                    live.pop(rk, None)
                keys_touched.add(kk)
        return keys_touched

    def finish(self) -> list[Violation]:
        """Report updates that no progress closed; return every violation found."""
        left = self.consumer.pending
        if left:
            self._position = "end"
            self._index = self.messages
            self._report(
                "unclosed",
                self.consumer.frontier,
                f"{left} update(s) at times >= {self.consumer.frontier} were never closed by a "
                "progress",
            )
        return self.violations


def _key_records(data: pa.ChunkedArray, key: Sequence[str]) -> pa.Array:
    """The :func:`~protocol.messages.record_key` of each record's key columns (a column
    the records lack counts as null, which the key leaves out)."""
    records = data.combine_chunks() if data.num_chunks != 1 else data.chunk(0)
    fields = records.flatten()  # (the records' nulls folded into each field)
    names = [records.type.field(i).name for i in range(records.type.num_fields)]
    columns = [fields[names.index(c)] if c in names else pa.nulls(len(records)) for c in key]
    return record_keys_of(pa.chunked_array([pa.StructArray.from_arrays(columns, names=list(key))]))


def check_messages(
    messages: Iterable[Message], *, non_negative: bool = False, key: Sequence[str] | None = None
) -> list[Violation]:
    """Every violation in a whole stream (empty when it keeps the feed semantics)."""
    return FeedChecker(non_negative=non_negative, key=key).check_all(messages)
