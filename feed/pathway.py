"""A feed as a Pathway table and back (extra ``pathway``): :func:`read`, :func:`write`.

Pathway (PyPI ``pathway``) is a differential-dataflow engine with a Python API. :func:`read`
pulls a feed from ``tidefeed serve`` with the client library
(:class:`protocol.client.FeedClient`: counts checked, rollbacks applied, dropped
connections resumed) and hands Pathway each complete time as **one Pathway commit**, so
every view Pathway keeps moves from one consistent state of the feed to the next::

    import pathway as pw
    from feed.pathway import read

    accounts = read("http://127.0.0.1:8080", "accounts", until=None)
    by_owner = accounts.groupby(accounts.owner).reduce(
        accounts.owner, total=pw.reducers.sum(accounts.balance)
    )
    pw.io.jsonlines.write(by_owner, "by_owner.jsonl")
    pw.run()

* **Keys.** A keyed feed is a table keyed by the feed's key (its key columns are the
  primary key): a time's update of a key replaces the row, a retraction alone deletes it.
  A multiset feed (no key) holds one row per copy of a record, told apart by an ``copy_``
  column (0, 1, ...), so a record that is there twice is two rows.
* **Columns** are the record's, typed from the feed's schema: long/int as ``int``,
  float/double as ``float``, decimals as ``float`` (Pathway has no decimal type), dates
  and local timestamps as ``pw.DateTimeNaive``, timestamps as ``pw.DateTimeUtc``, times of
  day as ``pw.Duration``, bytes, strings and booleans as themselves, nested values as
  ``pw.Json``; a nullable column is ``T | None``. Pathway reserves ``id``: such a column is
  ``id_`` (and a name ending in ``_`` that would collide gets one more ``_``).
* **Where it starts.** From the beginning, or with ``after=`` (a frontier: the resume
  token), or ``snapshot=True`` (the collection, then the changes); ``follow=False`` or
  ``until=F`` makes the table finite (``pw.run`` returns when it is read).
* **Restarts.** With ``name=`` and Pathway persistence (``pw.run(persistence_config=...)``)
  the connector records the frontier of every commit as its offset; a restarted program
  goes on from the last persisted one, so no time is read twice and none is skipped.
  ``name`` is also the server's pull subscription the client ACKs, so retention keeps what
  the program has not read (docs/consumers.md).

The schema is read once, at :func:`read`: a feed whose record schema changes while a
program reads it stops the program with a clear error (start it again to get the new
columns).
"""

from __future__ import annotations

import datetime as dt
import decimal
import os
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa

from protocol import avro_to_arrow
from protocol.client import ClientError, CompleteTime, FeedClient
from protocol.schema import avro_name

__all__ = ["pathway_columns", "read", "write"]

#: column names Pathway keeps for itself
RESERVED = frozenset({"id"})
#: the column that tells the copies of a record of a multiset feed apart
COPY = "copy_"


def pathway_columns(record: pa.StructType) -> dict[str, tuple[str, Any]]:
    """The Pathway column of every record field: ``{field: (column, type)}``."""
    import pathway as pw

    names = {f.name for f in record}
    out: dict[str, tuple[str, Any]] = {}
    for f in record:
        column = f.name
        while column in RESERVED or (column != f.name and column in names):
            column += "_"
        t = _pathway_type(f.type, pw)
        out[f.name] = (column, t | None if f.nullable else t)
    return out


def _pathway_type(t: pa.DataType, pw: Any) -> Any:
    if pa.types.is_boolean(t):
        return bool
    if pa.types.is_integer(t):
        return int
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        return float
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return str
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return bytes
    if pa.types.is_date(t):
        return pw.DateTimeNaive
    if pa.types.is_timestamp(t):
        return pw.DateTimeUtc if t.tz is not None else pw.DateTimeNaive
    if pa.types.is_time(t):
        return pw.Duration
    return pw.Json


def _value(v: Any, pw: Any) -> Any:
    """A record value as the Pathway column takes it."""
    if v is None or isinstance(v, bool | int | float | str | bytes):
        return v
    if isinstance(v, decimal.Decimal):
        return float(v)
    if isinstance(v, dt.datetime):
        return v
    if isinstance(v, dt.date):
        return dt.datetime(v.year, v.month, v.day)
    if isinstance(v, dt.time):
        return dt.timedelta(
            hours=v.hour, minutes=v.minute, seconds=v.second, microseconds=v.microsecond
        )
    return pw.Json(_jsonable(v))


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, decimal.Decimal):
        return float(v)
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, dt.date | dt.time):
        return v.isoformat()
    return v


def read(
    server_url: str,
    feed: str,
    *,
    token: str | None = None,
    after: int | None = None,
    snapshot: bool = False,
    follow: bool = True,
    until: int | None = None,
    name: str | None = None,
) -> Any:
    """The feed ``feed`` of the server at ``server_url`` as a Pathway table (see the
    module): one Pathway commit per complete time."""
    import pathway as pw

    client = FeedClient(server_url, feed, token=token, name=name)
    try:
        info = client.info()
    except OSError as e:  # (refused, unreachable, timed out: said before Pathway starts)
        raise ClientError(
            f"feed {feed!r}: cannot reach a feed server at {server_url}: "
            f"{getattr(e, 'reason', e)} (is 'tidefeed serve' running there?)"
        ) from None
    record = avro_to_arrow(info["schema"])
    key = list(info.get("key") or [])
    columns = pathway_columns(record)
    defs = {
        c: pw.column_definition(dtype=t, primary_key=field in key)
        for field, (c, t) in columns.items()
    }
    if not key:  # a multiset: every record column and the copy number make the key
        defs = {c: pw.column_definition(dtype=d.dtype, primary_key=True) for c, d in defs.items()}
        defs[COPY] = pw.column_definition(dtype=int, primary_key=True)
    schema = pw.schema_builder(defs, name=f"tidefeed_{feed}")

    def times(after: int | None) -> Iterable[CompleteTime]:
        # (Pathway's persisted offset is the resume point, not the server's ACKs)
        return client.times(
            after=after,
            snapshot=snapshot and after is None,
            follow=follow,
            until=until,
            from_ack=False,
        )

    finite = not follow or until is not None
    subject = _subject(feed, record, key, columns, times, after=after, finite=finite)
    return pw.io.python.read(subject, schema=schema, autocommit_duration_ms=None, name=name)


def _subject(
    feed: str,
    record: pa.DataType,
    key: list[str],
    columns: dict[str, tuple[str, Any]],
    times: Callable[[int | None], Iterable[CompleteTime]],
    *,
    after: int | None,
    finite: bool,
) -> Any:
    """The Pathway connector subject that sends each complete time of ``times`` as one
    Pathway commit (upserts by ``key``; without one, numbered copies of each record)."""
    import pathway as pw
    from pathway.io.python import ConnectorSubject

    fields = [(f, c) for f, (c, _) in columns.items()]

    class _Subject(ConnectorSubject):  # type: ignore[misc]  # (pathway is untyped here)
        def __init__(self) -> None:
            super().__init__(
                datasource_name=f"tidefeed:{feed}", session_type="upsert" if key else "native"
            )
            self.after = after
            self.copies: dict[tuple[Any, ...], int] = {}

        @property
        def _deletions_enabled(self) -> bool:
            return True

        def _seek(self, state: bytes) -> None:
            if not key:
                raise RuntimeError(
                    f"feed {feed!r} has no key: its copies are numbered by this program, "
                    "so it cannot resume from persisted state; start it without persistence"
                )
            self.after = int(state.decode())

        def _is_finite(self) -> bool:
            return finite

        def run(self) -> None:
            self._disable_commits()
            for item in times(self.after):
                got = item.updates.schema.field("data").type
                if got != record:
                    raise RuntimeError(
                        f"feed {feed!r}: time {item.time} has records of another schema than "
                        f"when this program started ({got} against {record}); start the "
                        "program again to read the new columns"
                    )
                plus: list[tuple[dict[str, Any], int]] = []
                minus: list[tuple[dict[str, Any], int]] = []
                for u in item.rows():
                    row = {c: _value(u["data"][f], pw) for f, c in fields}
                    (plus if u["diff"] > 0 else minus).append((row, u["diff"]))
                if key:
                    _upsert(self, plus, minus, [columns[k][0] for k in key])
                else:
                    _copies(self, self.copies, plus, minus)
                self._report_offset(str(item.frontier).encode())
                self.commit()

    return _Subject()


def _upsert(
    subject: Any,
    plus: list[tuple[dict[str, Any], int]],
    minus: list[tuple[dict[str, Any], int]],
    key: list[str],
) -> None:
    """One time of a keyed feed: its deletions, then its insertions (a key deleted and
    added at the same time is replaced, not deleted)."""
    added = {tuple(r[k] for k in key) for r, _ in plus}
    for r, _ in minus:
        if tuple(r[k] for k in key) not in added:
            subject.delete(**r)
    for r, _ in plus:
        subject.next(**r)


def _copies(
    subject: Any,
    copies: dict[tuple[Any, ...], int],
    plus: list[tuple[dict[str, Any], int]],
    minus: list[tuple[dict[str, Any], int]],
) -> None:
    """One time of a feed without a key: a record with ``n`` copies is ``n`` rows
    numbered ``0..n-1`` (the copy number is part of Pathway's key)."""
    for r, d in minus:
        ident = tuple(r.values())
        n = copies.get(ident, 0)
        for copy in range(n + d, n):
            subject.delete(**r, **{COPY: copy})
        copies[ident] = n + d
    for r, d in plus:
        ident = tuple(r.values())
        n = copies.get(ident, 0)
        for copy in range(n, n + d):
            subject.next(**r, **{COPY: copy})
        copies[ident] = n + d


#: Avro types of the Pathway column types :func:`write` takes
_AVRO = {int: "long", float: "double", str: "string", bool: "boolean"}


def write(table: Any, folder: str | os.PathLike[str], *, schema_file: str | None = None) -> None:
    """A Pathway table's changes as input of a feed: every Pathway time with changes
    becomes one file in ``folder`` of ``weighted`` rows (``{"record": row, "delta": ±1}``),
    and the record's Avro schema goes to ``schema_file`` (default: ``folder`` + ``.avsc``).
    ``tidefeed emit --source weighted:FOLDER --schema FOLDER.avsc --max-files-per-txn 1``
    (``--follow`` while the program runs) makes them a feed, one time per Pathway time,
    with the emitter's consolidation, progress and exactly-once commits; served, checked
    and read like any other feed (docs/consumers.md, "Pathway").

    Each file appears whole (written under a hidden name, then renamed) and is named by
    its Pathway time, so the files sort in time order. Columns of int, float, str and
    bool (each optionally None) are taken; another type is refused here, before the
    program runs."""
    import pathway as pw

    out = Path(folder)
    fields = []
    for name, hint in table.schema.typehints().items():
        base, nullable = _without_none(hint)
        if base not in _AVRO:
            raise TypeError(
                f"feed.pathway.write: column {name!r} is {hint}; only int, float, str and "
                "bool columns (or None) can be written, so convert it first"
            )
        fields.append(
            {"name": name, "type": ["null", _AVRO[base]], "default": None}
            if nullable
            else {"name": name, "type": _AVRO[base]}
        )
    out.mkdir(parents=True, exist_ok=True)
    schema = {"type": "record", "name": avro_name(out.name), "fields": fields}
    Path(schema_file or f"{out}.avsc").write_bytes(orjson.dumps(schema, option=orjson.OPT_INDENT_2))
    pending: list[bytes] = []

    def on_change(key: Any, row: dict[str, Any], time: int, is_addition: bool) -> None:
        pending.append(orjson.dumps({"record": row, "delta": 1 if is_addition else -1}))

    def on_time_end(time: int) -> None:
        if not pending:
            return
        final = out / f"part-{time:020d}.json"
        hidden = out / f".{final.name}.writing"  # (sources skip hidden files)
        with open(hidden, "wb") as f:
            f.write(b"\n".join(pending) + b"\n")
            f.flush()
            os.fsync(f.fileno())
        hidden.rename(final)
        pending.clear()

    pw.io.subscribe(table, on_change=on_change, on_time_end=on_time_end)


def _without_none(hint: Any) -> tuple[Any, bool]:
    """``T | None`` as ``(T, True)``; ``T`` as ``(T, False)``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False
