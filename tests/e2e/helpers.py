"""Running tidefeed as real processes, for the end-to-end and crash tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TIDEFEED = [sys.executable, "-m", "feed.cli"]


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
