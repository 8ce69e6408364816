"""Durable subscriptions over HTTP and the supervisor of their push tasks:
``PUT|GET|DELETE /v1/feeds/{feed}/subscriptions/{name}`` and ``POST …/{name}/ack``. A
subscription with a ``url`` gets one publisher task, supervised: any failure is logged,
counted, shown in its status and retried with back-off."""

from __future__ import annotations

import asyncio
import logging
import time

import orjson
from aiohttp import web

from feed.log.reader import FeedReader
from feed.log.subscriptions import Subscription, SubscriptionStore, valid_subscription
from feed.serve.publisher import BACKOFF_MAX, BACKOFF_START, DeliveryStopped, Publisher
from feed.serve.state import STATE, state_of
from protocol._http import HttpError, json_response
from protocol.push import Ack, PushClient

__all__ = [
    "ack_subscription",
    "delete_subscription",
    "get_subscription",
    "put_subscription",
    "start_push",
]

log = logging.getLogger("tidefeed.serve")

#: an idle subscription looks at its feed at least this often, whatever the watch says
WATCH_TIMEOUT_SECONDS = 60.0


def start_push(app: web.Application, sub: Subscription) -> None:
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
    sub.failed(f"{type(e).__name__}: {e}")


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
        sub.url,
        fmt=sub.format,
        schema=reader.info.schema,
        token=sub.token,
        allow=st.config.push_allow,
    ) as client:
        watch = st.watch(sub.feed)
        seen = watch.seen
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
            # (taken before the next look at the feed: a commit in between is not missed)
            seen = await watch.changed(seen, WATCH_TIMEOUT_SECONDS)


async def put_subscription(request: web.Request) -> web.Response:
    st = state_of(request)
    feed, name = request.match_info["feed"], request.match_info["name"]
    if not valid_subscription(name):
        raise HttpError(400, "bad_request", f"{name!r} is not a valid subscription name")
    try:
        body = orjson.loads(await request.read())
        sub = Subscription.from_request(feed, name, body)
    except (orjson.JSONDecodeError, ValueError) as e:
        raise HttpError(400, "malformed_body", f"bad subscription: {e}") from None
    if sub.url is not None:
        try:  # (it may ask DNS)
            await asyncio.to_thread(st.config.push_allow.check, sub.url)
        except ValueError as e:
            raise HttpError(400, "push_not_allowed", f"bad subscription: {e}") from None
    store = await asyncio.to_thread(st.sub_store, feed)
    existed = name in store.subs
    await asyncio.to_thread(store.put, sub)
    start_push(request.app, sub)
    return json_response(sub.public(), status=200 if existed else 201)


async def _subscription(request: web.Request) -> tuple[SubscriptionStore, Subscription]:
    """The store and the subscription a request names; 404 when there is none."""
    st = state_of(request)
    feed, name = request.match_info["feed"], request.match_info["name"]
    store = await asyncio.to_thread(st.sub_store, feed)
    sub = store.subs.get(name)
    if sub is None:
        raise HttpError(404, "unknown_subscription", f"no subscription {name!r} on {feed!r}")
    return store, sub


async def get_subscription(request: web.Request) -> web.Response:
    _, sub = await _subscription(request)
    reader = await asyncio.to_thread(state_of(request).reader, sub.feed)
    return json_response(sub.public() | {"frontier": reader.frontier})


async def delete_subscription(request: web.Request) -> web.Response:
    st = state_of(request)
    feed, name = request.match_info["feed"], request.match_info["name"]
    store = await asyncio.to_thread(st.sub_store, feed)
    task = st.tasks.pop((feed, name), None)
    if task is not None:
        task.cancel()
    if not await asyncio.to_thread(store.delete, name):
        raise HttpError(404, "unknown_subscription", f"no subscription {name!r} on {feed!r}")
    st.metrics.forget(feed, name)
    return json_response({"deleted": name})


async def ack_subscription(request: web.Request) -> web.Response:
    st = state_of(request)
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
