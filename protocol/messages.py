"""Messages of a differential change feed: updates and progress statements.

A feed is a stream of two kinds of message, a tagged union that code can ``match`` on:

* :class:`Updates` — a batch of ``(record, time, diff)`` updates. The batch keeps whichever
  representation it was made from (wire rows from NDJSON/Avro, or an Arrow table) and
  converts lazily, so a body decoded in one format and re-encoded in the same one never
  builds a Python object per update.
* :class:`Progress` — ``(lower, upper, counts)``: every update at a time in ``[lower, upper)``
  is counted in ``counts``.

:class:`Update` is the single-update view used by tests, models and small examples.
"""

from __future__ import annotations

import datetime as _dt
import decimal
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from .errors import CodecError

__all__ = [
    "columns_problem",
    "wire_rows_problem",
    "Message",
    "Progress",
    "Update",
    "Updates",
    "WireRow",
    "announcement",
    "progress",
    "record_key",
]

#: One update as it travels on the wire: ``{"data": {...}, "time": t, "diff": d}``.
WireRow: TypeAlias = dict[str, Any]

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


def wire_rows_problem(rows: list[Any]) -> str | None:
    """Why a list of wire updates is malformed, or ``None``: every format's rule for
    ``time`` (0 to 2^63 - 1) and ``diff`` (64-bit). One cheap pass, no allocation."""
    for i, r in enumerate(rows):
        if type(r) is not dict:
            return f"updates[{i}] is not an object"
        t, d = r.get("time"), r.get("diff")
        if type(t) is not int or type(d) is not int or type(r.get("data")) is not dict:
            return (
                f"updates[{i}] must have an object 'data' and integer 'time' and 'diff', "
                f"got {orjson.dumps(r)[:120].decode(errors='replace')}"
            )
        if not (0 <= t <= INT64_MAX and INT64_MIN <= d <= INT64_MAX):
            return f"updates[{i}] time {t} or diff {d} is outside the 64-bit range"
    return None


def columns_problem(table: pa.Table | pa.RecordBatch) -> str | None:
    """:func:`wire_rows_problem`'s rule for ``time`` and ``diff`` on Arrow columns."""
    for name, low in (("time", 0), ("diff", INT64_MIN)):
        col = table.column(name)
        if not len(col) or not pa.types.is_integer(col.type):
            continue
        lo, hi = pc.min_max(col).values()
        if lo.as_py() is not None and (lo.as_py() < low or hi.as_py() > INT64_MAX):
            return f"'{name}' from {lo.as_py()} to {hi.as_py()} is outside its range"
    return None


@dataclass(frozen=True, slots=True)
class Update:
    """One update: the record's multiplicity changes by ``diff`` at ``time``."""

    record: Mapping[str, Any]
    time: int
    diff: int

    def to_wire(self) -> WireRow:
        return {"data": dict(self.record), "time": self.time, "diff": self.diff}


@dataclass(frozen=True, slots=True)
class Progress:
    """Every update at a time in ``[lower, upper)`` is counted in ``counts``.

    ``counts`` holds ``(time, count)`` pairs. Construction does not judge the semantics (the
    checker and the consumer state machine do, so they can report what is wrong); it only
    normalises ``counts`` to a tuple of int pairs.
    """

    lower: int
    upper: int
    counts: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "counts", tuple((int(t), int(n)) for t, n in self.counts))

    @property
    def total(self) -> int:
        """The number of updates this progress covers."""
        return sum(n for _, n in self.counts)

    def is_announcement(self) -> bool:
        return self.lower == self.upper and not self.counts

    def to_wire(self) -> dict[str, Any]:
        return {
            "lower": [self.lower],
            "upper": [self.upper],
            "counts": [{"time": t, "count": n} for t, n in self.counts],
        }

    @classmethod
    def from_wire(cls, obj: Any, *, fmt: str = "", position: str = "") -> Progress:
        """Build a progress from its wire mapping, raising :class:`CodecError` on a bad shape."""

        def fail(why: str) -> CodecError:
            return CodecError(f"bad progress: {why}", fmt=fmt, position=position)

        if not isinstance(obj, Mapping):
            raise fail(f"expected an object, got {type(obj).__name__}")
        missing = {"lower", "upper", "counts"} - set(obj)
        if missing:
            raise fail(f"missing field(s) {sorted(missing)}")
        lower = _single_time(obj["lower"], "lower", fail)
        upper = _single_time(obj["upper"], "upper", fail)
        raw_counts = obj["counts"]
        if not isinstance(raw_counts, list):
            raise fail("'counts' must be a list of {time, count} objects")
        counts = []
        for i, c in enumerate(raw_counts):
            if (
                not isinstance(c, Mapping)
                or not _is_int(c.get("time"))
                or not _is_int(c.get("count"))
            ):
                raise fail(f"counts[{i}] must be an object with integer 'time' and 'count'")
            counts.append((c["time"], c["count"]))
        return cls(lower=lower, upper=upper, counts=tuple(counts))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _single_time(v: Any, name: str, fail: Any) -> int:
    # Times are totally ordered, so an antichain has exactly one element. An empty upper
    # (a closed stream) is not something a tidefeed feed ever says.
    if not isinstance(v, list) or len(v) != 1 or not _is_int(v[0]):
        raise fail(f"'{name}' must be a one-element list of integers, got {v!r:.60}")
    t: int = v[0]
    if not 0 <= t <= INT64_MAX:
        raise fail(f"'{name}' time {t} is outside 0..2^63-1")
    return t


def progress(time: int, count: int) -> Progress:
    """The simple form: ``count`` updates at ``time`` and nothing else up to ``time + 1``."""
    return Progress(lower=time, upper=time + 1, counts=((time, count),) if count else ())


def announcement(frontier: int) -> Progress:
    """A session's announcement: ``lower = upper = frontier`` with no counts (a rollback)."""
    return Progress(lower=frontier, upper=frontier, counts=())


# Arrow column names of an update batch.
UPDATE_COLUMNS = ("data", "time", "diff")


@dataclass(frozen=True, slots=True, eq=False)
class Updates:
    """A batch of updates, held as wire rows or as an Arrow table and converted lazily.

    Arrow tables have the columns ``data`` (struct), ``time`` (int64) and ``diff`` (int64).
    Make one with :meth:`from_rows`, :meth:`from_arrow` or :meth:`of`.
    """

    _rows: list[WireRow] | None = field(default=None, repr=False)
    _table: pa.Table | pa.RecordBatch | None = field(default=None, repr=False)

    @classmethod
    def from_rows(cls, rows: list[WireRow]) -> Updates:
        """Wrap wire rows ``{"data", "time", "diff"}`` (the list is kept, not copied)."""
        return cls(_rows=rows)

    @classmethod
    def from_arrow(cls, data: pa.Table | pa.RecordBatch) -> Updates:
        """Wrap an Arrow table or record batch (a batch becomes a table only when asked)."""
        missing = [c for c in UPDATE_COLUMNS if c not in data.column_names]
        if missing:
            raise CodecError(f"update batch lacks column(s) {missing}", fmt="arrow")
        return cls(_table=data)

    @classmethod
    def of(cls, updates: Iterable[Update]) -> Updates:
        return cls(_rows=[u.to_wire() for u in updates])

    def __len__(self) -> int:
        if self._rows is not None:
            return len(self._rows)
        assert self._table is not None
        return int(self._table.num_rows)

    def __iter__(self) -> Iterator[Update]:
        for r in self.rows():
            yield Update(r["data"], r["time"], r["diff"])

    def __repr__(self) -> str:
        return f"Updates(<{len(self)} updates>)"

    def rows(self) -> list[WireRow]:
        """The wire rows (built from the Arrow table once, on first use)."""
        if self._rows is None:
            assert self._table is not None
            object.__setattr__(self, "_rows", self._table.to_pylist(maps_as_pydicts="strict"))
        assert self._rows is not None
        return self._rows

    def table(self, data_type: pa.DataType | None = None) -> pa.Table:
        """The Arrow table, optionally cast so its ``data`` column has ``data_type``.

        Raises :class:`CodecError` when the rows do not fit the type (a missing time, a
        string where a number belongs, ...).
        """
        if self._table is None:
            object.__setattr__(self, "_table", rows_to_table(self.rows(), data_type))
        if isinstance(self._table, pa.RecordBatch):
            object.__setattr__(self, "_table", pa.Table.from_batches([self._table]))
        assert self._table is not None
        table: pa.Table = self._table
        if data_type is not None and table.schema != update_schema(data_type):
            table = cast_data(table.select(list(UPDATE_COLUMNS)), data_type)
        return table

    def has_table(self) -> bool:
        return self._table is not None

    def slice(self, start: int, length: int) -> Updates:
        """``length`` updates from ``start`` on (zero-copy for Arrow-held batches)."""
        if self._table is not None:
            return Updates(_table=self._table.slice(start, length))
        return Updates(_rows=self.rows()[start : start + length])


def update_schema(data_type: pa.DataType) -> pa.Schema:
    """The Arrow schema of an update batch whose records have ``data_type``.

    Fields are nullable in the schema (as Arrow infers them); the codecs reject null values.
    """
    return pa.schema(
        [
            pa.field("data", data_type),
            pa.field("time", pa.int64()),
            pa.field("diff", pa.int64()),
        ]
    )


def rows_to_table(rows: list[WireRow], data_type: pa.DataType | None = None) -> pa.Table:
    """Build the Arrow form of wire rows, checking times and diffs column-wise."""
    if not rows:
        return update_schema(data_type or pa.struct([])).empty_table()
    try:
        # one struct array built in C, several times faster than Table.from_pylist
        row_type = None if data_type is None else pa.struct(list(update_schema(data_type)))
        table = pa.Table.from_struct_array(pa.array(rows, type=row_type))
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError) as e:
        raise CodecError(f"updates do not fit the record schema: {e}") from e
    for name in UPDATE_COLUMNS:
        if name not in table.column_names:
            raise CodecError(f"updates lack '{name}'")
    for name in ("time", "diff"):
        col = table.column(name)
        if not pa.types.is_integer(col.type):
            raise CodecError(f"update '{name}' must be an integer, got {col.type}")
        if col.null_count:
            raise CodecError(f"{col.null_count} update(s) lack '{name}'")
    if table.column("data").null_count:
        raise CodecError("an update's 'data' is null; records must be objects")
    if data_type is None and not pa.types.is_struct(table.column("data").type):
        raise CodecError(f"update 'data' must be an object, got {table.column('data').type}")
    return table.select(list(UPDATE_COLUMNS))


def cast_data(table: pa.Table, data_type: pa.DataType) -> pa.Table:
    """Cast the ``data`` column of an update table to ``data_type``."""
    try:
        return table.cast(update_schema(data_type))
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, ValueError) as e:
        raise CodecError(f"updates do not fit the record schema: {e}") from e


Message: TypeAlias = Updates | Progress


def _json_default(v: Any) -> Any:
    if isinstance(v, decimal.Decimal):
        return str(v)
    if isinstance(v, bytes | bytearray | memoryview):
        return bytes(v).hex()
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, _dt.timedelta):
        return v.total_seconds()
    if isinstance(v, tuple | set | frozenset):
        return list(v)
    raise TypeError(f"cannot encode {type(v).__name__}")


def _without_nulls(value: Any) -> Any:
    """``value`` with every object member whose value is null left out, at any depth
    (in objects inside lists too; a list's null elements stay: they are positions)."""
    if isinstance(value, Mapping):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_without_nulls(v) for v in value]
    return value


def record_key(record: Mapping[str, Any]) -> bytes:
    """A canonical byte string identifying a record: field order does not matter, and a
    field that is null counts as absent, at the top level and in nested records alike. A
    feed's record schema grows (columns added, dropped columns kept as null:
    docs/sources.md, "Schema changes"), so the same row read before and after a change must
    be the same record; and a batch of JSON records read into one Arrow type gets the
    fields its other records have, as nulls, in every nested record: the record must not
    change with the batch it came in."""
    return record_keys([record])[0]


def record_keys(records: Sequence[Mapping[str, Any] | None], *, nested: bool = True) -> list[bytes]:
    """:func:`record_key` of every record (a ``None`` record keys as ``null``). ``nested``:
    whether a record may hold a nested record (False for a flat record type saves a scan
    of the keys)."""
    opt = orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS
    dumps = orjson.dumps
    keys = [
        dumps(
            r if r is None else {k: v for k, v in r.items() if v is not None},
            option=opt,
            default=_json_default,
        )
        for r in records
    ]
    if nested:
        # a nested null shows as ":null" (so may a string: keyed again, to the same key)
        for i, key in enumerate(keys):
            if b":null" in key:
                keys[i] = dumps(_without_nulls(records[i]), option=opt, default=_json_default)
    return keys
