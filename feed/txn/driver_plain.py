"""What the driver engine (:mod:`feed.txn.driver`) takes: the checks that a small
Debezium transaction's parsed input is the plain case, the feed's own snapshot among its
rows, and where a change of the table's shape cuts it. Each is decided on the Arrow table
the driver parsed (or one Spark job did), by the same rules as the Spark path's (named
where they are)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from feed.sources.positions import ALL_DONE, DATA_OPS
from feed.sources.snapshots import one_lsn_each

__all__ = [
    "Cut",
    "Snapshot",
    "after_committed",
    "data_events",
    "not_plain",
    "one_snapshot_each",
    "own_snapshot",
    "shape_cut",
]


def scalar(t: pa.DataType) -> bool:
    return bool(
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_decimal(t)
        or pa.types.is_date(t)
        or pa.types.is_timestamp(t)
        or pa.types.is_time(t)
        or pa.types.is_boolean(t)
    )


def data_events(t: pa.Table) -> pa.Table:
    """The data events (c/u/d/r) among the rows parsed."""
    return t.filter(pc.is_in(t.column("op"), pa.array(DATA_OPS)))


def not_plain(t: pa.Table, data: pa.Table, key: Sequence[str]) -> str | None:
    """Why the parsed input is not the plain case (see the module docstring), or None."""
    if t.column("_error").null_count < t.num_rows:
        return "bad rows"
    ops = set(pc.unique(t.column("op")).to_pylist())
    if ops - {*DATA_OPS, "x", "E"}:
        return f"ops {sorted(o for o in ops - {*DATA_OPS, 'x', 'E'} if o)}"
    snap = pc.fill_null(t.column("_snap"), "")
    if pc.any(pc.and_(pc.equal(t.column("op"), "r"), pc.equal(snap, "incremental"))).as_py():
        return "incremental snapshot reads"
    if data.column("pos_lo").null_count:
        return "an event without a source position"
    record = t.schema.field("after").type
    if not all(scalar(f.type) for f in record):
        return "a record with nested columns"
    if any(pa.types.is_floating(record.field(k).type) for k in key):
        return "a floating-point key column"
    if not key and t.column("_toast").null_count < t.num_rows:
        return "an unavailable value in an unkeyed feed"
    return None


def _snapshot_rows(t: pa.Table) -> pa.Array:
    """Which rows are a whole-table snapshot's reads or end markers
    (:func:`feed.sources.snapshots.snapshot_row`)."""
    snap = pc.fill_null(t.column("_snap"), "")
    read = pc.and_(pc.equal(t.column("op"), "r"), pc.not_equal(snap, "incremental"))
    return pc.fill_null(pc.or_(read, pc.equal(snap, "last")), False)


def one_snapshot_each(
    t: pa.Table, source: dict[str, Any]
) -> tuple[pa.Table, dict[str, tuple[int, list[int]]]]:
    """``t`` with the snapshot rows of each snapshot transaction at one LSN, and the
    moves made, as :func:`feed.sources.snapshots.one_lsn_each` has them."""
    snapshot = _snapshot_rows(t)
    at = t.filter(snapshot).select(["txn", "pos_lo"])
    pairs = at.group_by(["txn", "pos_lo"]).aggregate([]).to_pylist()
    figures = [{"lsn": p["pos_lo"], "s_txns": [p["txn"]]} for p in pairs if None not in p.values()]
    own = (source.get("snapshot_txn"), source.get("snapshot_lsn"))
    moves = one_lsn_each(figures, own_txn=own[0], own_lsn=own[1])
    if not moves:
        return t, moves
    txns = pa.array(list(moves), t.schema.field("txn").type)
    lsns = pa.array([lsn for lsn, _ in moves.values()], t.schema.field("pos_lo").type)
    to = pc.take(lsns, pc.index_in(t.column("txn"), value_set=txns))
    moved = pc.and_(snapshot, pc.is_valid(to))
    for name in ("pos_hi", "pos_lo"):
        i = t.schema.get_field_index(name)
        t = t.set_column(i, name, pc.if_else(moved, to, t.column(name)))
    return t, moves


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The feed's own snapshot among the rows read (:func:`own_snapshot`): its LSN (None:
    no snapshot row was read) and, once it is known whole, its LSN in ``ended``
    (:func:`~feed.sources.positions.snapshot_done`)."""

    lsn: int | None
    ended: frozenset[int] = frozenset()


def own_snapshot(t: pa.Table, data: pa.Table, source: dict[str, Any]) -> Snapshot | str:
    """The snapshot whose reads the driver applies, the feed's own (on a new feed, the one
    read), or why the transaction goes to Spark: rows of another snapshot, a new one that
    replaces the table or an old one behind the feed. It is whole, as
    :func:`feed.sources.snapshots.classify` has it, once its end marker (of any table) is
    read or an event was delivered after its last read."""
    rows = t.filter(_snapshot_rows(t))  # (no incremental read: not_plain refused those)
    if not rows.num_rows:
        return Snapshot(None)
    lsns = set(rows.column("pos_lo").to_pylist())
    own = source.get("snapshot_lsn", next(iter(lsns)))  # (one LSN, or it is refused)
    if lsns != {own} or own is None:
        return "rows of another snapshot than the feed's own"
    op, snap = rows.column("op"), pc.fill_null(rows.column("_snap"), "")
    in_data = pc.and_(pc.equal(op, "r"), pc.equal(snap, "last_in_data_collection"))
    if pc.any(pc.or_(pc.equal(snap, "last"), in_data)).as_py():
        return Snapshot(own, frozenset({own}))
    last_read, latest = last_place(rows), last_place(data)
    whole = latest is not None and last_read is not None and latest > last_read
    return Snapshot(own, frozenset({own}) if whole else frozenset())


def last_place(t: pa.Table) -> tuple[int, int] | None:
    """The latest place in delivery order, (``ord_file``, ``ord_row``), among ``t``'s rows."""
    places = zip(t.column("ord_file").to_pylist(), t.column("ord_row").to_pylist(), strict=True)
    return max(places, default=None)


@dataclass(frozen=True, slots=True)
class Cut:
    """Where the table changed shape in the input, as
    :func:`feed.txn.assembly._cut_at_shape` has it: everything from the first place of the
    source transaction of the first event of the new shape (``at``) is held back, and
    every file from that place's file on is read again (``files``)."""

    at: tuple[int, int]
    files: frozenset[str]
    start_file: str  # the file that transaction begins in
    shape_file: str  # the file of the first event of the new shape
    change: Any  # feed.sources.shapes.ShapeChange
    first: tuple[int, int]  # the place of that first event (two cuts at one `at`)


def shape_cut(t: pa.Table, unfit: tuple[int, Any]) -> Cut:
    """The cut at the first event of the unfit shape ``unfit`` (its hash, its change)."""
    shaped = t.filter(pc.equal(t.column("_shape"), unfit[0]))
    places = zip(
        shaped.column("ord_file").to_pylist(),
        shaped.column("ord_row").to_pylist(),
        shaped.column("_file").to_pylist(),
        shaped.column("txn").to_pylist(),
        strict=True,
    )
    first_file, first_row, shape_file, txn = min(places, key=lambda p: (p[0], p[1], p[2]))
    same = t.filter(pc.equal(t.column("txn"), txn)) if txn is not None else shaped
    ord_file, ord_row, start_file = min(
        zip(
            same.column("ord_file").to_pylist(),
            same.column("ord_row").to_pylist(),
            same.column("_file").to_pylist(),
            strict=True,
        )
    )
    later = t.filter(pc.greater_equal(t.column("ord_file"), ord_file)).column("_file")
    return Cut(
        (ord_file, ord_row),
        frozenset(pc.unique(later).to_pylist()),
        start_file,
        shape_file,
        unfit[1],
        (first_file, first_row),
    )


def after_committed(e: dict[str, Any], committed: tuple[int, int, int]) -> bool:
    """Whether event ``e`` is still to be turned into updates: it comes after the
    ``committed`` position, or it is a read of the snapshot at that position whose end
    is not committed (:func:`feed.sources.positions.position_filter`)."""
    if e["pos_hi"] is None:  # of a transaction whose END is not read: not committed
        return True
    at = (e["pos_hi"], e["pos_lo"], e["pos_n"])
    same_snapshot = e["op"] == "r" and at[:2] == committed[:2] and committed[2] < ALL_DONE
    return at > committed or same_snapshot
