"""The emitter's loops over an opened :class:`~feed.emit.emitter.Emitter`: a batch run takes
transactions until the input is consumed; a follow run polls the input every
``--trigger`` seconds, forever or until asked to stop."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, Protocol

from feed.emit.progress import TxnReport

__all__ = ["HeldBack", "run"]


class Emitter(Protocol):
    """What the loops drive: a feed's emitter (feed/emit/emitter.py) or a group's
    (feed/emit/group.py)."""

    config: Any
    log: Any

    def step(self) -> TxnReport | None: ...
    def pending_files(self) -> list[str]: ...
    def held_back(self) -> list[str]: ...
    def heartbeat(self) -> Any: ...


class HeldBack:
    """How long input has been held back (files pending that no transaction took: their
    source transactions are incomplete), and a WARNING when that lasts."""

    def __init__(self, emitter: Emitter, clock: Callable[[], float] = time.monotonic) -> None:
        self.emitter, self.clock = emitter, clock
        self.since: float | None = None
        self.warned: float | None = None

    def poll(self) -> None:
        e = self.emitter
        left = e.pending_files()
        now = self.clock()
        if not left:
            self.since = self.warned = None
            return
        self.since = now if self.since is None else self.since
        due = e.config.held_warning
        if now - self.since >= due and (self.warned is None or now - self.warned >= due):
            self.warned = now
            e.log.warning(
                "feed %s: %d input file(s) from %s held back for %.0f s: source "
                "transactions in them are incomplete (their END record or some of their "
                "events have not arrived%s)",
                e.config.feed,
                len(left),
                os.path.basename(left[0]),
                now - self.since,
                ""
                if e.config.tx_metadata
                else "; if END records go elsewhere, give --tx-metadata PATH",
            )


def run(emitter: Emitter, *, stop: Callable[[], bool] | None = None) -> list[TxnReport]:
    """Batch: transactions until the input is consumed, logging the share of input files
    done; input still held back at the end is logged at WARNING (:meth:`Emitter.held_back`
    lists it). Follow: forever (or until ``stop()``), committing an empty progress between
    polls where the clock is wallclock (:meth:`Emitter.heartbeat`), warning when input
    stays held back (:class:`HeldBack`)."""
    reports: list[TxnReport] = []
    total = len(emitter.pending_files())
    held = HeldBack(emitter)
    while True:
        if stop is not None and stop():
            return reports
        report = emitter.step()
        if report is not None:
            reports.append(report)
            if stop is not None and stop():
                return reports
            if not emitter.config.follow and total > emitter.config.max_files_per_txn:
                # (files held back are read again: counted once they are committed)
                done = max(0, total - len(emitter.pending_files()))
                emitter.log.info(
                    "feed %s: %d/%d input files (%.0f%%)",
                    emitter.config.feed,
                    done,
                    total,
                    100 * done / total,
                )
            continue
        if not emitter.config.follow:
            left = emitter.held_back()
            if left:
                emitter.log.warning(
                    "feed %s: the input ended inside source transactions: %d file(s) from "
                    "%s held back, not committed (an END record or events missing%s)",
                    emitter.config.feed,
                    len(left),
                    os.path.basename(left[0]),
                    ""
                    if emitter.config.tx_metadata
                    else "; END records elsewhere? give --tx-metadata PATH",
                )
            return reports
        if stop is not None and stop():
            return reports
        held.poll()
        emitter.heartbeat()
        deadline = time.monotonic() + emitter.config.trigger
        while time.monotonic() < deadline:
            if stop is not None and stop():
                return reports
            time.sleep(min(0.1, emitter.config.trigger))
