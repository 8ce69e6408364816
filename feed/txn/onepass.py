"""A plain Debezium transaction in one pass over its input.

The Spark path (:mod:`feed.txn.spark`) parses a transaction's input into a cache of every
change, takes the transaction figures over that cache in a second job, and only then
diffs and consolidates. For a feed whose transaction is one time (``--granularity
batch``) and whose input is plain, most of that can happen in the tasks that parse: a
task reads its files one by one with pyarrow (:func:`feed.sources.debezium_arrow.
parse_flat`, as the Spark path's columnar read does) and takes each file's figures
(:mod:`feed.txn.onepass_figures`). Without a key it turns each kept event into
``-before`` / ``+after`` (as :func:`feed.txn.diffs.unkeyed_diffs`) and sums the diffs of
each record (:mod:`feed.txn.onepass_sums`); with one it keeps each key's last event
(:mod:`feed.txn.onepass_keyed`); a task of several files merges its files' results
(:func:`task_files` spreads the files over as many tasks as Spark has cores, by their
bytes). Only that leaves the task; the same job combines it across tasks and caches
the result, and the figures come to the driver through an accumulator. The driver then
checks that the whole input was plain; a keyed transaction is diffed against the state
buckets its keys touch; and the updates are written
(:func:`feed.txn.segments.write_transaction`).

Plain here is what the Spark path's assembly releases whole, nothing held back: data
events, skipped lines and END records, every source transaction with metadata complete
across the files (:mod:`feed.txn.onepass_txns`), no snapshot read and no snapshot end
marker, no unavailable-value placeholder (an unkeyed feed quarantines those), every data
event at a position of its own (the files' tasks show it, as in
:class:`feed.sources.columnar.Positions`), and every table shape fitting the feed. An
event at or below the committed position is dropped as redelivered, as
:func:`feed.sources.positions.position_filter` drops it. On anything else the engine
declines, having written nothing, and the Spark path reads the input again (so it does
for a keyed delete of a key not present, a bad row there); settings that can never be
plain (another granularity, a key of a type not grouped alike, a ``--tx-metadata``
folder, ``--eager``, input the columnar parse does not take) decline before any job, and
so does input whose text shows snapshot reads or placeholders (all of it when small,
else the head of each file) or whose last line is an event of a source transaction.

tests/feed/test_onepass.py runs inputs through this engine and through the Spark path
alone and compares the feeds, the progress and the figures.
"""

from __future__ import annotations

import functools
import itertools
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from feed.sources.positions import Position, committed_position
from feed.txn import onepass_keyed
from feed.txn.context import DECLINED, Computed, TxnContext
from feed.txn.onepass_figures import (
    FileFigures,
    commit_lsns,
    file_figures,
    highest,
    plain_figures,
)
from feed.txn.onepass_sums import merge_sums, partial_sums
from feed.txn.segments import Written, write_transaction

if TYPE_CHECKING:
    from feed.txn.engine import Job

__all__ = ["run", "task_files"]

#: small input (in all) whose text is looked through before the job: one that shows an
#: END record, a snapshot read or a placeholder is not plain, so no job parses it twice;
#: of larger input, the head of each file
_SCAN_BYTES = 32 << 20
_HEAD_BYTES = 1 << 20
#: input under this size is not offered to the parse again once it declined a feed's input
_SMALL_BYTES = 16 << 20
#: an event's transaction block, in the last line of the input (:func:`_ends_inside`)
_IN_TRANSACTION = re.compile(rb'"transaction"\s*:\s*\{')
_TAIL_BYTES = 64 << 10
_NOT_PLAIN_TEXT = re.compile(rb'\\u|__debezium_unavailable_value|"op"\s*:\s*"r"')


def run(
    ctx: TxnContext, job: Job, secs: dict[str, float], reached: Callable[..., None]
) -> Written | object:
    """The transaction of ``job`` (:class:`feed.txn.engine.Job`) in one pass, or
    :data:`DECLINED` (nothing written) when it is not plain: see the module docstring."""
    why = _settings_refuse(ctx, job)
    if why is not None:
        ctx.log.debug("feed %s: not a one-pass transaction: %s", ctx.config.feed, why)
        return DECLINED
    t0 = time.perf_counter()
    try:
        parts, figures, probe = _read(ctx, job.files)
    except Exception as e:  # (a file gone under the read, a failed task: the Spark path says)
        ctx.log.warning(
            "feed %s: the one-pass read failed (%s); the Spark path reads the input",
            ctx.config.feed,
            str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__,
        )
        return DECLINED
    committed_hi = committed_position(ctx.cp.source.get("pos", [0, 0]))[0]
    why = plain_figures(figures, len(job.files), committed_hi) or _unfit(ctx, job.files, figures)
    if any(f.unparsed for f in figures):
        _parse_declined.add(ctx.feedlog.root)
    read = time.perf_counter() - t0
    rows = sum(f.rows for f in figures)
    done: Computed | str | None = why
    if why is None:
        try:
            if probe is None:
                done = _timed(ctx, parts)
            else:
                done = onepass_keyed.compute(ctx, parts, rows, probe, commit_lsns(figures))
        except BaseException:
            parts.unpersist()
            raise
    if not isinstance(done, Computed):
        parts.unpersist()
        ctx.log.debug("feed %s: not a one-pass transaction: %s", ctx.config.feed, done)
        return DECLINED
    secs["read"] = read
    if probe is not None:
        secs["compute"] = time.perf_counter() - t0 - read
    reached("after_read", rows_read=rows)
    try:
        t2 = time.perf_counter()
        reached("before_write", bad_rows=0)
        segments, state_ref = write_transaction(ctx, ctx.cp.seq + 1, done)
        secs["write"] = time.perf_counter() - t2
    finally:
        parts.unpersist()
        done.release()
    secs["one_pass"] = time.perf_counter() - t0
    return _written(figures, segments, state_ref, rows)


def _settings_refuse(ctx: TxnContext, job: Job) -> str | None:
    """Why the transaction of ``job`` is not this engine's, found without a job."""
    from feed.sources.columnar import why_not_columnar
    from feed.sources.connect import connect_names
    from feed.sources.inputs import input_bytes
    from protocol import SourceError

    cfg, info = ctx.config, ctx.info
    if not (cfg.kind.events and cfg.kind.columnar) or cfg.parse == "spark":
        return "not Debezium lines the columnar parse reads"
    if cfg.granularity != "batch":
        return "more than one time a transaction"
    if info.key and (cfg.kind.per_key or cfg.kind.whole_table or not _atomic(ctx)):
        return "a key of a kind or type the tasks do not group by"
    if job.tx_files or cfg.tx_metadata or job.eager is not None or not job.files:
        return "transaction metadata, eager delivery or no input"
    try:
        why = why_not_columnar(job.files, ctx.record_type, connect_names(info.schema or {}))
        if why is not None:
            return why
        size = input_bytes(job.files)
        if ctx.feedlog.root in _parse_declined and size < _SMALL_BYTES:
            # (a connector writes its lines one way: such input would most likely be
            # parsed to be declined again, a job lost in each small transaction)
            return "the columnar parse declined this feed's input before; small input"
        return _text_refuses(job.files, size) or _ends_inside(job.files[-1])
    except (OSError, SourceError) as e:  # (a file gone: the Spark path says what is wrong)
        return f"input that cannot be read ({e})"


def _atomic(ctx: TxnContext) -> bool:
    """Whether every key column is of a type pyarrow groups by as Spark does."""
    from pyspark.sql import types as T

    from feed.txn.diffs import groups_as_is

    fields = {f.name: f for f in ctx.record_type.fields}
    key = ctx.info.key
    return all(k in fields for k in key) and groups_as_is(T.StructType([fields[k] for k in key]))


def _text_refuses(files: Sequence[str], size: int) -> str | None:
    """Why the text of ``files`` (``size`` bytes in all) shows they are not plain: all of it
    for input of :data:`_SCAN_BYTES` at most, else the first :data:`_HEAD_BYTES` of each
    file (where a connector's initial snapshot, or an END record after the first
    transaction, shows)."""
    from feed.sources.file_text import search_text

    found = search_text(files, _NOT_PLAIN_TEXT, size, whole=_SCAN_BYTES, head=_HEAD_BYTES)
    if found is None:
        return None
    return f"{found[0]} holds {found[1].decode(errors='replace')!r}"


def _ends_inside(last: str) -> str | None:
    """Why the input surely ends inside a source transaction: the last line of its ``last``
    file is an event with a transaction block, whose END record Debezium writes after it.
    (Such a transaction is held back: no job parses the input to find that out.)"""
    from feed.sources.file_text import tail

    line = tail(last, _TAIL_BYTES).rstrip(b"\n ").rsplit(b"\n", 1)[-1]
    if _IN_TRANSACTION.search(line) is None:
        return None
    return f"{last} ends inside a source transaction (its END record is not read yet)"


def _unfit(ctx: TxnContext, files: Sequence[str], figures: Sequence[FileFigures]) -> str | None:
    """Why the table shapes read do not all fit the feed (the Spark path cuts there)."""
    from feed.txn.assembly import find_unfit_shapes
    from protocol import SourceError

    try:
        unfit = find_unfit_shapes(ctx, files, {h for f in figures for h in f.shapes})
    except SourceError as e:  # (the Spark path raises it, as it would without this engine)
        return str(e)
    return "the table changed shape" if unfit else None


_reads = itertools.count(1)
_lock = threading.Lock()
#: the feeds (their log folders) whose input the columnar parse declined in this process
_parse_declined: set[str] = set()


def _read(
    ctx: TxnContext, files: Sequence[str]
) -> tuple[Any, list[FileFigures], onepass_keyed.Probe | None]:
    """What the tasks give for ``files`` across files, cached, and each file's figures:
    one Spark job. Unkeyed, the updates (record, diff: the partial sums summed per record,
    zeros left out); keyed, each key's last image (:func:`~feed.txn.onepass_keyed.lasts`)
    and what the job found of them (:func:`~feed.txn.onepass_keyed.probe`)."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T
    from pyspark.sql.pandas.types import to_arrow_schema, to_arrow_type

    from feed.sources.cached import cached
    from feed.sources.columnar import parse_threads, set_union
    from feed.sources.inputs import spark_metadata_path
    from feed.txn.context import spillable

    spark = ctx.spark
    sc = spark.sparkContext
    with _lock:
        if getattr(sc, "_tidefeed_onepass", None) is None:
            sc._tidefeed_onepass = sc.accumulator(frozenset(), set_union())
        acc, read = sc._tidefeed_onepass, next(_reads)
    image = T.StructType([T.StructField(f.name, f.dataType) for f in ctx.record_type.fields])
    record, key = to_arrow_type(image, timezone="UTC"), tuple(ctx.info.key)
    if key:
        out = onepass_keyed.task_output(image, key)
        schema = to_arrow_schema(out, timezone="UTC")
        reduce = functools.partial(onepass_keyed.last_per_key, key=key, schema=schema)
        merge = onepass_keyed.merge
    else:
        out = T.StructType(
            [T.StructField("data", image, False), T.StructField("diff", T.LongType())]
        )
        reduce = functools.partial(partial_sums, record=record)
        merge = functools.partial(merge_sums, record=record)
    groups = task_files(files, int(sc.defaultParallelism))
    rows = [[(files[i], spark_metadata_path(files[i]), i) for i in g] for g in groups]
    # (a task's number, one per partition: its files go with the task's function, so
    # no Python worker of the job's first tasks serves a listing of them)
    listing = spark.range(0, len(rows), 1, len(rows))
    pos = committed_position(ctx.cp.source.get("pos", [0, 0]))
    threads = parse_threads(spark, len(groups))
    task = _task(record, key, ctx.info.table, pos, (acc, read), (reduce, merge), threads, rows)
    tasks = listing.mapInArrow(task, out)
    if key:
        across = onepass_keyed.lasts(tasks)
    else:
        # (summed across files in the same job: the cache holds the updates, not the
        # partial sums, which are about three times as many)
        summed = tasks.groupBy("data").agg(F.sum("diff").alias("diff"))
        across = summed.where(F.col("diff") != 0)
    updates = cached(across, spillable())
    try:
        # (the job: every file's task has added its figures once it is done)
        if key:
            probe: onepass_keyed.Probe | None = onepass_keyed.probe(ctx, updates)
        else:
            updates.count()
            probe = None
    except BaseException:
        updates.unpersist()
        raise
    with _lock:
        entries = acc.value
        mine = [f for f in entries if f.read == read]
        acc.value = frozenset(f for f in entries if f.read > read)
    return updates, mine, probe


def _task(
    record: pa.StructType,
    key: tuple[str, ...],
    table: str | None,
    pos: Position,
    acc: tuple[Any, int],
    steps: tuple[Callable[[pa.Table], pa.Table], Callable[[list[pa.Table]], pa.Table]],
    threads: bool,
    groups: list[list[tuple[str, str, int]]],
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """A task's function: its files (``groups``' entry at the task's number, each a path,
    the name Spark's ``_metadata`` gives it and its number) parsed one by one, each
    file's kept events reduced (``steps[0]``), and the task's reductions merged into one
    (``steps[1]``) before the shuffle."""
    reduce, merge = steps

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        done = list(each(batches))
        if done:
            yield from (merge(done) if len(done) > 1 else done[0]).to_batches()

    def each(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.Table]:
        from feed.sources.connect_json import Declined
        from feed.sources.debezium_arrow import parse_flat
        from feed.sources.file_text import mapped

        for batch in batches:
            for path, name, i in (f for g in batch.column(0).to_pylist() for f in groups[g]):
                try:
                    data = mapped(path)
                    t = parse_flat(data, record, key, table, i, name, threads)
                except (Declined, OSError) as e:  # (a file gone: the Spark path says so)
                    entry = FileFigures(acc[1], i, f"{name}: {e}", unparsed=True)
                    acc[0].add(frozenset([entry]))
                    continue
                figures, kept = file_figures(t, pos, acc[1], i)
                acc[0].add(frozenset([figures]))
                if figures.why is None:
                    yield reduce(kept)

    return run


#: the most files one task of the one-pass job reads: it holds each file's reduction
#: until it merges them, so a long backlog is cut into more tasks than the cores
FILES_PER_TASK = 8


def task_files(files: Sequence[str], cores: int) -> list[list[int]]:
    """The files' numbers spread over as many tasks as ``cores`` (more where a task
    would read more than :data:`FILES_PER_TASK`), so that each task's files come to about
    the same bytes (the largest first, each to the task with the fewest bytes so far). A
    task merges its files' reductions before the shuffle: a key changed in several of
    them crosses it once."""
    import os

    sizes = []
    for f in files:
        try:
            sizes.append(os.path.getsize(f))
        except OSError:  # (gone: its task says so)
            sizes.append(0)
    n = max(1, min(cores, len(files)), -(-len(files) // FILES_PER_TASK))
    tasks: list[list[int]] = [[] for _ in range(n)]
    load = [(0, 0)] * n  # (bytes, files) of each task so far
    for i in sorted(range(len(files)), key=lambda i: -sizes[i]):
        least = min((k for k in range(n) if load[k][1] < FILES_PER_TASK), key=load.__getitem__)
        tasks[least].append(i)
        load[least] = (load[least][0] + sizes[i], load[least][1] + 1)
    return [sorted(t) for t in tasks if t]


def _timed(ctx: TxnContext, updates: Any) -> Computed:
    """What an unkeyed transaction writes: its ``updates`` (record, diff) at its one time."""
    from pyspark.sql import functions as F

    timed = updates.select("data", F.lit(ctx.cp.next).cast("long").alias("time"), "diff")
    return Computed(
        updates=timed,
        good=None,
        bad=None,
        bad_rows=0,
        units=1,
        position=None,
        new_state=None,
        loaded=None,
    )


def _written(
    figures: Sequence[FileFigures], segments: list[Any], state_ref: str | None, rows: int
) -> Written:
    """What the commit records, as the Spark path's figures give it for plain input."""
    from feed.sources.positions import snapshot_done

    skipped: dict[str, int] = {}
    for f in figures:
        for reason, n in f.skipped:
            skipped[reason] = skipped.get(reason, 0) + n
    return Written(
        segments=segments,
        state_ref=state_ref,
        units=1,
        position=snapshot_done(highest(figures), ()),
        input_rows=rows,
        skipped=skipped,
        redelivered=sum(f.data - f.kept for f in figures),
        snapshot_lsn=None,
        bad_rows=0,
    )
