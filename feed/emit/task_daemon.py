"""The daemon that forks the Python workers of tidefeed's Spark tasks, with the libraries
they use already imported (``spark.python.daemon.module``; :func:`feed.emit.session.get_spark`
names it unless the user names another daemon).

PySpark's own daemon (:mod:`pyspark.daemon`) forks a worker per task slot, and Spark kills a
worker that has been idle for a minute. Every new worker then imported pyarrow, its
compute, JSON and Parquet modules, pandas (pyarrow's pandas shim imports it on first
use) and tidefeed's task modules itself: about a second of CPU before its first row,
paid again by each worker of each process, and after every pause of a follower. Here
the daemon imports them once, and a fork shares them.

A fork is safe only from a process with one thread. Two libraries start threads as they
load: OpenBLAS (through numpy) its thread pool, and the jemalloc that pyarrow bundles its
background thread. The daemon turns both off through their environment before importing
anything; the workers inherit that, which tidefeed's tasks do not notice (they call no
BLAS routine, and jemalloc then returns memory as it allocates rather than on a thread of
its own). If a thread is running anyway
once the imports are done, the daemon says so on its stderr and becomes PySpark's own
daemon (an ``exec``: no thread survives it), so nothing is forked from it.

Spark starts its workers with archives first on their import path: PySpark's sources
(``pyspark.zip``), py4j's, and the spark-core jar, which holds no Python at all. Python
reads modules from an archive without keeping their bytecode, and PySpark's worker calls
``importlib.invalidate_caches()`` before every task, which makes each archive's importer
read the archive's whole directory again: about 0.1 s a task here (the jar alone lists
some 6 000 files), paid by every task of every job. Where the same PySpark and py4j are
installed (a pip install, as here), the daemon takes those archives off its path before
importing anything (:func:`drop_archives`), and its workers import the installed
packages."""

from __future__ import annotations

import os
import sys

__all__ = ["ONE_THREAD_ENV", "TASK_MODULES", "drop_archives", "preload", "threads"]

#: the libraries' settings that keep them from starting threads as they load
ONE_THREAD_ENV = {
    "OPENBLAS_NUM_THREADS": "1",
    "JE_ARROW_MALLOC_CONF": "background_thread:false",
}

#: what the tasks import: pyarrow's modules, and tidefeed's whose functions the tasks run
#: (Spark's pickles name their module, and a worker imports it before its first row)
TASK_MODULES = (
    "pyarrow",
    "pyarrow.compute",
    "pyarrow.json",
    "pyarrow.parquet",
    "pandas",
    "feed.sources.columnar",
    "feed.sources.debezium_arrow",
    "feed.sources.store_lines",
    "feed.txn.grouped",
    "feed.txn.packs",
)


def drop_archives(path: list[str]) -> list[str]:
    """The entries of ``path`` (an import path) that are Spark's archives and can go:
    PySpark's and py4j's sources when the same version of each is installed elsewhere on
    the path, and jars that hold no Python. Nothing else is named: a user's ``--py-files``
    stay, and so does an archive whose package is installed in another version, or
    nowhere else on the path."""
    import importlib.machinery
    import zipfile

    spark = [
        p
        for p in path
        if p.endswith((".zip", ".jar"))
        and _spark_archive(os.path.basename(p))
        and os.path.isfile(p)
    ]
    rest = [p for p in path if p not in spark]
    gone = []
    for archive in spark:
        try:
            with zipfile.ZipFile(archive) as z:
                names = z.namelist()
                package = next((n.split("/")[0] for n in names if n.endswith("/version.py")), None)
                if archive.endswith(".jar"):
                    if not any(n.endswith(".py") for n in names):
                        gone.append(archive)
                    continue
                if package is None:
                    continue
                mine = z.read(f"{package}/version.py")
        except (OSError, zipfile.BadZipFile, KeyError):
            continue
        spec = importlib.machinery.PathFinder.find_spec(package, rest)
        if spec is None or not spec.submodule_search_locations:
            continue
        installed = os.path.join(next(iter(spec.submodule_search_locations)), "version.py")
        try:
            with open(installed, "rb") as f:
                if f.read() == mine:
                    gone.append(archive)
        except OSError:
            continue
    return gone


def _spark_archive(name: str) -> bool:
    """Whether an archive on the path is, by its name, one Spark put there."""
    return name == "pyspark.zip" or name.endswith(".jar") or name.startswith("py4j-")


def threads() -> int:
    """How many threads this process runs (Linux; 1 where it cannot tell)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def preload(worker_module: str | None = None) -> bool:
    """Import :data:`TASK_MODULES` and PySpark's ``worker_module`` (which its daemon
    imports in each forked worker) with the libraries kept to one thread; a module that
    fails to import is left to the worker that needs it, which reports the error. The
    objects loaded are then kept out of the garbage collector's passes (``gc.freeze``), so
    the workers' collections neither scan nor copy them. Whether the process still runs
    one thread."""
    import gc
    import importlib

    os.environ.update(ONE_THREAD_ENV)
    for name in (*TASK_MODULES, *([worker_module] if worker_module else [])):
        try:
            importlib.import_module(name)
        except Exception as e:  # (the task that needs it fails with its own error)
            print(f"tidefeed task daemon: {name} not preloaded: {e}", file=sys.stderr)
    gc.freeze()
    n = threads()
    if n > 1:
        print(
            f"tidefeed task daemon: {n} threads after preloading; PySpark's own daemon "
            "forks the workers instead",
            file=sys.stderr,
        )
    return n == 1


if __name__ == "__main__":
    for archive in drop_archives(sys.path):
        sys.path.remove(archive)
        # (and the importers made for it as Python started, which invalidate_caches asks)
        for entry in [e for e in sys.path_importer_cache if e.startswith(archive)]:
            del sys.path_importer_cache[entry]
    if not preload(sys.argv[1] if len(sys.argv) > 1 else None):
        os.execv(sys.executable, [sys.executable, "-m", "pyspark.daemon", *sys.argv[1:]])
    from pyspark.daemon import manager

    manager()
