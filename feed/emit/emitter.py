"""The transaction driver (DESIGN §4): exactly-once turning of input files into a feed.

Start-up (:meth:`Emitter.open`): load the latest checkpoint, claim a new epoch by committing
``seq + 1`` (a racing emitter loses with CommitConflict), delete every time folder at or
above the committed ``upper`` and every staged, quarantined or state folder no commit names
(the rollback of a transaction that did not commit).

One transaction (:meth:`Emitter.step`), by the first engine that takes it
(:mod:`feed.txn.engine`: small and plain on the driver, else in Spark; same files):

1. read the input files not yet consumed (:mod:`feed.sources.inputs`) into changes, drop input at
   or below the committed position and hold back incomplete source transactions;
2. turn changes into diffs (keyed state where needed), assign times from ``next``,
   consolidate per time;
3. write each time's updates to ``_staging`` and move them to ``times/<t>`` (a redo of the
   same time replaces them), the keyed state and the quarantined rows (:mod:`feed.txn.segments`);
4. **commit**: the manifest (:mod:`feed.log.manifest`), then the checkpoint (progress,
   ``next``, ``source``, ``state``, ``manifest``), the single commit point
   (:mod:`feed.log.commits`);
5. hand the committed progress to the publisher, if any.

The feed's settings are checked or created first (:mod:`feed.emit.settings`). Batch and follow
runs loop over :meth:`Emitter.step` in :mod:`feed.emit.loop`. A change of the source
table's shape commits a new schema version first (:mod:`feed.emit.versions`).
With eager delivery (:mod:`feed.emit.eager`) the executors push the updates between 3 and 4.

A crash before 4 leaves the old checkpoint, so the next start rolls back and redoes the
transaction at the same times (``next`` is fixed by the previous commit). A crash after 4
finds everything committed: the files are below ``source.file`` and are never read twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from feed._faults import maybe_die
from feed.emit.plans import Planned, State, now_ms, time_after, widening
from feed.emit.progress import TxnProgress, TxnReport
from feed.emit.session import spark_when_asked
from feed.emit.settings import EmitterConfig, feed_settings, load_schema_file
from feed.emit.versions import SchemaVersions
from feed.log.checkpoint import Checkpoint
from feed.log.commits import Committer, time_ranges
from feed.log.manifest import Segment
from feed.log.store import FeedLog
from feed.sources.inputs import InputWindow, next_source
from feed.sources.shapes import Evolve
from feed.txn.context import TxnContext
from feed.txn.engine import ENGINES, Engine, Job, run_job
from feed.txn.segments import Written
from protocol import CheckpointError, Progress

if TYPE_CHECKING:  # (its push client needs aiohttp: only an --eager emit loads it)
    from feed.emit.eager import EagerPusher

__all__ = ["Emitter", "EmitterConfig", "TxnReport", "load_schema_file"]

log = logging.getLogger("tidefeed.emit")


class Emitter(SchemaVersions):
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
        engines: Sequence[Engine] = ENGINES,
    ) -> None:
        self.config = config
        self.engines = tuple(engines)  # feed/txn/engine.py, in the order they are offered
        self._spark = spark
        self.log = logger or log
        self.on_commit = on_commit
        self.eager = eager
        self._lease: Any = None  # feed/log/lease.py, held from open to close
        self._clock = clock
        self.progress = progress
        self.feedlog = FeedLog(config.log, config.feed)
        self.commits = Committer(self.feedlog, feed=config.feed, logger=self.log)
        self.state = State.UNOPENED
        self.cp: Checkpoint | None = None
        self._delta_source: Any = None
        self.info: Any = None
        self._record_type: Any = None
        self.inputs = InputWindow(config.source_path, config.tx_metadata)
        self._shapes: set[int] = set()  # source table shapes found to fit (feed/sources/shapes.py)
        #: the running transaction's session (feed/emit/session.py: spark_when_asked)
        self._session: Callable[[], Any] | None = None

    # ---- lifecycle -------------------------------------------------------------------
    @property
    def spark(self) -> Any:
        if self._spark is None:
            from feed.emit.reach import check_executors_see
            from feed.emit.session import get_spark

            spark = get_spark(self.config.master, conf=dict(self.config.conf))
            files = self.inputs.all_files if self.config.kind.files else list
            check_executors_see(spark, self.feedlog.local_root, files)  # (on a cluster)
            self._spark = spark
        return self._spark

    def _require(self, state: State) -> None:
        if self.state is not state:
            raise CheckpointError(
                f"feed {self.config.feed!r}: emitter is {self.state.value}, needs {state.value}"
            )

    def open(self) -> Checkpoint:
        """Take the feed's lease (feed/log/lease.py), load or create the feed, claim a new
        epoch, roll back uncommitted work."""
        from feed.log.lease import Lease

        self._require(State.UNOPENED)
        cfg = self.config
        self._lease = Lease(self.feedlog, take_over=cfg.take_over, log=self.log)
        self._lease.acquire()
        try:
            return self._open()
        except BaseException:
            self.close()  # (the lease goes: nothing was claimed)
            if not self.feedlog.list_dir(self.feedlog.root):  # a new feed refused: no trace
                self.feedlog.delete_dir(self.feedlog.root)
            raise

    def _open(self) -> Checkpoint:
        cfg = self.config
        latest = self.commits.store.latest(repair=True)
        self.config, self.info = feed_settings(
            cfg,
            self.feedlog,
            latest,
            spark=lambda: self.spark,
            files=self.inputs.all_files,
            delta_schema=lambda: self._delta().record_schema(),
            log=self.log,
        )
        cfg = self.config
        from feed.sources.rows import spark_record_type

        self._record_type = spark_record_type(self.info.schema)
        # the shapes an emitter before this one found to fit (each version's file lists
        # them): judged again, a shape from before a DROP COLUMN reads as adding it back
        for version in self.info.versions:
            self._shapes.update(version.shapes)
        if latest is None:
            start = self._clock() if self.info.clock == "wallclock" else 1
            latest = Checkpoint.first(cfg.feed, next=start, schema=self.info.fingerprint)
        from feed.txn.state import BucketedState

        self._state = BucketedState(
            lambda: self.spark, self.feedlog, self._record_type, self.info.key, self._spark_path
        )
        claimed, gone = self.commits.claim(latest, self._state)
        self.cp = claimed
        if gone:
            rolled = f"{len(gone)} uncommitted time(s): {time_ranges(gone)}"
            self.log.info("feed %s: rolled back %s", cfg.feed, rolled)
        at = f"seq {claimed.seq}; frontier {claimed.frontier}, next time {claimed.next}"
        self.log.info("feed %s: epoch %d claimed at %s", cfg.feed, claimed.epoch, at)
        self.state = State.OPENED
        return claimed

    def close(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        self.state = State.CLOSED

    # ---- input -----------------------------------------------------------------------
    def _delta(self) -> Any:
        from feed.sources.delta import DeltaSource

        if self._delta_source is None:
            self._delta_source = DeltaSource(self.config.source_path)
        return self._delta_source

    def pending_files(self) -> list[str]:
        """Input files not consumed yet, in name order (also noted for the next commit)."""
        assert self.cp is not None
        if not self.config.kind.files:
            return []
        return self.inputs.pending(self.cp.source)

    def held_back(self) -> list[str]:
        """After a batch run: the input files still pending, which hold source transactions
        that never completed (their END record or events were not in the input)."""
        return self.pending_files()

    # ---- one transaction -------------------------------------------------------------
    def step(self) -> TxnReport | None:
        """Run one transaction over the pending input; ``None`` when there was none, or when
        every source transaction in it is still incomplete (held back for more input)."""
        self._require(State.OPENED)
        if not self.config.kind.files:
            return self._delta_step()
        pending = self.pending_files()
        # a source transaction (a Delta commit version: always) is never split
        kind, limit = self.config.kind, self.config.max_files_per_txn
        whole = self.config.granularity == "transaction" or kind.versions
        files = self.inputs.first(pending, limit, kind=kind, whole_txns=whole)
        return widening(pending, files, self._txn, self.progress)

    def _delta_step(self) -> TxnReport | None:
        """One transaction over the Delta versions after the committed one."""
        assert self.cp is not None
        staged = self._delta().stage_next(int(self.cp.source.get("version", -1)), self.feedlog)
        if staged is None:
            return None
        path, last = staged
        try:
            report = self._txn([self._spark_path(path)], source_update={"version": last})
        finally:
            self.feedlog.delete_file(path)
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
        """One transaction, with Spark started and the shuffle width its input needs."""
        assert self.cp is not None
        assert self.config.granularity is not None  # settled by open()
        secs: dict[str, float] = {}
        if self.progress is not None:
            self.progress.start(self.cp.seq + 1, len(files))
        with spark_when_asked(self._timed_start(secs), self.config.conf, files) as session:
            self._session = session
            try:
                return self._run_txn(files, secs, more=more, source_update=source_update)
            finally:
                self._session = None

    def _timed_start(self, secs: dict[str, float]) -> Callable[[], Any]:
        """The SparkSession, its start (the first a process makes) timed into ``secs``."""

        def start() -> Any:
            if self._spark is None:
                t0 = time.perf_counter()
                _ = self.spark
                secs["spark_start"] = time.perf_counter() - t0
            return self.spark

        return start

    def _run_txn(
        self,
        files: list[str],
        secs: dict[str, float],
        *,
        more: bool,
        source_update: dict[str, Any] | None,
    ) -> Any:
        """Read, compute, write and commit one transaction (see the module's docstring),
        by the first of the emitter's engines that takes it (feed/txn/engine.py)."""
        assert self.cp is not None
        tx_files = self.inputs.pending_tx(self.cp.source)
        job = Job(self.cp.seq + 1, files, tx_files, more=more, eager=self.eager)
        try:
            written = run_job(self.context(), job, secs, self._reached, self.engines)
        except Evolve as ev:
            return self.evolve(ev, secs)
        if not isinstance(written, Written):
            return written  # None or NEED_MORE: nothing to commit
        return self._finish(files, secs, written, tx_files=tx_files, source_update=source_update)

    def context(self) -> TxnContext:
        """What a transaction's dataflow needs from this emitter, from its committed
        checkpoint on."""
        assert self.cp is not None
        return TxnContext(
            session=self._session or (lambda: self.spark),
            config=self.config,
            cp=self.cp,
            info=self.info,
            record_type=self._record_type,
            state=self._state,
            feedlog=self.feedlog,
            log=self.log,
            spark_path=self._spark_path,
            shapes=self._shapes,
        )

    def _reached(self, step: str, **facts: Any) -> None:
        """A transaction reached ``step`` (``after_read``, ``before_write``,
        ``after_write``): fault injection, and the progress line's stage."""
        maybe_die(step)
        if step == "after_read":
            self._stage("computing diffs", **facts)
        elif step == "before_write":
            self._stage("writing", **facts)

    def _finish(
        self,
        files: list[str],
        secs: dict[str, float],
        w: Written,
        *,
        tx_files: Sequence[str],
        source_update: dict[str, Any] | None,
    ) -> TxnReport:
        """Commit what a transaction over ``files`` (and ``tx_files``) wrote, with a
        source's own ``source_update`` (a Delta version); prune and report."""
        assert self.cp is not None
        self._reached("after_write")
        t3 = time.perf_counter()
        planned = self.plan(files, w, tx_files=tx_files, source_update=source_update)
        self._stage("committing", updates=sum(n for _, n in planned.progress.counts))
        new_cp = self._commit(planned.build, w.segments)  # the commit point
        secs["commit"] = time.perf_counter() - t3
        maybe_die("after_commit")
        return self.committed(new_cp, files, secs, w)

    def plan(
        self,
        files: Sequence[str],
        w: Written,
        *,
        tx_files: Sequence[str],
        source_update: dict[str, Any] | None = None,
        units: int | None = None,
        held: frozenset[str] | None = None,
        next_time: int | None = None,
    ) -> Planned:
        """The checkpoint a transaction over ``files`` that wrote ``w`` commits. A group
        (feed/emit/group.py) gives the group's ``units``, ``held`` files and ``next_time``."""
        assert self.cp is not None
        cfg, cp = self.config, self.cp
        units = w.units if units is None else units
        counts = {s.time: s.count for s in w.segments}
        upper = cp.next + units if units else cp.frontier
        progress = Progress(cp.frontier, max(upper, cp.frontier), tuple(sorted(counts.items())))
        if next_time is None:
            next_time = time_after(self.info.clock, self._clock, progress.upper)
        source = next_source(
            cp.source,
            position=w.position,
            cdf=cfg.kind.versions,
            replaces=w.replaces,
            files=None if source_update is not None else (self.inputs.listed, files),
            tx_files=(self.inputs.tx_listed, tx_files) if tx_files else None,
            held=set(w.held_files if held is None else held),
            update=source_update,
        )
        if cfg.kind.events and "snapshot_lsn" not in source:
            source["snapshot_lsn"] = w.snapshot_lsn
            if w.snapshot_txn is not None:
                source["snapshot_txn"] = w.snapshot_txn
        return Planned(progress=progress, next=next_time, source=source, state=w.state_ref)

    def committed(
        self, new_cp: Checkpoint, files: Sequence[str], secs: dict[str, float], w: Written
    ) -> TxnReport:
        """After the commit of a transaction that wrote ``w``: prune, log and report it,
        and hand it to ``on_commit``."""
        self.cp = new_cp
        self.commits.prune(new_cp, self._state)
        report = TxnReport.of(new_cp, len(files), w, secs)
        if self.progress is not None:
            self.progress.done()  # the live line goes before the summary is logged
        self.log.info("feed %s: %s", self.config.feed, report.line())
        if self.on_commit:
            self.on_commit(new_cp)
        return report

    def _commit(
        self, build: Callable[[Checkpoint], Checkpoint], segments: Sequence[Segment]
    ) -> Checkpoint:
        assert self.cp is not None
        self.cp = self.commits.commit(self.cp, build, segments)
        return self.cp

    def _stage(self, name: str, **facts: Any) -> None:
        if self.progress is not None:
            self.progress.stage(name, **facts)

    def _spark_path(self, path: str) -> str:
        fl = self.feedlog
        return path if fl.local_root is not None else fl.spark_path(path[len(fl.root) + 1 :])

    # ---- loops -------------------------------------------------------------------------
    def run(self, *, stop: Callable[[], bool] | None = None) -> list[TxnReport]:
        """Batch: transactions until the input is consumed. Follow: forever (or until
        ``stop``). See :func:`feed.emit.loop.run`."""
        from feed.emit.loop import run

        self._require(State.OPENED)
        return run(self, stop=stop)
