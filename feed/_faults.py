"""Fault points for the crash tests: places in the commit, compaction and delivery paths
where a test may have the process killed (``after_read``, ``after_write``,
``after_commit``, ``during_publish``, ``compact_before_commit``, ``compact_after_commit``;
``before_commit`` just before the checkpoint is written, ``before_link`` inside every
whole-file publication, between the fsync of the temporary file and its link to the real
name, and ``before_link:<folder>`` for the publications into one folder: ``_commits``,
``_manifests``, ``parts``, ``state``; the group and schema-version steps of
feed/emit/group.py and feed/emit/emitter.py).

The library only calls :func:`maybe_die` at each point; what happens there is a hook
installed by whoever runs it (:func:`install`), by default nothing. The ``tidefeed``
command installs :func:`kill_at` from ``TIDEFEED_TEST_KILL_AT=STEP[:N]`` (SIGKILL the
N-th time the process reaches STEP; the count is the part after the last colon:
``before_link:_commits:2`` is the second commit file), which is how the crash tests and
the reliability harness reach real processes. ``TIDEFEED_TEST_PAUSE_AT=STEP[:N][,…]``
installs :func:`pause_at` the same way (SIGSTOP there: a test sends its signals to a
process it knows to be inside a transaction, then SIGCONT). Without a hook a point costs
one global lookup."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

__all__ = [
    "KILL_ENV",
    "PAUSE_ENV",
    "FaultHook",
    "install",
    "install_from_env",
    "kill_at",
    "maybe_die",
    "pause_at",
]

KILL_ENV = "TIDEFEED_TEST_KILL_AT"
PAUSE_ENV = "TIDEFEED_TEST_PAUSE_AT"
#: called with the name of every fault point the process reaches
FaultHook = Callable[[str], None]
_hook: FaultHook | None = None


def install(hook: FaultHook | None) -> None:
    """Have ``hook`` called at every fault point from now on (None: nothing happens)."""
    global _hook
    _hook = hook


def _nth(spec: str, act: Callable[[], None]) -> FaultHook:
    """A hook that calls ``act`` the N-th time the process reaches STEP (``STEP[:N]``)."""
    name, _, nth = spec.rpartition(":")
    if not nth.isdigit():
        name, nth = spec, "1"
    want, seen = int(nth or 1), 0

    def hook(step: str) -> None:
        nonlocal seen
        if step == name:
            seen += 1
            if seen == want:
                act()

    return hook


def kill_at(spec: str) -> FaultHook:
    """A hook that SIGKILLs this process the N-th time it reaches STEP (``STEP[:N]``)."""
    return _nth(spec, lambda: os.kill(os.getpid(), signal.SIGKILL))


def pause_at(specs: str) -> FaultHook:
    """A hook that stops this process (SIGSTOP) at each ``STEP[:N]`` of the comma-separated
    ``specs``; it goes on when sent SIGCONT, and signals sent to it meanwhile are handled
    as it goes on, before the step's code runs."""
    hooks = [_nth(s, lambda: os.kill(os.getpid(), signal.SIGSTOP)) for s in specs.split(",")]

    def hook(step: str) -> None:
        for h in hooks:
            h(step)

    return hook


def install_from_env() -> None:
    """Install :func:`kill_at` or :func:`pause_at` when ``TIDEFEED_TEST_KILL_AT`` or
    ``TIDEFEED_TEST_PAUSE_AT`` is set (the command line)."""
    kill, pause = os.environ.get(KILL_ENV), os.environ.get(PAUSE_ENV)
    hooks = [h for h in (kill and kill_at(kill), pause and pause_at(pause)) if h]
    if hooks:

        def hook(step: str) -> None:
            for h in hooks:
                h(step)

        install(hook)


def maybe_die(step: str) -> None:
    """A fault point: the installed hook, if any, decides."""
    if _hook is not None:
        _hook(step)
