"""What a transaction's dataflow works with: its context, what reading the input gives
(:class:`ReadChanges`), what computing the updates gives (:class:`Computed`), and the small
helpers both stages share (the engines are :mod:`feed.txn.spark` and :mod:`feed.txn.driver`;
the stages :mod:`feed.txn.dataflow`)."""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from feed.log.checkpoint import Checkpoint
from feed.log.store import FeedLog
from feed.sources.cached import released

__all__ = [
    "DECLINED",
    "NEED_MORE",
    "Computed",
    "GroupHold",
    "ReadChanges",
    "TxnContext",
    "bad_sample",
    "base_name",
    "read_source",
    "spillable",
    "tally",
    "waiting",
]

#: what :func:`feed.txn.dataflow.read_input` returns when nothing in its input is complete
#: yet but more input files are pending
NEED_MORE = object()

#: a transaction engine's answer for a job it does not take, having written nothing
#: (:mod:`feed.txn.engine`)
DECLINED = object()


def waiting(log: logging.Logger, who: str, held: int, *, more: bool) -> object | None:
    """What a transaction that releases nothing gives back, every source transaction it
    read held back: :data:`NEED_MORE` when ``more`` input files are pending, else None,
    saying in the log what ``who`` (a feed, a group) waits for."""
    if more:
        return NEED_MORE
    log.info("%s: waiting for the rest of %d source transaction(s)", who, held)
    return None


def spillable() -> Any:
    """Serialized, spilling to disk: cached input never fills the driver's heap."""
    from pyspark import StorageLevel

    return StorageLevel.MEMORY_AND_DISK


def base_name(uri: str) -> str:
    """The file name in a path or in Spark's ``_metadata.file_path`` (a quoted URI)."""
    return urllib.parse.unquote(uri.rstrip("/").rsplit("/", 1)[-1])


def bad_sample(bad: Any, cached: Sequence[Any]) -> str:
    """The first bad rows' files and reasons, for the error of a transaction that stops
    (``bad`` and ``cached``, of no more use, are released)."""
    sample = bad.limit(3).collect()
    released(bad, *cached)
    return "; ".join(f"{base_name(r['_file'])}: {r['_error']}" for r in sample)


def tally(grouped: Any, stale: Any, fresh: Any = None) -> Any:
    """Input rows, TOAST placeholders, stale (already committed) rows, bad rows and deletes
    per group, and the table shapes of the ``fresh`` events (past the committed position:
    an event read again, committed under an older shape, is no change of shape)."""
    from pyspark.sql import functions as F

    if fresh is None:
        fresh = F.lit(True)

    ok = F.col("_error").isNull()
    return grouped.agg(
        F.count(F.lit(1)).alias("n"),
        F.count("_toast").alias("toast"),
        F.count(F.when(stale & ok, 1)).alias("stale"),
        F.count("_error").alias("errors"),
        F.count(F.when(ok & (F.col("op") == "d"), 1)).alias("deletes"),
        F.collect_set(F.when(fresh, F.col("_shape"))).alias("shapes"),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class TxnContext:
    """What a transaction's dataflow needs from its driver."""

    session: Callable[[], Any]  # the SparkSession, started when first asked for
    config: Any  # the settled EmitterConfig
    cp: Checkpoint  # the committed checkpoint the transaction starts from
    info: Any  # the feed's settings (feed.json)
    record_type: Any  # the record's Spark struct type
    state: Any  # the keyed state (feed.txn.state.BucketedState)
    feedlog: FeedLog
    log: logging.Logger
    spark_path: Callable[[str], str]  # a feed-log path as Spark writes to it
    #: the source table shapes this process found to fit the feed (feed/sources/shapes.py)
    shapes: set[int] = field(default_factory=set)

    @property
    def spark(self) -> Any:
        """The SparkSession (the driver engine takes a small transaction without one)."""
        return self.session()


@dataclass(slots=True, kw_only=True)
class ReadChanges:
    """The input as read: the changes to turn into updates, the bad rows, and the figures."""

    changes: Any  # every input row (cached)
    good: Any  # the changes released for this transaction
    bad: Any  # rows found bad while reading
    order: Any = None  # the released source transactions in order (a DataFrame), if known
    position: tuple[Any, ...] | None = None  # the highest source position, when known
    replaces: tuple[int, str] | None = None  # a new Debezium snapshot: (LSN, source txn)
    touched: frozenset[int] | None = None  # the state buckets this transaction meets
    held_files: frozenset[str] = frozenset()  # files read again later (held-back txns')
    held: int = 0  # source transactions held back
    redelivered: int = 0  # events dropped as already committed
    input_rows: int = 0
    toast_rows: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    #: whether a bad row may turn up: bad input rows, a new snapshot behind the committed
    #: position, deletes (of a key that may not be there) or TOAST placeholders; when not,
    #: no job counts the bad rows
    suspect: bool = False
    cached: tuple[Any, ...] = ()  # DataFrames to release when the transaction ends
    #: False when no snapshot read was among the input (Debezium: the figures say so)
    snapshot_reads: bool = True
    #: source transactions released (None: not counted), and those held back with the
    #: first place in delivery order of any of them (feed/emit/group.py needs them)
    ready: int | None = None
    held_txns: frozenset[str] = frozenset()
    held_at: tuple[int, int] | None = None
    #: a group's feed: the table changed shape (raised by the group if nothing is ready)
    shape_error: Exception | None = None

    def release(self) -> None:
        released(self.changes, *self.cached)


@dataclass(frozen=True, slots=True)
class GroupHold:
    """What a group of feeds holds back in every one of its feeds (feed/emit/group.py): these
    source transactions, and whatever is delivered from ``at`` on."""

    txns: frozenset[str] = frozenset()
    at: tuple[int, int] | None = None


@dataclass(slots=True, kw_only=True)
class Computed:
    """A transaction's updates and what else its commit writes."""

    updates: Any  # consolidated updates: time, data, diff
    good: Any  # the changes the updates come from
    bad: Any  # every bad row (cached)
    bad_rows: int
    units: int  # how many times the updates take from ``next``
    position: tuple[Any, ...] | None  # the highest source position
    new_state: Any  # the keyed state to write, if any
    loaded: Any  # the state buckets read (feed.txn.state), if keyed
    cached: list[Any] = field(default_factory=list)

    def release(self) -> None:
        for df in self.cached:
            if df is not None:
                df.unpersist()


def read_source(ctx: TxnContext, files: Sequence[str]) -> Any:
    """The canonical changes of ``files`` (:func:`feed.sources.kinds.read_changes`), a DataFrame."""
    from feed.sources.kinds import read_changes

    cfg = ctx.config
    options: dict[str, Any] = {
        k: v for k, v in (("order", cfg.order), ("deleted", cfg.deleted)) if v
    }
    options.update(table=ctx.info.table, schema=ctx.info.schema)
    return read_changes(
        ctx.spark,
        cfg.kind.reader,
        files,
        ctx.record_type,
        ctx.info.key,
        options,
    )
