"""Fault points (feed/_faults.py): the library calls a hook someone installed; only the
``tidefeed`` command turns ``TIDEFEED_TEST_KILL_AT`` or ``TIDEFEED_TEST_PAUSE_AT`` into one."""

from __future__ import annotations

import signal
import subprocess
import sys

from feed import _faults

from ..e2e.helpers import wait_stopped


def test_a_fault_point_calls_the_installed_hook_and_nothing_else(monkeypatch):
    monkeypatch.setenv(_faults.KILL_ENV, "after_commit")  # read by the CLI, not the library
    seen: list[str] = []
    _faults.install(None)
    _faults.maybe_die("after_commit")  # no hook: this process lives on
    _faults.install(seen.append)
    try:
        _faults.maybe_die("after_commit")
        _faults.maybe_die("before_link:_commits")
    finally:
        _faults.install(None)
    assert seen == ["after_commit", "before_link:_commits"]


def test_kill_at_kills_the_nth_time_the_step_is_reached():
    code = (
        "from feed._faults import kill_at\n"
        "hook = kill_at('before_link:_commits:2')\n"
        "hook('before_link:_commits'); print('first', flush=True)\n"
        "hook('before_link'); hook('after_commit'); print('others', flush=True)\n"
        "hook('before_link:_commits'); print('never', flush=True)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert p.stdout.split() == ["first", "others"]


def test_pause_at_stops_at_each_step_and_a_signal_sent_meanwhile_is_handled_first():
    code = (
        "import signal, sys\n"
        "from feed._faults import pause_at\n"
        "signal.signal(signal.SIGUSR1, lambda *_: print('usr1', flush=True))\n"
        "hook = pause_at('after_read:2,after_write')\n"
        "hook('after_read'); print('read 1', flush=True)\n"
        "hook('after_read'); print('read 2', flush=True)\n"
        "hook('after_write'); print('written', flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(2):  # at the second after_read, then at after_write
            wait_stopped(proc)
            proc.send_signal(signal.SIGUSR1)
            proc.send_signal(signal.SIGCONT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert out.split("\n") == ["read 1", "usr1", "read 2", "usr1", "written", ""]
