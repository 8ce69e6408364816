"""The checkpoint store: a sequence of immutable commit files, the emitter's single commit point.

Contract (DESIGN §4):

* A checkpoint is the JSON object ``{"format": 1, "feed", "epoch", "seq", "progress":
  {"lower", "upper", "counts"}, "next", "source", "schema", "since", "writers", "state"}``,
  stored as ``<feed>/_commits/<seq:020d>.json``. The latest checkpoint is the one with the
  highest ``seq``.
* :meth:`CheckpointStore.commit` writes ``seq`` with an exclusive create: on a local disk
  ``O_CREAT | O_EXCL`` then fsync of the file and of the folder, so after it returns the
  commit survives a power cut, and of two writers racing for the same ``seq`` exactly one
  wins. The loser gets :class:`~protocol.errors.CommitConflict` and must stop: it is stale.
  Other filesystems (object stores) get a check-then-write, which narrows but does not close
  the race; see ``docs/operations.md``.
* A commit file is never changed after it is written. Readers may read any of the last
  :data:`KEEP_COMMITS` commits; older ones are pruned after each commit.
* ``progress`` is an intention: the updates it counts are all in the feed log before the
  commit file exists, so once the file exists they must be delivered.

Extensions to the DESIGN fields: ``since`` (the compaction point, 0 until compacted),
``writers`` (``[[from_time, epoch], …]``: which epoch's files hold the times from
``from_time`` on, so files left by a fenced-out writer are never read) and ``state`` (the
folder of the keyed-state snapshot this commit goes with, or null) and ``manifest`` (the
manifest, feed/log/manifest.py, that says which files hold each committed time; null only in a
feed written before manifests, which ``writers`` then describes).
"""

from __future__ import annotations

import logging
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import orjson

from feed.log.store import FeedLog
from protocol import CheckpointError, CommitConflict, Progress

__all__ = ["FORMAT", "KEEP_COMMITS", "Checkpoint", "CheckpointStore", "CommitKind", "fixed"]

#: what wrote a commit (:meth:`CheckpointStore.made_by`)
CommitKind = Literal["claim", "compaction", "transaction"]

FORMAT = 1
KEEP_COMMITS = 5
log = logging.getLogger("tidefeed.checkpoint")
_COMMIT_NAME = re.compile(r"^(\d{20})\.json$")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """One committed checkpoint (see the module docstring for the fields)."""

    feed: str
    epoch: int
    seq: int
    progress: Progress
    next: int
    source: Any = None
    schema: str = ""
    since: int = 0
    writers: tuple[tuple[int, int], ...] = ()
    state: str | None = None
    manifest: str | None = None
    format: int = FORMAT
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def frontier(self) -> int:
        return self.progress.upper

    def to_json(self) -> bytes:
        d = asdict(self)
        d["progress"] = {
            "lower": self.progress.lower,
            "upper": self.progress.upper,
            "counts": [[t, n] for t, n in self.progress.counts],
        }
        d["writers"] = [list(w) for w in self.writers]
        extra = d.pop("extra")
        d.update(extra)
        return orjson.dumps(d, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)

    @classmethod
    def from_json(cls, raw: bytes, *, where: str) -> Checkpoint:
        try:
            d = orjson.loads(raw)
            if d.get("format") != FORMAT:
                raise CheckpointError(f"{where}: unknown checkpoint format {d.get('format')!r}")
            p = d.pop("progress")
            known = {f for f in cls.__dataclass_fields__ if f != "extra"}
            extra = {k: d.pop(k) for k in list(d) if k not in known}
            return cls(
                **{k: v for k, v in d.items() if k not in ("progress", "writers")},
                progress=Progress(p["lower"], p["upper"], tuple(map(tuple, p["counts"]))),
                writers=tuple((int(a), int(b)) for a, b in d.get("writers", [])),
                extra=extra,
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: unreadable checkpoint: {e}") from e

    @classmethod
    def first(cls, feed: str, *, next: int, schema: str) -> Checkpoint:
        """The checkpoint before a new feed's first commit: nothing read, nothing
        committed, the first time ``next``."""
        return cls(
            feed=feed,
            epoch=0,
            seq=0,
            progress=Progress(0, 0, ()),
            next=next,
            source={"file": None, "file_beyond": [], "pos": [0, 0, 0]},
            schema=schema,
        )

    def successor(self, **changes: Any) -> Checkpoint:
        return replace(self, seq=self.seq + 1, **changes)

    def epoch_for(self, time: int) -> int:
        """The epoch whose files hold ``time`` (the writer of the range that contains it)."""
        chosen = self.writers[0][1] if self.writers else self.epoch
        for start, epoch in self.writers:
            if start <= time:
                chosen = epoch
        return chosen


class CheckpointStore:
    """Reads and writes the commit files of one feed."""

    def __init__(self, log: FeedLog) -> None:
        self.log = log
        self.dir = log.path("_commits")

    def path_of(self, seq: int) -> str:
        """The commit file of ``seq``."""
        return f"{self.dir}/{seq:020d}.json"

    def seqs(self) -> list[int]:
        """The seqs of the kept commit files, in order."""
        return self._seqs()

    def _seqs(self) -> list[int]:
        infos = self.log.list_dir(self.dir)
        return sorted(
            int(m.group(1)) for i in infos if (m := _COMMIT_NAME.match(i.base_name)) is not None
        )

    def latest(self, *, repair: bool = False) -> Checkpoint | None:
        """The checkpoint with the highest seq, or ``None`` for a feed never committed.

        A newest commit file that is empty or cut short was never published whole (a crash
        while an older tidefeed, or an object store without conditional create, wrote it):
        its transaction did not commit, so the one before it is the latest. With ``repair``
        (the emitter's start-up) the broken file is renamed ``<seq>.json.broken`` so its
        seq can be committed again."""
        seqs = self._seqs()
        if not seqs:
            return None
        try:
            return self.read(seqs[-1])
        except CheckpointError as e:
            if not isinstance(e.__cause__, orjson.JSONDecodeError):
                raise
            path = self.path_of(seqs[-1])
            log.warning("feed %s: ignoring %s, written only in part: %s", self.log.feed, path, e)
            if repair:
                self.log.fs.move(path, f"{path}.broken")
            return self.read(seqs[-2]) if len(seqs) > 1 else None

    def made_by(self, seq: int) -> CommitKind | None:
        """What wrote commit ``seq``: a ``"claim"`` (it raised the epoch), a
        ``"compaction"`` (it raised ``since``) or a ``"transaction"``; None when it or the
        commit before it is no longer kept (or was never written)."""
        try:
            this, before = self.read(seq), self.read(seq - 1)
        except (CheckpointError, FileNotFoundError):
            return None
        if this.epoch > before.epoch:
            return "claim"
        if this.since > before.since:
            return "compaction"
        return "transaction"

    def read(self, seq: int) -> Checkpoint:
        path = self.path_of(seq)
        try:
            with self.log.fs.open_input_stream(path) as f:
                raw = f.read()
        except (OSError, FileNotFoundError) as e:
            raise CheckpointError(f"feed {self.log.feed!r}: cannot read {path}: {e}") from e
        return Checkpoint.from_json(raw, where=f"feed {self.log.feed!r} commit {seq}")

    def commit(self, cp: Checkpoint) -> None:
        """Write ``cp`` as commit ``cp.seq``, exclusively; raise CommitConflict if it exists."""
        if not self.log.create_exclusive(self.path_of(cp.seq), cp.to_json()):
            raise CommitConflict(
                f"feed {self.log.feed!r}: commit {cp.seq} already exists: another emitter "
                f"(epoch > {cp.epoch}) has taken over this feed; this one is stale and stops"
            )
        self._prune(cp.seq)

    def _prune(self, seq: int) -> None:
        for old in self._seqs():
            if old <= seq - KEEP_COMMITS:
                self.log.delete_file(self.path_of(old))


def fixed(cp: Checkpoint | None) -> bool:
    """Whether a feed has committed anything beyond epoch claims (a transaction or a
    heartbeat): from then on its settings and schema are fixed."""
    return cp is not None and cp.frontier > 0
