"""The transaction engines behind one interface.

A transaction is a :class:`Job`: the input files of transaction ``seq`` (and its pending
``--tx-metadata`` files). An :class:`Engine` reads, computes and writes it, and answers
with what it wrote (:class:`~feed.txn.segments.Written`, for the emitter to commit),
``None`` (nothing complete to commit), :data:`~feed.txn.context.NEED_MORE` (the same,
with more input pending) or :data:`DECLINED` (not a transaction this engine takes; it
wrote nothing). :func:`run_job` offers the job to each engine in turn.

Three engines give the same feed for every transaction they take:

- :data:`DRIVER` (:mod:`feed.txn.driver`): a small, plain Debezium transaction,
  computed on the driver with pyarrow, parsed there too (Spark only parses what that
  parse declines);
- :data:`ONEPASS` (:mod:`feed.txn.onepass`): a plain transaction of one time, keyed or not,
  parsed, figured and summed per record (or reduced per key) in the same Spark tasks;
- :data:`SPARK` (:mod:`feed.txn.spark`): any transaction, computed in Spark.

tests/feed/test_driver_txn.py runs random histories through ``ENGINES`` and through
``(SPARK,)`` alone and compares the feeds; tests/feed/test_onepass.py does the same for
``(ONEPASS, SPARK)``.

A group of feeds (feed/emit/group.py) offers its transaction to the driver engine's
``run_group`` first, when its engines include it; the group's Spark path reads every
feed's part together and lives in feed/emit/group.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from feed.txn import driver, onepass, spark
from feed.txn.context import DECLINED, TxnContext
from feed.txn.segments import Written

__all__ = ["DECLINED", "DRIVER", "ENGINES", "ONEPASS", "SPARK", "Engine", "Job", "run_job"]


@dataclass(frozen=True, slots=True)
class Job:
    """One transaction's input: ``files`` for transaction ``seq``, the pending
    ``--tx-metadata`` files ``tx_files``, whether ``more`` input files are pending beyond
    them, and the eager pusher of ``--eager`` (feed/emit/eager.py) if any."""

    seq: int
    files: Sequence[str]
    tx_files: Sequence[str] = ()
    more: bool = False
    eager: Any = None


class Engine(Protocol):
    """Reads, computes and writes one transaction; telling ``reached(step, **facts)``
    ``after_read`` and ``before_write`` once each, for the transactions it takes, and
    timing its stages into ``secs``."""

    name: str

    def run(
        self, ctx: TxnContext, job: Job, secs: dict[str, float], reached: Callable[..., None]
    ) -> Written | object | None: ...


class DriverEngine:
    """Small plain Debezium transactions, on the driver (feed/txn/driver.py)."""

    name = "driver"

    def run(
        self, ctx: TxnContext, job: Job, secs: dict[str, float], reached: Callable[..., None]
    ) -> Written | object | None:
        if job.eager is not None:
            return DECLINED  # the executors push eagerly: only the Spark path has them
        t0 = time.perf_counter()
        written = driver.run(ctx, job.seq, job.files, job.tx_files, reached, more=job.more)
        if written is DECLINED:
            return DECLINED
        secs["driver"] = time.perf_counter() - t0
        return written

    def run_group(
        self,
        ctxs: Sequence[TxnContext],
        job: Job,
        secs: dict[str, float],
        reached: Callable[..., None],
        group: str,
    ) -> list[Written] | object | None:
        """A group's transaction (feed/emit/group.py), every feed's part on the driver:
        each feed's :class:`~feed.txn.segments.Written`, None, NEED_MORE or DECLINED as
        :func:`feed.txn.driver.run_group` answers."""
        t0 = time.perf_counter()
        out = driver.run_group(ctxs, job.files, job.tx_files, reached, more=job.more, group=group)
        if out is not DECLINED:
            secs["driver"] = time.perf_counter() - t0
        return out


class SparkEngine:
    """Any transaction, in Spark (feed/txn/spark.py)."""

    name = "spark"

    def run(
        self, ctx: TxnContext, job: Job, secs: dict[str, float], reached: Callable[..., None]
    ) -> Written | object | None:
        return spark.run(
            ctx, job.files, job.tx_files, secs, more=job.more, reached=reached, eager=job.eager
        )


class OnePassEngine:
    """Plain unkeyed transactions of one time, in one pass in Spark (feed/txn/onepass.py)."""

    name = "one-pass"

    def run(
        self, ctx: TxnContext, job: Job, secs: dict[str, float], reached: Callable[..., None]
    ) -> Written | object | None:
        return onepass.run(ctx, job, secs, reached)


DRIVER: DriverEngine = DriverEngine()
ONEPASS: Engine = OnePassEngine()
SPARK: Engine = SparkEngine()
#: the order the emitter offers a transaction in: the driver first, where it is cheap,
#: then the one pass where the input is plain
ENGINES: tuple[Engine, ...] = (DRIVER, ONEPASS, SPARK)


def run_job(
    ctx: TxnContext,
    job: Job,
    secs: dict[str, float],
    reached: Callable[..., None],
    engines: Sequence[Engine] = ENGINES,
) -> Written | object | None:
    """``job`` run by the first of ``engines`` that takes it (see the module docstring)."""
    for engine in engines:
        out = engine.run(ctx, job, secs, reached)
        if out is not DECLINED:
            return out
    names = ", ".join(e.name for e in engines)
    raise ValueError(f"transaction {job.seq}: no engine of ({names}) takes it")
