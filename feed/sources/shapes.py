"""A source table's shape, checked on every Debezium event: never drop a column silently.

A wrapped Debezium event (``{"schema", "payload"}``) carries the Kafka Connect schema of
its table, so an ``ALTER TABLE`` shows on the first event after it: a column more or
less, or a column of another type. The parse (:mod:`feed.sources.debezium`) gives each
data event of the feed's table a 64-bit hash of its columns' schema text (``_shape``);
the emitter gathers the distinct hashes of what a transaction read. A hash this process
has not seen is checked once: one event of that shape is read again
(:func:`feed.sources.debezium_schema.shape_sample`) and its columns compared with the
feed's record schema. The same shape (or one whose columns all fit the feed's: an ``int``
column in a feed that holds ``long``, a default changed, a decimal narrowed) is accepted.
At the first event of any other shape the emitter commits what was delivered before it;
then :func:`evolve` gives the feed's next schema version (committed by
feed/txn/evolve.py), or, for a change no version holds, the emitter stops with
:class:`~protocol.SourceError` naming each column added, dropped or changed
(docs/sources.md, "Schema changes"). Bare events (no wrapper) carry no schema and are not
checked.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import orjson

from feed.sources.connect import CONNECT_NAME, connect_to_avro
from protocol import SourceError

__all__ = [
    "Evolve",
    "ShapeChange",
    "evolve",
    "next_version",
    "sample_in",
    "shape_change",
    "shape_error",
    "unfit_shapes",
    "with_renames",
]

_WIDER = {"int": ("long", "float", "double"), "long": ("double",), "float": ("double",)}


@dataclass(frozen=True, slots=True)
class ShapeChange:
    """How a table's columns differ from the feed's record schema."""

    added: tuple[str, ...]
    dropped: tuple[str, ...]
    changed: tuple[tuple[str, str, str], ...]  # (column, the feed's type, the new type)
    #: the table's Kafka Connect columns as the first event of the new shape gives them
    columns: tuple[dict[str, Any], ...] = ()
    #: (old name, new name) of each column renamed, as the capture's column numbers say
    renamed: tuple[tuple[str, str], ...] = ()
    #: whether the capture's column numbers tell the adds and drops apart from renames
    numbered: bool = False

    def __bool__(self) -> bool:
        return bool(self.added or self.dropped or self.changed)

    def describe(self) -> str:
        parts = []
        olds = {old for old, _ in self.renamed}
        news = {new for _, new in self.renamed}
        for old, new in self.renamed:
            parts.append(f"renamed {old} to {new}")
        if set(self.added) - news:
            parts.append("added " + ", ".join(n for n in self.added if n not in news))
        if set(self.dropped) - olds:
            parts.append("dropped " + ", ".join(n for n in self.dropped if n not in olds))
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


def shape_change(
    feed_schema: dict[str, Any],
    columns: Sequence[dict[str, Any]],
    gone: Collection[str] = frozenset(),
) -> ShapeChange:
    """How the Connect ``columns`` of an event differ from ``feed_schema`` (Avro), whose
    columns ``gone`` were dropped from the table already (kept in the feed, null): one of
    those that is back counts as added."""
    event = {f["name"]: f["type"] for f in connect_to_avro(list(columns), "record")["fields"]}
    feed = {f["name"]: f["type"] for f in feed_schema.get("fields", [])}
    return ShapeChange(
        added=tuple(n for n in event if n not in feed or n in gone),
        dropped=tuple(n for n in feed if n not in event and n not in gone),
        changed=tuple(
            (n, _name(feed[n]), _name(event[n]))
            for n in event
            if n in feed and n not in gone and not _fits(event[n], feed[n])
        ),
        columns=tuple(columns),
    )


def _nullable(t: Any) -> list[Any]:
    """``t`` as a nullable union (a column absent from some of a feed's records)."""
    if isinstance(t, list):
        return t if "null" in t else ["null", *t]
    return ["null", t]


def _widened(old: Any, new: Any) -> Any | None:
    """The type a column of type ``old`` takes when the table gives it type ``new``: one
    that holds every value of both, and reads each old value as the same record (None
    when there is none: a narrowing, a decimal's scale changed, another kind of value)."""
    base_old, base_new = _base(old), _base(new)
    if not _fits(base_old, base_new):
        return None
    if base_old in ("int", "long") and base_new in ("float", "double"):
        return None  # 5 would read as 5.0: another record
    if (
        isinstance(base_old, dict)
        and isinstance(base_new, dict)
        and base_old.get("logicalType") == "decimal"
        and base_old.get("scale") != base_new.get("scale")
    ):
        return None  # 1.5 would read as 1.50: another record
    return _nullable(base_new) if isinstance(old, list) else base_new


def evolve(
    feed_schema: dict[str, Any], gone: Collection[str], change: ShapeChange
) -> tuple[dict[str, Any], dict[str, Any], tuple[str, ...]] | str:
    """The next version of ``feed_schema`` for a table that changed shape as ``change``
    says (every old column kept: a dropped one nullable, an added one nullable at the end,
    a widened one in its new type), the Connect default of each added column that has
    one, and the widened columns; or why there is none (a type change no type of both
    holds)."""
    if change.added and change.dropped and not change.numbered:
        return (
            "a column dropped and another added between two events of the table may be "
            "a RENAME COLUMN, whose values a drop and an add would lose; tidefeed does "
            "not guess which, and no column numbers were recorded for the table (tidefeed "
            "capture postgres records them)"
        )
    event = {
        f["name"]: f["type"] for f in connect_to_avro(list(change.columns), "record")["fields"]
    }
    feed = {f["name"]: f["type"] for f in feed_schema.get("fields", [])}
    carried: dict[str, Any] = {}  # a renamed column's type: holds its old and new values
    for old, new in change.renamed:
        carried[new] = (
            feed[old] if _fits(event[new], feed[old]) else _widened(feed[old], event[new])
        )
        if carried[new] is None:
            return (
                f"{old} was renamed to {new} and changed from {_name(feed[old])} to "
                f"{_name(event[new])}, and no type reads each old value as the same record"
            )
    connect = {c.get("field"): c for c in change.columns}
    fields: list[dict[str, Any]] = []
    widened: list[str] = []
    refused: list[str] = []
    for f in feed_schema.get("fields", []):
        name, t = f["name"], f["type"]
        if name in change.dropped or (name in gone and name not in change.added):
            fields.append({**f, "type": _nullable(t), "default": None})
        elif name in event and not _fits(event[name], t):
            wide = _widened(t, event[name])
            if wide is None:
                refused.append(f"{name} from {_name(t)} to {_name(event[name])}")
                continue
            fields.append({**f, "type": wide})
            widened.append(name)
        elif name in change.added:  # dropped before, back now: the table's type
            fields.append({"name": name, "type": _nullable(event[name]), "default": None})
        else:
            fields.append(f)
    if refused:
        return "no type holds both the old and the new values of " + ", ".join(refused)
    known = {f["name"] for f in fields}
    fields += [
        {"name": n, "type": _nullable(carried.get(n, t)), "default": None}
        for n, t in event.items()
        if n not in known
    ]
    defaults = {
        n: connect[n]["default"]
        for n in change.added
        if n not in carried and connect.get(n, {}).get("default") is not None
    }
    return {**feed_schema, "fields": fields}, defaults, tuple(widened)


def _columns_of(wrapper: dict[str, Any]) -> frozenset[str] | None:
    """The column names a wrapped event's Connect schema gives its table."""
    for f in (wrapper.get("schema") or {}).get("fields") or ():
        if f.get("field") == "after":
            return frozenset(str(c.get("field")) for c in f.get("fields") or ())
    return None


def column_numbers(
    files: Sequence[str], table: str, new: frozenset[str], upto: str
) -> list[dict[str, int]]:
    """The column numbers the capture recorded for ``table`` (``COLUMNS_TABLE`` rows: one
    at the start of the capture, one in each ``ALTER TABLE``'s transaction), in stream
    order, up to the first event of ``table`` in ``upto`` (a file name) whose columns are
    ``new``: the catalog's story up to the change of shape."""
    from feed.sources.capture import COLUMNS_TABLE
    from feed.sources.debezium_schema import table_of
    from feed.sources.events import debezium_event
    from feed.sources.file_text import input_lines

    marker = COLUMNS_TABLE.rsplit(".", 1)[-1].encode()
    ours = f'"{table.rsplit(".", 1)[-1]}"'.encode()
    maps: list[dict[str, int]] = []
    for path in files:
        last = path.rsplit("/", 1)[-1] == upto
        for line in input_lines(path):
            if marker not in line and not (last and ours in line):
                continue
            found = debezium_event(line)
            if found is None:
                continue
            wrapper, payload = found
            of = table_of(payload)
            if of == COLUMNS_TABLE and payload.get("op") in ("c", "r"):
                row = payload.get("after") or {}
                if row.get("tbl") == table:
                    try:
                        maps.append(
                            {str(k): int(v) for k, v in orjson.loads(row["columns"]).items()}
                        )
                    except (
                        orjson.JSONDecodeError,
                        KeyError,
                        TypeError,
                        ValueError,
                        AttributeError,
                    ):
                        continue  # not a row this capture wrote: no numbers from it
            elif last and of == table and _columns_of(wrapper) == new:
                return maps
        if last:
            break
    return maps


def with_renames(
    change: ShapeChange, files: Sequence[str], table: str | None, upto: str
) -> ShapeChange:
    """``change`` (a column dropped and another added) told apart by the column numbers
    the capture recorded (:func:`column_numbers`): a column whose number stays under a new
    name is renamed; the others are truly dropped or added. Unchanged when no numbers of
    both shapes were recorded (a folder not written by ``tidefeed capture postgres``)."""
    if not table or not (change.added and change.dropped):
        return change
    new = frozenset(str(c.get("field")) for c in change.columns)
    old = (new - set(change.added)) | set(change.dropped)
    maps = column_numbers(files, table, new, upto)
    at_new = next((i for i in range(len(maps) - 1, -1, -1) if set(maps[i]) == new), None)
    if at_new is None:
        return change
    at_old = next((i for i in range(at_new - 1, -1, -1) if set(maps[i]) == old), None)
    if at_old is None:
        return change
    name_of = {n: name for name, n in maps[at_old].items()}
    renamed = tuple(
        (name_of[n], name)
        for name, n in maps[at_new].items()
        if n in name_of and name_of[n] != name
    )
    if any(o not in change.dropped or n not in change.added for o, n in renamed):
        return change  # names traded between columns: not told apart here
    return replace(change, renamed=renamed, numbered=True)


def unfit_shapes(
    *,
    feed_schema: dict[str, Any],
    shapes: Iterable[int | None],
    known: set[int],
    sample: Any,
    gone: Collection[str] = frozenset(),
    feed: str = "",
    files: Collection[str] = (),
) -> list[tuple[int, ShapeChange]]:
    """Every shape hash in ``shapes`` (not ``known``) whose columns do not fit
    ``feed_schema``, with how (``sample(h)`` gives the Connect columns of one event of
    shape ``h``); the ones that fit are added to ``known``. The caller cuts at the one
    delivered first: cut at a later one (an ``ADD COLUMN``, then a ``DROP COLUMN``), the
    earlier shape's events would be committed under the old record (docs/sources.md).
    A shape whose event ``sample`` does not find again in ``files`` (a file removed or
    rewritten under the read) is a :class:`SourceError`: taken as fitting, its events,
    read already, would lose the columns the feed's record does not have."""
    found = []
    for h in sorted({s for s in shapes if s is not None} - known):
        try:
            columns = sample(h)
        except FileNotFoundError:
            columns = []
        if not columns:
            listed = sorted(f.rsplit("/", 1)[-1] for f in files)
            more = f" and {len(listed) - 5} more" if len(listed) > 5 else ""
            names = (", ".join(listed[:5]) or "the input") + more
            raise SourceError(
                f"feed {feed!r}: the input changed while it was read: no event of a table "
                f"shape read in {names} is there any more (a file removed or rewritten "
                "under the emitter?); nothing was committed. Input files must stay as "
                "written until the feed has consumed them: run the emit again."
            )
        change = shape_change(feed_schema, columns, gone)
        if change:
            found.append((h, change))
        else:
            known.add(h)
    return found


class Evolve(Exception):
    """Not a failure: the feed's table changed shape at the head of its pending input, in
    a way the next schema version holds. The emitter commits that version at the next
    time (feed/txn/evolve.py) and reads the input again."""

    def __init__(
        self,
        schema: dict[str, Any],
        defaults: dict[str, Any],
        change: ShapeChange,
        widened: tuple[str, ...],
        where: str,
    ) -> None:
        super().__init__(f"the table changed shape at {where}: {change.describe()}")
        self.schema = schema
        self.defaults = defaults
        self.change = change
        self.widened = widened
        self.where = where


def next_version(
    feed: str, table: str | None, info: Any, change: ShapeChange, where: str
) -> Exception:
    """What to raise at a change of shape at the head of the input: :class:`Evolve`
    when the next schema version holds it, else the error that stops the feed."""
    found = evolve(info.schema, info.dropped, change)
    if isinstance(found, str):
        return shape_error(feed, table, change, where, found)
    schema, defaults, widened = found
    return Evolve(schema, defaults, change, widened, where)


def shape_error(
    feed: str, table: str | None, change: ShapeChange, where: str, why: str
) -> SourceError:
    """The error that stops a feed at a table shape it cannot take, saying ``why``."""
    return SourceError(
        f"feed {feed!r}: the source table {table or ''} changed shape at {where}: "
        f"{change.describe()}; {why}. The feed is committed up to the change and nothing "
        "after it (docs/sources.md, 'Schema changes'): start a new feed (a new --feed, "
        "from a new snapshot of the table) to take the new shape."
    )


def sample_in(spark: Callable[[], Any], files: Collection[str]) -> Any:
    """:func:`check_shapes`'s ``sample`` over input ``files`` (``spark`` gives the session
    when one is needed)."""
    from feed.sources.debezium_schema import shape_sample

    def sample(h: int) -> list[dict[str, Any]]:
        from pyspark.errors import AnalysisException

        try:
            return shape_sample(spark(), list(files), h)
        except AnalysisException as e:
            if e.getCondition() == "PATH_NOT_FOUND":  # a file removed since it was read
                raise FileNotFoundError(str(e)) from e
            raise

    return sample
