"""The ``tidefeed`` command line (DESIGN §9).

Every option also reads ``TIDEFEED_<OPTION>`` from the environment (``--on-bad-record`` from
``TIDEFEED_ON_BAD_RECORD``); a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import IO, Any

import orjson

from protocol import CODECS, CodecError, FeedChecker, TidefeedError, get_codec

__all__ = ["build_parser", "main"]

FORMATS = tuple(CODECS)


def _env_name(flag: str) -> str:
    return "TIDEFEED_" + flag.lstrip("-").replace("-", "_").upper()


def _option(p: argparse.ArgumentParser, flag: str, **kw: Any) -> None:
    """Add ``flag``, defaulting to ``TIDEFEED_<FLAG>`` from the environment when set."""
    env = os.environ.get(_env_name(flag))
    if env is not None:
        if kw.get("action") == "store_true":
            kw["default"] = env.strip().lower() not in ("", "0", "false", "no")
        else:
            kw["default"] = env
            kw.pop("required", None)
        kw["help"] = (kw.get("help") or "") + f" [from ${_env_name(flag)}]"
    p.add_argument(flag, **kw)


def sniff_format(head: bytes) -> str:
    """Guess a stream's format from its first bytes: Avro and Arrow have magic numbers."""
    if head.startswith(b"Obj\x01"):
        return "avro"
    if head.startswith(b"\xff\xff\xff\xff"):
        return "arrow"
    return "ndjson"


def _peek(stream: IO[bytes]) -> bytes:
    """The first bytes of a buffered binary stream, without consuming them."""
    peek = getattr(stream, "peek", None)
    return bytes(peek(8)[:8]) if peek is not None else b""


def _open_in(path: str) -> IO[bytes]:
    if path == "-":
        return sys.stdin.buffer
    try:
        return open(path, "rb")
    except OSError as e:
        raise SystemExit(f"tidefeed: cannot open {path}: {e.strerror}") from e


def _load_schema(path: str | None) -> Any:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return orjson.loads(f.read())
    except OSError as e:
        raise SystemExit(f"tidefeed: cannot read schema {path}: {e.strerror}") from e
    except orjson.JSONDecodeError as e:
        raise SystemExit(f"tidefeed: schema {path} is not JSON: {e}") from e


def cmd_check(args: argparse.Namespace) -> int:
    src = _open_in(args.file)
    fmt = args.format or sniff_format(_peek(src))
    decoder = get_codec(fmt).decoder(src)
    key = [c for c in args.key.split(",") if c] if args.key else None
    checker = FeedChecker(non_negative=args.non_negative, key=key)
    name = "stdin" if args.file == "-" else args.file
    try:
        for message in decoder:
            checker.check(message, position=decoder.position)
    except CodecError as e:
        for v in checker.violations:
            print(f"{name}: {v}")
        print(f"{name}: malformed {fmt}: {e}")
        return 1
    violations = checker.finish()
    for v in violations:
        print(f"{name}: {v}")
    summary = (
        f"{name}: {checker.messages} messages, {checker.updates} updates, "
        f"frontier {checker.frontier}"
    )
    if violations:
        print(f"{summary}: INVALID ({len(violations)} violation(s))", file=sys.stderr)
        return 1
    print(f"{summary}: valid", file=sys.stderr)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    src = _open_in(args.input)
    schema = _load_schema(args.schema)
    decoder = get_codec(args.from_).decoder(src, schema=schema)
    out = sys.stdout.buffer if args.output == "-" else open(args.output, "wb")  # noqa: SIM115
    encoder = None
    try:
        for message in decoder:
            if encoder is None:
                # Avro and Arrow inputs know their record schema once the header is read
                encoder = get_codec(args.to).encoder(out, schema=schema or decoder.record_schema)
            encoder.write(message)
        if encoder is None:
            encoder = get_codec(args.to).encoder(out, schema=schema or decoder.record_schema)
        encoder.close()
    finally:
        out.flush()
        if out is not sys.stdout.buffer:
            out.close()
    return 0


def _parse_source(spec: str) -> tuple[str, str]:
    from .sources import SOURCE_KINDS

    kind, sep, path = spec.partition(":")
    if not sep or not path:
        raise SystemExit(f"tidefeed emit: --source must be KIND:PATH, got {spec!r}")
    if kind not in SOURCE_KINDS:
        raise SystemExit(
            f"tidefeed emit: unknown source kind {kind!r}; known kinds: {', '.join(SOURCE_KINDS)}"
        )
    return kind, path


def cmd_emit(args: argparse.Namespace) -> int:
    import logging

    from .emitter import Emitter, EmitterConfig, load_schema_file
    from .session import parse_conf

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr
    )
    kind, path = _parse_source(args.source)
    if args.eager and not args.push:
        raise SystemExit("tidefeed emit: --eager pushes to a receiver: give --push URL too")
    config = EmitterConfig(
        source_kind=kind,
        source_path=path,
        feed=args.feed,
        log=args.log,
        key=tuple(c for c in (args.key or "").split(",") if c),
        schema=load_schema_file(args.schema) if args.schema else None,
        clock=args.clock,
        granularity=args.granularity,
        follow=args.follow,
        trigger=float(args.trigger),
        master=args.master,
        on_bad_record=args.on_bad_record,
        max_files_per_txn=int(args.max_files_per_txn),
        order=args.order,
        deleted=args.deleted,
        table=args.table or None,
        tx_metadata=args.tx_metadata or None,
        conf=tuple(parse_conf(args.conf).items()),
    )
    import signal

    stopping: list[int] = []

    def request_stop(signum: int, _frame: Any) -> None:
        # finish the transaction under way, then stop: nothing half-done is left behind
        stopping.append(signum)
        print("tidefeed emit: stopping after the current transaction", file=sys.stderr)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    deliver = _push_delivery(args, config, lambda: emitter.eager) if args.push else None
    emitter = Emitter(config, on_commit=deliver)
    emitter.open()
    if args.eager:
        from .eager import EagerPusher

        # executors encode the pushes with the feed's schema, known once the feed is open
        emitter.eager = EagerPusher(
            url=args.push, fmt=args.format, schema=emitter.info.schema, token=args.token
        )
    try:
        if deliver is not None:
            assert emitter.cp is not None
            deliver(emitter.cp, fresh=True)  # the announcement and any backlog first
        reports = emitter.run(stop=lambda: bool(stopping))
    finally:
        emitter.close()
    cp = emitter.cp
    assert cp is not None
    updates = sum(r.updates for r in reports)
    bad = sum(r.bad_rows for r in reports)
    print(
        f"feed {config.feed}: {len(reports)} transaction(s), {updates} updates, "
        f"{bad} quarantined row(s); frontier {cp.frontier}, epoch {cp.epoch}",
        file=sys.stderr,
    )
    return 0


def _push_delivery(
    args: argparse.Namespace, config: Any, eager_of: Callable[[], Any]
) -> Callable[..., None]:
    """A commit hook that pushes the committed feed to ``--push`` before going on. With
    eager delivery, a transaction's updates are at the receiver already: its progress
    alone closes it, and only when that fails is the log delivered again."""
    from .publisher import deliver_log

    def deliver(cp: Any, *, fresh: bool = False) -> None:
        eager = eager_of()
        acked = eager.close(cp.progress, cp.epoch) if eager is not None and not fresh else None
        if acked is None or acked < cp.frontier:
            acked = deliver_log(
                config.log,
                config.feed,
                args.push,
                epoch=cp.epoch,
                fmt=args.format,
                token=args.token,
                give_up_after=float(args.push_timeout),
            )
        print(f"tidefeed emit: {args.push} ACKed frontier {acked}", file=sys.stderr)

    return deliver


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from .server import ServerConfig, run_server

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr
    )
    run_server(
        ServerConfig(
            log=args.log,
            host=args.host,
            port=int(args.port),
            token=args.token or None,
            retain=int(args.retain) if args.retain not in (None, "") else None,
        )
    )
    return 0


def cmd_compact(args: argparse.Namespace) -> int:
    from .compaction import compact

    print(compact(args.log, args.feed, int(args.to)).summary(), file=sys.stderr)
    return 0


def cmd_receive(args: argparse.Namespace) -> int:
    from protocol.receiver import ReceiverConfig, run_receiver

    run_receiver(
        ReceiverConfig(db=args.db, host=args.host, port=int(args.port), token=args.token or None)
    )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .inspection import inspect_feed

    return inspect_feed(
        log=args.log,
        feed=args.feed,
        after=args.after,
        at=args.at,
        fmt=args.format,
        out=sys.stdout,
    )


def cmd_capture(args: argparse.Namespace) -> int:
    import logging

    from .capture import DEFAULT_SLOT, CaptureConfig, run_capture

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr
    )
    extra = {}
    for kv in args.debezium or []:
        k, sep, v = kv.partition("=")
        if not sep:
            raise SystemExit(f"tidefeed capture: --debezium takes KEY=VALUE, got {kv!r}")
        extra[k] = v
    return run_capture(
        CaptureConfig(
            dsn=args.dsn,
            tables=tuple(t for t in args.table.split(",") if t),
            out=args.out,
            slot=args.slot or DEFAULT_SLOT,
            extra=extra,
        )
    )


def cmd_demo(args: argparse.Namespace) -> int:
    if args.postgres:
        from .demo_postgres import run_postgres_demo

        return run_postgres_demo(workdir=args.workdir)
    from .demo import run_demo

    return run_demo(workdir=args.workdir)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tidefeed",
        description="A differential change feed: consolidated (record, time, diff) updates "
        "with progress, delivered exactly once.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands: dict[str, Callable[[argparse.Namespace], int]] = {}

    p = sub.add_parser("check", help="validate a feed stream (exit 0 valid, 1 invalid)")
    _option(p, "--format", choices=FORMATS, help="input format (default: detect)")
    _option(
        p,
        "--non-negative",
        action="store_true",
        help="also require non-negative accumulated multiplicities (§2.6)",
    )
    _option(p, "--key", help="key columns, comma-separated: at most one live row per key")
    p.add_argument("file", nargs="?", default="-", metavar="FILE|-")
    commands["check"] = cmd_check

    p = sub.add_parser("convert", help="convert a feed stream between formats")
    _option(p, "--from", dest="from_", choices=FORMATS, required=True, help="input format")
    _option(p, "--to", choices=FORMATS, required=True, help="output format")
    _option(p, "--schema", help="record schema (Avro JSON, .avsc)")
    p.add_argument("input", nargs="?", default="-", metavar="IN|-")
    p.add_argument("output", nargs="?", default="-", metavar="OUT|-")
    commands["convert"] = cmd_convert

    p = sub.add_parser("emit", help="turn row changes into a consolidated feed (Spark)")
    _option(
        p,
        "--source",
        required=True,
        help="KIND:PATH; kinds: debezium, cdf, upsert, snapshot, weighted",
    )
    _option(p, "--feed", required=True, help="feed name")
    _option(p, "--log", required=True, help="feed log URI (a local path or s3://…)")
    _option(p, "--key", help="key columns, comma-separated (keeps per-key state)")
    _option(p, "--schema", help="record schema (Avro JSON, .avsc); default: inferred")
    _option(
        p,
        "--clock",
        choices=("wallclock", "logical"),
        help="time of each transaction (default: the feed's; a new feed: wallclock)",
    )
    _option(
        p,
        "--granularity",
        choices=("batch", "transaction"),
        help="one time per emitter or per source transaction (default: the feed's; a new "
        "feed: batch)",
    )
    _option(p, "--follow", action="store_true", help="keep picking up new files")
    _option(p, "--trigger", default="5", help="seconds between polls in --follow mode")
    _option(p, "--push", help="push the feed to this receiver URL")
    _option(p, "--eager", action="store_true", help="push before the commit (with --push)")
    _option(p, "--format", choices=FORMATS, default="ndjson", help="push format")
    _option(p, "--token", help="bearer token for the receiver")
    _option(
        p,
        "--push-timeout",
        default="300",
        help="seconds to keep retrying an unreachable receiver before failing",
    )
    _option(p, "--master", default=None, help="Spark master (default local[*])")
    p.add_argument(
        "--conf",
        action="append",
        metavar="KEY=VALUE",
        help="a Spark setting, over spark-submit --conf and spark-defaults.conf (repeatable)",
    )
    _option(p, "--on-bad-record", choices=("quarantine", "fail"), default="quarantine")
    _option(p, "--max-files-per-txn", default="1000", help="input files per transaction")
    _option(p, "--order", help="upsert source: the column that orders the upserts")
    _option(p, "--deleted", help="upsert source: the boolean column that marks a delete")
    _option(
        p,
        "--table",
        help="debezium source: the SCHEMA.TABLE the feed holds; other tables' events are "
        "skipped (default: the table of the first change event)",
    )
    _option(
        p,
        "--tx-metadata",
        help="debezium source: a folder of Debezium transaction metadata records, when "
        "they are not in the source folder itself",
    )
    commands["emit"] = cmd_emit

    p = sub.add_parser("inspect", help="print a committed feed from its log (no Spark)")
    _option(p, "--log", required=True, help="feed log URI")
    _option(p, "--feed", required=True, help="feed name")
    _option(p, "--after", type=int, help="only times >= T")
    _option(p, "--at", type=int, help="the collection at complete time T")
    _option(p, "--format", choices=("table", *FORMATS), default="table")
    commands["inspect"] = cmd_inspect

    p = sub.add_parser("serve", help="serve feeds over HTTP (pull and push subscriptions)")
    _option(p, "--log", required=True, help="feed log URI")
    _option(p, "--host", default="127.0.0.1")
    _option(p, "--port", default="8080")
    _option(p, "--token", help="require this bearer token")
    _option(
        p,
        "--retain",
        help="compact automatically, keeping the last T time units below each frontier "
        "(milliseconds with the wallclock clock) and all that subscriptions have not ACKed",
    )
    commands["serve"] = cmd_serve

    p = sub.add_parser("compact", help="fold old times into one snapshot (DESIGN §8)")
    _option(p, "--log", required=True, help="feed log URI")
    _option(p, "--feed", required=True, help="feed name")
    _option(p, "--to", required=True, type=int, help="fold every time <= T; since becomes T")
    commands["compact"] = cmd_compact

    p = sub.add_parser("receive", help="run the reference receiver (SQLite)")
    _option(p, "--db", required=True, help="SQLite database file")
    _option(p, "--host", default="127.0.0.1")
    _option(p, "--port", default="9090")
    _option(p, "--token", help="require this bearer token")
    commands["receive"] = cmd_receive

    p = sub.add_parser(
        "capture", help="capture a database's changes into a source folder (Debezium)"
    )
    p.add_argument("database", choices=("postgres",), help="the source database kind")
    _option(p, "--dsn", required=True, help="postgresql://USER:PASSWORD@HOST:PORT/DBNAME")
    _option(p, "--table", required=True, help="SCHEMA.TABLE[,…] to capture")
    _option(p, "--out", required=True, help="source folder to write change event files into")
    _option(p, "--slot", help="replication slot name (default: tidefeed)")
    p.add_argument(
        "--debezium",
        action="append",
        metavar="KEY=VALUE",
        help="a Debezium connector setting to add or override (repeatable)",
    )
    commands["capture"] = cmd_capture

    p = sub.add_parser("demo", help="run the demo end to end")
    _option(p, "--workdir", help="where the demo writes (default: a fresh temporary folder)")
    _option(
        p,
        "--postgres",
        action="store_true",
        help="run a throwaway PostgreSQL and capture it with Debezium (needs PostgreSQL "
        "installed and the postgres extra)",
    )
    commands["demo"] = cmd_demo

    parser.set_defaults(_commands=commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        command: Callable[[argparse.Namespace], int] = args._commands[args.command]
        return command(args)
    except TidefeedError as e:
        print(f"tidefeed {args.command}: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
