"""The daemon that forks the Python workers of Spark's tasks (feed/emit/task_daemon.py): the
workers start with the task modules imported, and nothing is forked from a process that
runs threads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PRELOAD = """
import sys, threading, time
from feed.emit.task_daemon import preload, threads
if sys.argv[1] == "thread":
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
print(preload("pyspark.worker"), threads(), "pyspark.worker" in sys.modules,
      "feed.txn.grouped" in sys.modules)
"""


@pytest.mark.parametrize("running", ["alone", "thread"])
def test_preloading_keeps_the_daemon_to_one_thread_and_says_when_it_cannot(running):
    p = subprocess.run(
        [sys.executable, "-c", PRELOAD, running], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr[-2000:]
    one, n, worker, task = p.stdout.split()
    assert (worker, task) == ("True", "True")  # (what a forked worker would import)
    assert "not preloaded" not in p.stderr, p.stderr  # (every module named is there)
    if running == "alone":  # pyarrow's, numpy's and pandas' libraries started no thread
        assert (one, n) == ("True", "1"), p.stderr
    else:
        assert (one, n) == ("False", "2")
        assert "2 threads after preloading; PySpark's own daemon forks" in p.stderr


def test_a_daemon_that_finds_a_thread_becomes_pysparks_own(tmp_path):
    """A library that starts a thread as Python starts (here a ``sitecustomize``) would
    make every fork unsafe: the daemon replaces itself with PySpark's, which then serves
    the JVM as usual (it writes its port, and ends when its input closes)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    with subprocess.Popen(
        [sys.executable, "-m", "feed.emit.task_daemon", "pyspark.worker"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as p:
        assert p.stdin is not None and p.stdout is not None and p.stderr is not None
        try:
            port = p.stdout.read(4)  # (the daemon's first words to the JVM: its port)
            assert len(port) == 4 and int.from_bytes(port, "big") > 0
            cmdline = Path(f"/proc/{p.pid}/cmdline").read_bytes().split(b"\0")
            assert cmdline[1:4] == [b"-m", b"pyspark.daemon", b"pyspark.worker"]
        finally:
            p.stdin.close()  # (the daemon's signal to stop)
            p.wait(timeout=60)
        err = p.stderr.read().decode()  # (it ended: PySpark's daemon exits 1 when told to)
    assert "threads after preloading; PySpark's own daemon forks the workers" in err


def _seen_by_a_worker(batches):
    import pyarrow as pa

    parent = os.getppid()
    line = Path(f"/proc/{parent}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    threads = len(os.listdir(f"/proc/{parent}/task"))
    preloaded = all(m in sys.modules for m in ("pyarrow.parquet", "feed.txn.grouped"))
    for _ in batches:
        yield pa.RecordBatch.from_pydict(
            {"daemon": [line], "threads": [threads], "preloaded": [preloaded]}
        )


@pytest.mark.spark
def test_the_workers_of_tidefeeds_tasks_are_forked_by_its_daemon_with_modules_loaded(spark):
    df = spark.range(4).repartition(2)
    rows = df.mapInArrow(_seen_by_a_worker, "daemon string, threads long, preloaded boolean")
    seen = rows.collect()
    assert seen and all("-m feed.emit.task_daemon pyspark.worker" in r.daemon for r in seen)
    assert all(r.threads == 1 and r.preloaded for r in seen), seen
