"""``tidefeed emit``: the command line's side of the emitter (feed/emit/): the source and
its options checked before Spark starts, signals, a group of feeds, and ``--push``
delivery from a background publisher (feed/serve/background.py)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from feed.cli.options import (
    EXIT_FAILED,
    EXIT_INCOMPLETE,
    EXIT_OK,
    UsageError,
    checked_token,
    exit_code_for_signal,
)
from feed.sources.registry import KINDS, SourceKind, source_kind
from protocol import SourceError

__all__ = ["cmd_emit"]


def _parse_source(spec: str, args: argparse.Namespace) -> tuple[SourceKind, str]:
    """``--source KIND:PATH``, and the options only another kind takes refused (they
    would be ignored)."""
    name, sep, path = spec.partition(":")
    if not sep or not path:
        raise UsageError(f"tidefeed emit: --source must be KIND:PATH, got {spec!r}")
    try:
        kind = source_kind(name)
    except SourceError as e:
        raise UsageError(f"tidefeed emit: {e}") from None
    for other in KINDS.values():
        for option in other.options:
            if getattr(args, option) and option not in kind.options:
                flag = "--" + option.replace("_", "-")
                variable = args._parsers["emit"].env_variable(flag)
                raise UsageError(
                    f"tidefeed emit: {flag}{f' (from ${variable})' if variable else ''} is an "
                    f"option of {other.name} sources; --source {name}: does not take it"
                )
    for option, what in kind.required:  # (said now, not once Spark has started)
        if not getattr(args, option):
            flag = "--" + option.replace("_", "-")
            raise UsageError(f"tidefeed emit: --source {name}: needs {flag} ({what})")
    return kind, path


def _local_path_exists(path: str, what: str) -> None:
    """Fail at once, before Spark starts, on a local path that is not there."""
    if "://" not in path and not os.path.exists(path):
        raise SystemExit(f"tidefeed emit: {what} {path!r} does not exist")


#: how long each master of a ``spark://`` URL is given to accept a connection
MASTER_CONNECT_SECONDS = 5.0


def _master_answers(master: str | None) -> None:
    """Fail at once, before Spark starts, when no master of a ``spark://HOST:PORT[,…]``
    URL accepts a connection: Spark's own client retries an unreachable standalone master
    for about a minute before it gives up. Other masters are left to Spark."""
    from feed.emit.session import master_addresses

    if not master or not (addresses := master_addresses(master)):
        return
    tried = []
    entries = master.removeprefix("spark://").split(",")
    for where, address in zip(entries, addresses, strict=True):
        if address is None or address[1] is None:
            tried.append(f"{where}: not HOST:PORT")
            continue
        try:
            with socket.create_connection(address, MASTER_CONNECT_SECONDS):
                return
        except OSError as e:
            tried.append(f"{where}: {e.strerror or e}")
    raise SystemExit(
        f"tidefeed emit: no Spark master answers at {master} ({'; '.join(tried)}); "
        "check --master, or start the master first; nothing was started"
    )


def cmd_emit(args: argparse.Namespace) -> int:
    kind, path = _parse_source(args.source, args)
    checked_token(args.token, "emit")
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
    _master_answers(config.master or dict(config.conf).get("spark.master"))
    stopping = _stop_on_signals()
    if grouped:
        configs = [
            replace(config, feed=f, table=t, granularity="transaction")
            for f, t in zip(feeds, tables, strict=True)
        ]
        return _emit_group(configs, stopping)
    return _emit_one(args, config, stopping)


def _emitter_config(args: argparse.Namespace, kind: SourceKind, path: str) -> Any:
    from feed.emit.emitter import EmitterConfig, load_schema_file
    from feed.emit.session import parse_conf

    return EmitterConfig(
        source_kind=kind.name,
        source_path=path,
        feed=args.feed,
        log=args.log,
        key=tuple(c for c in (args.key or "").split(",") if c),
        schema=load_schema_file(args.schema) if args.schema else None,
        clock=args.clock,
        granularity=args.granularity,
        layout=args.layout,
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
        parse=args.parse,
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


def _check_group(
    args: argparse.Namespace, kind: SourceKind, tables: list[str], feeds: list[str]
) -> None:
    """A group's flags (``--table A,B --feed a,b``), refused plainly when they cannot
    make one (before Spark starts)."""
    where = "see docs/sources.md, 'Several tables'"
    if not kind.events:
        raise UsageError(
            f"tidefeed emit: a group of feeds (--feed {args.feed}) reads the tables of one "
            f"Debezium folder; --source {kind.name}: holds one table: give one --feed ({where})"
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
    from feed.emit.group import GroupEmitter
    from feed.emit.group_commits import group_name
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
