"""A plain unkeyed Debezium transaction in one pass over its input.

The Spark path (:mod:`feed.txn.spark`) parses a transaction's input into a cache of every
change, takes the transaction figures over that cache in a second job, and only then
diffs and consolidates. For a feed without a key whose transaction is one time
(``--granularity batch``) and whose input is plain, all of that can happen in the tasks
that parse: each task reads one file with pyarrow (:func:`feed.sources.debezium_arrow.
parse_flat`, as the Spark path's columnar read does), takes that file's figures, turns
each kept event into ``-before`` / ``+after`` (as :func:`feed.txn.diffs.unkeyed_diffs`)
and sums the diffs of each record within the file. Only those partial sums leave the
task; the same job sums them per record across files and caches the result, and the
figures come to the driver through an accumulator. The driver then checks that the whole
input was plain, and a second job writes the updates (:func:`feed.txn.segments.write_updates`).

Plain here is what the Spark path's assembly releases whole, with no figure per source
transaction (:meth:`feed.sources.transactions._Assembly.plain`): data events and skipped
lines only, no END record and no transaction blocks, no snapshot read and no snapshot end
marker, no unavailable-value placeholder (an unkeyed feed quarantines those), every data
event at a position of its own (the files' tasks show it, as in
:class:`feed.sources.columnar.Positions`), and every table shape fitting the feed. An
event at or below the committed position is dropped as redelivered, as
:func:`feed.sources.positions.position_filter` drops it. On anything else the engine
declines, having written nothing, and the Spark path reads the input again; settings that
can never be plain (a key, another granularity, ``--tx-metadata``, ``--eager``, input
the columnar parse does not take) decline before any job, and so does input whose text
shows END records, snapshot reads or placeholders (all of it when small, else the head
of each file).

tests/feed/test_onepass.py runs inputs through this engine and through the Spark path
alone and compares the feeds, the progress and the figures.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc

from feed.sources.positions import ALL_DONE, DATA_OPS, Position, committed_position
from feed.txn.context import DECLINED, TxnContext
from feed.txn.segments import Written

if TYPE_CHECKING:
    from feed.txn.engine import Job

__all__ = ["FileFigures", "partial_sums", "plain_figures", "run"]

#: small input (in all) whose text is looked through before the job: one that shows an
#: END record, a snapshot read or a placeholder is not plain, so no job parses it twice;
#: of larger input, the head of each file
_SCAN_BYTES = 32 << 20
_HEAD_BYTES = 1 << 20
#: input under this size is not offered to the parse again once it declined a feed's input
_SMALL_BYTES = 16 << 20
_NOT_PLAIN_TEXT = re.compile(rb'END|\\u|__debezium_unavailable_value|"op"\s*:\s*"r"')


class FileFigures(NamedTuple):
    """What one file's task saw (an entry of the read's accumulator)."""

    read: int  # the read it belongs to (the accumulator is the process's)
    ord_file: int
    why: str | None  # why the file is not plain (None: it is)
    rows: int = 0  # input rows
    skipped: tuple[tuple[str, int], ...] = ()  # skipped lines by reason
    data: int = 0  # data events
    kept: int = 0  # data events past the committed position
    last: tuple[int, int, int] | None = None  # the highest kept position
    shapes: tuple[int, ...] = ()  # table shapes of the rows past the committed position
    #: where its data events sit: the file's entry for :func:`~feed.sources.columnar.
    #: all_distinct` (:func:`~feed.sources.columnar.seen_positions`)
    positions: tuple[Any, ...] | None = None
    unparsed: bool = False  # the columnar parse declined the file (or could not read it)


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
        updates, figures = _read(ctx, job.files)
    except Exception as e:  # (a file gone under the read, a failed task: the Spark path says)
        ctx.log.warning(
            "feed %s: the one-pass read failed (%s); the Spark path reads the input",
            ctx.config.feed,
            str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__,
        )
        return DECLINED
    why = plain_figures(figures, len(job.files)) or _unfit(ctx, job.files, figures)
    if any(f.unparsed for f in figures):
        _parse_declined.add(ctx.feedlog.root)
    if why is not None:
        updates.unpersist()
        ctx.log.debug("feed %s: not a one-pass transaction: %s", ctx.config.feed, why)
        return DECLINED
    secs["read"] = time.perf_counter() - t0
    rows = sum(f.rows for f in figures)
    reached("after_read", rows_read=rows)
    try:
        t1 = time.perf_counter()
        reached("before_write", bad_rows=0)
        segments = _write(ctx, updates)
        secs["write"] = time.perf_counter() - t1
    finally:
        updates.unpersist()
    secs["one_pass"] = time.perf_counter() - t0
    return _written(ctx, figures, segments, rows)


def _settings_refuse(ctx: TxnContext, job: Job) -> str | None:
    """Why the transaction of ``job`` is not this engine's, found without a job."""
    from feed.sources.columnar import why_not_columnar
    from feed.sources.connect import connect_names
    from feed.sources.inputs import input_bytes
    from protocol import SourceError

    cfg, info = ctx.config, ctx.info
    if not (cfg.kind.events and cfg.kind.columnar) or cfg.parse == "spark":
        return "not Debezium lines the columnar parse reads"
    if info.key or cfg.granularity != "batch":
        return "a keyed feed, or more than one time a transaction"
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
        return _text_refuses(job.files, size)
    except (OSError, SourceError) as e:  # (a file gone: the Spark path says what is wrong)
        return f"input that cannot be read ({e})"


def _text_refuses(files: Sequence[str], size: int) -> str | None:
    """Why the text of ``files`` (``size`` bytes in all) shows they are not plain: all of it
    for input of :data:`_SCAN_BYTES` at most, else the first :data:`_HEAD_BYTES` of each
    file (where a connector's initial snapshot, or an END record after the first
    transaction, shows)."""
    whole = size <= _SCAN_BYTES
    for path in files:
        with open(path, "rb") as f:
            found = _NOT_PLAIN_TEXT.search(f.read() if whole else f.read(_HEAD_BYTES))
        if found is not None:
            return f"{path} holds {found.group().decode(errors='replace')!r}"
    return None


def plain_figures(figures: Sequence[FileFigures], n_files: int) -> str | None:
    """Why the files' ``figures`` show input that is not plain, or None."""
    from feed.sources.columnar import all_distinct

    if len({f.ord_file for f in figures}) != n_files:
        return "a file's task gave no figures"
    for f in sorted(figures, key=lambda f: f.ord_file):
        if f.why is not None:
            return f.why
    if not all_distinct([f.positions for f in figures if f.positions], n_files):
        return "data events that may share a position (one read twice)"
    return None


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


def _read(ctx: TxnContext, files: Sequence[str]) -> tuple[Any, list[FileFigures]]:
    """The updates of ``files`` (record, diff: the partial sums summed per record across
    files, zeros left out; cached) and each file's figures: one Spark job."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T
    from pyspark.sql.pandas.types import to_arrow_type

    from feed.sources.cached import cached
    from feed.sources.columnar import set_union
    from feed.sources.inputs import spark_metadata_path
    from feed.txn.context import spillable

    spark = ctx.spark
    sc = spark.sparkContext
    with _lock:
        if getattr(sc, "_tidefeed_onepass", None) is None:
            sc._tidefeed_onepass = sc.accumulator(frozenset(), set_union())
        acc, read = sc._tidefeed_onepass, next(_reads)
    image = T.StructType([T.StructField(f.name, f.dataType) for f in ctx.record_type.fields])
    out = T.StructType([T.StructField("data", image, False), T.StructField("diff", T.LongType())])
    rows = [(p, spark_metadata_path(p), i) for i, p in enumerate(files)]
    listing = spark.sparkContext.parallelize(rows, max(1, len(rows))).toDF(
        "path string, name string, i long"
    )
    pos = committed_position(ctx.cp.source.get("pos", [0, 0]))
    task = _task(to_arrow_type(image, timezone="UTC"), ctx.info.table, pos, (acc, read))
    # (summed across files in the same job: the cache holds the updates, not the
    # partial sums, which are about three times as many)
    summed = listing.mapInArrow(task, out).groupBy("data").agg(F.sum("diff").alias("diff"))
    updates = cached(summed.where(F.col("diff") != 0), spillable())
    try:
        updates.count()  # (the job: every file's task has added its figures once it is done)
    except BaseException:
        updates.unpersist()
        raise
    with _lock:
        entries = acc.value
        mine = [f for f in entries if f.read == read]
        acc.value = frozenset(f for f in entries if f.read > read)
    return updates, mine


def _task(
    record: pa.StructType, table: str | None, pos: Position, acc: tuple[Any, int]
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from feed.sources.connect_json import Declined
        from feed.sources.debezium_arrow import parse_flat

        for batch in batches:
            for path, name, i in zip(*(batch.column(c).to_pylist() for c in range(3)), strict=True):
                try:
                    with open(path, "rb") as f:
                        data = f.read()
                    t = parse_flat(data, record, (), table, i, name)
                except (Declined, OSError) as e:  # (a file gone: the Spark path says so)
                    entry = FileFigures(acc[1], i, f"{name}: {e}", unparsed=True)
                    acc[0].add(frozenset([entry]))
                    continue
                figures, kept = file_figures(t, pos, acc[1], i)
                acc[0].add(frozenset([figures]))
                if figures.why is None:
                    yield from partial_sums(t.filter(kept), record).to_batches()

    return run


def file_figures(
    t: pa.Table, pos: Position, read: int, ord_file: int
) -> tuple[FileFigures, pa.ChunkedArray]:
    """One file's figures from its parsed rows ``t`` (the columns of
    :func:`~feed.sources.debezium_arrow.parse_flat`), and which rows are data events past
    the committed position ``pos`` (as :func:`~feed.sources.positions.position_filter`)."""
    from feed.sources.columnar import seen_positions

    op, snap = t["op"], pc.fill_null(t["_snap"], "")
    is_data = pc.is_in(op, pa.array(DATA_OPS))
    hi, lo, n = pos
    h, lw, nn = t["pos_hi"], t["pos_lo"], t["pos_n"]
    after = pc.or_kleene(
        pc.greater(h, hi),
        pc.and_kleene(
            pc.equal(h, hi),
            pc.or_kleene(pc.greater(lw, lo), pc.and_kleene(pc.equal(lw, lo), pc.greater(nn, n))),
        ),
    )
    same = pc.and_kleene(pc.and_kleene(pc.equal(op, "r"), pc.equal(h, hi)), pc.equal(lw, lo))
    same = pc.and_kleene(same, pa.scalar(n < ALL_DONE))
    fresh = pc.fill_null(pc.or_kleene(pc.or_kleene(pc.is_null(h), after), same), False)
    kept = pc.and_(is_data, fresh)
    snapshot = pc.or_(
        pc.and_(pc.fill_null(pc.equal(op, "r"), False), pc.not_equal(snap, "incremental")),
        pc.equal(snap, "last"),
    )
    why = _why_not_plain(t, is_data, kept, snapshot)
    skips = (
        pc.value_counts(t["_skip"].drop_null()).to_pylist()
        if t["_skip"].null_count < len(t)
        else []
    )
    figures = FileFigures(
        read=read,
        ord_file=ord_file,
        why=why,
        rows=t.num_rows,
        skipped=tuple(sorted((s["values"], s["counts"]) for s in skips)),
        data=pc.sum(is_data.cast(pa.int64())).as_py() or 0,
        kept=pc.sum(kept.cast(pa.int64())).as_py() or 0,
        last=_highest(t.filter(kept)),
        shapes=tuple(sorted(set(t.filter(fresh)["_shape"].drop_null().to_pylist()))),
        positions=seen_positions(read, ord_file, t),
    )
    return figures, kept


def _why_not_plain(
    t: pa.Table, is_data: pa.ChunkedArray, kept: pa.ChunkedArray, snapshot: pa.ChunkedArray
) -> str | None:
    """Why one file's rows are not plain (see the module docstring), or None."""
    name = t["_file"][0].as_py() if t.num_rows else ""
    unplaced = pc.or_(pc.is_null(t["pos_hi"]), pc.is_null(t["pos_lo"]))
    checks = (
        (pc.any(pc.equal(t["op"], "E")), "a transaction END record"),
        (pc.any(pc.and_(is_data, pc.fill_null(t["tx_meta"], False))), "transaction blocks"),
        (pc.any(snapshot), "a snapshot read or a snapshot's end"),
        (pc.any(pc.is_valid(t["_toast"])), "an unavailable-value placeholder"),
        (pc.any(pc.is_valid(t["_error"])), "a bad row"),
        (pc.any(pc.and_(kept, unplaced)), "an event without a position"),
    )
    for found, why in checks:
        if found.as_py():
            return f"{name}: {why}"
    return None


def _highest(kept: pa.Table) -> tuple[int, int, int] | None:
    """The highest (``pos_hi``, ``pos_lo``, ``pos_n``) of the kept events, or None."""
    if kept.num_rows == 0 or kept["pos_hi"].null_count:
        return None
    by = [("pos_hi", "descending"), ("pos_lo", "descending"), ("pos_n", "descending")]
    top = kept.select(["pos_hi", "pos_lo", "pos_n"]).take(pc.sort_indices(kept, by)[:1])
    return tuple(int(top[c][0].as_py()) for c in ("pos_hi", "pos_lo", "pos_n"))  # type: ignore[return-value]


def partial_sums(kept: pa.Table, record: pa.StructType) -> pa.Table:
    """``-before`` and ``+after`` of the ``kept`` events (each times its weight), summed
    per record, zero sums left out: columns ``data`` (the record) and ``diff``."""
    names = [f"c{i}" for i in range(record.num_fields)]
    parts = []
    for column, sign in (("before", -1), ("after", 1)):
        img = kept.filter(pc.is_valid(kept[column]))
        fields = img[column].combine_chunks().flatten() if img.num_rows else []
        if not img.num_rows:
            continue
        weight = img["weight"] if sign > 0 else pc.negate(img["weight"])
        parts.append(pa.table([*fields, weight], names=[*names, "diff"]))
    if not parts:
        return pa.table({"data": pa.array([], record), "diff": pa.array([], pa.int64())})
    summed = pa.concat_tables(parts).group_by(names).aggregate([("diff", "sum")])
    summed = summed.filter(pc.not_equal(summed["diff_sum"], 0))
    columns = [summed[n].combine_chunks() for n in names]
    data = pa.StructArray.from_arrays(columns, fields=list(record))
    return pa.table({"data": data, "diff": summed["diff_sum"]})


def _write(ctx: TxnContext, updates: Any) -> list[Any]:
    """The transaction's ``updates`` (record, diff), written as its one time's segments."""
    from pyspark.sql import functions as F

    from feed.txn.segments import write_updates

    timed = updates.select("data", F.lit(ctx.cp.next).cast("long").alias("time"), "diff")
    return write_updates(ctx, ctx.cp.seq + 1, timed)


def _written(
    ctx: TxnContext, figures: Sequence[FileFigures], segments: list[Any], rows: int
) -> Written:
    """What the commit records, as the Spark path's figures give it for plain input."""
    from feed.sources.positions import snapshot_done

    skipped: dict[str, int] = {}
    for f in figures:
        for reason, n in f.skipped:
            skipped[reason] = skipped.get(reason, 0) + n
    tops = [f.last for f in figures if f.last is not None]
    return Written(
        segments=segments,
        state_ref=ctx.cp.state,
        units=1,
        position=snapshot_done(max(tops) if tops else None, ()),
        input_rows=rows,
        skipped=skipped,
        redelivered=sum(f.data - f.kept for f in figures),
        snapshot_lsn=None,
        bad_rows=0,
    )
