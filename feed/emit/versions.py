"""A feed's schema versions, as the emitter commits them (DESIGN §2; docs/schema.md).

When a source table changes shape in a way the feed can follow, the transaction's
dataflow raises :class:`~feed.sources.shapes.Evolve` before writing anything. The emitter
then commits, at the next time and as a transaction of its own, the feed's next schema
version with the rows its keyed state holds rewritten into it (:mod:`feed.txn.evolve`);
the input that changed shape stays pending and is read through the new version by the
next transaction. A group of feeds (feed/emit/group.py) commits its members' versions
through :meth:`SchemaVersions.version_plan` and :meth:`SchemaVersions.adopt_version`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from feed._faults import maybe_die
from feed.emit.plans import Planned, time_after
from feed.emit.progress import TxnReport
from feed.emit.settings import EmitterConfig
from feed.log.checkpoint import Checkpoint
from feed.log.info import SchemaVersion
from feed.log.manifest import Segment
from feed.sources.shapes import Evolve
from feed.txn.context import TxnContext
from feed.txn.engine import DRIVER, Engine
from feed.txn.segments import Written
from protocol import Progress, SourceError

__all__ = ["SchemaVersions"]


class SchemaVersions:
    """The emitter's part that commits and adopts schema versions (a mixin of
    :class:`~feed.emit.emitter.Emitter`, whose attributes and methods it names below)."""

    config: EmitterConfig
    cp: Checkpoint | None
    info: Any
    eager: Any
    log: logging.Logger
    _clock: Callable[[], int]
    _record_type: Any
    _state: Any
    _shapes: set[int]
    engines: tuple[Engine, ...]

    if TYPE_CHECKING:  # defined by the emitter

        def context(self) -> TxnContext: ...
        def _stage(self, name: str, **facts: Any) -> None: ...
        def _commit(
            self, build: Callable[[Checkpoint], Checkpoint], segments: Sequence[Segment]
        ) -> Checkpoint: ...
        def committed(
            self, new_cp: Checkpoint, files: Sequence[str], secs: dict[str, float], w: Written
        ) -> TxnReport: ...

    def evolve(self, ev: Evolve, secs: dict[str, float]) -> TxnReport:
        """Commit the feed's next schema version at the next time, with the rows its
        state holds rewritten into it; the input stays pending."""

        assert self.cp is not None
        if self.eager is not None:
            raise SourceError(
                f"feed {self.config.feed!r}: {ev}. A feed emitted with --eager does not take "
                "a new schema version yet: run this emit without --eager once (it commits "
                "the version and goes on), then go back to --eager."
            )
        cp, start = self.cp, self.cp.next
        upper = max(start + 1, cp.frontier)
        nxt = time_after(self.info.clock, self._clock, upper)
        t0 = time.perf_counter()
        version, w, plan = self.version_plan(ev, start, upper, nxt, secs)
        secs["rewrite"] = time.perf_counter() - t0
        maybe_die("before_version_commit")
        t1 = time.perf_counter()
        new_cp = self._commit(plan.build, w.segments)
        secs["commit"] = time.perf_counter() - t1
        self.adopt_version(version, ev)
        return self.committed(new_cp, [], secs, w)

    def version_plan(
        self, ev: Evolve, start: int, upper: int, nxt: int, secs: dict[str, float]
    ) -> tuple[SchemaVersion, Written, Planned]:
        """The version ``ev`` describes, written from ``start`` (:meth:`new_version`), and
        the commit that makes it the feed's: its updates at ``start``, progress to
        ``upper``, ``next`` at ``nxt``."""
        from protocol import fingerprint

        assert self.cp is not None
        version, w = self.new_version(ev, start, secs)
        counts = tuple((s.time, s.count) for s in w.segments)
        plan = Planned(
            progress=Progress(self.cp.frontier, upper, counts),
            next=nxt,
            source=self.cp.source,
            state=w.state_ref,
            schema=fingerprint(version.schema),
        )
        return version, w, plan

    def new_version(
        self, ev: Evolve, start: int, secs: dict[str, float]
    ) -> tuple[SchemaVersion, Written]:
        """The schema version ``ev`` describes, from time ``start``, written with the
        state rewritten into it and the updates that makes at ``start``: all but the
        commit (feed/txn/evolve.py). ``secs`` has ``driver`` when Spark had no part in it."""
        from feed.txn.evolve import rewrite

        assert self.cp is not None
        self._stage("rewriting the state into a new schema version")
        # (on the driver when the emitter offers it transactions and the state is one it
        # takes: then a feed whose transactions are all the driver's never starts Spark)
        driver = DRIVER in self.engines and self.config.driver_txn_bytes > 0
        t0 = time.perf_counter()
        version, segments, state_ref, alone = rewrite(
            self.context(), ev, self.cp.seq + 1, start, driver=driver
        )
        if driver and alone:
            secs["driver"] = secs.get("driver", 0.0) + time.perf_counter() - t0
        return version, Written(
            segments=segments,
            state_ref=state_ref,
            units=1,
            position=None,
            input_rows=0,
            skipped={},
            redelivered=0,
            snapshot_lsn=None,
        )

    def adopt_version(self, version: SchemaVersion, ev: Evolve) -> None:
        """After the commit of ``version``: read from now on through it."""
        from feed.sources.rows import spark_record_type

        self.info = self.info.evolved(version)
        self._record_type = spark_record_type(version.schema)
        self._state.record_type = self._record_type
        # The shapes found to fit stay known: a version keeps every column (a dropped one
        # nullable) and only widens types, so each still fits. Judged again, a shape from
        # before a DROP COLUMN would read as adding the dropped column back; with both
        # shapes in one held source transaction the versions then took turns for ever.
        self.log.info(
            "feed %s: the source table changed shape at %s (%s): schema version from time "
            "%d committed",
            self.config.feed,
            ev.where,
            ev.change.describe(),
            version.start,
        )
