"""A feed's settings (``feed.json``: record schema, key, clock, granularity, source, group)
and the later versions of its record schema (``schemas/<from>.json``), as the log stores
them (feed/log/store.py reads and writes the files)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

import orjson

from protocol import fingerprint

__all__ = ["Clock", "FeedInfo", "Granularity", "Layout", "SchemaVersion"]

#: what a feed's times count: source transactions in order, or milliseconds of wall time
Clock = Literal["logical", "wallclock"]
#: what one time of a feed holds: one emitter transaction, or one source transaction
Granularity = Literal["batch", "transaction"]
#: how a feed's updates are filed: a folder per time (DESIGN §5), or packs of many times
#: (feed/txn/packs.py)
Layout = Literal["times", "packs"]


@dataclass(frozen=True, slots=True)
class SchemaVersion:
    """A version of a feed's record schema (``schemas/<from>.json``): the schema every
    record at ``start`` and later has, until the next version. Each version holds every
    column of the one before (docs/sources.md, "Schema changes"): ``added`` columns are
    nullable, ``dropped`` ones are kept and null from ``start`` on, ``widened`` ones took a
    type that holds every old value."""

    start: int
    schema: dict[str, Any]
    added: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    widened: tuple[str, ...] = ()
    #: (old name, new name): a column renamed (also listed as dropped and added: the old
    #: column is null from ``start`` on, the new one holds its values)
    renamed: tuple[tuple[str, str], ...] = ()
    #: the source table shapes (feed/sources/shapes.py) found to fit the feed before this
    #: version was committed: each fits this one too (a version keeps every column and
    #: only widens types), and an emitter started later must not judge them again
    shapes: tuple[int, ...] = ()

    def changes(self) -> dict[str, Any]:
        """The columns this version added, dropped, widened and renamed (old: new)."""
        return {
            "added": list(self.added),
            "dropped": list(self.dropped),
            "widened": list(self.widened),
            "renamed": dict(self.renamed),
        }

    def describe(self) -> str:
        """What this version changed, in words."""
        parts = [f"{k} {', '.join(c)}" for k, c in self.changes().items() if c and k != "renamed"]
        parts += [f"renamed {old} to {new}" for old, new in self.renamed]
        return "; ".join(parts)

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "from": self.start,
                "schema": self.schema,
                "fingerprint": fingerprint(self.schema),
                **self.changes(),
                "shapes": list(self.shapes),
            },
            option=orjson.OPT_INDENT_2,
        )

    @staticmethod
    def from_json(data: bytes) -> SchemaVersion:
        d = orjson.loads(data)
        return SchemaVersion(
            start=int(d["from"]),
            schema=d["schema"],
            added=tuple(d.get("added") or ()),
            dropped=tuple(d.get("dropped") or ()),
            widened=tuple(d.get("widened") or ()),
            renamed=tuple((str(k), str(v)) for k, v in (d.get("renamed") or {}).items()),
            shapes=tuple(int(h) for h in d.get("shapes") or ()),
        )


@dataclass(frozen=True, slots=True)
class FeedInfo:
    """The contents of ``feed.json``, with the later versions of its record schema:
    ``schema`` is the newest one (see :meth:`at`)."""

    name: str
    schema: dict[str, Any]
    key: tuple[str, ...]
    clock: Clock
    created: str
    table: str | None = None  # the source table the feed holds (schema.table), if named
    source: str | None = None  # the source kind (None: a feed from before it was kept)
    granularity: Granularity | None = None
    order: str | None = None  # upsert: the order column
    deleted: str | None = None  # upsert: the delete-flag column
    #: the feeds of its group (one time domain over several tables: feed/emit/group.py), in
    #: order; empty for a feed of its own
    group: tuple[str, ...] = ()
    layout: Layout | None = None  # None: a folder per time (a feed from before packs)
    #: the record schema's later versions, oldest first (``schemas/``: not in feed.json)
    versions: tuple[SchemaVersion, ...] = field(default=(), compare=False)
    #: the schema feed.json names (the first version, from the feed's first time)
    first_schema: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.schema)

    @property
    def original(self) -> dict[str, Any]:
        """The schema feed.json names: the first version, from the feed's first time."""
        return self.first_schema if self.first_schema is not None else self.schema

    @property
    def version(self) -> int:
        """The first time of the current schema version (0: the feed's first schema)."""
        return self.versions[-1].start if self.versions else 0

    @property
    def dropped(self) -> frozenset[str]:
        """Columns the source table no longer has (kept, null from their drop on)."""
        out: set[str] = set()
        for v in self.versions:
            out = (out - set(v.added)) | set(v.dropped)
        return frozenset(out)

    def history(self) -> list[SchemaVersion]:
        """Every version of the record schema, the feed's first (from time 0) first."""
        return [SchemaVersion(0, self.original), *self.versions]

    def at(self, frontier: int) -> FeedInfo:
        """The feed as a reader at ``frontier`` sees it: only the versions of committed
        times (a version file of a time not committed yet, or rolled back, is left out)."""
        kept = tuple(v for v in self.versions if v.start < frontier)
        if kept == self.versions:
            return self
        return replace(self, versions=kept, schema=kept[-1].schema if kept else self.original)

    def evolved_to(self, versions: list[SchemaVersion]) -> FeedInfo:
        """The feed of ``feed.json`` (this) with its later schema ``versions``."""
        if not versions:
            return self
        return replace(
            self, schema=versions[-1].schema, versions=tuple(versions), first_schema=self.schema
        )

    def evolved(self, version: SchemaVersion) -> FeedInfo:
        """The feed with ``version`` as its newest schema."""
        older = tuple(v for v in self.versions if v.start < version.start)
        return replace(
            self, schema=version.schema, versions=(*older, version), first_schema=self.original
        )

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "name": self.name,
                "schema": self.original,
                "key": list(self.key),
                "clock": self.clock,
                "created": self.created,
                "fingerprint": self.fingerprint,
                **{
                    k: v
                    for k, v in (
                        ("table", self.table),
                        ("source", self.source),
                        ("granularity", self.granularity),
                        ("order", self.order),
                        ("deleted", self.deleted),
                        ("layout", self.layout if self.layout == "packs" else None),
                    )
                    if v
                },
                **({"group": list(self.group)} if self.group else {}),
            },
            option=orjson.OPT_INDENT_2,
        )
