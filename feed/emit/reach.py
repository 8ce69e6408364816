"""What a cluster's executors must see: the feed log and the input, when they are local paths.

On a ``spark://`` (or any non-local) master the executors run on other machines. A local
``--log`` must be on a filesystem every machine mounts at the same place (the tasks write
the segments and the state there, and the driver moves and reads them), and so must a local
source path (the tasks read the input). Where it is not, the transaction fails late and
obscurely (a file the driver cannot find, an input Spark finds empty). So before the first
Spark job of a run on such a master, :func:`check_executors_see` asks the executors: the
driver writes a probe file with a random token into the log's folder, and one task per core
reads it back and looks at the first input file; any task that cannot is an error naming
the path, the host and the fix, before anything of the transaction is written.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from feed.sources.stores import is_remote, local_path
from protocol import SourceError

__all__ = ["check_executors_see"]


def check_executors_see(
    spark: Any, log_folder: str | None, inputs: Callable[[], Sequence[str]]
) -> None:
    """Refuse a local log folder (``log_folder``; None: the log is in a store) or local
    input files (``inputs()``: those of the run, listed only on a non-local master; the
    first is looked at) that the executors of a non-local master do not see as the
    driver does."""
    master = str(spark.sparkContext.master)
    if master.startswith("local"):
        return
    probes: list[tuple[str, str, Any]] = []  # (what, path, what must be there)
    probe = None
    if log_folder is not None:
        os.makedirs(log_folder, exist_ok=True)
        token = uuid.uuid4().hex
        probe = os.path.join(log_folder, f".executor-probe-{token[:8]}")
        with open(probe, "w") as f:
            f.write(token)
        probes.append(("log", probe, token))
    local = [p for p in inputs() if not is_remote(p)]
    if local:
        first = local_path(local[0])
        probes.append(("source path", first, os.path.getsize(first)))
    if not probes:
        return
    try:
        n = max(1, int(spark.sparkContext.defaultParallelism))
        seen = spark.sparkContext.parallelize(range(n), n).map(lambda _: _look(probes)).collect()
    finally:
        if probe is not None:
            os.unlink(probe)
    for host, missing in seen:
        for what, path in missing:
            where = log_folder if what == "log" else os.path.dirname(path)
            raise SourceError(
                f"the {what} {where} is not visible to Spark's executors on {host} (master "
                f"{master}): there a local path must be on a filesystem every machine mounts "
                "at the same place, or be an object store URI such as s3://bucket/prefix "
                "(docs/operations.md, 'Running the emitter')"
            )


def _look(probes: list[tuple[str, str, Any]]) -> tuple[str, list[tuple[str, str]]]:
    """Runs on an executor: its host, and the probes it does not see as the driver wrote
    them (the log's token, the input file's size)."""
    missing = []
    for what, path, expected in probes:
        try:
            if what == "log":
                with open(path) as f:
                    ok = f.read() == expected
            else:
                ok = os.path.getsize(path) == expected
        except OSError:
            ok = False
        if not ok:
            missing.append((what, path))
    return socket.gethostname(), missing
