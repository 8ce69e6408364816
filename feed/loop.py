"""The emitter's loops over an opened :class:`~feed.emitter.Emitter`: a batch run takes
transactions until the input is consumed; a follow run polls the input every
``--trigger`` seconds, forever or until asked to stop."""

from __future__ import annotations

import time
from collections.abc import Callable

from .emitter import Emitter
from .progress import TxnReport

__all__ = ["run"]


def run(emitter: Emitter, *, stop: Callable[[], bool] | None = None) -> list[TxnReport]:
    """Batch: transactions until the input is consumed, logging the share of input files
    done. Follow: forever (or until ``stop()``), committing an empty progress between
    polls where the clock is wallclock (:meth:`Emitter.heartbeat`)."""
    reports: list[TxnReport] = []
    total = len(emitter.pending_files())
    while True:
        if stop is not None and stop():
            return reports
        report = emitter.step()
        if report is not None:
            reports.append(report)
            if stop is not None and stop():
                return reports
            if not emitter.config.follow and total > emitter.config.max_files_per_txn:
                done = sum(r.files for r in reports)
                emitter.log.info(
                    "feed %s: %d/%d input files (%.0f%%)",
                    emitter.config.feed,
                    done,
                    total,
                    100 * done / total,
                )
            continue
        if not emitter.config.follow or (stop is not None and stop()):
            return reports
        emitter.heartbeat()
        deadline = time.monotonic() + emitter.config.trigger
        while time.monotonic() < deadline:
            if stop is not None and stop():
                return reports
            time.sleep(min(0.1, emitter.config.trigger))
