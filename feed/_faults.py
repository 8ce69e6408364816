"""Fault injection for the crash tests: ``TIDEFEED_TEST_KILL_AT=STEP[:N]`` SIGKILLs this
process the N-th time it reaches STEP (``after_read``, ``after_write``, ``after_commit``,
``during_publish``, ``compact_before_commit``, ``compact_after_commit``). Unset, it costs
one dictionary lookup."""

from __future__ import annotations

import os
import signal

__all__ = ["KILL_ENV", "maybe_die"]

KILL_ENV = "TIDEFEED_TEST_KILL_AT"
_seen: dict[str, int] = {}


def maybe_die(step: str) -> None:
    want = os.environ.get(KILL_ENV)
    if not want:
        return
    name, _, nth = want.partition(":")
    if name != step:
        return
    _seen[step] = _seen.get(step, 0) + 1
    if _seen[step] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
