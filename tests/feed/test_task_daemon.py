"""The daemon that forks the Python workers of Spark's tasks (feed/emit/task_daemon.py): the
workers start with the task modules imported, and nothing is forked from a process that
runs threads."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pyspark
import pytest

from feed.emit.task_daemon import drop_archives

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
    import pyspark

    archives = [k for k, v in sys.path_importer_cache.items() if type(v).__name__ == "zipimporter"]
    for _ in batches:
        yield pa.RecordBatch.from_pydict(
            {
                "daemon": [line],
                "threads": [threads],
                "preloaded": [preloaded],
                "pyspark": [pyspark.__file__],
                "archives": [len(archives)],
            }
        )


@pytest.mark.spark
def test_the_workers_of_tidefeeds_tasks_are_forked_by_its_daemon_with_modules_loaded(spark):
    df = spark.range(4).repartition(2)
    schema = "daemon string, threads long, preloaded boolean, pyspark string, archives long"
    seen = df.mapInArrow(_seen_by_a_worker, schema).collect()
    assert seen and all("-m feed.emit.task_daemon pyspark.worker" in r.daemon for r in seen)
    assert all(r.threads == 1 and r.preloaded for r in seen), seen
    # (PySpark as installed, not from Spark's archive: no importer of an archive is left
    # for the invalidate_caches before each task to read again)
    installed = str(Path(pyspark.__file__).parent)
    assert all(r.pyspark.startswith(installed) and r.archives == 0 for r in seen), seen


def _archive(path: Path, files: dict[str, bytes]) -> str:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return str(path)


def test_only_sparks_archives_of_what_is_installed_alike_leave_the_path(tmp_path):
    """Spark's archives go from the daemon's path where the installed package is the same
    (its version file, byte for byte) and jars that hold no Python; a user's archive, an
    archive of another version, or one of a package installed nowhere else stay."""
    lib = Path(pyspark.__file__).parent / "python" / "lib"
    site = str(Path(pyspark.__file__).parent.parent)
    theirs = sorted(str(p) for p in lib.glob("*.zip"))
    jar = next(iter((Path(pyspark.__file__).parent / "jars").glob("spark-core_*.jar")))
    assert {Path(p).name.split("-")[0] for p in theirs} == {"pyspark.zip", "py4j"}
    assert sorted(drop_archives([*theirs, str(jar), site])) == sorted([*theirs, str(jar)])
    # (without the installed packages on the path: nothing to import instead)
    assert drop_archives([*theirs, str(jar)]) == [str(jar)]
    other = tmp_path / "other"
    other.mkdir()
    older = _archive(other / "pyspark.zip", {"pyspark/version.py": b'__version__ = "3.0.0"\n'})
    with_python = _archive(tmp_path / "tools.jar", {"tools/__init__.py": b""})
    users = _archive(tmp_path / "deps.zip", {"deps/__init__.py": b"", "deps/version.py": b""})
    assert drop_archives([older, with_python, users, site]) == []
