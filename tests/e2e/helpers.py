"""Running tidefeed as real processes, for the end-to-end and crash tests."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

TIDEFEED = [sys.executable, "-m", "feed.cli.main"]


def tidefeed(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300, stdin: bytes | None = None
) -> subprocess.CompletedProcess[bytes]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEFEED_")}
    full_env.update(env or {})
    return subprocess.run(
        [*TIDEFEED, *args], capture_output=True, env=full_env, timeout=timeout, input=stdin
    )


def start(*args: str, env: dict[str, str] | None = None, log: Path | None = None):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEFEED_")}
    full_env.update(env or {})
    if log is None:
        return subprocess.Popen(
            [*TIDEFEED, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=full_env
        )
    with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([*TIDEFEED, *args], stdout=out, stderr=out, env=full_env)


def wait_stopped(proc: subprocess.Popen, timeout: float = 180) -> None:
    """Wait until ``proc`` is stopped (``TIDEFEED_TEST_PAUSE_AT``: its state is ``T``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        assert proc.poll() is None, f"exited with {proc.returncode}"
        time.sleep(0.02)
    raise TimeoutError(f"process {proc.pid} never stopped")


def signal_main_thread(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to ``proc``'s main thread (tgkill), not to the process: a signal for
    the process may be taken by any of its threads, and one that took it then waited for
    a core (a loaded machine) while the main thread ran on to its next pause point. The
    next signal then joined it (signals do not queue): two Ctrl-Cs delivered as one, in
    the CI run of 19d9810. The main thread takes its own signal as it goes on, before it
    runs another line of Python."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.tgkill(proc.pid, proc.pid, sig) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill {proc.pid}")


def write_parts(folder: Path, lines: list[bytes], parts: int, start: int = 0) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    size = -(-len(lines) // parts)
    paths = []
    for i in range(parts):
        chunk = lines[i * size : (i + 1) * size]
        if chunk:
            p = folder / f"part-{start + i:04d}.json"
            tmp = folder / f".{p.name}.writing"  # hidden: sources skip dot files
            tmp.write_bytes(b"".join(line + b"\n" for line in chunk))
            tmp.rename(p)  # files appear whole, as a connector's sink writes them
            paths.append(p)
    return paths


def write_parts_at_transactions(folder: Path, lines: list[bytes], parts: int) -> list[Path]:
    """Like :func:`write_parts`, but every cut falls between two Debezium transactions."""
    import orjson

    def tx(line: bytes) -> object:
        e = orjson.loads(line)
        return e.get("payload", e)["source"]["txId"]

    size = -(-len(lines) // parts)
    cuts = []
    for i in range(1, parts):
        c = i * size
        while 0 < c < len(lines) and tx(lines[c]) == tx(lines[c - 1]):
            c += 1
        cuts.append(c)
    bounds = [0, *cuts, len(lines)]
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for n, (a, b) in enumerate(itertools.pairwise(bounds)):
        if a < b:
            paths += write_parts(folder, lines[a:b], 1, start=n)
    return paths


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_up(port: int, timeout: float = 30) -> None:
    """Wait until a tidefeed server answers /healthz on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing answers on 127.0.0.1:{port}")


def receiver_frontier(port: int, feed: str = "bank") -> int | None:
    """The frontier a tidefeed receiver on 127.0.0.1:port holds for ``feed`` (None: new)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/push/{feed}", timeout=30) as r:
        frontier: int | None = json.loads(r.read())["frontier"]
    return frontier


def bank_emit_args(src: Path, log: Path, *extra: str) -> list[str]:
    """``tidefeed emit`` of the generated bank's Debezium files in ``src`` (schema file
    ``accounts.avsc`` beside ``src``) into feed ``bank`` of ``log``: keyed on ``id``,
    logical clock, one input file per transaction."""
    return [
        "emit",
        "--source",
        f"debezium:{src}",
        "--feed",
        "bank",
        "--log",
        str(log),
        "--key",
        "id",
        "--clock",
        "logical",
        "--max-files-per-txn",
        "1",
        "--schema",
        str(src.parent / "accounts.avsc"),
        *extra,
    ]
