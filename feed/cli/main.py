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

from feed._faults import install_from_env
from feed.cli import parser as cli_parser
from feed.cli.emit import cmd_emit
from feed.cli.files import cmd_check, cmd_convert
from feed.cli.options import (
    DEFAULT_LOG_LEVEL,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    OptionParser,
    UsageError,
    checked_token,
    configure_logging,
    exit_code_for_signal,
    with_env,
)
from protocol import TidefeedError

__all__ = ["build_parser", "main"]


def _listening(command: str, host: str, port: int, run: Callable[[], None]) -> int:
    """Run a server; a port in use (or any other failure to listen) is one line, and so is
    a second SIGINT/SIGTERM that arrives while the first one's shutdown is under way."""
    from aiohttp.web_runner import GracefulExit

    try:
        run()
    except GracefulExit:
        # aiohttp raises it for each signal; the second escapes its shutdown (a SystemExit
        # of code 1, silent). What was kept is kept: a commit is atomic, and a push
        # subscription's position is checked with its receiver at the next start.
        print(
            f"tidefeed {command}: stopped by a second signal before shutting down", file=sys.stderr
        )
        return EXIT_OK
    except TidefeedError:
        raise  # (a storage error is an OSError too, but not a failure to listen)
    except OSError as e:
        in_use = e.errno == errno.EADDRINUSE
        reason = "the address is already in use" if in_use else (e.strerror or str(e))
        raise SystemExit(f"tidefeed {command}: cannot listen on {host}:{port}: {reason}") from e
    return EXIT_OK


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
        token=checked_token(args.token, "serve"),
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
        token=checked_token(args.token, "receive"),
        idle_timeout=args.idle_timeout,
        warm_up=not args.no_warm_up,
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
    install_from_env()  # the crash tests' fault points (feed/_faults.py)
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
    # (py4j's error holds the JVM's exception; PySpark's own, converted from it, such as
    # IllegalArgumentException for a bad --conf value, keeps it as _origin)
    java = getattr(e, "java_exception", None) or getattr(e, "_origin", None)
    with contextlib.suppress(Exception):  # the JVM may be gone already
        while java is not None:
            message = _first_words(java.getMessage() or "")
            if message:
                reason = f"{java.getClass().getSimpleName()}: {message}"
            java = java.getCause()
    line = (reason or _one_line(e)).strip()  # (both are one line already)
    if "S3AFileSystem" in line:
        line += (
            " (Spark's own readers read Parquet and Delta input, and an --eager push's "
            "segments, in s3:// as s3a://, which needs the hadoop-aws jars: see "
            "docs/operations.md)"
        )
    return line


def _first_words(message: str) -> str:
    """A JVM message's first line with text in it, and the line after a heading that ends
    in a colon (Spark's "Error from python worker:" puts the error on the next line)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} {lines[1]}"
    return lines[0] if lines else ""


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
