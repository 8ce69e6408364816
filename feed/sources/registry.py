"""The kinds of source tidefeed reads, and what sets each apart: the one place that knows.

Everything outside :mod:`feed.sources` asks a :class:`SourceKind` what its kind does
(``kind.events``, ``kind.whole_table``, …) instead of comparing its name. This module
needs no Spark: the command line checks a ``--source`` and its options before Spark
starts. The readers themselves are in :mod:`feed.sources.kinds` (``SourceKind.reader``
names one) and :mod:`feed.sources.debezium`; docs/sources.md describes every kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol import SourceError

__all__ = ["KINDS", "SOURCE_KINDS", "SourceKind", "source_kind"]


@dataclass(frozen=True, slots=True)
class SourceKind:
    """One kind of source: how its input is read and which of tidefeed's rules apply."""

    name: str
    #: the reader of its rows in :mod:`feed.sources.kinds` (a Delta table's change rows
    #: are read as ``cdf`` rows)
    reader: str
    #: the input is a folder of files, consumed in name order; otherwise a table read by
    #: its own versions (Delta)
    files: bool = True
    #: the rows are Debezium change events: they name their table, a source transaction
    #: ends with an END record, a new snapshot replaces the collection, TOAST placeholders
    #: are filled from the keyed state
    events: bool = False
    #: the rows carry their commit version (``_commit_version``): one version is never
    #: split between transactions, and one at or below the committed one is a redelivery
    versions: bool = False
    #: every file holds the whole table: no keyed state is kept, every row is checked and
    #: keeps its raw text for the quarantine
    whole_table: bool = False
    #: the changes of one key are ordered among themselves (by a column or the version)
    per_key: bool = False
    #: the source declares its record schema (a Delta table's); otherwise it is ``--schema``
    #: or inferred from the first input
    own_schema: bool = False
    #: how many input files schema inference reads (None: all, as the first event of the
    #: feed's table may come late in a folder shared with other tables)
    infer_files: int | None = 5
    #: how a line of its files names its source transaction, where a transaction may span
    #: files (a function of :mod:`feed.sources.inputs`: ``debezium``, the event's
    #: ``source.txId``; ``commit_version``, the row's ``_commit_version``); the input
    #: window of a transaction then never ends between two files of one source transaction
    line_txn: str | None = None
    #: its flat lines may be parsed by pyarrow in Spark's tasks (feed/sources/columnar.py)
    columnar: bool = False
    #: the ``tidefeed emit`` options only this kind takes (EmitterConfig field names)
    options: tuple[str, ...] = ()
    #: the options this kind cannot go without, each with what its value says
    required: tuple[tuple[str, str], ...] = ()


KINDS: dict[str, SourceKind] = {
    k.name: k
    for k in (
        SourceKind(
            "debezium",
            "debezium",
            events=True,
            infer_files=None,
            line_txn="debezium",
            columnar=True,
            options=("table", "tx_metadata"),
        ),
        SourceKind("cdf", "cdf", versions=True, per_key=True, line_txn="commit_version"),
        SourceKind(
            "upsert",
            "upsert",
            per_key=True,
            options=("order", "deleted"),
            required=(
                ("key", "the column(s) a row is upserted by"),
                ("order", "what orders the upserts"),
            ),
        ),
        SourceKind("snapshot", "snapshot", whole_table=True),
        SourceKind("weighted", "weighted"),
        SourceKind("delta", "cdf", files=False, per_key=True, own_schema=True),
    )
}
SOURCE_KINDS = tuple(KINDS)


def source_kind(name: str) -> SourceKind:
    """The kind called ``name``; an unknown name is a :class:`~protocol.SourceError` that
    lists the known ones."""
    try:
        return KINDS[name]
    except KeyError:
        raise SourceError(
            f"unknown source kind {name!r}; known kinds: {', '.join(SOURCE_KINDS)}"
        ) from None
