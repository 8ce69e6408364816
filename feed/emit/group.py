"""Groups of feeds: several tables of one database in one time domain (DESIGN §9).

``tidefeed emit --table public.accounts,public.transfers --feed accounts,transfers`` runs
one :class:`GroupEmitter` over one Debezium folder: one emitter per feed (each reads the
same input window, keeps its table's rows and writes its own feed as always), driven as
one transaction loop.

* **One time per source transaction, the same in every feed.** The released source
  transactions of all the feeds, in source order, are numbered once: a transaction takes
  the time ``next + its rank`` in every feed, and a feed it did not touch has no update at
  that time (its progress covers it). Every feed's progress ends at the same ``upper``.
* **Held back together.** A source transaction held back in one feed (its END record, or
  some of that table's events, not read yet) is held back in all of them, with everything
  delivered after it: each feed's reading is done again with the group's hold
  (:class:`~feed.txn.context.GroupHold`) until every feed holds the same.
* **One commit point.** After every feed has written its segments (and keyed state), a
  group commit file ``<log>/_groups/<a+b>/<seq:020d>.json`` is created exclusively: it
  names, for each feed, the checkpoint to commit (progress, ``next``, input position,
  state) and the segments it adds. Only then is each feed's own checkpoint committed.
  Readers read a feed's checkpoint, so no reader sees any feed's frontier move before the
  whole group's transaction is in the log. A crash between the group file and the feeds'
  checkpoints is finished at the next start (roll forward) before anything is rolled back.
* **Fencing.** A start claims a new group epoch by committing the next group seq, then
  claims each feed's epoch as a lone emitter does: an older group emitter loses its next
  group commit (:class:`~protocol.CommitConflict`) and stops before touching any
  checkpoint.

A feed of a group is read, served, pushed and compacted as any other feed: each is a
complete CDCv2 stream on its own. Its ``feed.json`` names the group, and emitting it alone
(or in another group) is refused: its times would lose step with the others'.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from feed._faults import maybe_die
from feed.emit.emitter import Emitter
from feed.emit.group_commits import GroupCommits, commit_entry, group_name, roll_forward
from feed.emit.plans import Planned, State, now_ms, time_after, widening
from feed.emit.progress import TxnProgress, TxnReport
from feed.emit.session import spark_when_asked
from feed.emit.settings import EmitterConfig
from feed.log.checkpoint import Checkpoint
from feed.log.manifest import Segment
from feed.sources.shapes import Evolve
from feed.txn.context import DECLINED, waiting
from feed.txn.dataflow import numbered_once, read_group
from feed.txn.engine import DRIVER, ENGINES, Engine, Job
from feed.txn.segments import Written
from feed.txn.spark import compute_and_write
from protocol import CheckpointError, Progress

__all__ = ["GroupEmitter"]

log = logging.getLogger("tidefeed.emit")


def _die_at(step: str, **_: Any) -> None:
    maybe_die(step)


def _cp(member: Emitter) -> Checkpoint:
    assert member.cp is not None
    return member.cp


@dataclass(frozen=True, slots=True)
class _Done:
    """One feed's transaction, written and planned, before the commit."""

    member: Emitter
    written: Written
    secs: dict[str, float]  # the feed's own stages, added to the group's
    shared: bool = False  # secs are the group's, already counted (the driver's)


class GroupEmitter:
    """Runs the transactions of a group of feeds as one (see the module docstring):
    ``open()``, ``step()`` or ``run()``, ``close()``, as :class:`~feed.emit.emitter.Emitter`."""

    def __init__(
        self,
        configs: Sequence[EmitterConfig],
        *,
        logger: logging.Logger | None = None,
        clock: Callable[[], int] = now_ms,
        progress: TxnProgress | None = None,
        engines: Sequence[Engine] = ENGINES,
    ) -> None:
        if len(configs) < 2:
            raise ValueError("a group holds two or more feeds")
        feeds = tuple(c.feed for c in configs)
        if len(set(feeds)) != len(feeds):
            raise ValueError(f"a feed is named twice in the group {','.join(feeds)}")
        self.feeds = feeds
        self.name = group_name(feeds)
        self.log = logger or log
        self._clock = clock
        self._now = clock()
        self.progress = progress
        self.engines = tuple(engines)  # the driver's run_group is tried first when it is in
        self.members = [
            Emitter(replace(c, group=feeds), logger=self.log, clock=self._frozen, engines=engines)
            for c in configs
        ]
        for m in self.members[1:]:
            m.inputs = self.members[0].inputs  # one listing of the input for all of them
        # (what the loops read: follow, trigger, the window; feed: the group's name)
        self.config = replace(configs[0], feed=self.name, group=feeds)
        self.commits = GroupCommits(configs[0].log, feeds)
        self.epoch = self.seq = 0
        self.state = State.UNOPENED

    def _frozen(self) -> int:
        """The members' clock: one reading per group transaction, so their times agree."""
        return self._now

    def _require(self, state: State) -> None:
        if self.state is not state:
            raise CheckpointError(f"group {self.name}: emitter is {self.state.value}")

    @property
    def cp(self) -> Any:
        """The first feed's checkpoint (every feed of the group has its frontier)."""
        return self.members[0].cp

    # ---- lifecycle -------------------------------------------------------------------
    def open(self) -> None:
        """Finish a group commit a crash left in part, claim a new group epoch, then open
        every feed (each claims its own epoch and rolls back what it did not commit)."""
        self._require(State.UNOPENED)
        try:
            self._open()
        except BaseException:
            self.close()  # (the feeds opened so far let their leases go)
            raise

    def _open(self) -> None:
        self._now = self._clock()
        latest = self.commits.latest()
        if latest is not None:
            if list(latest.get("feeds") or ()) != list(self.feeds):
                raise CheckpointError(
                    f"group {self.name}: its log names the feeds {latest.get('feeds')}"
                )
            roll_forward(self.config.log, latest, self.log)
        seq = int(latest["seq"]) if latest else 0
        epoch = int(latest["epoch"]) if latest else 0
        self.commits.commit(seq + 1, epoch + 1, {})
        self.seq, self.epoch = seq + 1, epoch + 1
        for m in self.members:
            m.open()
            self.config = replace(self.config, clock=m.config.clock)
        spots = {(_cp(m).frontier, _cp(m).next) for m in self.members}
        if len(spots) > 1:
            raise CheckpointError(
                f"group {self.name}: its feeds are out of step ("
                + "; ".join(
                    f"{m.config.feed}: frontier {_cp(m).frontier}, next {_cp(m).next}"
                    for m in self.members
                )
                + "); a feed of a group is emitted only with its group"
            )
        self.log.info(
            "group %s: epoch %d claimed; frontier %d, next time %d",
            self.name,
            self.epoch,
            self.cp.frontier,
            self.cp.next,
        )
        self.state = State.OPENED

    def close(self) -> None:
        for m in self.members:
            m.close()
        self.state = State.CLOSED

    # ---- input -----------------------------------------------------------------------
    def pending_files(self) -> list[str]:
        return self.members[0].pending_files()

    def held_back(self) -> list[str]:
        return self.members[0].held_back()

    # ---- one transaction -------------------------------------------------------------
    def step(self) -> TxnReport | None:
        """One group transaction over the pending input (see :meth:`Emitter.step`)."""
        self._require(State.OPENED)
        self._now = self._clock()
        first = self.members[0]
        pending = first.pending_files()
        files = first.inputs.first(
            pending, self.config.max_files_per_txn, kind=first.config.kind, whole_txns=True
        )
        return widening(pending, files, self._txn, self.progress)

    def _txn(self, files: list[str], *, more: bool) -> Any:
        first = self.members[0]
        secs: dict[str, float] = {}
        if self.progress is not None:
            self.progress.start(self.seq + 1, len(files))
        start = first._timed_start(secs)

        def shared() -> Any:  # (the feeds share the first one's session)
            spark = start()
            for m in self.members[1:]:
                m._spark = spark
            return spark

        with spark_when_asked(shared, self.config.conf, files) as session:
            for m in self.members:
                m._session = session
            try:
                return self._run_txn(files, secs, more=more)
            finally:
                for m in self.members:
                    m._session = None

    def _run_txn(self, files: list[str], secs: dict[str, float], *, more: bool) -> Any:
        """Every feed's reading of ``files`` under the group's hold, its updates at the
        times the group's numbering gives, and the group's commit."""
        first = self.members[0]
        assert first.cp is not None
        tx_files = first.inputs.pending_tx(first.cp.source)
        ctxs = [m.context() for m in self.members]
        if DRIVER in self.engines:
            job = Job(self.seq + 1, files, tx_files, more=more)
            out = DRIVER.run_group(ctxs, job, secs, _die_at, self.name)
            if isinstance(out, list):
                # the driver computed the feeds together: each feed's line shows that time
                # (the group's own seconds have it once)
                shared = {"driver": secs.get("driver", 0.0)}
                parts = [
                    _Done(m, w, dict(shared), shared=True)
                    for m, w in zip(self.members, out, strict=True)
                ]
                held = max(w.held for w in out)
                return self._commit_txn(files, tx_files, parts, secs, held_txns=held)
            if out is not DECLINED:
                return out
        t0 = time.perf_counter()
        reads, hold = read_group(ctxs, files, tx_files, more=more, group=self.name)
        secs["read"] = time.perf_counter() - t0
        stopped = {i: r.shape_error for i, r in enumerate(reads) if r.shape_error is not None}
        if all(r.ready == 0 for r in reads) and (hold.txns or stopped):
            for r in reads:
                r.release()
            for e in stopped.values():
                if not isinstance(e, Evolve):
                    raise e
            if stopped:
                return self._evolve(stopped, secs)
            return waiting(self.log, f"group {self.name}", len(hold.txns), more=more)
        maybe_die("after_read")
        done: list[_Done] = []
        with numbered_once(reads):
            for member, r in zip(self.members, reads, strict=True):
                own: dict[str, float] = {}
                w = compute_and_write(member.context(), r, own, reached=_die_at)
                done.append(_Done(member, w, own))
        return self._commit_txn(files, tx_files, done, secs, held_txns=len(hold.txns))

    def _commit_txn(
        self,
        files: list[str],
        tx_files: list[str],
        done: list[_Done],
        secs: dict[str, float],
        *,
        held_txns: int,
    ) -> TxnReport:
        """Commit what every feed wrote, at the same times in every feed."""
        units = {d.written.units for d in done}
        if len(units) != 1:
            raise CheckpointError(
                f"group {self.name}: the feeds' transactions took different numbers of "
                f"times ({sorted(units)}); nothing was committed"
            )
        maybe_die("after_write")
        n = units.pop()
        first = self.members[0]
        cp = _cp(first)
        upper = cp.next + n if n else cp.frontier
        next_time = time_after(first.info.clock, self._clock, upper)
        held = frozenset().union(*(d.written.held_files for d in done))
        t3 = time.perf_counter()
        plans = [
            d.member.plan(
                files, d.written, tx_files=tx_files, units=n, held=held, next_time=next_time
            )
            for d in done
        ]
        cps = self._commit(plans, [d.written.segments for d in done])
        secs["commit"] = time.perf_counter() - t3
        for d in done:
            if d.shared:
                continue  # (the group's seconds have them already)
            for k, v in d.secs.items():
                secs[k] = secs.get(k, 0.0) + v
        reports = [
            d.member.committed(c, files, d.secs, d.written) for d, c in zip(done, cps, strict=True)
        ]
        report = TxnReport(
            seq=self.seq,
            progress=Progress(cp.frontier, max(upper, cp.frontier), ()),
            files=len(files),
            input_rows=max(r.input_rows for r in reports),
            updates=sum(r.updates for r in reports),
            bad_rows=sum(r.bad_rows for r in reports),
            seconds=secs,
            held=held_txns,
        )
        self.log.info("group %s: %s", self.name, report.line())
        return report

    def _evolve(self, evolving: dict[int, Any], secs: dict[str, float]) -> TxnReport:
        """The next schema version of each feed whose table changed shape at the head of
        the input (``evolving``: member index -> :class:`~feed.sources.shapes.Evolve`), committed
        at the next time with every feed of the group: one time that stands for the
        ``ALTER TABLE``, empty in the feeds whose tables it did not change."""
        first = self.members[0]
        cp = _cp(first)
        start = cp.next
        upper = max(start + 1, cp.frontier)
        nxt = time_after(first.info.clock, self._clock, upper)
        t0 = time.perf_counter()
        plans: list[Planned] = []
        writes: list[Written | None] = []
        versions = {}
        for i, m in enumerate(self.members):
            if i not in evolving:
                plans.append(Planned.idle(_cp(m), upper, nxt))
                writes.append(None)
                continue
            versions[i], w, plan = m.version_plan(evolving[i], start, upper, nxt, secs)
            plans.append(plan)
            writes.append(w)
        secs["rewrite"] = time.perf_counter() - t0
        maybe_die("before_version_commit")
        t1 = time.perf_counter()
        cps = self._commit(plans, [w.segments if w is not None else [] for w in writes])
        secs["commit"] = time.perf_counter() - t1
        for i, (m, c) in enumerate(zip(self.members, cps, strict=True)):
            if i in versions:
                m.adopt_version(versions[i], evolving[i])
            m.cp = c
        report = TxnReport(
            seq=self.seq,
            progress=Progress(cp.frontier, upper, ()),
            files=0,
            input_rows=0,
            updates=sum(s.count for w in writes if w is not None for s in w.segments),
            bad_rows=0,
            seconds=secs,
        )
        self.log.info("group %s: a new schema version: %s", self.name, report.line())
        return report

    def _commit(self, plans: Sequence[Planned], segments: Sequence[Sequence[Segment]]) -> list[Any]:
        """The group commit file (the commit point), then each feed's checkpoint."""
        members = {
            m.config.feed: commit_entry(p, s)
            for m, p, s in zip(self.members, plans, segments, strict=True)
        }
        maybe_die("before_group_commit")
        self.commits.commit(self.seq + 1, self.epoch, members)
        self.seq += 1
        maybe_die("after_group_commit")
        out = []
        for i, (m, p, s) in enumerate(zip(self.members, plans, segments, strict=True)):
            if i:
                maybe_die("between_feed_commits")
            assert m.cp is not None
            out.append(m.commits.commit(m.cp, p.build, s))
        return out

    def heartbeat(self) -> Any:
        """Commit an empty progress up to now in every feed (wallclock groups)."""
        self._require(State.OPENED)
        first = self.members[0]
        if first.info.clock != "wallclock":
            return None
        upper = max(self._clock(), _cp(first).next)
        if upper <= _cp(first).frontier:
            return None
        plans = [Planned.idle(_cp(m), upper, upper) for m in self.members]
        cps = self._commit(plans, [[] for _ in self.members])
        for m, c in zip(self.members, cps, strict=True):
            m.cp = c
        return cps[0]

    # ---- loops -------------------------------------------------------------------------
    def run(self, *, stop: Callable[[], bool] | None = None) -> list[TxnReport]:
        from feed.emit.loop import run

        self._require(State.OPENED)
        return run(self, stop=stop)
