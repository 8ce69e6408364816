"""The reference receiver (``tidefeed receive``): DESIGN §3 over HTTP, durable in SQLite.

Endpoints (DESIGN §7):

* ``GET /v1/push/{feed}`` -> ``{"frontier": F, "epoch": E, "pending": n}`` (``null``
  frontier when new; ``pending`` is an addition to DESIGN §7, for operators and tests);
* ``POST /v1/push/{feed}`` with ``Tidefeed-Epoch: E`` and a body in any format -> ``200
  {"frontier": F, "pending": n}`` once every completed time is durable;
* ``GET /v1/collections/{feed}[?at=T]`` -> NDJSON ``{"data": {…}, "count": n}``;
* ``GET /healthz``.

A body is applied atomically by :class:`~protocol.state.Consumer`: a malformed body (400),
a protocol violation (409) or a refused body (401, 413, 415, 429) changes no state. Pushes
to one feed are applied one at a time, in arrival order; blocking work (decoding, SQLite)
runs in a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import generate_latest

from ._http import (
    IDLE_TIMEOUT,
    HttpError,
    encoding_middleware,
    error_middleware,
    json_response,
    outcome_of,
    read_body,
    settle,
    token_middleware,
)
from ._warm import warm_up
from .codecs import codec_for_content_type
from .errors import CodecError, ProtocolError, TidefeedError
from .messages import Updates, _json_default
from .receiver_metrics import ReceiverMetrics
from .sqlite_store import FoldGaveWay, SqliteDatabase
from .state import Consumer

__all__ = ["EPOCH_HEADER", "ReceiverConfig", "make_receiver_app", "run_receiver"]

log = logging.getLogger("tidefeed.receive")

EPOCH_HEADER = "Tidefeed-Epoch"
FEED_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiverConfig:
    db: str
    host: str = "127.0.0.1"
    port: int = 9090
    token: str | None = None
    max_body: int = 64 << 20
    #: over this many pending (uncommitted) updates a feed answers 429 until they complete
    pending_high_watermark: int = 2_000_000
    #: over this many pending updates over all feeds, bodies with updates answer 429
    max_pending_total: int = 4_000_000
    retry_after_seconds: int = 1
    #: seconds a commit waits for a lock on the database before answering 503
    busy_timeout: float = 5.0
    #: a connection that sends no whole request (its headers unfinished, or nothing after
    #: the last answer) for this many seconds is closed
    idle_timeout: float = IDLE_TIMEOUT
    #: apply a made-up large time in memory before listening (:mod:`protocol._warm`)
    warm_up: bool = True


DB = web.AppKey("db", SqliteDatabase)
CONSUMERS = web.AppKey("consumers", dict)
LOCKS = web.AppKey("locks", dict)
FOLDING = web.AppKey("folding", dict)
#: when each feed last had a push session's request (its handshake or a body)
LAST_PUSH = web.AppKey("last_push", dict)
FOLD_TURN = web.AppKey("fold_turn", asyncio.Lock)
METRICS = web.AppKey("metrics", ReceiverMetrics)
BODY_BYTES = web.RequestKey("body_bytes", int)
#: the thread background folds run in, at a lower CPU priority
FOLDER = web.AppKey("folder", concurrent.futures.ThreadPoolExecutor)
#: how much nicer than the receiver's other threads the fold thread runs (Linux)
FOLD_NICENESS = 10


def _fold_thread_niceness() -> None:
    """Lower the calling thread's CPU priority: a background fold is work that can wait,
    and on a small machine it otherwise takes CPU from pushes and from the processes
    beside the receiver (a feed server, say). Linux applies niceness per thread; where
    that fails the fold runs at normal priority."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + FOLD_NICENESS)


#: a feed's background fold waits for this long a pause in its pushes
FOLD_IDLE_SECONDS = 0.5
CONFIG = web.AppKey("config", ReceiverConfig)


def _feed(request: web.Request) -> str:
    name = request.match_info["feed"]
    if not FEED_NAME.fullmatch(name) or ".." in name:
        raise HttpError(404, "unknown_feed", f"{name!r} is not a valid feed name")
    return name


_CREATING = threading.Lock()


def _consumer(app: web.Application, feed: str) -> Consumer:
    """The one consumer of ``feed`` (built from the store on first use). Runs in worker
    threads: creation is locked, or a status GET racing the first POST could build a
    second consumer from the store's old state and leave the POST's one orphaned."""
    consumers: dict[str, Consumer] = app[CONSUMERS]
    found = consumers.get(feed)
    if found is not None:
        return found
    with _CREATING:
        if feed not in consumers:
            consumers[feed] = Consumer(app[DB].store(feed), feed=feed)
        return consumers[feed]


def _lock(app: web.Application, feed: str) -> asyncio.Lock:
    locks: dict[str, asyncio.Lock] = app[LOCKS]
    return locks.setdefault(feed, asyncio.Lock())


async def get_push(request: web.Request) -> web.Response:
    feed = _feed(request)
    request.app[LAST_PUSH][feed] = time.monotonic()  # a session's handshake: folds wait
    c = await asyncio.to_thread(_consumer, request.app, feed)
    return json_response({"frontier": c.frontier, "epoch": c.epoch, "pending": c.pending})


async def post_push(request: web.Request) -> web.Response:
    feed = _feed(request)
    label, outcome = feed, "accepted"
    try:
        return await _post_push(request, feed)
    except Exception as e:
        # counted under the feed only if the receiver holds it: invented names add no series
        c = request.app[CONSUMERS].get(feed)
        if c is None or (c.frontier is None and c.pending == 0):
            label = ""
        outcome = outcome_of(e)
        raise
    finally:
        metrics = request.app[METRICS]
        metrics.bodies.labels(label, outcome).inc()
        metrics.bytes.labels(label).inc(request.get(BODY_BYTES, 0))


async def _post_push(request: web.Request, feed: str) -> web.Response:
    metrics = request.app[METRICS]
    ctype = request.headers.get("Content-Type", "")
    codec = codec_for_content_type(ctype)
    if codec is None:
        raise HttpError(
            415,
            "unsupported_content_type",
            f"unknown content type {ctype!r}; send application/x-ndjson, "
            "application/vnd.tidefeed.cdcv2+avro or "
            "application/vnd.apache.arrow.stream",
        )
    raw_epoch = request.headers.get(EPOCH_HEADER)
    try:
        epoch = int(raw_epoch) if raw_epoch is not None else None
    except ValueError:
        epoch = None
    if epoch is None or not 0 <= epoch < 1 << 63:  # stored as a 64-bit SQLite integer
        raise HttpError(
            400,
            "missing_epoch",
            f"header {EPOCH_HEADER} must be an integer in [0, 2**63), got {raw_epoch!r}",
        )
    request.app[LAST_PUSH][feed] = time.monotonic()  # background folds wait for a pause
    body = await read_body(request)
    request[BODY_BYTES] = len(body)
    async with _lock(request.app, feed):
        consumer = await asyncio.to_thread(_consumer, request.app, feed)
        before = consumer.frontier
        try:
            messages = await asyncio.to_thread(codec.decode, body)
            _check_pending(request.app, feed, consumer, messages)
            result = await asyncio.to_thread(lambda: consumer.apply(messages, epoch=epoch))
        except (ProtocolError, CodecError) as e:
            log.warning(
                "feed %s: rejected a %d-byte body (epoch %d): %s", feed, len(body), epoch, e
            )
            raise
        finally:
            request.app[LAST_PUSH][feed] = time.monotonic()
    if result.committed:
        _fold_soon(request.app, feed)
    if result.committed:
        metrics.updates.labels(feed).inc(sum(t.num_rows for t in result.committed))
    if result.frontier != before:
        metrics.commits.labels(feed).inc()
        log.info(
            "feed %s: committed [%s, %s), %d update(s) (epoch %d)",
            feed,
            before or 0,
            result.frontier,
            sum(t.num_rows for t in result.committed),
            epoch,
        )
    if result.uncounted:
        log.warning(
            "feed %s: %d update(s) below the first progress dropped: no progress counted them",
            feed,
            result.uncounted,
        )
    if result.rollbacks:  # every session's announcement is one
        log.debug("feed %s: announcement: pending updates rolled back (epoch %d)", feed, epoch)
    return json_response({"frontier": result.frontier, "pending": result.pending})


def _fold_soon(app: web.Application, feed: str) -> None:
    """Fold ``feed``'s new parts into its kept collection in the background, once pushes
    to the receiver (to any feed) pause for :data:`FOLD_IDLE_SECONDS`, a round at a time
    (a round holds the database, which a commit then waits for), one round at a time
    over all feeds: a stream of pushes is not slowed down, and a collection read then
    has little or nothing to merge."""
    folding: dict[str, asyncio.Task[None]] = app[FOLDING]
    if feed in folding:
        return
    store = app[DB].store(feed)

    def idle() -> float:
        last: float = max(app[LAST_PUSH].values())
        return time.monotonic() - last

    loop = asyncio.get_running_loop()
    # a round gives way to a push that arrives meanwhile
    round_ = functools.partial(
        store.fold, max_rounds=1, give_way=lambda: idle() < FOLD_IDLE_SECONDS
    )

    async def fold() -> None:
        try:
            while True:
                if idle() < FOLD_IDLE_SECONDS:
                    await asyncio.sleep(FOLD_IDLE_SECONDS - idle())
                    continue
                async with app[FOLD_TURN]:  # one round at a time over all feeds
                    if idle() < FOLD_IDLE_SECONDS:
                        continue
                    try:
                        if not await loop.run_in_executor(app[FOLDER], round_):
                            return
                    except FoldGaveWay:
                        continue  # a push came: done again at the next pause
        except TidefeedError as e:  # a locked or closed database: the next read folds
            log.debug("feed %s: background fold stopped: %s", feed, e)
        finally:
            folding.pop(feed, None)

    folding[feed] = asyncio.create_task(fold(), name=f"fold {feed}")


def _check_pending(app: web.Application, feed: str, consumer: Consumer, messages: Any) -> None:
    """429 for a body that would add updates to a feed holding its bound of pending ones,
    or to a receiver holding its bound over all feeds. A body without updates (the
    progress that completes what is pending, an announcement) always gets through."""
    if not any(isinstance(m, Updates) and len(m) for m in messages):
        return
    cfg = app[CONFIG]
    total = sum(c.pending for c in app[CONSUMERS].values())
    if consumer.pending >= cfg.pending_high_watermark:
        why = f"feed {feed!r} holds {consumer.pending} pending updates (limit "
        why += f"{cfg.pending_high_watermark})"
    elif total >= cfg.max_pending_total:
        why = f"this receiver holds {total} pending updates over all feeds (limit "
        why += f"{cfg.max_pending_total})"
    else:
        return
    raise HttpError(
        429,
        "too_many_pending",
        f"{why}; send the progress that completes them",
        headers={"Retry-After": str(cfg.retry_after_seconds)},
    )


async def get_collection(request: web.Request) -> web.StreamResponse:
    feed = _feed(request)
    if feed not in request.app[CONSUMERS] and feed not in await asyncio.to_thread(
        request.app[DB].feeds
    ):
        raise HttpError(404, "unknown_feed", f"no producer has pushed feed {feed!r} here")
    consumer = await asyncio.to_thread(_consumer, request.app, feed)
    at_raw = request.query.get("at")
    at = None
    if at_raw is not None:
        try:
            at = int(at_raw)
        except ValueError:
            raise HttpError(
                400, "bad_request", f"'at' must be an integer, got {at_raw[:40]!r}"
            ) from None
        if not 0 <= at < 1 << 63:  # times are 64-bit (DESIGN §1), as SQLite stores them
            raise HttpError(400, "bad_request", "'at' must be a time in [0, 2**63)")
        if consumer.frontier is None or at >= consumer.frontier:
            raise HttpError(
                400,
                "not_complete",
                f"time {at} is not complete at feed {feed!r} (frontier {consumer.frontier})",
            )
    store = request.app[DB].store(feed)
    if at is not None:
        # an earlier time: accumulated from the parts kept at or below it
        rows = await asyncio.to_thread(lambda: list(store.collection(at)))
        body = b"".join(
            orjson.dumps(
                {"data": d, "count": n}, option=orjson.OPT_NON_STR_KEYS, default=_json_default
            )
            + b"\n"
            for d, n in rows
        )
        return web.Response(body=body, content_type="application/x-ndjson")
    # the frontier: the kept collection streamed from SQLite, merged with what is not
    # folded into it yet
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    kept = store.current()
    try:
        while True:
            chunk = await asyncio.to_thread(_next_lines, kept)
            if not chunk:
                break
            await resp.write(chunk)
    finally:
        # (a client gone mid-stream: folds wait for the reader to be closed)
        await asyncio.to_thread(kept.close)
    await resp.write_eof()
    return resp


def _next_lines(rows: Iterator[tuple[bytes, int]], n: int = 10_000) -> bytes:
    """The next ``n`` rows of a collection as NDJSON lines (``b""`` when there are none)."""
    out = []
    for rkey, count in itertools.islice(rows, n):
        out.append(b'{"data":%s,"count":%d}\n' % (rkey, count))
    return b"".join(out)


async def healthz(_request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def get_metrics(request: web.Request) -> web.Response:
    app = request.app

    def every_feed() -> None:  # feeds in the database not pushed to since the start
        for feed in app[DB].feeds():
            _consumer(app, feed)

    await asyncio.to_thread(every_feed)
    body = await asyncio.to_thread(generate_latest, app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


def make_receiver_app(config: ReceiverConfig) -> web.Application:
    app = web.Application(
        client_max_size=config.max_body,
        middlewares=[error_middleware, token_middleware(config.token), encoding_middleware],
    )
    app[CONFIG] = config
    app[CONSUMERS] = {}
    app[LOCKS] = {}
    app[FOLDING] = {}
    app[LAST_PUSH] = {}
    app[FOLD_TURN] = asyncio.Lock()
    consumers: dict[str, Consumer] = app[CONSUMERS]
    app[METRICS] = ReceiverMetrics(lambda: dict(consumers))
    app[FOLDER] = concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="fold", initializer=_fold_thread_niceness
    )

    async def database(app: web.Application):  # type: ignore[no-untyped-def]
        app[DB] = await asyncio.to_thread(
            lambda: SqliteDatabase(config.db, busy_timeout=config.busy_timeout)
        )
        yield
        for task in list(app[FOLDING].values()):  # a fold ends with its current part
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # a round under way finishes (its thread cannot be cancelled) before the close
        await asyncio.to_thread(app[FOLDER].shutdown, wait=True)
        await asyncio.to_thread(app[DB].close)

    app.cleanup_ctx.append(database)
    app.router.add_get("/v1/push/{feed}", get_push)
    app.router.add_post("/v1/push/{feed}", post_push)
    app.router.add_get("/v1/collections/{feed}", get_collection)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", get_metrics)
    return app


async def _warm_up(_app: web.Application) -> None:
    await warm_up()


def run_receiver(config: ReceiverConfig) -> None:
    app = make_receiver_app(config)
    app.on_startup.append(settle)
    if config.warm_up:
        app.on_startup.append(_warm_up)
    web.run_app(
        app,
        host=config.host,
        port=config.port,
        keepalive_timeout=config.idle_timeout,
        print=lambda s: print(s, flush=True),
    )
