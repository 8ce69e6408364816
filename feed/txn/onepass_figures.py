"""What the one-pass engine's tasks (:mod:`feed.txn.onepass`) saw of each file, and
whether all of the files together show plain input (see that module's docstring)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc

from feed.sources.positions import ALL_DONE, DATA_OPS, Position
from feed.txn.onepass_txns import Open, at_commit, complete, open_transactions

__all__ = ["FileFigures", "commit_lsns", "file_figures", "highest", "plain_figures"]


class FileFigures(NamedTuple):
    """What one file's task saw (an entry of the read's accumulator)."""

    read: int  # the read it belongs to (the accumulator is the process's)
    ord_file: int
    why: str | None  # why the file is not plain (None: it is)
    rows: int = 0  # input rows
    skipped: tuple[tuple[str, int], ...] = ()  # skipped lines by reason
    data: int = 0  # data events
    kept: int = 0  # data events past the committed position
    last: tuple[int, int, int] | None = None  # the highest kept position
    shapes: tuple[int, ...] = ()  # table shapes of the rows past the committed position
    #: where its data events sit: the file's entry for :func:`~feed.sources.columnar.
    #: all_distinct` (:func:`~feed.sources.columnar.seen_positions`)
    positions: tuple[Any, ...] | None = None
    unparsed: bool = False  # the columnar parse declined the file (or could not read it)
    #: the source transactions the file cannot judge alone (:mod:`feed.txn.onepass_txns`)
    opened: tuple[Open, ...] = ()


def plain_figures(
    figures: Sequence[FileFigures], n_files: int, committed_hi: int = 0
) -> str | None:
    """Why the files' ``figures`` show input that is not plain, or None (every source
    transaction open in a file is complete across them: :func:`~feed.txn.onepass_txns.
    complete`)."""
    from feed.sources.columnar import all_distinct

    if len({f.ord_file for f in figures}) != n_files:
        return "a file's task gave no figures"
    for f in sorted(figures, key=lambda f: f.ord_file):
        if f.why is not None:
            return f.why
    if not all_distinct([f.positions for f in figures if f.positions], n_files):
        return "data events that may share a position (one read twice)"
    return complete([o for f in figures for o in f.opened], committed_hi)[0]


def highest(figures: Sequence[FileFigures]) -> tuple[int, int, int] | None:
    """The highest position of the kept events of the (plain) files' ``figures``."""
    tops = [f.last for f in figures if f.last is not None]
    tops += complete([o for f in figures for o in f.opened], 0)[1]
    return max(tops) if tops else None


def commit_lsns(figures: Sequence[FileFigures]) -> dict[str, int]:
    """The commit LSN of each source transaction open in a file, where its END was read."""
    return {o.txn: o.commit for f in figures for o in f.opened if o.commit is not None}


#: the columns of a file's kept events that the tasks use (:func:`file_figures`)
KEPT_COLUMNS = (
    *("op", "before", "after", "weight", "txn", "tx_meta"),
    *("pos_hi", "pos_lo", "pos_n", "ord_file", "ord_row"),
)


def file_figures(
    t: pa.Table, pos: Position, read: int, ord_file: int
) -> tuple[FileFigures, pa.Table]:
    """One file's figures from its parsed rows ``t`` (the columns of
    :func:`~feed.sources.debezium_arrow.parse_flat`), and its data events past the
    committed position ``pos`` (as :func:`~feed.sources.positions.position_filter`; the
    columns :data:`KEPT_COLUMNS`), each
    event of a transaction with metadata at its commit LSN (:func:`~feed.txn.
    onepass_txns.at_commit`; null where that END is in another file)."""
    from feed.sources.columnar import seen_positions

    parsed, t = t, at_commit(t)
    op, snap = t["op"], pc.fill_null(t["_snap"], "")
    is_data = pc.is_in(op, pa.array(DATA_OPS))
    hi, lo, n = pos
    h, lw, nn = t["pos_hi"], t["pos_lo"], t["pos_n"]
    after = pc.or_kleene(
        pc.greater(h, hi),
        pc.and_kleene(
            pc.equal(h, hi),
            pc.or_kleene(pc.greater(lw, lo), pc.and_kleene(pc.equal(lw, lo), pc.greater(nn, n))),
        ),
    )
    same = pc.and_kleene(pc.and_kleene(pc.equal(op, "r"), pc.equal(h, hi)), pc.equal(lw, lo))
    same = pc.and_kleene(same, pa.scalar(n < ALL_DONE))
    fresh = pc.fill_null(pc.or_kleene(pc.or_kleene(pc.is_null(h), after), same), False)
    kept = pc.and_(is_data, fresh)
    snapshot = pc.or_(
        pc.and_(pc.fill_null(pc.equal(op, "r"), False), pc.not_equal(snap, "incremental")),
        pc.equal(snap, "last"),
    )
    why = _why_not_plain(parsed, is_data, kept, snapshot)  # (an event's own position)
    rows = t.select(list(KEPT_COLUMNS))
    rows = rows if pc.all(kept).as_py() else rows.filter(kept)
    opened, why_open = open_transactions(t, rows, hi)
    why = why or (why_open and f"{_name(t)}: {why_open}")
    skips = (
        pc.value_counts(t["_skip"].drop_null()).to_pylist()
        if t["_skip"].null_count < len(t)
        else []
    )
    figures = FileFigures(
        read=read,
        ord_file=ord_file,
        why=why,
        rows=t.num_rows,
        skipped=tuple(sorted((s["values"], s["counts"]) for s in skips)),
        data=pc.sum(is_data.cast(pa.int64())).as_py() or 0,
        kept=pc.sum(kept.cast(pa.int64())).as_py() or 0,
        last=_highest(rows),
        shapes=tuple(sorted(set(t["_shape"].filter(fresh).drop_null().to_pylist()))),
        positions=seen_positions(read, ord_file, t),
        opened=opened,
    )
    return figures, rows


def _why_not_plain(
    t: pa.Table, is_data: pa.ChunkedArray, kept: pa.ChunkedArray, snapshot: pa.ChunkedArray
) -> str | None:
    """Why one file's rows are not plain (see the module docstring), or None."""
    name = _name(t)
    unplaced = pc.or_(pc.is_null(t["pos_hi"]), pc.is_null(t["pos_lo"]))
    checks = (
        (pc.any(snapshot), "a snapshot read or a snapshot's end"),
        (pc.any(pc.is_valid(t["_toast"])), "an unavailable-value placeholder"),
        (pc.any(pc.is_valid(t["_error"])), "a bad row"),
        (pc.any(pc.and_(kept, unplaced)), "an event without a position"),
    )
    for found, why in checks:
        if found.as_py():
            return f"{name}: {why}"
    return None


def _name(t: pa.Table) -> str:
    return t["_file"][0].as_py() if t.num_rows else ""


def _highest(kept: pa.Table) -> tuple[int, int, int] | None:
    """The highest (``pos_hi``, ``pos_lo``, ``pos_n``) of the kept events placed in the
    file (those of a transaction whose END is elsewhere are not: :data:`Open`'s ``top``),
    or None."""
    rows = kept.select(["pos_hi", "pos_lo", "pos_n"])
    rows = rows.filter(pc.is_valid(rows["pos_hi"]))
    if rows.num_rows == 0:
        return None
    top: list[int] = []
    for c in ("pos_hi", "pos_lo", "pos_n"):  # (the highest of each among the rows left:
        high = pc.max(rows[c]).as_py()  # no sort; a placed event's are never null)
        top.append(high)
        rows = rows.filter(pc.equal(rows[c], high))
    return (top[0], top[1], top[2])
