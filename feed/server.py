"""The feed server (``tidefeed serve``): pull and push delivery of committed feeds (DESIGN §7).

* ``GET /v1/feeds`` and ``GET /v1/feeds/{feed}``: name, schema, frontier, since, counts.
* ``GET /v1/feeds/{feed}/changes?after=T&follow=…&snapshot=…&format=…``: a streamed
  response — the announcement, then every committed time ``>= T`` (or one consolidated
  snapshot, then the live tail), with heartbeats while idle. ``T`` below ``since`` is 410.
* ``PUT|GET|DELETE /v1/feeds/{feed}/subscriptions/{name}``: durable subscriptions; with a
  ``url`` the server pushes (one publisher task each), without one it is a named pull
  subscriber that ACKs with ``POST …/{name}/ack {"frontier": F}``.
* ``GET /healthz``, ``GET /metrics`` (Prometheus text).

Reads of the log and writes of subscription files run in worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
from dataclasses import dataclass
from typing import Any

import orjson
import pyarrow.fs as pafs
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from protocol import (
    CODECS,
    CheckpointError,
    Compacted,
    Progress,
    Updates,
    announcement,
    get_codec,
)
from protocol._http import HttpError, error_middleware, json_response, token_middleware
from protocol.push import Ack, PushClient

from .compaction import compact, retention_target
from .log import log_root, valid_feed_name
from .publisher import BACKOFF_MAX, BACKOFF_START, DeliveryStopped, Publisher
from .reader import FeedReader
from .subscriptions import Subscription, SubscriptionStore, valid_subscription

__all__ = ["ServerConfig", "make_server_app", "run_server"]

log = logging.getLogger("tidefeed.serve")

POLL_SECONDS = 0.5
HEARTBEAT_SECONDS = 5.0
#: updates per encoded chunk of a pull stream (bounded bytes per write and per loop turn)
STREAM_CHUNK_UPDATES = 20_000


COMPACT_SECONDS = 60.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    log: str
    host: str = "127.0.0.1"
    port: int = 8080
    token: str | None = None
    poll_seconds: float = POLL_SECONDS
    heartbeat_seconds: float = HEARTBEAT_SECONDS
    #: automatic retention (DESIGN §8): keep this many time units below each frontier
    #: (milliseconds with the wallclock clock) and compact what is older; None: keep all
    retain: int | None = None
    compact_seconds: float = COMPACT_SECONDS


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # subscription: a push subscription's name; "" for a pull stream
        self.updates = Counter(
            "tidefeed_updates_served",
            "Updates sent to consumers (push: ACKed by the receiver)",
            ["feed", "subscription", "via"],
            registry=r,
        )
        self.bytes = Counter(
            "tidefeed_bytes_sent",
            "Body bytes sent to consumers (push: ACKed by the receiver)",
            ["feed", "subscription", "via"],
            registry=r,
        )
        self.push_errors = Counter(
            "tidefeed_push_errors", "Failed pushes", ["feed", "subscription"], registry=r
        )
        self.lag_times = Gauge(
            "tidefeed_subscriber_lag_times",
            "Feed frontier minus the subscriber's ACKed frontier",
            ["feed", "subscription"],
            registry=r,
        )
        self.lag_seconds = Gauge(
            "tidefeed_subscriber_lag_seconds",
            "Seconds the subscriber has been behind the feed's frontier (0: caught up)",
            ["feed", "subscription"],
            registry=r,
        )
        self.quarantined = Gauge(
            "tidefeed_quarantined_rows",
            "Input rows the emitter set aside as bad, in committed transactions",
            ["feed"],
            registry=r,
        )


CONFIG = web.AppKey("config", ServerConfig)


class ServerState:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.readers: dict[str, FeedReader] = {}
        self.subs: dict[str, SubscriptionStore] = {}
        self.tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._quarantine: dict[str, dict[int, int]] = {}  # feed -> quarantine folder -> rows

    def feed_names(self) -> list[str]:
        fs, root = log_root(self.config.log)
        infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
        return sorted(
            i.base_name
            for i in infos
            if i.type == pafs.FileType.Directory
            and valid_feed_name(i.base_name)
            and fs.get_file_info(f"{i.path}/feed.json").type == pafs.FileType.File
        )

    def reader(self, feed: str) -> FeedReader:
        if not valid_feed_name(feed):
            raise HttpError(404, "unknown_feed", f"{feed!r} is not a valid feed name")
        r = self.readers.get(feed)
        if r is None:
            try:
                r = FeedReader(self.config.log, feed)
            except CheckpointError:
                raise HttpError(404, "unknown_feed", f"no feed {feed!r} in this log") from None
            self.readers[feed] = r
        else:
            r.refresh()
        return r

    def count_quarantined(self) -> None:
        """Set the quarantined-rows gauge of every feed: the rows in the quarantine folders
        of committed transactions (a folder is read once; an uncommitted one is not
        counted: the emitter's next start deletes it)."""
        for feed in self.feed_names():
            reader = self.reader(feed)
            fl, seen = reader.log, self._quarantine.setdefault(feed, {})
            committed = reader.checkpoint.seq if reader.checkpoint else 0
            for n in fl.numbered_dirs("quarantine"):
                if n > committed or n in seen:
                    continue
                rows = 0
                for info in fl.list_dir(fl.path("quarantine", str(n))):
                    if info.base_name.endswith(".json"):
                        with fl.fs.open_input_stream(info.path) as f:
                            rows += f.read().count(b"\n")
                seen[n] = rows
            self.metrics.quarantined.labels(feed).set(sum(seen.values()))

    def sub_store(self, feed: str) -> SubscriptionStore:
        if feed not in self.subs:
            self.subs[feed] = SubscriptionStore(self.reader(feed).log)
        return self.subs[feed]


STATE = web.AppKey("state", ServerState)


def _state(request: web.Request) -> ServerState:
    return request.app[STATE]


def _describe(r: FeedReader, *, counts: bool) -> dict[str, Any]:
    d: dict[str, Any] = {
        "name": r.name,
        "schema": r.info.schema,
        "key": list(r.info.key),
        "clock": r.info.clock,
        "frontier": r.frontier,
        "since": r.since,
        "epoch": r.checkpoint.epoch if r.checkpoint else 0,
    }
    if counts:
        d["counts"] = [{"time": t, "count": n} for t, n in sorted(r.counts().items())]
    return d


async def list_feeds(request: web.Request) -> web.Response:
    st = _state(request)

    def describe_all() -> list[dict[str, Any]]:
        return [_describe(st.reader(f), counts=False) for f in st.feed_names()]

    return json_response({"feeds": await asyncio.to_thread(describe_all)})


async def feed_info(request: web.Request) -> web.Response:
    st = _state(request)
    feed = request.match_info["feed"]
    return json_response(await asyncio.to_thread(lambda: _describe(st.reader(feed), counts=True)))


def _int_param(request: web.Request, name: str) -> int | None:
    raw = request.query.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise HttpError(400, "bad_request", f"'{name}' must be an integer, got {raw!r}") from None
    if not 0 <= value < 1 << 63:  # times are 64-bit (DESIGN §1)
        raise HttpError(400, "bad_request", f"'{name}' must be a time in [0, 2**63)")
    return value


def _bool_param(request: web.Request, name: str) -> bool:
    raw = request.query.get(name, "false").lower()
    if raw not in ("true", "false", "1", "0"):
        raise HttpError(400, "bad_request", f"'{name}' must be true or false, got {raw!r}")
    return raw in ("true", "1")


def _format(request: web.Request) -> str:
    fmt = request.query.get("format")
    if fmt is None:
        accept = request.headers.get("Accept", "")
        fmt = next((c.name for c in CODECS.values() if c.content_type in accept), "ndjson")
    if fmt not in CODECS:
        raise HttpError(
            415, "unsupported_format", f"unknown format {fmt!r}; use one of {', '.join(CODECS)}"
        )
    return fmt


async def changes(request: web.Request) -> web.StreamResponse:
    st = _state(request)
    feed = request.match_info["feed"]
    after = _int_param(request, "after")
    follow = _bool_param(request, "follow")
    snapshot = _bool_param(request, "snapshot")
    fmt = _format(request)
    await asyncio.to_thread(st.reader, feed)  # 404 for an unknown feed
    # this stream's own reader: a reader shared with other requests could be refreshed
    # between listing times and closing them, and announce times this stream never sent
    reader = await asyncio.to_thread(FeedReader, st.config.log, feed)
    opening: list[Any] = []
    lower = 0
    if not (snapshot and reader.frontier > 0):
        try:
            opening, lower = await asyncio.to_thread(reader.opening, after)
        except Compacted as e:
            raise HttpError(410, "compacted", str(e), extra={"since": e.since}) from None
    codec = get_codec(fmt)
    resp = web.StreamResponse(headers={"Content-Type": codec.content_type})
    await resp.prepare(request)
    sink = io.BytesIO()
    encoder = codec.encoder(sink, schema=reader.info.schema)
    m = st.metrics

    def encode(messages: list[Any]) -> bytes:
        for msg in messages:
            encoder.write(msg)
        encoder.flush()
        data = sink.getvalue()
        sink.seek(0)
        sink.truncate()
        return data

    async def send(messages: list[Any]) -> None:
        """Encode in a worker thread, a bounded chunk at a time: a large time never holds
        the event loop (other streams, pushes, /healthz) and never becomes one huge
        write; each chunk is an update message of its own (consumers take any number
        before the progress)."""
        for chunk in _chunks(messages):
            data = await asyncio.to_thread(encode, chunk)
            n = sum(len(x) for x in chunk if isinstance(x, Updates))
            if n:
                m.updates.labels(feed, "", "pull").inc(n)
            if data:
                m.bytes.labels(feed, "", "pull").inc(len(data))
                await resp.write(data)

    async def begin() -> None:
        nonlocal lower
        if snapshot and reader.frontier > 0:
            lower = reader.frontier
            await send(await asyncio.to_thread(reader.snapshot_opening, lower))
        else:
            await send(opening)

    def overtaken(at: int, since: int) -> Compacted:
        return Compacted(
            f"feed {feed!r} was compacted to {since} while this stream was at {at}: "
            f"resume from a snapshot (snapshot=true), or pull from after={since} if you "
            f"hold everything below {since}",
            since=since,
        )

    async def catch_up() -> None:
        nonlocal lower
        frontier = reader.frontier  # one checkpoint for the times listed and the closing
        if reader.since > lower:
            raise overtaken(lower, reader.since)
        for t in await asyncio.to_thread(reader.times, lower, frontier):
            try:
                batch = await asyncio.to_thread(reader.updates, t)
            except CheckpointError:
                # its files are gone: folded by a compaction since this stream listed it?
                since = (await asyncio.to_thread(FeedReader, st.config.log, feed)).since
                if since <= t:
                    raise
                raise overtaken(t, since) from None
            n = len(batch)
            await send(([batch] if n else []) + [Progress(lower, t + 1, ((t, n),) if n else ())])
            lower = t + 1
        if lower < frontier:
            await send([Progress(lower, frontier, ())])
            lower = frontier

    try:  # a consumer may go away at any write, the opening's too
        try:
            await begin()
            await catch_up()
            await _follow(st, reader, follow, lambda: lower, catch_up, send)
        except Compacted as e:
            # never an empty or partial time: the stream ends after its last whole message,
            # NDJSON with a last line saying why (Avro and Arrow have no place for it)
            log.info(
                "feed %s: a stream at %d was overtaken by compaction to %d", feed, lower, e.since
            )
            if fmt == "ndjson":
                line = {"error": "compacted", "detail": str(e), "since": e.since}
                await resp.write(orjson.dumps(line) + b"\n")
        encoder.close()
        tail = sink.getvalue()
        if tail:
            await resp.write(tail)
        await resp.write_eof()
    except ConnectionResetError:
        log.info("feed %s: a consumer went away", feed)
    return resp


def _chunks(messages: list[Any]) -> list[list[Any]]:
    """``messages`` in groups to encode together: small messages share a group, update
    batches are cut into slices of at most :data:`STREAM_CHUNK_UPDATES`."""
    out: list[list[Any]] = [[]]
    for msg in messages:
        if isinstance(msg, Updates) and len(msg) > STREAM_CHUNK_UPDATES:
            for i in range(0, len(msg), STREAM_CHUNK_UPDATES):
                out.append([msg.slice(i, STREAM_CHUNK_UPDATES)])
            out.append([])
        else:
            out[-1].append(msg)
    return [c for c in out if c]


async def _follow(
    st: ServerState, reader: FeedReader, follow: bool, position: Any, catch_up: Any, send: Any
) -> None:
    """Keep streaming new commits; a heartbeat announcement when nothing came for a while."""
    idle_since = time.monotonic()
    while follow:
        await asyncio.sleep(st.config.poll_seconds)
        before = position()
        await asyncio.to_thread(reader.refresh)
        await catch_up()
        if position() != before:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since >= st.config.heartbeat_seconds:
            # heartbeat: an announcement is legal anywhere and nothing is pending here
            await send([announcement(position())])
            idle_since = time.monotonic()


# ---- subscriptions -----------------------------------------------------------------------
def _start_push(app: web.Application, sub: Subscription) -> None:
    st = app[STATE]
    key = (sub.feed, sub.name)
    old = st.tasks.pop(key, None)
    if old is not None:
        old.cancel()
    if sub.url and sub.status == "active":
        st.tasks[key] = asyncio.create_task(_push_loop(app, sub), name=f"push {key}")


async def _push_loop(app: web.Application, sub: Subscription) -> None:
    """Deliver a feed to a push subscription, forever. Supervised: a failure of any kind is
    logged, counted (``tidefeed_push_errors``), shown in the subscription's ``last_error``
    and ``retrying_since``, and retried with back-off; only a refusal retrying cannot fix
    (a 4xx other than 409/413/429) stops the subscription, with its reason."""
    st = app[STATE]
    store = st.sub_store(sub.feed)
    m = st.metrics
    assert sub.url is not None
    backoff = BACKOFF_START
    while True:
        try:
            await _push_sessions(app, store, sub)
            return  # stopped for good (the reason is in the subscription)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the supervisor's job is to survive anything
            m.push_errors.labels(sub.feed, sub.name).inc()
            _failed(sub, e)
            log.exception(
                "push %s/%s to %s failed; retrying in %.1fs", sub.feed, sub.name, sub.url, backoff
            )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)


def _failed(sub: Subscription, e: Exception) -> None:
    sub.last_error = f"{type(e).__name__}: {e}"[:1000]
    if sub.retrying_since is None:
        sub.retrying_since = time.time()


async def _push_sessions(app: web.Application, store: SubscriptionStore, sub: Subscription) -> None:
    st = app[STATE]
    m = st.metrics
    assert sub.url is not None
    reader = await asyncio.to_thread(FeedReader, st.config.log, sub.feed)
    behind_since: list[float] = []  # when this server first saw the subscriber behind
    # read at each scrape, so it grows while a delivery is retrying
    m.lag_seconds.labels(sub.feed, sub.name).set_function(
        lambda: time.time() - behind_since[0] if behind_since else 0.0
    )

    def lag() -> None:
        if sub.acked is not None and sub.acked >= reader.frontier:
            behind_since.clear()
        elif not behind_since:
            behind_since.append(time.time())
        m.lag_times.labels(sub.feed, sub.name).set(max(0, reader.frontier - (sub.acked or 0)))

    def on_ack(ack: Ack) -> None:
        sub.retrying_since = None
        store.ack(sub.name, ack.frontier)
        lag()

    def on_sent(updates: int, nbytes: int) -> None:
        m.updates.labels(sub.feed, sub.name, "push").inc(updates)
        m.bytes.labels(sub.feed, sub.name, "push").inc(nbytes)

    def on_error(e: Exception) -> None:
        m.push_errors.labels(sub.feed, sub.name).inc()
        _failed(sub, e)
        lag()

    async with PushClient(
        sub.url, fmt=sub.format, schema=reader.info.schema, token=sub.token
    ) as client:
        while True:
            await asyncio.to_thread(reader.refresh)
            lag()
            if sub.acked is None or sub.acked < reader.frontier:
                epoch = reader.checkpoint.epoch if reader.checkpoint else 0
                pub = Publisher(
                    reader, client, epoch=epoch, on_ack=on_ack, on_error=on_error, on_sent=on_sent
                )
                try:
                    await pub.deliver()
                except DeliveryStopped as e:
                    m.push_errors.labels(sub.feed, sub.name).inc()
                    sub.last_error = str(e)
                    await asyncio.to_thread(store.stop, sub.name, str(e))
                    log.error("push %s/%s stopped: %s", sub.feed, sub.name, e)
                    return
                await asyncio.to_thread(store.flush)
            lag()
            await asyncio.sleep(st.config.poll_seconds)


async def put_subscription(request: web.Request) -> web.Response:
    st = _state(request)
    feed, name = request.match_info["feed"], request.match_info["name"]
    if not valid_subscription(name):
        raise HttpError(400, "bad_request", f"{name!r} is not a valid subscription name")
    try:
        body = orjson.loads(await request.read())
        sub = Subscription.from_request(feed, name, body)
    except (orjson.JSONDecodeError, ValueError) as e:
        raise HttpError(400, "malformed_body", f"bad subscription: {e}") from None
    store = await asyncio.to_thread(st.sub_store, feed)
    existed = name in store.subs
    await asyncio.to_thread(store.put, sub)
    _start_push(request.app, sub)
    return json_response(sub.public(), status=200 if existed else 201)


async def _subscription(request: web.Request) -> tuple[SubscriptionStore, Subscription]:
    """The store and the subscription a request names; 404 when there is none."""
    st = _state(request)
    feed, name = request.match_info["feed"], request.match_info["name"]
    store = await asyncio.to_thread(st.sub_store, feed)
    sub = store.subs.get(name)
    if sub is None:
        raise HttpError(404, "unknown_subscription", f"no subscription {name!r} on {feed!r}")
    return store, sub


async def get_subscription(request: web.Request) -> web.Response:
    _, sub = await _subscription(request)
    reader = await asyncio.to_thread(_state(request).reader, sub.feed)
    return json_response(sub.public() | {"frontier": reader.frontier})


async def delete_subscription(request: web.Request) -> web.Response:
    st = _state(request)
    feed, name = request.match_info["feed"], request.match_info["name"]
    store = await asyncio.to_thread(st.sub_store, feed)
    task = st.tasks.pop((feed, name), None)
    if task is not None:
        task.cancel()
    if not await asyncio.to_thread(store.delete, name):
        raise HttpError(404, "unknown_subscription", f"no subscription {name!r} on {feed!r}")
    return json_response({"deleted": name})


async def ack_subscription(request: web.Request) -> web.Response:
    st = _state(request)
    store, sub = await _subscription(request)
    feed, name = sub.feed, sub.name
    try:
        frontier = orjson.loads(await request.read()).get("frontier")
        if not isinstance(frontier, int) or isinstance(frontier, bool) or frontier < 0:
            raise ValueError
    except (orjson.JSONDecodeError, AttributeError, ValueError):
        raise HttpError(
            400, "malformed_body", 'the body must be {"frontier": <int >= 0>}'
        ) from None
    reader = await asyncio.to_thread(st.reader, feed)
    if frontier > reader.frontier:
        raise HttpError(
            409, "ack_ahead", f"ACK {frontier} is above the feed's frontier {reader.frontier}"
        )
    await asyncio.to_thread(store.ack, name, frontier)
    return json_response(sub.public())


async def healthz(_request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    st = _state(request)
    await asyncio.to_thread(st.count_quarantined)
    body = generate_latest(st.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


# ---- retention -----------------------------------------------------------------------------
def _apply_retention(st: ServerState) -> list[str]:
    """One pass of the automatic policy over every feed; returns what it did."""
    assert st.config.retain is not None
    done = []
    for feed in st.feed_names():
        reader = st.reader(feed)
        store = st.sub_store(feed)
        store.flush(force=True)  # compaction checks the ACKs on disk
        target = retention_target(
            reader.frontier, reader.since, st.config.retain, store.lowest_ack()
        )
        if target is None:
            continue
        try:
            done.append(compact(st.config.log, feed, target).summary())
        except CheckpointError as e:
            log.warning("retention: feed %s: %s", feed, e)
    return done


async def _retention_loop(st: ServerState) -> None:
    while True:
        try:
            for line in await asyncio.to_thread(_apply_retention, st):
                log.info("retention: %s", line)
        except (OSError, CheckpointError) as e:
            log.error("retention pass failed: %s", e)
        await asyncio.sleep(st.config.compact_seconds)


def make_server_app(config: ServerConfig) -> web.Application:
    app = web.Application(middlewares=[error_middleware, token_middleware(config.token)])
    app[CONFIG] = config
    app[STATE] = ServerState(config)

    async def subscriptions(app: web.Application):  # type: ignore[no-untyped-def]
        st = app[STATE]
        for feed in await asyncio.to_thread(st.feed_names):
            store = await asyncio.to_thread(st.sub_store, feed)
            for sub in store.subs.values():
                _start_push(app, sub)  # resume from the receiver's ACKed frontier
        yield
        for task in st.tasks.values():
            task.cancel()
        for task in st.tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for store in st.subs.values():
            await asyncio.to_thread(store.flush, force=True)

    app.cleanup_ctx.append(subscriptions)
    if config.retain is not None:

        async def retention(app: web.Application):  # type: ignore[no-untyped-def]
            task = asyncio.create_task(_retention_loop(app[STATE]), name="retention")
            yield
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        app.cleanup_ctx.append(retention)
    r = app.router
    r.add_get("/v1/feeds", list_feeds)
    r.add_get("/v1/feeds/{feed}", feed_info)
    r.add_get("/v1/feeds/{feed}/changes", changes)
    r.add_put("/v1/feeds/{feed}/subscriptions/{name}", put_subscription)
    r.add_get("/v1/feeds/{feed}/subscriptions/{name}", get_subscription)
    r.add_delete("/v1/feeds/{feed}/subscriptions/{name}", delete_subscription)
    r.add_post("/v1/feeds/{feed}/subscriptions/{name}/ack", ack_subscription)
    r.add_get("/healthz", healthz)
    r.add_get("/metrics", metrics)
    return app


def run_server(config: ServerConfig) -> None:
    web.run_app(
        make_server_app(config),
        host=config.host,
        port=config.port,
        print=lambda s: print(s, flush=True),
    )
