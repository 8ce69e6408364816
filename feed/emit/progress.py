"""What the emitter's transaction under way is doing, for the person watching it.

On a terminal (stderr is a TTY) a live status line (rich) shows the transaction, its stage,
the rows read so far and the seconds spent, refreshed while Spark works; the log line of
each committed transaction (``tidefeed.emit``) is the summary. Elsewhere (a service, CI, a
pipe) nothing is drawn and each stage is a DEBUG log line; a transaction still under way
after ``every`` seconds (10) gets an INFO line with its stage and figures, and another
each ``every`` seconds after, so a long one is never silent and a short one stays one line.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

from protocol import Progress

if TYPE_CHECKING:
    from feed.log.checkpoint import Checkpoint
    from feed.txn.segments import Written

__all__ = ["STAGES", "TxnProgress", "TxnReport"]

#: the stages of one transaction, in order
STAGES = ("reading", "computing diffs", "writing", "committing")


class TxnProgress:
    """Reports the stages of the transactions of one feed (see the module docstring)."""

    def __init__(
        self,
        feed: str,
        *,
        live: bool | None = None,
        stream: IO[str] | None = None,
        logger: logging.Logger | None = None,
        every: float = 10.0,
    ) -> None:
        self.feed = feed
        self.every = every
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self.log = logger or logging.getLogger("tidefeed.emit")
        self.seq = 0
        self.stage_name = ""
        self.facts: dict[str, Any] = {}
        self.started = 0.0
        self._live: Any = None
        self._ticker: threading.Thread | None = None
        self._over = threading.Event()

    def start(self, seq: int, files: int) -> None:
        """A transaction begins (``files`` input files)."""
        self.seq, self.facts, self.started = seq, {"files": files}, time.monotonic()
        if self.live and self._live is None:
            from rich.console import Console
            from rich.live import Live

            console = Console(file=self.stream, force_terminal=True)
            self._live = Live(_Line(self), console=console, refresh_per_second=4, transient=True)
            self._live.start()
        elif not self.live and self._ticker is None:
            self._over.clear()
            self._ticker = threading.Thread(
                target=self._tick, name="tidefeed-progress", daemon=True
            )
            self._ticker.start()
        self.stage(STAGES[0])

    def _tick(self) -> None:
        """Off a terminal: an INFO line each ``every`` seconds while the transaction lasts."""
        while not self._over.wait(self.every):
            self.log.info("feed %s: %s (under way)", self.feed, self.line())

    def stage(self, name: str, **facts: Any) -> None:
        """The transaction moves to stage ``name``; ``facts`` (rows=…) add to what it knows."""
        self.stage_name = name
        self.facts.update(facts)
        self.log.debug("feed %s: %s", self.feed, self.line())

    def done(self) -> None:
        """The transaction is over (committed, or failed): the live line goes."""
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._ticker is not None:
            self._over.set()
            self._ticker.join()
            self._ticker = None

    def line(self) -> str:
        elapsed = time.monotonic() - self.started if self.started else 0.0
        facts = ", ".join(
            f"{v:,} {k.replace('_', ' ')}" if isinstance(v, int) else f"{k} {v}"
            for k, v in self.facts.items()
        )
        return f"txn {self.seq}: {self.stage_name}… {facts}, {elapsed:.1f}s"


class _Line:
    """A rich renderable that reads the progress each time it is drawn (so the seconds move
    while a Spark job runs)."""

    def __init__(self, progress: TxnProgress) -> None:
        self.progress = progress

    def __rich__(self) -> str:
        return f"[bold]{self.progress.feed}[/bold] {self.progress.line()}"


@dataclass(slots=True)
class TxnReport:
    """What one transaction did (also the content of its log line)."""

    seq: int
    progress: Progress
    files: int
    input_rows: int
    updates: int
    bad_rows: int
    seconds: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)  # lines with no change, by reason
    held: int = 0  # source transactions held back (incomplete)
    redelivered: int = 0  # events dropped as already turned into updates, or repeated

    @classmethod
    def of(cls, cp: Checkpoint, files: int, w: Written, secs: dict[str, float]) -> TxnReport:
        """The report of the transaction committed as ``cp`` that wrote ``w``."""
        return cls(
            seq=cp.seq,
            progress=cp.progress,
            files=files,
            input_rows=w.input_rows,
            updates=sum(n for _, n in cp.progress.counts),
            bad_rows=w.bad_rows,
            seconds=secs,
            skipped=w.skipped,
            held=w.held,
            redelivered=w.redelivered,
        )

    def line(self) -> str:
        secs = " ".join(f"{k}={v:.2f}s" for k, v in self.seconds.items())
        times = f"[{self.progress.lower}, {self.progress.upper})"
        skipped = "".join(
            f" skipped[{k.replace(' ', '_')}]={v}" for k, v in sorted(self.skipped.items())
        )
        extra = f" redelivered={self.redelivered}" if self.redelivered else ""
        extra += f" held_back_txns={self.held}" if self.held else ""
        return (
            f"txn {self.seq}: times {times} files={self.files} input_rows={self.input_rows} "
            f"updates={self.updates} bad_rows={self.bad_rows}{skipped}{extra} {secs}"
        )
