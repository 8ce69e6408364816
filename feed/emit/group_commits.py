"""A group's commit files (feed/emit/group.py): ``<log>/_groups/<a+b>/<seq:020d>.json``,
each created exclusively as the one commit point of a group transaction, naming for every
feed the checkpoint to commit and the segments it adds; and the roll forward that finishes
a group commit a crash left in part."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import orjson

from feed.emit.plans import Planned
from feed.log.commits import Committer
from feed.log.manifest import Segment
from feed.log.store import FeedLog
from protocol import CheckpointError, CommitConflict, Progress

__all__ = [
    "FORMAT",
    "GROUPS_DIR",
    "GroupCommits",
    "commit_entry",
    "from_entry",
    "group_name",
    "roll_forward",
]

#: the folder of the log that holds every group's commit files
GROUPS_DIR = "_groups"
#: group commit files kept (older ones are pruned)
KEEP_GROUP_COMMITS = 5
_NAME = re.compile(r"^(\d{20})\.json$")
FORMAT = 1


def group_name(feeds: Sequence[str]) -> str:
    """The group's folder name: its feeds joined by ``+`` (a character feed names lack)."""
    return "+".join(feeds)


class GroupCommits:
    """The commit files of one group, ``<log>/_groups/<name>/<seq:020d>.json``."""

    def __init__(self, log_uri: str, feeds: Sequence[str]) -> None:
        self.fl = FeedLog(log_uri, GROUPS_DIR, own_folder=True)
        self.feeds = tuple(feeds)
        self.name = group_name(feeds)
        self.dir = self.fl.path(self.name)

    def path_of(self, seq: int) -> str:
        return f"{self.dir}/{seq:020d}.json"

    def seqs(self) -> list[int]:
        return sorted(
            int(m.group(1))
            for i in self.fl.list_dir(self.dir)
            if (m := _NAME.match(i.base_name)) is not None
        )

    def latest(self) -> dict[str, Any] | None:
        """The newest group commit, or None for a group never started."""
        seqs = self.seqs()
        if not seqs:
            return None
        path = self.path_of(seqs[-1])
        try:
            body = orjson.loads(self.fl.read_bytes(path))
        except (OSError, orjson.JSONDecodeError) as e:
            raise CheckpointError(f"group {self.name}: cannot read {path}: {e}") from e
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise CheckpointError(f"group {self.name}: {path} is not a group commit")
        return body

    def commit(self, seq: int, epoch: int, members: dict[str, Any]) -> None:
        """Create group commit ``seq`` of ``epoch`` exclusively, naming for each feed in
        ``members`` its :func:`commit_entry`: the group's commit point."""
        body = {
            "format": FORMAT,
            "group": self.name,
            "feeds": list(self.feeds),
            "seq": seq,
            "epoch": epoch,
            "members": members,
        }
        data = orjson.dumps(body, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
        if not self.fl.create_exclusive(self.path_of(seq), data):
            raise CommitConflict(
                f"group {self.name}: commit {seq} already exists: another emitter (epoch > "
                f"{epoch}) has taken over this group; this one is stale and stops"
            )
        for old in self.seqs():
            if old <= seq - KEEP_GROUP_COMMITS:
                self.fl.delete_file(self.path_of(old))


def commit_entry(plan: Planned, segments: Sequence[Segment]) -> dict[str, Any]:
    """What a group commit records of one feed's part of the transaction."""
    p = plan.progress
    return {
        "lower": p.lower,
        "upper": p.upper,
        "counts": [[t, n] for t, n in p.counts],
        "next": plan.next,
        "source": plan.source,
        "state": plan.state,
        "segments": [_segment_entry(s) for s in segments],
        **({"schema": plan.schema} if plan.schema is not None else {}),
    }


def _segment_entry(s: Segment) -> list[Any]:
    """A segment as a group commit records it: time, epoch, count, files, and for packs
    each file's row groups."""
    entry: list[Any] = [s.time, s.epoch, s.count, list(s.files)]
    if s.groups:
        entry.append([list(g) for g in s.groups])
    return entry


def from_entry(e: dict[str, Any]) -> tuple[Planned, list[Segment]]:
    plan = Planned(
        progress=Progress(e["lower"], e["upper"], tuple((t, n) for t, n in e["counts"])),
        next=e["next"],
        source=e["source"],
        state=e["state"],
        schema=e.get("schema"),
    )
    return plan, [
        Segment(t, ep, n, tuple(f), tuple(tuple(g) for g in (groups[0] if groups else ())))
        for t, ep, n, f, *groups in e["segments"]
    ]


def roll_forward(log_uri: str, latest: dict[str, Any], logger: logging.Logger) -> dict[str, int]:
    """Commit each feed's checkpoint of the group transaction ``latest`` that a crash left
    uncommitted (its data is in the log: the group file is written after it); return the
    feeds rolled forward with their new frontiers."""
    done: dict[str, int] = {}
    for feed, e in (latest.get("members") or {}).items():
        committer = Committer(FeedLog(log_uri, feed), feed=feed, logger=logger)
        cp = committer.store.latest(repair=True)
        frontier = cp.frontier if cp is not None else 0
        if frontier >= e["upper"]:
            continue
        if cp is None or frontier != e["lower"]:
            raise CheckpointError(
                f"group {latest.get('group')}: feed {feed!r} is at frontier {frontier}, but "
                f"the group's last commit ({latest['seq']}) takes it from {e['lower']} to "
                f"{e['upper']}: the feed was changed outside its group"
            )
        plan, segments = from_entry(e)
        new_cp = committer.commit(cp, plan.build, segments)
        done[feed] = new_cp.frontier
    if done:
        logger.info(
            "group %s: finished group commit %d left in part by a crash: %s",
            latest.get("group"),
            latest["seq"],
            ", ".join(f"{f} to frontier {u}" for f, u in done.items()),
        )
    return done
