"""A class-data-sharing archive for the JVMs of the `tidefeed` processes tests start.

Each `tidefeed emit` a test starts launches a JVM that loads some 14,000 Spark and Scala
classes from jars before its first job: about a quarter of a short emit's time here. The
JVM can map classes a previous run loaded from an archive instead (AppCDS,
``-XX:SharedArchiveFile``): one run dumps the archive at its exit
(``-XX:ArchiveClassesAtExit``), the later ones map it. tests/conftest.py builds it once per
virtual environment, Java and pyspark (the first test session that runs processes pays
one short emit, about 25 s) and hands it to the processes with the rest of their JVM
options. An archive the JVM cannot use is ignored (its warning is switched off), so the
worst case is the time it would have taken anyway; what the tests check does not depend
on it. Users' JVMs never see it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from feed._java import java_binary

#: the JVM options that map an archive without a word when it cannot be used
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"


def archive_path() -> Path | None:
    """Where this environment's archive is (made or not), or None without a ``java``."""
    java = java_binary()
    if java is None:
        return None
    import pyspark

    jars = Path(pyspark.__file__).parent / "jars"
    key = "\n".join([os.path.realpath(java), pyspark.__version__, str(jars), sys.prefix])
    name = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(sys.prefix) / "tidefeed-test-jvm" / f"{name}.jsa"


def ensure(jvm_options: str) -> Path | None:
    """The archive, dumped now by one short `tidefeed emit` if it is not there yet (run
    with ``jvm_options`` too, as the tests' processes are); None if that failed."""
    path = archive_path()
    if path is None:
        return None
    if path.exists():
        return path
    from feed.demo.data import generate_bank

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tidefeed-jvm-archive-") as tmp:
        src = Path(tmp) / "in"
        src.mkdir()
        events = generate_bank(transactions=20, seed=3).events
        for i, part in enumerate((events[: len(events) // 2], events[len(events) // 2 :])):
            (src / f"part-{i}.json").write_bytes(b"".join(e + b"\n" for e in part))
        staged = path.parent / f"{path.stem}.{os.getpid()}.partial"
        options = f"{jvm_options} -XX:ArchiveClassesAtExit={staged} {QUIET}"
        env = {
            **{k: v for k, v in os.environ.items() if k != "TIDEFEED_JVM_ARCHIVE"},
            "PYSPARK_SUBMIT_ARGS": f"--driver-java-options '{options}' pyspark-shell",
        }
        cmd = [sys.executable, "-m", "feed.cli.main", "emit", "--source", f"debezium:{src}"]
        cmd += ["--feed", "bank", "--log", str(Path(tmp) / "log"), "--key", "id"]
        # (through Spark: a small input is otherwise computed without starting it)
        cmd += ["--clock", "logical", "--granularity", "transaction", "--driver-txn-bytes", "0"]
        done = subprocess.run(cmd, env=env, capture_output=True, timeout=600)
        if done.returncode != 0 or not staged.exists():
            staged.unlink(missing_ok=True)
            return None
        os.replace(staged, path)  # whole or not there: a later session never maps half
    return path
