"""The ``tidefeed`` command line (DESIGN §9).

Options also come from the environment (``TIDEFEED_<COMMAND>_<OPTION>``, and
``TIDEFEED_<OPTION>`` where that cannot mean two things: feed/cli/options.py); a flag given on
the command line wins. Exit codes: 0 done, 1 invalid input or a failed command (one line on
stderr; ``--debug`` adds the traceback), 2 a usage error, 130/143 stopped by SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from feed.cli import parser as cli_parser
from feed.cli.files import cmd_check, cmd_convert
from feed.cli.options import (
    DEFAULT_LOG_LEVEL,
    EXIT_FAILED,
    EXIT_INCOMPLETE,
    EXIT_OK,
    EXIT_USAGE,
    OptionParser,
    UsageError,
    configure_logging,
    exit_code_for_signal,
    with_env,
)
from protocol import TidefeedError

__all__ = ["build_parser", "main"]


def _parse_source(spec: str) -> tuple[str, str]:
    from feed.sources.kinds import SOURCE_KINDS

    kind, sep, path = spec.partition(":")
    if not sep or not path:
        raise UsageError(f"tidefeed emit: --source must be KIND:PATH, got {spec!r}")
    if kind not in SOURCE_KINDS:
        raise UsageError(
            f"tidefeed emit: unknown source kind {kind!r}; known kinds: {', '.join(SOURCE_KINDS)}"
        )
    return kind, path


def _local_path_exists(path: str, what: str) -> None:
    """Fail at once, before Spark starts, on a local path that is not there."""
    if "://" not in path and not os.path.exists(path):
        raise SystemExit(f"tidefeed emit: {what} {path!r} does not exist")


def cmd_emit(args: argparse.Namespace) -> int:
    kind, path = _parse_source(args.source)
    _token(args.token, "emit")
    if args.eager and not args.push:
        raise UsageError("tidefeed emit: --eager pushes to a receiver: give --push URL too")
    tables = [t.strip() for t in (args.table or "").split(",")] if args.table else []
    feeds = [f.strip() for f in args.feed.split(",")]
    grouped = len(feeds) > 1 or len(tables) > 1
    if grouped:
        _check_group(args, kind, tables, feeds)
    _local_path_exists(path, "source path")
    if args.schema:
        _local_path_exists(args.schema, "--schema file")
    if args.tx_metadata and not args.follow:  # a follower waits for it to appear
        _local_path_exists(args.tx_metadata, "--tx-metadata path")
    config = _emitter_config(args, kind, path)
    stopping = _stop_on_signals()
    if grouped:
        configs = [
            replace(config, feed=f, table=t, granularity="transaction")
            for f, t in zip(feeds, tables, strict=True)
        ]
        return _emit_group(configs, stopping)
    return _emit_one(args, config, stopping)


def _emitter_config(args: argparse.Namespace, kind: str, path: str) -> Any:
    from feed.emit.emitter import EmitterConfig, load_schema_file
    from feed.emit.session import parse_conf

    return EmitterConfig(
        source_kind=kind,
        source_path=path,
        feed=args.feed,
        log=args.log,
        key=tuple(c for c in (args.key or "").split(",") if c),
        schema=load_schema_file(args.schema) if args.schema else None,
        clock=args.clock,
        granularity=args.granularity,
        follow=args.follow,
        trigger=args.trigger,
        master=args.master,
        on_bad_record=args.on_bad_record,
        max_files_per_txn=args.max_files_per_txn,
        order=args.order,
        deleted=args.deleted,
        table=args.table or None,
        tx_metadata=args.tx_metadata or None,
        conf=tuple(parse_conf(args.conf).items()),
        driver_txn_bytes=args.driver_txn_bytes,
        take_over=args.take_over,
    )


def _stop_on_signals() -> list[int]:
    """SIGINT and SIGTERM finish the transaction under way, then stop (the signal is
    appended to the list returned); a second one stops at once."""
    stopping: list[int] = []

    def request_stop(signum: int, _frame: Any) -> None:
        # finish the transaction under way, then stop: nothing half-done is left behind.
        # os.write, not print: the main thread may be inside a write to stderr already
        if stopping:
            if sys.stderr.isatty():
                os.write(2, b"\x1b[?25h\n")  # the live progress line hid the cursor
            os.write(
                2,
                b"tidefeed emit: stopping now; the transaction under way is rolled "
                b"back at the next start\n",
            )
            os._exit(exit_code_for_signal(signum))
        stopping.append(signum)
        os.write(
            2, b"tidefeed emit: stopping after the transaction under way (again to stop at once)\n"
        )

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    return stopping


def _emit_one(args: argparse.Namespace, config: Any, stopping: list[int]) -> int:
    from feed.emit.emitter import Emitter
    from feed.emit.progress import TxnProgress

    push: Any = None  # the background publisher of --push, once the feed is open
    emitter = Emitter(
        config,
        on_commit=(lambda cp: _delivered_on_commit(push, emitter.eager, cp)) if args.push else None,
        progress=TxnProgress(config.feed),
    )
    emitter.open()
    delivered = True
    try:
        if args.push:
            push = _start_push(args, config, emitter)
        reports = emitter.run(stop=lambda: bool(stopping))
        if push is not None and not stopping:
            delivered = _finish_push(args, push, lambda: bool(stopping))
    finally:
        emitter.close()
        if push is not None:
            push.close()
    cp = emitter.cp
    assert cp is not None
    updates = sum(r.updates for r in reports)
    bad = sum(r.bad_rows for r in reports)
    print(
        f"feed {config.feed}: {len(reports)} transaction(s), {updates} updates, "
        f"{bad} quarantined row(s); frontier {cp.frontier}, epoch {cp.epoch}",
        file=sys.stderr,
    )
    if stopping:
        return exit_code_for_signal(stopping[0])
    if not config.follow and emitter.held_back():
        print(
            f"tidefeed emit: the input ended inside source transactions; their files are "
            "held back, not committed, and are read again at the next run (exit "
            f"{EXIT_INCOMPLETE}: see the warning above)",
            file=sys.stderr,
        )
        return EXIT_INCOMPLETE
    return EXIT_OK if delivered else EXIT_FAILED


def _start_push(args: argparse.Namespace, config: Any, emitter: Any) -> Any:
    """The publisher of ``--push`` (feed/serve/background.py), started on what is
    committed; with ``--eager``, the executors' pusher, used while the receiver is caught
    up."""
    from feed.serve.background import BackgroundPublisher

    push = BackgroundPublisher(
        config.log, config.feed, args.push, fmt=args.format, token=args.token
    )
    if args.eager:
        from feed.emit.eager import EagerPusher

        # executors encode the pushes with the feed's schema, known once the feed is open
        emitter.eager = EagerPusher(
            url=args.push,
            fmt=args.format,
            schema=emitter.info.schema,
            token=args.token,
            ready=push.idle,
        )
    assert emitter.cp is not None
    push.start(emitter.cp.frontier)  # the announcement and any backlog first
    return push


def _delivered_on_commit(push: Any, eager: Any, cp: Any) -> None:
    """After each commit: with eager delivery the receiver holds the transaction's updates
    already and its progress alone closes it; otherwise (or when that fails) the publisher
    delivers the commit from the log. Never waits for a receiver that is down."""
    if push is None:
        return  # (the commit of a new schema version, made while the feed opens)
    if eager is not None and not eager.skipped and push.idle():
        acked = eager.close(cp.progress, cp.epoch)
        if acked is not None:
            push.acked_directly(acked)
    push.notify(cp.frontier)


def _finish_push(args: argparse.Namespace, push: Any, stop: Callable[[], bool]) -> bool:
    """At the end of a run: wait up to ``--push-timeout`` for the receiver to ACK the last
    commit. Not delivered is not lost: the log has it, and the next start delivers it."""
    if push.finish(0.5, stop):
        return True
    if push.stopped is None and not stop():
        print(
            f"tidefeed emit: everything is committed (frontier {push.wanted}); waiting up to "
            f"{args.push_timeout:g}s for {args.push} to ACK it (Ctrl-C stops waiting)",
            file=sys.stderr,
        )
        if push.finish(args.push_timeout, stop):
            return True
    if stop():
        print(
            f"tidefeed emit: delivery to {args.push} stopped; it goes on from the "
            "receiver's frontier at the next start",
            file=sys.stderr,
        )
        return True
    if push.stopped is None:
        print(
            f"tidefeed emit: {args.push} did not ACK the last commit within --push-timeout "
            f"({args.push_timeout:g}s; {_acked(push.acked)}). Everything is committed: the "
            "next start of emit delivers it, or a subscription of tidefeed serve",
            file=sys.stderr,
        )
    return False


def _check_group(args: argparse.Namespace, kind: str, tables: list[str], feeds: list[str]) -> None:
    """A group's flags (``--table A,B --feed a,b``), refused plainly when they cannot
    make one (before Spark starts)."""
    where = "see docs/sources.md, 'Several tables'"
    if kind != "debezium":
        raise UsageError(
            f"tidefeed emit: a group of feeds (--feed {args.feed}) reads the tables of one "
            f"Debezium folder; --source {kind}: holds one table: give one --feed ({where})"
        )
    if len(tables) != len(feeds):
        raise UsageError(
            f"tidefeed emit: --table lists {len(tables)} table(s) and --feed {len(feeds)} "
            f"feed(s): a group needs one feed name per table, in the same order ({where})"
        )
    for what, names in (("--table", tables), ("--feed", feeds)):
        if any(not n for n in names) or len(set(names)) != len(names):
            raise UsageError(f"tidefeed emit: {what} {','.join(names)}: each name once, none empty")
    if args.granularity == "batch":
        raise UsageError(
            "tidefeed emit: a group gives each source transaction its own time, the same "
            f"in every feed: leave out --granularity batch ({where})"
        )
    if args.push or args.eager:
        raise UsageError(
            "tidefeed emit: --push delivers one feed; for a group, serve the log "
            "(tidefeed serve) and subscribe to each feed, or run one tidefeed receive "
            f"subscription per feed ({where})"
        )


def _emit_group(configs: list[Any], stopping: list[int]) -> int:
    """``emit`` of a group of feeds (feed/emit/group.py): one transaction loop for all."""
    from feed.emit.group import GroupEmitter, group_name
    from feed.emit.progress import TxnProgress

    emitter = GroupEmitter(configs, progress=TxnProgress(group_name([c.feed for c in configs])))
    emitter.open()
    try:
        reports = emitter.run(stop=lambda: bool(stopping))
    finally:
        emitter.close()
    updates = sum(r.updates for r in reports)
    bad = sum(r.bad_rows for r in reports)
    print(
        f"group {emitter.name}: {len(reports)} transaction(s), {updates} updates, "
        f"{bad} quarantined row(s); frontier {emitter.cp.frontier} in every feed "
        f"({', '.join(emitter.feeds)})",
        file=sys.stderr,
    )
    if stopping:
        return exit_code_for_signal(stopping[0])
    if not configs[0].follow and emitter.held_back():
        print(
            "tidefeed emit: the input ended inside source transactions; their files are "
            "held back, not committed, and are read again at the next run (exit "
            f"{EXIT_INCOMPLETE}: see the warning above)",
            file=sys.stderr,
        )
        return EXIT_INCOMPLETE
    return EXIT_OK


def _acked(frontier: int | None) -> str:
    return "it has ACKed nothing yet" if frontier is None else f"it is at {frontier}"


def _listening(command: str, host: str, port: int, run: Callable[[], None]) -> int:
    """Run a server; a port in use (or any other failure to listen) is one line."""
    try:
        run()
    except TidefeedError:
        raise  # (a storage error is an OSError too, but not a failure to listen)
    except OSError as e:
        in_use = e.errno == errno.EADDRINUSE
        reason = "the address is already in use" if in_use else (e.strerror or str(e))
        raise SystemExit(f"tidefeed {command}: cannot listen on {host}:{port}: {reason}") from e
    return EXIT_OK


def _token(token: str | None, command: str) -> str | None:
    """``--token`` as given; an empty one (``--token ""``, an empty ``TIDEFEED_TOKEN``) is
    refused rather than taken as "no token": that would turn authentication off."""
    if token is not None and not token.strip():
        raise SystemExit(
            f"tidefeed {command}: --token is empty; give a token, or leave the flag (and "
            "TIDEFEED_TOKEN) out to run without one"
        )
    return token


def cmd_serve(args: argparse.Namespace) -> int:
    from feed.serve.server import ServerConfig, run_server
    from protocol.destinations import Destinations

    try:
        allow = Destinations.parse(args.push_allow)
    except ValueError as e:
        raise UsageError(f"tidefeed serve: {e}") from None
    if "://" not in args.log and not os.path.isdir(args.log):
        # a mistyped --log served nothing, with no word why
        raise SystemExit(
            f"tidefeed serve: no feed log at {args.log!r} (the folder tidefeed emit --log "
            "writes); create it, or start an emitter first"
        )
    config = ServerConfig(
        log=args.log,
        host=args.host,
        port=args.port,
        token=_token(args.token, "serve"),
        push_allow=allow,
        retain=args.retain,
        compact_seconds=args.compact_every,
        max_streams=args.max_streams,
        max_streams_per_client=args.max_streams_per_client,
        stall_seconds=args.stall_timeout,
        idle_timeout=args.idle_timeout,
    )
    return _listening("serve", args.host, args.port, lambda: run_server(config))


def cmd_compact(args: argparse.Namespace) -> int:
    from feed.log.compaction import compact

    print(compact(args.log, args.feed, int(args.to)).summary(), file=sys.stderr)
    return 0


def cmd_receive(args: argparse.Namespace) -> int:
    from protocol.receiver import ReceiverConfig, run_receiver

    config = ReceiverConfig(
        db=args.db,
        host=args.host,
        port=args.port,
        token=_token(args.token, "receive"),
        idle_timeout=args.idle_timeout,
    )
    return _listening("receive", args.host, args.port, lambda: run_receiver(config))


def cmd_inspect(args: argparse.Namespace) -> int:
    from feed.log.inspection import inspect_feed

    return inspect_feed(
        log=args.log,
        feed=args.feed,
        after=args.after,
        at=args.at,
        fmt=args.format,
        out=sys.stdout,
    )


def cmd_status(args: argparse.Namespace) -> int:
    from feed.cli.status import print_status

    return print_status(args.log, args.format, sys.stdout)


def cmd_capture(args: argparse.Namespace) -> int:
    from feed.sources.capture import DEFAULT_SLOT, CaptureConfig, run_capture

    extra = {}
    for kv in args.debezium or []:
        k, sep, v = kv.partition("=")
        if not sep:
            raise UsageError(f"tidefeed capture: --debezium takes KEY=VALUE, got {kv!r}")
        extra[k] = v
    return run_capture(
        CaptureConfig(
            dsn=args.dsn,
            tables=tuple(t for t in args.table.split(",") if t),
            out=args.out,
            slot=args.slot or DEFAULT_SLOT,
            extra=extra,
            track_columns=not args.no_column_tracking,
        )
    )


def cmd_demo(args: argparse.Namespace) -> int:
    import logging

    if args.log_level == DEFAULT_LOG_LEVEL:  # the demo narrates itself; --log-level for more
        logging.getLogger("tidefeed").setLevel(logging.WARNING)
    if args.postgres:
        from feed.demo.postgres import run_postgres_demo

        return run_postgres_demo(workdir=args.workdir)
    from feed.demo.main import run_demo

    return run_demo(workdir=args.workdir)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "check": cmd_check,
    "convert": cmd_convert,
    "emit": cmd_emit,
    "inspect": cmd_inspect,
    "serve": cmd_serve,
    "compact": cmd_compact,
    "receive": cmd_receive,
    "demo": cmd_demo,
    "capture": cmd_capture,
    "status": cmd_status,
}


def build_parser() -> OptionParser:
    return cli_parser.build_parser(COMMANDS)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    if not raw:  # the commands, not an error about a missing one
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    args = parser.parse_args(with_env(raw, parser.get_default("_parsers")))
    configure_logging(args.log_level, args.log_format)
    try:
        command: Callable[[argparse.Namespace], int] = args._commands[args.command]
        return command(args)
    except UsageError as e:
        print(e.message, file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # a reader of our output went away (| head)
        return EXIT_OK
    except (TidefeedError, OSError) as e:
        if args.debug:
            traceback.print_exc()
        print(f"tidefeed {args.command}: {_one_line(e)}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return exit_code_for_signal(signal.SIGINT)
    except Exception as e:
        if _is_py4j(e):
            if args.debug:
                traceback.print_exc()
            print(
                f"tidefeed {args.command}: Spark failed: {_spark_reason(e)} (nothing of the "
                "transaction under way was committed; --debug shows the whole error)",
                file=sys.stderr,
            )
            return EXIT_FAILED
        raise


def _spark_reason(e: BaseException) -> str:
    """The root cause of a Spark/py4j error, as one line (the JVM's innermost message:
    'No space left on device', not 'An error occurred while calling o123.parquet')."""
    reason = None
    java = getattr(e, "java_exception", None)
    with contextlib.suppress(Exception):  # the JVM may be gone already
        while java is not None:
            message = java.getMessage()
            if message:
                reason = f"{java.getClass().getSimpleName()}: {message}"
            java = java.getCause()
    line = (reason or _one_line(e)).strip().splitlines()[0]
    if "S3AFileSystem" in line:
        line += (
            " (Spark reads s3:// input and logs as s3a://, which needs the hadoop-aws jars: "
            "see docs/operations.md)"
        )
    return line


def _is_py4j(e: BaseException) -> bool:
    return type(e).__module__.startswith(("py4j", "pyspark"))


def _one_line(e: BaseException) -> str:
    """An error as one line: its first line (Spark's messages carry whole JVM traces)."""
    text = str(e).strip() or type(e).__name__
    if isinstance(e, OSError) and e.strerror and e.filename:
        text = f"{e.filename}: {e.strerror}"
    return text.splitlines()[0]


if __name__ == "__main__":
    sys.exit(main())
