"""Fault injection for the crash tests: ``TIDEFEED_TEST_KILL_AT=STEP[:N]`` SIGKILLs this
process the N-th time it reaches STEP (``after_read``, ``after_write``, ``after_commit``,
``during_publish``, ``compact_before_commit``, ``compact_after_commit``; ``before_commit``
just before the checkpoint is written, ``before_link`` inside every whole-file publication,
between the fsync of the temporary file and its link to the real name, and
``before_link:<folder>`` for the publications into one folder: ``_commits``,
``_manifests``, ``parts``, ``state``). The count is the part after the last colon:
``before_link:_commits:2`` is the second commit file. Unset, it costs one dictionary
lookup."""

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
    name, _, nth = want.rpartition(":")
    if not nth.isdigit():
        name, nth = want, "1"
    if name != step:
        return
    _seen[step] = _seen.get(step, 0) + 1
    if _seen[step] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
