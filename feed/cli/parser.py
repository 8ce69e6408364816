"""The ``tidefeed`` command line's parser: every command's options, their defaults and
help (feed/cli/options.py has the option machinery; feed/cli/main.py runs the commands)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from feed.cli.options import (
    DEFAULT_LOG_LEVEL,
    LOG_LEVELS,
    OptionParser,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    scope_env,
    version,
)
from feed.emit.defaults import (
    DEFAULT_CLOCK,
    DEFAULT_DRIVER_TXN_BYTES,
    DEFAULT_GRANULARITY,
    DEFAULT_LAYOUT,
    DEFAULT_MAX_FILES,
    DEFAULT_TRIGGER,
)
from feed.emit.session import DEFAULT_MASTER
from feed.serve.limits import COMPACT_SECONDS, MAX_STREAMS, MAX_STREAMS_PER_CLIENT, STALL_SECONDS
from feed.sources.registry import KINDS
from protocol.defaults import DEFAULT_PUSH_ALLOW, FORMATS, IDLE_TIMEOUT

__all__ = ["build_parser"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_SERVE_PORT = 8080
DEFAULT_RECEIVE_PORT = 9090
DEFAULT_PUSH_TIMEOUT = 300.0


def time_or_latest(value: str) -> int | str:
    """A time (a non-negative integer), or ``latest``."""
    if value == "latest":
        return value
    try:
        return non_negative_int(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a time (a whole number >= 0) or latest"
        ) from None


def _common(p: OptionParser) -> None:
    """Options every command has: logging and tracebacks."""
    p.option(
        "--log-level", choices=LOG_LEVELS, default=DEFAULT_LOG_LEVEL, help="tidefeed's log level"
    )
    p.option(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="log lines as text or JSON objects",
    )
    p.option("--debug", action="store_true", help="show the traceback of an error")


def build_parser(handlers: Mapping[str, Callable[[argparse.Namespace], int]]) -> OptionParser:
    """The parser of every command; ``handlers`` runs each (by command name)."""
    parser = OptionParser(
        prog="tidefeed",
        description="A differential change feed: consolidated (record, time, diff) updates "
        "with progress, delivered exactly once.",
        epilog="Exit codes: 0 done, 1 invalid input or failed, 2 usage error, 130/143 stopped "
        "by SIGINT/SIGTERM. Options also read TIDEFEED_<COMMAND>_<OPTION> from the "
        "environment (see each command's --help).",
    )
    parser.add_argument("--version", action="version", version=f"tidefeed {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands: dict[str, Callable[[argparse.Namespace], int]] = {}
    parsers: dict[str, OptionParser] = {}

    def command(name: str, **kw: Any) -> OptionParser:
        fn = handlers[name]
        p: OptionParser = sub.add_parser(name, **kw)
        commands[name] = fn
        parsers[name] = p
        return p

    _check(command)
    _convert(command)
    _emit(command)
    _inspect(command)
    _serve(command)
    _compact(command)
    _receive(command)
    _capture(command)
    _demo(command)

    for p in parsers.values():
        _common(p)
    scope_env(parsers)
    parser.set_defaults(_commands=commands, _parsers=parsers)
    return parser


def _check(command: Callable[..., OptionParser]) -> None:
    p = command("check", help="validate a feed stream (exit 0 valid, 1 invalid)")
    p.option("--format", choices=FORMATS, help="input format (default: detected from the bytes)")
    p.option(
        "--non-negative",
        action="store_true",
        help="also require that no record's accumulated count goes below zero",
    )
    p.option("--key", help="key columns, comma-separated: at most one live row per key")
    p.add_argument("file", nargs="?", default="-", metavar="FILE|-", help="the stream to check")


def _convert(command: Callable[..., OptionParser]) -> None:
    p = command("convert", help="convert a feed stream between formats")
    p.option("--from", dest="from_", choices=FORMATS, required=True, help="input format")
    p.option("--to", choices=FORMATS, required=True, help="output format")
    p.option("--schema", help="record schema (Avro JSON, .avsc); needed from NDJSON")
    p.add_argument("input", nargs="?", default="-", metavar="IN|-")
    p.add_argument("output", nargs="?", default="-", metavar="OUT|-")


def _emit(command: Callable[..., OptionParser]) -> None:
    p = command("emit", help="turn row changes into a consolidated feed (Spark)")
    folders = ", ".join(k.name for k in KINDS.values() if k.files)
    p.option(
        "--source",
        required=True,
        help=f"KIND:PATH, a file or folder of change files, local or s3://… (kinds: {folders}), "
        "or delta:TABLE_URI for a Delta table's change data feed",
    )
    p.option("--feed", required=True, help="feed name (a list A,B with --table A,B: a group)")
    p.option("--log", required=True, help="feed log: a local folder or s3://…")
    p.option("--key", help="key columns, comma-separated (keeps each key's current row)")
    p.option("--schema", help="record schema (Avro JSON, .avsc); default: inferred")
    p.option(
        "--clock",
        choices=("wallclock", "logical"),
        help="times in milliseconds since the epoch, or 1, 2, 3 … (default: the feed's; a "
        f"new feed: {DEFAULT_CLOCK})",
    )
    p.option(
        "--granularity",
        choices=("batch", "transaction"),
        help="one time per emitter transaction, or one per source transaction (default: the "
        f"feed's; a new feed: {DEFAULT_GRANULARITY})",
    )
    p.option(
        "--layout",
        choices=("times", "packs"),
        help="how the log files updates: a folder per time, or packs of many times in a "
        "few files, for object stores (default: the feed's; a new feed: "
        f"{DEFAULT_LAYOUT}; docs/operations.md, 'Packs')",
    )
    _emit_run(p)
    _emit_push(p)
    _emit_spark(p)
    _emit_source_options(p)


def _emit_run(p: OptionParser) -> None:
    """``emit``: how the run goes."""
    p.option("--follow", action="store_true", help="keep running and pick up new files")
    p.option(
        "--trigger",
        type=positive_float,
        default=DEFAULT_TRIGGER,
        help="seconds between polls for new files with --follow",
    )
    p.option(
        "--take-over",
        action="store_true",
        help="take the feed from an emitter that holds it (it stops at its next commit); "
        "without it, a second emitter of a feed is refused",
    )
    p.option(
        "--on-bad-record",
        choices=("quarantine", "fail"),
        default="quarantine",
        help="set a bad input row aside with its reason and go on, or stop with nothing committed",
    )
    p.option(
        "--max-files-per-txn",
        type=positive_int,
        default=DEFAULT_MAX_FILES,
        help="input files read by one transaction at most",
    )


def _emit_push(p: OptionParser) -> None:
    """``emit``: delivering the feed as it is committed."""
    p.option(
        "--push",
        metavar="URL",
        help="deliver the feed to this receiver as it is committed (from a background "
        "publisher: a receiver that is down never holds back the commits)",
    )
    p.option("--eager", action="store_true", help="push updates before the commit (with --push)")
    p.option("--format", choices=FORMATS, default="ndjson", help="push format")
    p.option("--token", help="bearer token the receiver expects")
    p.option(
        "--push-timeout",
        type=non_negative_float,
        default=DEFAULT_PUSH_TIMEOUT,
        help="at the end of a run, seconds to wait for the receiver to take the last commit "
        "before exiting with 1 (the log keeps it; the next start delivers it)",
    )


def _emit_spark(p: OptionParser) -> None:
    """``emit``: where the transactions run."""
    p.option("--master", help=f"Spark master (default: {DEFAULT_MASTER})")
    p.add_argument(
        "--conf",
        action="append",
        metavar="KEY=VALUE",
        help="a Spark setting, over spark-submit --conf and spark-defaults.conf (repeatable)",
    )
    p.option(
        "--driver-txn-bytes",
        type=non_negative_int,
        default=DEFAULT_DRIVER_TXN_BYTES,
        help="a debezium transaction over at most this many input bytes is parsed and "
        "computed on the driver, without Spark (which then starts only when a transaction "
        "needs it), when its input is plain (0: always in Spark; docs/emitter.md)",
    )
    p.option(
        "--parse",
        choices=("auto", "spark"),
        default="auto",
        help="how a transaction in Spark parses debezium lines: auto (the default) by "
        "pyarrow in Spark's tasks where that reads them exactly as Spark's JSON reader "
        "does (flat lines of plain columns), else by that reader; spark: always by "
        "Spark's reader, and never in one pass (docs/emitter.md)",
    )


def _emit_source_options(p: OptionParser) -> None:
    """``emit``: the options of one kind of source (feed/sources/registry.py); the others
    refuse them."""
    p.option("--order", help="upsert source: the column that orders the upserts")
    p.option("--deleted", help="upsert source: the boolean column that marks a delete")
    p.option(
        "--table",
        help="debezium source: the SCHEMA.TABLE the feed holds; other tables' events are "
        "skipped (default: the table of the first change event). A list (A,B) with a "
        "list of --feed names makes a group: one time domain over the tables",
    )
    p.option(
        "--tx-metadata",
        help="debezium source: a folder of Debezium transaction metadata records, when "
        "they are not in the source folder itself",
    )


def _inspect(command: Callable[..., OptionParser]) -> None:
    p = command("inspect", help="print a committed feed from its log (no Spark)")
    p.option("--log", required=True, help="feed log: a local folder or s3://…")
    p.option("--feed", required=True, help="feed name")
    p.option("--after", type=int, help="only times >= T")
    p.option(
        "--at",
        type=time_or_latest,
        metavar="T|latest",
        help="the collection at complete time T (latest: the newest complete time)",
    )
    p.option("--format", choices=("table", *FORMATS), default="table", help="output format")


def _serve(command: Callable[..., OptionParser]) -> None:
    p = command("serve", help="serve feeds over HTTP (pull and push subscriptions)")
    p.option("--log", required=True, help="feed log: a local folder or s3://…")
    p.option("--host", default=DEFAULT_HOST, help="address to listen on")
    p.option("--port", type=port, default=DEFAULT_SERVE_PORT, help="port to listen on")
    p.option("--token", help="require this bearer token from every client")
    p.option(
        "--push-allow",
        default=DEFAULT_PUSH_ALLOW,
        help="HOST|CIDR,… where push subscriptions may point (default: this machine only)",
    )
    p.option(
        "--retain",
        type=non_negative_int,
        help="compact automatically, keeping the last T time units below each frontier "
        "(milliseconds with the wallclock clock) and all that subscriptions have not ACKed "
        "(default: never compact)",
    )
    p.option(
        "--compact-every",
        type=positive_float,
        default=COMPACT_SECONDS,
        help="seconds between two retention passes (with --retain)",
    )
    p.option(
        "--max-streams",
        type=positive_int,
        default=MAX_STREAMS,
        help="pull streams open at a time, in all (past it: 503)",
    )
    p.option(
        "--max-streams-per-client",
        type=positive_int,
        default=MAX_STREAMS_PER_CLIENT,
        help="pull streams open at a time from one client address (past it: 429)",
    )
    p.option(
        "--stall-timeout",
        type=positive_float,
        default=STALL_SECONDS,
        help="close a pull stream whose consumer reads nothing for this many seconds",
    )
    p.option(
        "--idle-timeout",
        type=positive_float,
        default=IDLE_TIMEOUT,
        help="close a connection that sends no whole request for this many seconds",
    )


def _compact(command: Callable[..., OptionParser]) -> None:
    p = command("compact", help="fold old times into one snapshot")
    p.option("--log", required=True, help="feed log: a local folder or s3://…")
    p.option("--feed", required=True, help="feed name")
    p.option("--to", required=True, type=int, help="fold every time <= T; since becomes T")


def _receive(command: Callable[..., OptionParser]) -> None:
    p = command("receive", help="run the reference receiver (SQLite)")
    p.option("--db", required=True, help="SQLite database file")
    p.option("--host", default=DEFAULT_HOST, help="address to listen on")
    p.option("--port", type=port, default=DEFAULT_RECEIVE_PORT, help="port to listen on")
    p.option("--token", help="require this bearer token from every producer")
    p.option(
        "--idle-timeout",
        type=positive_float,
        default=IDLE_TIMEOUT,
        help="close a connection that sends no whole request for this many seconds",
    )
    p.option(
        "--no-warm-up",
        action="store_true",
        help="listen at once, without first applying a made-up time of 400k updates in memory "
        "(~0.2 s of CPU, ~70 MB kept; without it the first large push pays that growth)",
    )

    p = command(
        "status", help="every feed of a log: frontier, last commit, emitter, subscriptions and lag"
    )
    p.option("--log", required=True, help="feed log: a local folder or s3://…")
    p.option("--format", choices=("table", "json"), default="table", help="output format")


def _capture(command: Callable[..., OptionParser]) -> None:
    p = command("capture", help="capture a database's changes into a source folder (Debezium)")
    p.add_argument("database", choices=("postgres",), help="the source database kind")
    p.option("--dsn", required=True, help="postgresql://USER:PASSWORD@HOST:PORT/DBNAME")
    p.option("--table", required=True, help="SCHEMA.TABLE[,…] to capture")
    p.option("--out", required=True, help="source folder to write change event files into")
    p.option("--slot", help="replication slot name (default: tidefeed)")
    p.add_argument(
        "--debezium",
        action="append",
        metavar="KEY=VALUE",
        help="a Debezium connector setting to add or override (repeatable)",
    )
    p.add_argument(
        "--no-column-tracking",
        action="store_true",
        help="do not install the trigger that records column numbers (then a RENAME COLUMN "
        "stops the feed instead of renaming its column)",
    )


def _demo(command: Callable[..., OptionParser]) -> None:
    p = command("demo", help="run the demo end to end")
    p.option(
        "--workdir",
        help="where the demo writes; an existing demo there is kept and a new run folder is "
        "made beside it (default: a fresh temporary folder)",
    )
    p.option(
        "--postgres",
        action="store_true",
        help="run a throwaway PostgreSQL and capture it with Debezium (needs PostgreSQL "
        "installed and the postgres extra)",
    )
