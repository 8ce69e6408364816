"""A feed's settings: this run's flags (:class:`EmitterConfig`) and the feed's own
(``feed.json``, written when the feed is created).

A new feed takes its settings from the flags (the defaults where they are left out) and its
record schema from ``--schema``, a Delta table or the first input. A later run is checked
against them before anything is read: a flag left out takes the feed's value, a flag that
differs is refused (:func:`settle`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import orjson
import pyarrow as pa

from feed.emit.defaults import (
    DEFAULT_CLOCK,
    DEFAULT_DRIVER_TXN_BYTES,
    DEFAULT_GRANULARITY,
    DEFAULT_LAYOUT,
    DEFAULT_MAX_FILES,
    DEFAULT_TRIGGER,
)
from feed.log.checkpoint import Checkpoint, fixed
from feed.log.info import Clock, FeedInfo, Granularity, Layout
from feed.log.store import FeedLog
from feed.sources.registry import SourceKind, source_kind
from protocol import CodecError, SourceError, fingerprint
from protocol.schema import avro_to_arrow

__all__ = [
    "DEFAULT_CLOCK",
    "DEFAULT_GRANULARITY",
    "DEFAULT_LAYOUT",
    "DEFAULT_MAX_FILES",
    "DEFAULT_TRIGGER",
    "EmitterConfig",
    "create_feed",
    "feed_settings",
    "load_schema_file",
    "settle",
]

#: a bad input row is quarantined (kept with its reason) or stops the transaction
BadRecords = Literal["quarantine", "fail"]
#: how a Spark transaction parses Debezium's lines (EmitterConfig.parse)
Parse = Literal["auto", "spark"]
RESERVED = ("time", "diff")
#: a follow-mode emitter warns once input has been held back this long (incomplete source
#: transactions: an END record or events not arrived), and again as often while it lasts
HELD_WARNING_SECONDS = 60.0


@dataclass(frozen=True, slots=True, kw_only=True)
class EmitterConfig:
    source_kind: str
    source_path: str
    feed: str
    log: str
    key: tuple[str, ...] = ()
    schema: dict[str, Any] | None = None
    clock: Clock | None = None  # None: the feed's, else wallclock
    granularity: Granularity | None = None  # None: the feed's, else batch
    layout: Layout | None = None  # None: the feed's, else times
    follow: bool = False
    trigger: float = DEFAULT_TRIGGER
    master: str | None = None
    on_bad_record: BadRecords = "quarantine"
    max_files_per_txn: int = DEFAULT_MAX_FILES
    order: str | None = None  # upsert: the column that orders upserts
    deleted: str | None = None  # upsert: the boolean column that marks deletes
    table: str | None = None  # debezium: the schema.table the feed holds
    tx_metadata: str | None = None  # debezium: a folder of transaction metadata records
    conf: tuple[tuple[str, str], ...] = ()  # Spark settings (--conf), over everything else
    #: keyed Debezium input of at most this many bytes is computed on the driver (0: never)
    driver_txn_bytes: int = DEFAULT_DRIVER_TXN_BYTES
    #: how Spark parses Debezium's lines: "auto" by pyarrow in its tasks where that reads
    #: them as Spark's own parse does (feed/sources/debezium_arrow.py), else Spark's;
    #: "spark" always Spark's
    parse: Parse = "auto"
    #: follow: warn when input has been held back this long (seconds)
    held_warning: float = HELD_WARNING_SECONDS
    #: the feeds of the group this feed is emitted in (feed/emit/group.py); () alone
    group: tuple[str, ...] = ()
    #: take the feed from an emitter that holds its lease (feed/log/lease.py)
    take_over: bool = False

    @property
    def kind(self) -> SourceKind:
        """What the source's kind is and does (:mod:`feed.sources.registry`)."""
        return source_kind(self.source_kind)


def feed_settings(
    cfg: EmitterConfig,
    feedlog: FeedLog,
    latest: Checkpoint | None,
    *,
    spark: Callable[[], Any],
    files: Callable[[], list[str]],
    delta_schema: Callable[[], dict[str, Any]],
    log: logging.Logger,
) -> tuple[EmitterConfig, FeedInfo]:
    """The run's settings and the feed's, at the emitter's start: the feed's own
    (``feed.json``, at the schema versions the ``latest`` commit holds) settling the
    run's flags, or, for a feed with nothing committed, new ones from the flags
    (:func:`create_feed`)."""
    info = feedlog.info()
    if info is not None and latest is not None:
        info = info.at(latest.frontier)  # the schema versions committed
    if info is not None and not fixed(latest):
        # an earlier run wrote the feed's settings but never committed a transaction (it
        # failed, was killed, or every row it read was bad): they are not the feed's yet,
        # and this run's flags (or inference) decide them
        log.info("feed %s: nothing committed yet; its settings are set anew", cfg.feed)
        info = None
    if info is not None:
        return settle(cfg, info), info
    cfg = replace(
        cfg,
        clock=cfg.clock or DEFAULT_CLOCK,
        granularity=cfg.granularity or DEFAULT_GRANULARITY,
        layout=cfg.layout or DEFAULT_LAYOUT,
    )
    info = create_feed(cfg, feedlog, spark=spark, files=files, delta_schema=delta_schema, log=log)
    return cfg, info


def create_feed(
    cfg: EmitterConfig,
    feedlog: FeedLog,
    *,
    spark: Callable[[], Any],
    files: Callable[[], list[str]],
    delta_schema: Callable[[], dict[str, Any]],
    log: logging.Logger,
) -> FeedInfo:
    """Write a new feed's settings (``feed.json``) from this run's flags; the record schema is
    ``--schema``, a Delta table's own, or inferred from the first input files (``spark``,
    ``files`` and ``delta_schema`` are only called when needed)."""
    from feed.sources.debezium_schema import debezium_table
    from feed.sources.kinds import infer_record_schema

    schema = cfg.schema
    table = cfg.table
    if cfg.kind.events and table is None:
        # a feed is one table: the first change event's, unless --table names it
        table = debezium_table(files())
    if schema is None and cfg.kind.own_schema:
        schema = delta_schema()
    if schema is None:
        first = files()[: cfg.kind.infer_files]
        if not first:  # (said before Spark starts: there is nothing for it to read)
            raise SourceError(
                f"feed {cfg.feed!r} is new and {cfg.source_path} holds no input files to "
                f"infer its record schema from: give --schema FILE, or run once files are "
                f"there"
            )
        schema = infer_record_schema(
            spark,
            cfg.kind.reader,
            first,
            exclude=tuple(c for c in (cfg.order, cfg.deleted) if c),
            table=table,
        )
    names = {f["name"] for f in schema.get("fields", [])}
    clash = [n for n in RESERVED if n in names]
    if clash:
        raise SourceError(
            f"feed {cfg.feed!r}: record columns {clash} clash with the feed log's own "
            "'time' and 'diff' columns; rename them"
        )
    missing = [k for k in cfg.key if k not in names]
    if missing:
        raise SourceError(
            f"feed {cfg.feed!r}: key column(s) {missing} are not in the record "
            f"schema (columns: {sorted(names)})"
        )
    fingerprint(schema)  # validates
    if table:
        log.info("feed %s: holds source table %s", cfg.feed, table)
    assert cfg.clock is not None
    return feedlog.create(
        schema=schema,
        key=cfg.key,
        clock=cfg.clock,
        table=table,
        source=cfg.source_kind,
        granularity=cfg.granularity,
        layout=cfg.layout,
        order=cfg.order,
        deleted=cfg.deleted,
        group=cfg.group,
    )


def settle(cfg: EmitterConfig, info: FeedInfo) -> EmitterConfig:
    """This run's settings against the feed's (``feed.json``), before anything is read:
    a flag left out takes the feed's value, a flag that differs is refused. Settings a
    feed from an older tidefeed did not keep come from the flags (or the defaults)."""
    known = {fingerprint(v.schema) for v in info.history()}
    if cfg.schema is not None and fingerprint(cfg.schema) not in known:
        raise SourceError(
            f"feed {cfg.feed!r}: --schema differs from every version of the feed's record "
            f"schema (the current one: fingerprint {info.fingerprint[:12]}…). --schema "
            "sets a new feed's first schema; after that the schema follows the source "
            "table's changes (docs/sources.md, 'Schema changes'): leave --schema out, or "
            "emit into a new feed"
        )
    if tuple(cfg.group) != tuple(info.group):
        raise SourceError(
            f"feed {cfg.feed!r} was created "
            + (f"in the group {','.join(info.group)}" if info.group else "on its own")
            + "; this run emits it "
            + (f"in the group {','.join(cfg.group)}" if cfg.group else "on its own")
            + ". A feed of a group keeps its times only with the group's other feeds: "
            "emit the same --table and --feed lists (docs/sources.md, 'Several tables')"
        )
    settled: dict[str, Any] = {}
    for name, flag, stored in (
        ("source_kind", "--source KIND", info.source),
        ("key", "--key", ",".join(info.key)),
        ("clock", "--clock", info.clock),
        ("granularity", "--granularity", info.granularity),
        ("layout", "--layout", info.layout),
        ("table", "--table", info.table),
        ("order", "--order", info.order),
        ("deleted", "--deleted", info.deleted),
    ):
        given = getattr(cfg, name)
        if name == "key":
            given = ",".join(given) if given else None
        if stored is None or given is None:
            value = given if stored is None else stored
        elif given != stored:
            raise SourceError(
                f"feed {cfg.feed!r} was created with {flag} {stored or '(none)'}; this "
                f"run gives {given}. A feed's settings are fixed when it is created: "
                "leave the flag out (the feed's value is used), or emit into a new feed"
            )
        else:
            value = stored
        if name == "key":
            value = tuple(c for c in (value or "").split(",") if c) or info.key
        settled[name] = value
    settled["clock"] = settled["clock"] or DEFAULT_CLOCK
    settled["granularity"] = settled["granularity"] or DEFAULT_GRANULARITY
    settled["layout"] = settled["layout"] or DEFAULT_LAYOUT
    return replace(cfg, **settled)


#: the deepest nesting of records a ``--schema`` may have (deeper ones exhaust Python's
#: stack further on, after the feed's folder is made)
MAX_SCHEMA_DEPTH = 64


def load_schema_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            schema = orjson.loads(f.read())
    except OSError as e:
        raise SourceError(f"cannot read schema file {path}: {e.strerror}") from e
    except orjson.JSONDecodeError as e:
        raise SourceError(f"schema file {path} is not JSON: {e}") from e
    if not isinstance(schema, dict) or schema.get("type") != "record":
        raise SourceError(f"schema file {path} must hold an Avro record schema")
    try:
        record = avro_to_arrow(schema)
    except (CodecError, KeyError, TypeError, ValueError, RecursionError) as e:
        raise SourceError(f"schema file {path}: not a record schema tidefeed holds: {e}") from e
    columns = _columns(record)
    depth = max((n.count(".") + 1 for n, _ in columns), default=0)
    if depth > MAX_SCHEMA_DEPTH:
        raise SourceError(
            f"schema file {path}: records nested {depth} deep; tidefeed holds at most "
            f"{MAX_SCHEMA_DEPTH} levels"
        )
    for name, t in columns:
        if pa.types.is_time(t):
            # (Spark has no time-of-day type, and would say so only once it runs)
            raise SourceError(
                f"schema file {path}: column {name!r} is a time of day ({t}), which Spark "
                "cannot hold; declare it as a long (microseconds since midnight, as "
                "Debezium's MicroTime is captured) or a string"
            )
    return schema


def _columns(t: pa.DataType, prefix: str = "") -> list[tuple[str, pa.DataType]]:
    """Every column of a record type and of the records, lists and maps inside it, by its
    dotted name."""
    if pa.types.is_struct(t):
        fields = [t.field(i) for i in range(t.num_fields)]
        return [c for f in fields for c in _columns(f.type, f"{prefix}{f.name}.")]
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _columns(t.value_type, prefix)
    if pa.types.is_map(t):
        return _columns(t.item_type, prefix)
    return [(prefix[:-1], t)]
