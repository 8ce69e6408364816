"""The batch loop's progress lines (feed/emit/loop.py), on an emitter stand-in: no Spark."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from feed.emit.loop import run
from feed.emit.progress import TxnReport
from protocol import Progress


@dataclass
class _Config:
    feed: str = "f"
    follow: bool = False
    max_files_per_txn: int = 2
    tx_metadata: str | None = None


@dataclass
class _Emitter:
    """Five files; each step commits what ``plan`` says and holds the rest back, as a
    transaction whose last file ends inside a source transaction does."""

    pending: list[str]
    plan: list[tuple[int, int]]  # per step: (files read, files committed)
    config: _Config = field(default_factory=_Config)
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("tidefeed.test_loop"))

    def pending_files(self) -> list[str]:
        return list(self.pending)

    def held_back(self) -> list[str]:
        return list(self.pending)

    def step(self) -> TxnReport | None:
        if not self.plan:
            return None
        read, committed = self.plan.pop(0)
        self.pending = self.pending[committed:]
        return TxnReport(
            seq=1, progress=Progress(0, 1, ()), files=read, input_rows=0, updates=0, bad_rows=0
        )


def test_a_file_held_back_and_read_again_is_counted_once(caplog):
    files = [f"f{i}" for i in range(5)]
    # the second file is held back by the first transaction and read again by the next
    e = _Emitter(list(files), [(2, 1), (2, 2), (2, 2)])
    with caplog.at_level(logging.INFO, logger="tidefeed.test_loop"):
        reports = run(e)  # type: ignore[arg-type]
    assert len(reports) == 3
    lines = [r.getMessage() for r in caplog.records if "input files" in r.getMessage()]
    assert lines == [
        "feed f: 1/5 input files (20%)",
        "feed f: 3/5 input files (60%)",
        "feed f: 5/5 input files (100%)",
    ]
