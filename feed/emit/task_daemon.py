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
daemon (an ``exec``: no thread survives it), so nothing is forked from it."""

from __future__ import annotations

import os
import sys

__all__ = ["ONE_THREAD_ENV", "TASK_MODULES", "preload", "threads"]

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
    if not preload(sys.argv[1] if len(sys.argv) > 1 else None):
        os.execv(sys.executable, [sys.executable, "-m", "pyspark.daemon", *sys.argv[1:]])
    from pyspark.daemon import manager

    manager()
