"""A source table's shape, checked on every Debezium event: never drop a column silently.

A wrapped Debezium event (``{"schema", "payload"}``) carries the Kafka Connect schema of
its table, so an ``ALTER TABLE`` shows on the first event after it: a column more or less,
or a column of another type. The parse (:mod:`feed.debezium`) gives each data event of the
feed's table a 64-bit hash of its columns' schema text (``_shape``); the emitter gathers the
distinct hashes of what a transaction read. A hash this process has not seen is checked
once: one event of that shape is read again (:func:`feed.debezium.shape_sample`) and its
columns compared with the feed's record schema. The same shape (or one whose columns all
fit the feed's: an ``int`` column in a feed that holds ``long``, a default changed, a
decimal narrowed) is
accepted. At the first event of any other shape the emitter commits what was delivered
before it and then stops with :class:`~protocol.SourceError`, naming each column added,
dropped or changed.

The feed's record schema does not evolve yet (docs/sources.md, "Schema changes"): this
check makes a schema change a loud stop, where before its columns were dropped, turned
into nulls, or its rows quarantined or held back without end. Bare events (no wrapper)
carry no schema and are not checked.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from protocol import SourceError

from .connect import CONNECT_NAME, connect_to_avro

__all__ = ["ShapeChange", "first_unfit", "sample_in", "shape_change", "shape_error"]

_WIDER = {"int": ("long", "float", "double"), "long": ("double",), "float": ("double",)}


@dataclass(frozen=True, slots=True)
class ShapeChange:
    """How a table's columns differ from the feed's record schema."""

    added: tuple[str, ...]
    dropped: tuple[str, ...]
    changed: tuple[tuple[str, str, str], ...]  # (column, the feed's type, the new type)

    def __bool__(self) -> bool:
        return bool(self.added or self.dropped or self.changed)

    def describe(self) -> str:
        parts = []
        if self.added:
            parts.append("added " + ", ".join(self.added))
        if self.dropped:
            parts.append("dropped " + ", ".join(self.dropped))
        for name, was, now in self.changed:
            parts.append(f"{name} changed from {was} to {now}")
        return "; ".join(parts)


def _base(t: Any) -> Any:
    """A field type without its nullable union and without attributes that do not change
    how a value reads (a Connect default)."""
    if isinstance(t, list):
        rest = [b for b in t if b != "null"]
        t = rest[0] if len(rest) == 1 else rest
    if isinstance(t, dict):
        t = {k: v for k, v in t.items() if k != "default"}
        if set(t) == {"type"} and isinstance(t["type"], str):
            return t["type"]
    return t


def _name(t: Any) -> str:
    t = _base(t)
    if isinstance(t, dict):
        logical = t.get("logicalType")
        if logical == "decimal":
            return f"decimal({t.get('precision')}, {t.get('scale')})"
        return str(logical or t.get(CONNECT_NAME) or t.get("type"))
    return str(t)


def _fits(new: Any, feed: Any) -> bool:
    """Whether every value of type ``new`` reads as type ``feed`` unchanged."""
    new, feed = _base(new), _base(feed)
    if new == feed:
        return True
    if isinstance(new, str) and isinstance(feed, str):
        return feed in _WIDER.get(new, ())
    if isinstance(new, dict) and isinstance(feed, dict):
        if new.get("logicalType") == feed.get("logicalType") == "decimal":
            return (
                new.get("scale") == feed.get("scale")
                and int(new.get("precision", 0)) <= int(feed.get("precision", 0))
                and new.get(CONNECT_NAME) == feed.get(CONNECT_NAME)
            )
        return {k: v for k, v in new.items() if k != CONNECT_NAME} == feed
    if isinstance(new, dict) and isinstance(feed, str):
        # a logical type read as its plain type (a uuid as a string) by a --schema feed
        return new.get("type") == feed and new.get(CONNECT_NAME) is None
    return False


def shape_change(feed_schema: dict[str, Any], columns: Sequence[dict[str, Any]]) -> ShapeChange:
    """How the Connect ``columns`` of an event differ from ``feed_schema`` (Avro)."""
    event = {f["name"]: f["type"] for f in connect_to_avro(list(columns), "record")["fields"]}
    feed = {f["name"]: f["type"] for f in feed_schema.get("fields", [])}
    return ShapeChange(
        added=tuple(n for n in event if n not in feed),
        dropped=tuple(n for n in feed if n not in event),
        changed=tuple(
            (n, _name(feed[n]), _name(event[n]))
            for n in event
            if n in feed and not _fits(event[n], feed[n])
        ),
    )


def first_unfit(
    *,
    feed_schema: dict[str, Any],
    shapes: Iterable[int | None],
    known: set[int],
    sample: Any,
) -> tuple[int, ShapeChange] | None:
    """The first shape hash in ``shapes`` (not ``known``) whose columns do not fit
    ``feed_schema``, with how (``sample(h)`` gives the Connect columns of one event of
    shape ``h``); the ones that fit are added to ``known``."""
    for h in sorted({s for s in shapes if s is not None} - known):
        columns = sample(h)
        if not columns:
            continue  # not found again (a file gone): checked when it is read next
        change = shape_change(feed_schema, columns)
        if change:
            return h, change
        known.add(h)
    return None


def shape_error(feed: str, table: str | None, change: ShapeChange, where: str) -> SourceError:
    """The error that stops a feed at a table shape it cannot hold."""
    return SourceError(
        f"feed {feed!r}: the source table {table or ''} changed shape at {where}: "
        f"{change.describe()}. tidefeed does not evolve a feed's record schema yet "
        "(docs/sources.md, 'Schema changes') and drops no column silently: the feed is "
        "committed up to the change, nothing after it. Start a new feed (a new --feed, "
        "from a new snapshot of the table) to take the new shape."
    )


def sample_in(spark: Any, files: Collection[str]) -> Any:
    """:func:`check_shapes`'s ``sample`` over input ``files``."""
    from .debezium import shape_sample

    return lambda h: shape_sample(spark, list(files), h)
