"""What the emitter and a group of feeds share about a transaction's commit: the
checkpoint it will record (:class:`Planned`), the emitter's states, the wallclock, and the
widening of a transaction's input window while no source transaction in it completes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from feed.emit.progress import TxnProgress, TxnReport
from feed.log.checkpoint import Checkpoint
from feed.txn.context import NEED_MORE
from protocol import Progress

__all__ = ["Planned", "State", "now_ms", "time_after", "widening"]


@dataclass(frozen=True, slots=True)
class Planned:
    """What a transaction's commit records: its checkpoint is ``build(base)``."""

    progress: Progress
    next: int
    source: dict[str, Any]
    state: str | None
    schema: str | None = None  # a new schema version's fingerprint (None: unchanged)

    @classmethod
    def idle(cls, cp: Checkpoint, upper: int, nxt: int) -> Planned:
        """A commit with no update that moves ``cp``'s frontier to ``upper``."""
        return cls(Progress(cp.frontier, upper, ()), nxt, cp.source, cp.state)

    def build(self, base: Checkpoint) -> Checkpoint:
        more = {"schema": self.schema} if self.schema is not None else {}
        return base.successor(
            progress=self.progress, next=self.next, source=self.source, state=self.state, **more
        )


def widening(
    pending: list[str],
    files: list[str],
    txn: Callable[..., Any],
    progress: TxnProgress | None,
) -> TxnReport | None:
    """``txn(files, more=…)``, over twice as many of the ``pending`` files each time it
    finds nothing complete (:data:`~feed.txn.context.NEED_MORE`: a source transaction is
    longer than the window); ``None`` without input or when nothing is complete."""
    if not files:
        return None
    while True:
        try:
            report = txn(files, more=len(files) < len(pending))
        finally:
            if progress is not None:
                progress.done()
        if report is not NEED_MORE:
            assert report is None or isinstance(report, TxnReport)
            return report
        files = pending[: 2 * len(files)]


class State(Enum):
    UNOPENED = "unopened"
    OPENED = "opened"
    CLOSED = "closed"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def time_after(clock_kind: str, clock: Callable[[], int], upper: int) -> int:
    """The next transaction's time once a commit has reached ``upper``: ``upper`` itself
    on a logical clock; on the wall clock, now if now is later (times follow the clock,
    never go back)."""
    return max(clock(), upper) if clock_kind == "wallclock" else upper
