"""The transaction driver (DESIGN §4): exactly-once turning of input files into a feed.

Start-up (:meth:`Emitter.open`): load the latest checkpoint, claim a new epoch by committing
``seq + 1`` (a racing emitter loses with CommitConflict), delete every time folder at or
above the committed ``upper`` and every staged, quarantined or state folder no commit names
(the rollback of a transaction that did not commit).

One transaction (:meth:`Emitter.step`):

1. list input files not yet consumed (named above the high-water ``source.file``, see
   feed/inputs.py) in name order; read them into changes; drop input at or below the
   committed position (redelivery);
2. turn changes into diffs (keyed state where needed), assign times from ``next``,
   consolidate per time;
3. write each time's updates to ``_staging`` and move them to ``times/<t>`` (a redo of the
   same time replaces them: idempotent), write the keyed-state snapshot and quarantined rows;
4. **commit**: the manifest (feed/manifest.py), then the checkpoint (progress, ``next``,
   ``source``, ``state``, ``manifest``) — the checkpoint is the single commit point;
5. hand the committed progress to the publisher, if any.

With eager delivery (:mod:`feed.eager`) the executors push the updates between 3 and 4.

A crash before 4 leaves the old checkpoint, so the next start rolls back and redoes the
transaction at the same times (``next`` is fixed by the previous commit). A crash after 4
finds everything committed: the files are below ``source.file`` and are never read twice.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import orjson

from protocol import CheckpointError, CommitConflict, Progress, SourceError, fingerprint

from ._faults import maybe_die
from .checkpoint import Checkpoint, CheckpointStore
from .eager import EagerPusher
from .inputs import FilePosition, consumed_position, list_files, without_legacy
from .log import FeedLog
from .manifest import ManifestStore, Segment
from .progress import TxnProgress

__all__ = ["Emitter", "EmitterConfig", "TxnReport", "load_schema_file"]

log = logging.getLogger("tidefeed.emit")

DEFAULT_TRIGGER = 5.0
DEFAULT_MAX_FILES = 1000
LIST_PRUNE_EVERY = 256
DEFAULT_CLOCK = "wallclock"  # a new feed's, when --clock is left out
DEFAULT_GRANULARITY = "batch"  # a new feed's, when --granularity is left out
RESERVED = ("time", "diff")


def _spillable() -> Any:
    """Serialized, spilling to disk: cached input never fills the driver's heap."""
    from pyspark import StorageLevel

    return StorageLevel.MEMORY_AND_DISK


class State(Enum):
    UNOPENED = "unopened"
    OPENED = "opened"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True, kw_only=True)
class EmitterConfig:
    source_kind: str
    source_path: str
    feed: str
    log: str
    key: tuple[str, ...] = ()
    schema: dict[str, Any] | None = None
    clock: str | None = None  # None: the feed's, else wallclock
    granularity: str | None = None  # None: the feed's, else batch
    follow: bool = False
    trigger: float = DEFAULT_TRIGGER
    master: str | None = None
    on_bad_record: str = "quarantine"
    max_files_per_txn: int = DEFAULT_MAX_FILES
    order: str | None = None  # upsert: the column that orders upserts
    deleted: str | None = None  # upsert: the boolean column that marks deletes
    table: str | None = None  # debezium: the schema.table the feed holds
    tx_metadata: str | None = None  # debezium: a folder of transaction metadata records
    conf: tuple[tuple[str, str], ...] = ()  # Spark settings (--conf), over everything else


@dataclass(slots=True)
class TxnReport:
    """What one transaction did (also the content of its log line)."""

    seq: int
    progress: Progress
    files: int
    input_rows: int
    updates: int
    bad_rows: int
    seconds: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)  # lines with no change, by reason
    held: int = 0  # source transactions held back (incomplete)
    redelivered: int = 0  # events dropped as already turned into updates, or repeated

    def line(self) -> str:
        secs = " ".join(f"{k}={v:.2f}s" for k, v in self.seconds.items())
        times = f"[{self.progress.lower}, {self.progress.upper})"
        skipped = "".join(
            f" skipped[{k.replace(' ', '_')}]={v}" for k, v in sorted(self.skipped.items())
        )
        extra = f" redelivered={self.redelivered}" if self.redelivered else ""
        extra += f" held_back_txns={self.held}" if self.held else ""
        return (
            f"txn {self.seq}: times {times} files={self.files} input_rows={self.input_rows} "
            f"updates={self.updates} bad_rows={self.bad_rows}{skipped}{extra} {secs}"
        )


def _edge_txn(kind: str, path: str, *, last: bool) -> str | None:
    """The source transaction of the first (or last) change of a JSON-lines file, if known.
    Lines that carry no change (tombstones, heartbeats, transaction metadata) are passed."""
    if kind not in ("debezium", "cdf") or path.endswith(".parquet"):
        return None
    try:
        with open(path, "rb") as f:
            if last:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - (1 << 20)))
                lines = [x for x in f.read().splitlines() if x.strip()][::-1]
            else:
                lines = [x for x in (f.readline() for _ in range(100)) if x.strip()]
    except OSError:
        return None
    from .sources import debezium_event

    for line in lines:
        if kind == "cdf":
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            v = row.get("_commit_version") if isinstance(row, dict) else None
        else:
            found = debezium_event(line)
            if found is None:
                continue
            src = found[1].get("source")
            v = src.get("txId") if isinstance(src, dict) else None
        return None if v is None else str(v)
    return None


#: what :meth:`Emitter._txn` returns when nothing in its input is complete yet but more
#: input files are pending
_NEED_MORE = object()


def _base_name(uri: str) -> str:
    """The file name in a path or in Spark's ``_metadata.file_path`` (a quoted URI)."""
    import urllib.parse

    return urllib.parse.unquote(uri.rstrip("/").rsplit("/", 1)[-1])


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def _fixed(cp: Checkpoint | None) -> bool:
    """Whether a feed has committed anything beyond epoch claims (a transaction or a
    heartbeat): from then on its settings and schema are fixed."""
    return cp is not None and cp.frontier > 0


def _bad_sample(bad: Any, cached: Sequence[Any]) -> str:
    """The first bad rows' files and reasons, for the error of a transaction that stops
    (``bad`` and ``cached``, of no more use, are released)."""
    sample = bad.limit(3).collect()
    for df in (bad, *cached):
        df.unpersist()
    return "; ".join(f"{_base_name(r['_file'])}: {r['_error']}" for r in sample)


def _tally(grouped: Any, stale: Any) -> Any:
    """Input rows, TOAST placeholders and stale (already committed) rows per group."""
    from pyspark.sql import functions as F

    return grouped.agg(
        F.count(F.lit(1)).alias("n"),
        F.count("_toast").alias("toast"),
        F.count(F.when(stale & F.col("_error").isNull(), 1)).alias("stale"),
    )


class Emitter:
    """Runs the transactions of one feed: ``open()``, ``step()`` or ``run()``, ``close()``."""

    def __init__(
        self,
        config: EmitterConfig,
        *,
        spark: Any = None,
        logger: logging.Logger | None = None,
        on_commit: Callable[[Checkpoint], None] | None = None,
        eager: EagerPusher | None = None,
        clock: Callable[[], int] = now_ms,
        progress: TxnProgress | None = None,
    ) -> None:
        self.config = config
        self._spark = spark
        self.log = logger or log
        self.on_commit = on_commit
        self.eager = eager
        self._clock = clock
        self.progress = progress
        self.feedlog = FeedLog(config.log, config.feed)
        self.store = CheckpointStore(self.feedlog)
        self.manifests = ManifestStore(self.feedlog)
        self.state = State.UNOPENED
        self.cp: Checkpoint | None = None
        self._delta_source: Any = None
        self.info: Any = None
        self._record_type: Any = None
        self._listed: list[str] = []  # file names the last poll saw (input, tx metadata)
        self._tx_listed: list[str] = []

    # ---- lifecycle -------------------------------------------------------------------
    @property
    def spark(self) -> Any:
        if self._spark is None:
            from .session import get_spark

            self._spark = get_spark(self.config.master, conf=dict(self.config.conf))
        return self._spark

    def _require(self, state: State) -> None:
        if self.state is not state:
            raise CheckpointError(
                f"feed {self.config.feed!r}: emitter is {self.state.value}, needs {state.value}"
            )

    def open(self) -> Checkpoint:
        """Load or create the feed, claim a new epoch, roll back uncommitted work."""
        self._require(State.UNOPENED)
        cfg = self.config
        self.info = self.feedlog.info()
        latest = self.store.latest(repair=True)
        if self.info is not None and not _fixed(latest):
            # an earlier run wrote the feed's settings but never committed a transaction
            # (it failed, was killed, or every row it read was bad): they are not the
            # feed's yet, and this run's flags (or inference) decide them
            self.log.info("feed %s: nothing committed yet; its settings are set anew", cfg.feed)
            self.info = None
        if self.info is None:
            self.config = cfg = replace(
                cfg,
                clock=cfg.clock or DEFAULT_CLOCK,
                granularity=cfg.granularity or DEFAULT_GRANULARITY,
            )
            self.info = self._create_feed()
        else:
            self.config = cfg = self._settle()
        from .sources import spark_record_type

        self._record_type = spark_record_type(self.info.schema)
        if latest is None:
            start = self._clock() if self.info.clock == "wallclock" else 1
            latest = Checkpoint(
                feed=cfg.feed,
                epoch=0,
                seq=0,
                progress=Progress(0, 0, ()),
                next=start,
                source={"file": None, "file_beyond": [], "pos": [0, 0, 0]},
                schema=self.info.fingerprint,
            )
        claimed = latest.successor(epoch=latest.epoch + 1)
        if latest.seq and latest.manifest is None and latest.frontier > 0:
            # a feed from before manifests: publish the one its folders imply
            legacy = self.manifests.of(latest)
            m = self.manifests.write(seq=claimed.seq, epoch=claimed.epoch, base=legacy)
            claimed = replace(claimed, manifest=m.name, writers=())
            self.log.info("feed %s: migrated to a manifest-based log (%s)", cfg.feed, m.name)
        self.store.commit(claimed)
        self.cp = claimed
        kept_states, kept_manifests = self._kept_refs(claimed)
        self.manifests.prune(kept_manifests)
        gone = self.feedlog.delete_times_from(claimed.progress.upper)
        self.feedlog.delete_dir(self.feedlog.path("_staging"))
        from .state import BucketedState

        self._state = BucketedState(
            lambda: self.spark, self.feedlog, self._record_type, self.info.key, self._spark_path
        )
        self._state.prune(kept_states)
        for name in ("quarantine",):
            for n in self.feedlog.numbered_dirs(name):
                if n > latest.seq and f"{name}/{n}" != claimed.state:
                    self.feedlog.delete_dir(self.feedlog.path(name, str(n)))
        if gone:
            self.log.info("feed %s: rolled back uncommitted times %s", cfg.feed, gone)
        self.log.info(
            "feed %s: epoch %d claimed at seq %d; frontier %d, next time %d",
            cfg.feed,
            claimed.epoch,
            claimed.seq,
            claimed.frontier,
            claimed.next,
        )
        self.state = State.OPENED
        return claimed

    def close(self) -> None:
        self.state = State.CLOSED

    def _create_feed(self) -> Any:
        from .sources import debezium_table, infer_record_schema

        cfg = self.config
        schema = cfg.schema
        table = cfg.table
        if cfg.source_kind == "debezium" and table is None:
            # a feed is one table: the first change event's, unless --table names it
            table = debezium_table(self._all_files())
        if schema is None and cfg.source_kind == "delta":
            schema = self._delta().record_schema()
        if schema is None:
            schema = infer_record_schema(
                self.spark,
                cfg.source_kind,
                self._all_files() if cfg.source_kind == "debezium" else self._all_files()[:5],
                exclude=tuple(c for c in (cfg.order, cfg.deleted) if c),
                table=table,
            )
        names = {f["name"] for f in schema.get("fields", [])}
        clash = [n for n in RESERVED if n in names]
        if clash:
            raise SourceError(
                f"feed {cfg.feed!r}: record columns {clash} clash with the feed log's own "
                "'time' and 'diff' columns; rename them"
            )
        missing = [k for k in cfg.key if k not in names]
        if missing:
            raise SourceError(
                f"feed {cfg.feed!r}: key column(s) {missing} are not in the record "
                f"schema (columns: {sorted(names)})"
            )
        fingerprint(schema)  # validates
        if table:
            self.log.info("feed %s: holds source table %s", cfg.feed, table)
        assert cfg.clock is not None
        return self.feedlog.create(
            schema=schema,
            key=cfg.key,
            clock=cfg.clock,
            table=table,
            source=cfg.source_kind,
            granularity=cfg.granularity,
            order=cfg.order,
            deleted=cfg.deleted,
        )

    def _settle(self) -> EmitterConfig:
        """This run's settings against the feed's (``feed.json``), before anything is read:
        a flag left out takes the feed's value, a flag that differs is refused. Settings a
        feed from an older tidefeed did not keep come from the flags (or the defaults)."""
        cfg, info = self.config, self.info
        if cfg.schema is not None and fingerprint(cfg.schema) != info.fingerprint:
            raise SourceError(
                f"feed {cfg.feed!r}: --schema differs from the feed's record schema "
                f"(fingerprint {info.fingerprint[:12]}…); a feed's schema is fixed when it "
                "is created: leave --schema out, or emit into a new feed"
            )
        settled: dict[str, Any] = {}
        for name, flag, stored in (
            ("source_kind", "--source KIND", info.source),
            ("key", "--key", ",".join(info.key)),
            ("clock", "--clock", info.clock),
            ("granularity", "--granularity", info.granularity),
            ("table", "--table", info.table),
            ("order", "--order", info.order),
            ("deleted", "--deleted", info.deleted),
        ):
            given = getattr(cfg, name)
            if name == "key":
                given = ",".join(given) if given else None
            if stored is None or given is None:
                value = given if stored is None else stored
            elif given != stored:
                raise SourceError(
                    f"feed {cfg.feed!r} was created with {flag} {stored or '(none)'}; this "
                    f"run gives {given}. A feed's settings are fixed when it is created: "
                    "leave the flag out (the feed's value is used), or emit into a new feed"
                )
            else:
                value = stored
            if name == "key":
                value = tuple(c for c in (value or "").split(",") if c) or info.key
            settled[name] = value
        settled["clock"] = settled["clock"] or DEFAULT_CLOCK
        settled["granularity"] = settled["granularity"] or DEFAULT_GRANULARITY
        return replace(cfg, **settled)

    # ---- input -----------------------------------------------------------------------
    def _all_files(self, where: str | None = None) -> list[str]:
        return list_files(where or self.config.source_path)

    def _delta(self) -> Any:
        from .delta import DeltaSource

        if self._delta_source is None:
            self._delta_source = DeltaSource(self.config.source_path)
        return self._delta_source

    def pending_files(self) -> list[str]:
        """Input files not consumed yet, in name order (also noted for the next commit)."""
        assert self.cp is not None
        if self.config.source_kind == "delta":
            return []
        listed = self._all_files()
        self._listed = [os.path.basename(f) for f in listed]
        return FilePosition.from_source(self.cp.source).pending(listed)

    def _pending_tx_files(self) -> list[str]:
        """Transaction metadata files (``--tx-metadata``) not yet consumed: all of them go
        into every read, they are small and say which transactions are complete."""
        assert self.cp is not None
        if not self.config.tx_metadata:
            return []
        listed = list_files(self.config.tx_metadata, what="--tx-metadata path")
        self._tx_listed = [os.path.basename(f) for f in listed]
        return FilePosition.from_source(self.cp.source, "tx_file").pending(listed)

    # ---- one transaction -------------------------------------------------------------
    def step(self) -> TxnReport | None:
        """Run one transaction over the pending input; ``None`` when there was none, or when
        every source transaction in it is still incomplete (held back for more input)."""
        self._require(State.OPENED)
        if self.config.source_kind == "delta":
            return self._delta_step()
        pending = self.pending_files()
        files = pending[: self.config.max_files_per_txn]
        if not files:
            return None
        if self.config.granularity == "transaction" or self.config.source_kind == "cdf":
            # never split a source transaction (a Delta commit version: always): take the
            # next file too while it goes on with the transaction the last file ended in
            while len(files) < len(pending):
                last = _edge_txn(self.config.source_kind, files[-1], last=True)
                if last is None or last != _edge_txn(
                    self.config.source_kind, pending[len(files)], last=False
                ):
                    break
                files.append(pending[len(files)])
        while True:
            try:
                report = self._txn(files, more=len(files) < len(pending))
            finally:
                if self.progress is not None:
                    self.progress.done()
            if report is not _NEED_MORE:
                assert report is None or isinstance(report, TxnReport)
                return report
            # nothing complete in this window: a source transaction is longer than it
            files = pending[: 2 * len(files)]

    def _delta_step(self) -> TxnReport | None:
        """One transaction over the Delta versions after the committed one."""
        from .delta import MAX_VERSIONS

        assert self.cp is not None
        done = int(self.cp.source.get("version", -1))
        source = self._delta()
        latest = source.latest()
        if latest <= done:
            return None
        last = min(latest, done + MAX_VERSIONS)
        fl = self.feedlog
        staged = fl.path("_staging", f"delta-v{done + 1}-v{last}.parquet")
        fl.fs.create_dir(fl.path("_staging"), recursive=True)
        source.stage(done + 1, last, staged, fl.fs)
        try:
            report = self._txn([self._spark_path(staged)], source_update={"version": last})
        finally:
            fl.delete_file(staged)
        assert isinstance(report, TxnReport)
        return report

    def heartbeat(self) -> Checkpoint | None:
        """Commit an empty progress up to now (wallclock feeds) so consumers can close times."""
        self._require(State.OPENED)
        assert self.cp is not None
        if self.info.clock != "wallclock":
            return None
        upper = max(self._clock(), self.cp.next)
        if upper <= self.cp.frontier:
            return None
        cp = self._commit(
            lambda base: base.successor(progress=Progress(base.frontier, upper, ()), next=upper),
            (),
        )
        if self.on_commit:
            self.on_commit(cp)
        return cp

    def _txn(
        self,
        files: list[str],
        *,
        more: bool = False,
        source_update: dict[str, Any] | None = None,
    ) -> Any:
        from pyspark.sql import functions as F

        from .diffs import (
            assign_units,
            consolidate_diffs,
            fill_unavailable,
            keyed_diffs,
            replacement_deletes,
            snapshot_diffs,
            unkeyed_diffs,
        )
        from .sources import read_changes
        from .transactions import assemble

        assert self.cp is not None
        cfg, cp, fl = self.config, self.cp, self.feedlog
        assert cfg.granularity is not None  # settled by open()
        seq = cp.seq + 1
        secs: dict[str, float] = {}
        if self.progress is not None:
            self.progress.start(seq, len(files))
        if self._spark is None:  # the first transaction of a process starts Spark
            t0 = time.perf_counter()
            _ = self.spark
            secs["spark_start"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        options: dict[str, Any] = {
            k: v for k, v in (("order", cfg.order), ("deleted", cfg.deleted)) if v
        }
        options.update(table=self.info.table, schema=self.info.schema)
        tx_files = self._pending_tx_files()
        changes = read_changes(
            self.spark,
            "cdf" if cfg.source_kind == "delta" else cfg.source_kind,
            [*files, *tx_files],
            self._record_type,
            self.info.key,
            options,
        )
        # keep the raw text only where a bad row may need it (parse errors; deletes and
        # snapshot rows, which the keyed checks may still find bad): the cache stays small
        keep_raw = F.col("_error").isNotNull() | (F.col("op") == "d") | F.col("_toast").isNotNull()
        if cfg.source_kind == "snapshot":
            keep_raw = F.lit(True)
        changes = changes.withColumn("_raw", F.when(keep_raw, F.col("_raw"))).persist(_spillable())
        bad = changes.where(F.col("_error").isNotNull()).select("_file", "_raw", "_error")
        # (another table's last snapshot read stays: it says where a snapshot ends)
        good = changes.where(
            F.col("_error").isNull() & ((F.col("op") != "x") | (F.col("_snap") == "last"))
        )
        held_files: frozenset[str] = frozenset()
        order: Any = None  # the released source transactions in order (a DataFrame)
        position: Any = None  # the highest source position, when the source tells it
        txn_cached: tuple[Any, ...] = ()
        held = redelivered = 0
        replaces: tuple[int, str] | None = None  # a new Debezium snapshot: (LSN, txn)
        keyed = bool(self.info.key) and cfg.source_kind != "snapshot"
        image = F.when(F.col("op") == "d", F.col("before")).otherwise(F.col("after"))
        touched: frozenset[int] | None = None  # the state buckets this transaction meets
        tally_rows: list[Any] | None = None
        if cfg.source_kind == "debezium":
            from .state import bucket_of

            buckets = self._state.buckets(cp.state) if keyed else None
            # the counts and the state buckets come with the transaction figures: one job
            assembled = assemble(
                good,
                cp.source.get("pos", [0, 0]),
                snapshot_lsn=cp.source.get("snapshot_lsn"),
                new_feed="snapshot_lsn" not in cp.source,
                logger=self.log,
                feed=cfg.feed,
                bucket=bucket_of(image, self.info.key, buckets) if buckets else None,
                also=_tally(changes.groupBy("_file", "_skip"), F.lit(False)),
            )
            touched, tally_rows = assembled.buckets, list(assembled.also)
            good, held_files = assembled.changes, assembled.held_files
            order, position = assembled.order, assembled.position
            bad = bad.unionByName(assembled.bad)
            held, redelivered = assembled.held, assembled.redelivered
            txn_cached = assembled.cached
            replaces = assembled.replaces
            if replaces is not None and not keyed:
                for df in (changes, *txn_cached):
                    df.unpersist()
                raise SourceError(
                    f"feed {cfg.feed!r}: Debezium snapshotted {cfg.table or 'the table'} "
                    f"again (snapshot LSN {replaces[0]}); an unkeyed feed cannot tell which "
                    "rows the new snapshot no longer holds, so nothing was committed: give "
                    "the feed --key, or start a new feed from the new snapshot"
                )
            if replaces is not None and buckets:
                touched = frozenset(range(buckets))  # every key may have gone
            if held and not assembled.ready:
                for df in (changes, *txn_cached):
                    df.unpersist()
                if more:
                    return _NEED_MORE
                self.log.info(
                    "feed %s: waiting for the rest of %d source transaction(s)", cfg.feed, held
                )
                return None
        if held_files:
            # a file that is read again later is quarantined and counted then
            held_list = sorted(held_files)
            bad = bad.where(~F.col("_file").isin(held_list))
            counted = changes.where(~F.col("_file").isin(held_list))
        else:
            counted = changes
        done_version = cp.source.get("cdf_version") if cfg.source_kind == "cdf" else None
        stale = F.lit(False)
        if done_version is not None:
            # a Delta commit is whole in one emitter transaction (the file window never
            # splits a version): a version at or below the committed one is a redelivery
            stale = (F.col("op") != "x") & (F.col("pos_hi") <= F.lit(done_version))
            good = good.where(~stale)
        if tally_rows is None:
            tally_rows = _tally(counted.groupBy("_skip"), stale).collect()
        else:  # by file: a file that is read again later is counted then
            tally_rows = [r for r in tally_rows if r["_file"] not in held_files]
        input_rows, toast_rows = 0, 0
        skipped: dict[str, int] = {}
        for r in tally_rows:
            input_rows += r["n"]
            toast_rows += r["toast"]
            redelivered += r["stale"]
            if r["_skip"] is not None:
                skipped[r["_skip"]] = skipped.get(r["_skip"], 0) + r["n"]
        secs["read"] = time.perf_counter() - t0
        maybe_die("after_read")
        self._stage("computing diffs", rows_read=input_rows)

        t1 = time.perf_counter()
        good, units, ranked = assign_units(good, cfg.granularity, order)
        loaded = live = None
        if keyed:
            from .state import GONE_COLUMN

            # only the state buckets this transaction's keys fall in
            loaded = self._state.load(cp.state, good, image, touched=touched)
            if loaded.rows is not None:  # a deleted key's tombstone is not a row
                live = loaded.rows.where(~F.col(GONE_COLUMN))
            if replaces is not None:
                gone = replacement_deletes(good, live, self.info.key, replaces)
                good = good.unionByName(gone)
        if toast_rows:
            if loaded is not None:
                filled = fill_unavailable(good, live, self.info.key)
                good = filled.diffs
                assert filled.bad is not None
                bad = bad.unionByName(filled.bad)
            else:
                bad = bad.unionByName(
                    good.where(F.col("_toast").isNotNull()).select(
                        "_file",
                        "_raw",
                        F.concat(
                            F.lit("unavailable value (unchanged TOASTed column) in "),
                            F.col("_toast"),
                            F.lit(
                                ": give --key so the feed's state fills it in, or set "
                                "REPLICA IDENTITY FULL on the table"
                            ),
                        ).alias("_error"),
                    )
                )
                good = good.where(F.col("_toast").isNull())
        new_state = None
        cached = None
        if cfg.source_kind == "snapshot":
            # the previous snapshot, whole: diffing full snapshots is O(table) by nature
            last = self._state.read([cp.state]) if cp.state else None
            d = snapshot_diffs(good, last, self.info.key, cfg.granularity)
            diffs, new_state, cached = d.diffs, d.state, d.cached
            if d.bad is not None:
                bad = bad.unionByName(d.bad)
        elif loaded is not None:
            # a Delta update pre-image says nothing the keyed state does not know already
            d = keyed_diffs(
                good.where(F.col("op") != "p"),
                loaded.rows,
                self.info.key,
                per_key=cfg.source_kind in ("upsert", "cdf", "delta"),
            )
            diffs, new_state, cached = d.diffs, d.state, d.cached
            assert d.bad is not None
            bad = bad.unionByName(d.bad)
        else:
            diffs = unkeyed_diffs(good)
        t_next = cp.next
        updates = consolidate_diffs(diffs, t_next)
        bad = bad.persist(_spillable())
        bad_rows = bad.count()
        if bad_rows and not _fixed(cp) and bad_rows + sum(skipped.values()) >= input_rows:
            # a new feed whose first input is all bad (the wrong source kind or file, say)
            # fixes nothing: no commit, no consumed files, no settings
            reasons = _bad_sample(bad, (changes, *txn_cached))
            self.feedlog.delete_file(self.feedlog.path("feed.json"))
            raise SourceError(
                f"feed {cfg.feed!r}: every one of the {bad_rows} input row(s) is bad, e.g. "
                f"{reasons}; nothing was committed and the feed was not created (check "
                "--source KIND and the input files)"
            )
        if bad_rows and cfg.on_bad_record == "fail":
            reasons = _bad_sample(bad, (changes, *txn_cached))
            raise SourceError(
                f"feed {cfg.feed!r}: {bad_rows} bad input row(s), e.g. {reasons}; "
                "nothing was committed (--on-bad-record fail)"
            )
        if cfg.source_kind != "debezium":
            # (Debezium's position came with the transaction figures, without a job)
            last = good.agg(F.max(F.struct("pos_hi", "pos_lo", "pos_n")).alias("m"))
            row = last.collect()[0]["m"]
            position = None if row is None else tuple(row)
        secs["compute"] = time.perf_counter() - t1

        t2 = time.perf_counter()
        self._stage("writing", bad_rows=bad_rows)
        staging = fl.path("_staging", f"{seq}-{uuid.uuid4().hex[:8]}")
        flat = updates.select("time", "data.*", "diff")
        flat.write.partitionBy("time").parquet(self._spark_path(staging))
        segments = self._install(staging, cp.epoch)
        counts = {s.time: s.count for s in segments}
        state_ref = cp.state
        if new_state is not None and loaded is not None:
            state_ref = self._state.write(seq, new_state, loaded)
        elif new_state is not None:  # successive snapshots: the last one, whole
            state_ref = f"state/{seq}-{uuid.uuid4().hex[:8]}"
            new_state.select("data.*").write.parquet(self._spark_path(fl.path(state_ref)))
        if bad_rows:
            bad.select(
                F.col("_file").alias("file"),
                F.col("_raw").alias("raw"),
                F.col("_error").alias("reason"),
            ).write.mode("overwrite").json(self._spark_path(fl.path("quarantine", str(seq))))
        fl.delete_dir(staging)
        secs["write"] = time.perf_counter() - t2
        if self.eager is not None and counts:
            t_eager = time.perf_counter()
            paths = [self._spark_path(fl.path(f)) for s in segments for f in s.files]
            pushed = self.eager.push(self.spark, paths, cp.epoch)
            secs["eager"] = time.perf_counter() - t_eager
            self.log.info(
                "feed %s: eager: pushed %d update(s) before the commit (%d failed)",
                cfg.feed,
                pushed.pushed,
                pushed.failed,
            )
        maybe_die("after_write")

        t3 = time.perf_counter()
        self._stage("committing", updates=sum(counts.values()))
        upper = t_next + units if units else cp.frontier
        progress = Progress(cp.frontier, max(upper, cp.frontier), tuple(sorted(counts.items())))
        next_time = progress.upper
        if self.info.clock == "wallclock":
            next_time = max(self._clock(), progress.upper)
        held_names = {_base_name(f) for f in held_files}
        source = {
            **without_legacy(cp.source),
            "pos": list(position) if position is not None else cp.source.get("pos", [0, 0, 0]),
        }
        if source_update is None:
            source.update(consumed_position(cp.source, "file", self._listed, files, held_names))
        if cfg.source_kind == "cdf" and position is not None:
            source["cdf_version"] = position[0]
        if replaces is not None:
            source["snapshot_lsn"] = replaces[0]  # the feed's own snapshot from now on
        elif cfg.source_kind == "debezium" and "snapshot_lsn" not in source:
            # the first snapshot read committed: later reads at another LSN are a new one
            reads = good.where(F.col("op") == "r").agg(F.min("pos_lo").alias("m"))
            source["snapshot_lsn"] = reads.collect()[0]["m"]  # None: the feed had none
        if source_update is not None:
            # not a folder of files: the source's own position (a Delta version)
            source.update(source_update)
        if tx_files:
            source.update(
                consumed_position(cp.source, "tx_file", self._tx_listed, tx_files, held_names)
            )
        new_cp = self._commit(  # the commit point
            lambda base: base.successor(
                progress=progress, next=next_time, source=source, state=state_ref
            ),
            segments,
        )
        secs["commit"] = time.perf_counter() - t3
        maybe_die("after_commit")
        self._prune(new_cp)
        for df in (changes, bad, cached, ranked, *txn_cached):
            if df is not None:
                df.unpersist()
        report = TxnReport(
            seq=seq,
            progress=progress,
            files=len(files),
            input_rows=input_rows,
            updates=sum(counts.values()),
            bad_rows=bad_rows,
            seconds=secs,
            skipped=skipped,
            held=held,
            redelivered=redelivered,
        )
        if self.progress is not None:
            self.progress.done()  # the live line goes before the summary is logged
        self.log.info("feed %s: %s", cfg.feed, report.line())
        if self.on_commit:
            self.on_commit(new_cp)
        return report

    def _stage(self, name: str, **facts: Any) -> None:
        if self.progress is not None:
            self.progress.stage(name, **facts)

    def _spark_path(self, path: str) -> str:
        fl = self.feedlog
        return path if fl.local_root is not None else fl.spark_path(path[len(fl.root) + 1 :])

    def _install(self, staging: str, epoch: int) -> list[Segment]:
        """Move staged ``time=<t>`` folders to ``times/<t>``; return each time's segment."""
        fl = self.feedlog
        segments = []
        for d in fl.list_dir(staging):
            if not d.base_name.startswith("time="):
                continue
            t = int(d.base_name.split("=", 1)[1])
            files = [i.path for i in fl.list_dir(d.path) if i.base_name.endswith(".parquet")]
            n = fl.row_count(files)
            if n:
                installed = fl.install_time(t, epoch, files)
                segments.append(Segment(t, epoch, n, tuple(installed)))
        return sorted(segments, key=lambda s: s.time)

    def _commit(
        self, build: Callable[[Checkpoint], Checkpoint], segments: Sequence[Segment]
    ) -> Checkpoint:
        """Commit ``build(latest)``: publish its manifest (the latest one plus ``segments``)
        first, then the checkpoint. A compaction may have committed in between (same epoch,
        a higher seq): then commit on top of it; a higher epoch means this emitter is stale."""
        assert self.cp is not None
        base = self.cp
        for _ in range(16):
            new_cp = build(base)
            if segments:
                m = self.manifests.write(
                    seq=new_cp.seq,
                    epoch=new_cp.epoch,
                    base=self.manifests.of(base),
                    added=segments,
                )
                new_cp = replace(new_cp, manifest=m.name)
            maybe_die("before_commit")
            try:
                self.store.commit(new_cp)
            except CommitConflict:
                winner = self.store.latest()
                if winner is None or winner.epoch != base.epoch or winner.seq <= base.seq:
                    raise
                self.log.info(
                    "feed %s: commit %d was taken by a compaction (since %d); "
                    "committing on top of it",
                    self.config.feed,
                    new_cp.seq,
                    winner.since,
                )
                base = winner
                continue
            self.cp = new_cp
            return new_cp
        raise CommitConflict(f"feed {self.config.feed!r}: gave up committing after 16 conflicts")

    def _kept_refs(self, cp: Checkpoint) -> tuple[set[str | None], set[str | None]]:
        """The state snapshots and manifests the kept commits name."""
        states, manifests = {cp.state}, {cp.manifest}
        for s in self.store._seqs():
            if s != cp.seq:
                with contextlib.suppress(CheckpointError):
                    other = self.store.read(s)
                    states.add(other.state)
                    manifests.add(other.manifest)
        return states, manifests

    def _prune(self, cp: Checkpoint) -> None:
        """Delete the state and manifest files no kept commit needs (and an uncommitted
        transaction's); every :data:`LIST_PRUNE_EVERY` commits also whatever a crashed or
        finished process left (by listing, with a grace period)."""
        states, manifests = self._kept_refs(cp)
        self._state.prune(states)
        listing = cp.seq % LIST_PRUNE_EVERY == 0
        self.manifests.prune(manifests, written=None if listing else self.manifests.written)

    # ---- loops -------------------------------------------------------------------------
    def run(self, *, stop: Callable[[], bool] | None = None) -> list[TxnReport]:
        """Batch: transactions until the input is consumed. Follow: forever (or until ``stop``)."""
        self._require(State.OPENED)
        reports: list[TxnReport] = []
        total = len(self.pending_files())
        while True:
            if stop is not None and stop():
                return reports
            report = self.step()
            if report is not None:
                reports.append(report)
                if stop is not None and stop():
                    return reports
                if not self.config.follow and total > self.config.max_files_per_txn:
                    done = sum(r.files for r in reports)
                    self.log.info(
                        "feed %s: %d/%d input files (%.0f%%)",
                        self.config.feed,
                        done,
                        total,
                        100 * done / total,
                    )
                continue
            if not self.config.follow or (stop is not None and stop()):
                return reports
            self.heartbeat()
            deadline = time.monotonic() + self.config.trigger
            while time.monotonic() < deadline:
                if stop is not None and stop():
                    return reports
                time.sleep(min(0.1, self.config.trigger))


def load_schema_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            schema = orjson.loads(f.read())
    except OSError as e:
        raise SourceError(f"cannot read schema file {path}: {e.strerror}") from e
    except orjson.JSONDecodeError as e:
        raise SourceError(f"schema file {path} is not JSON: {e}") from e
    if not isinstance(schema, dict) or schema.get("type") != "record":
        raise SourceError(f"schema file {path} must hold an Avro record schema")
    return schema
