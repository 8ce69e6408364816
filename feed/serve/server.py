"""The feed server (``tidefeed serve``): pull and push delivery of committed feeds (DESIGN §7).

The app is assembled here from its parts:

* ``feed/serve/pull.py``: ``GET /v1/feeds``, ``GET /v1/feeds/{feed}`` and the streamed
  ``GET /v1/feeds/{feed}/changes`` (after / follow / snapshot, every format);
* ``feed/serve/supervisor.py``: ``PUT|GET|DELETE /v1/feeds/{feed}/subscriptions/{name}``,
  ``POST …/{name}/ack`` and one supervised publisher task per push subscription;
* ``feed/serve/retention.py``: automatic compaction (``--retain``);
* ``feed/serve/state.py``: the configuration, metrics and per-feed readers they share;
* here: ``GET /healthz`` and ``GET /metrics`` (Prometheus text).

Reads of the log and writes of subscription files run in worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web
from prometheus_client import generate_latest

from feed.serve import pull
from feed.serve import supervisor as push_supervisor
from feed.serve.retention import retention_loop
from feed.serve.state import CONFIG, STATE, ServerConfig, ServerState, state_of
from protocol._http import (
    encoding_middleware,
    error_middleware,
    json_response,
    settle,
    token_middleware,
)

__all__ = ["ServerConfig", "make_server_app", "run_server"]


async def healthz(_request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    st = state_of(request)
    await asyncio.to_thread(st.count_quarantined)
    body = generate_latest(st.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


def make_server_app(config: ServerConfig) -> web.Application:
    app = web.Application(
        middlewares=[error_middleware, token_middleware(config.token), encoding_middleware]
    )
    app[CONFIG] = config
    app[STATE] = ServerState(config)

    async def subscriptions(app: web.Application):  # type: ignore[no-untyped-def]
        st = app[STATE]
        for feed in await asyncio.to_thread(st.feed_names):
            store = await asyncio.to_thread(st.sub_store, feed)
            for sub in store.subs.values():
                push_supervisor.start_push(app, sub)  # resume from the receiver's ACKed frontier
        yield
        for task in st.tasks.values():
            task.cancel()
        for task in st.tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for store in st.subs.values():
            await asyncio.to_thread(store.flush, force=True)
        for watch in st.watches.values():
            await watch.close()

    app.cleanup_ctx.append(subscriptions)

    async def end_streams(app: web.Application) -> None:
        # (before aiohttp waits for running handlers: a followed stream ends by itself
        # only when its consumer goes, and a stop would wait out the shutdown timeout)
        app[STATE].stopping.set()

    app.on_shutdown.append(end_streams)
    if config.retain is not None:

        async def retention(app: web.Application):  # type: ignore[no-untyped-def]
            task = asyncio.create_task(retention_loop(app[STATE]), name="retention")
            yield
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        app.cleanup_ctx.append(retention)
    r = app.router
    r.add_get("/v1/feeds", pull.list_feeds)
    r.add_get("/v1/feeds/{feed}", pull.feed_info)
    r.add_get("/v1/feeds/{feed}/changes", pull.changes)
    r.add_put("/v1/feeds/{feed}/subscriptions/{name}", push_supervisor.put_subscription)
    r.add_get("/v1/feeds/{feed}/subscriptions/{name}", push_supervisor.get_subscription)
    r.add_delete("/v1/feeds/{feed}/subscriptions/{name}", push_supervisor.delete_subscription)
    r.add_post("/v1/feeds/{feed}/subscriptions/{name}/ack", push_supervisor.ack_subscription)
    r.add_get("/healthz", healthz)
    r.add_get("/metrics", metrics)
    return app


def lean_memory() -> None:
    """Allocate so that what the streams free is reused, not cached per thread.

    A server's memory is mostly short-lived buffers of a few hundred KB (a batch read and
    its encoding) made and freed in worker threads. Arrow's default pool (mimalloc) and
    glibc's per-thread arenas each keep such memory once freed: 50 stuck pull streams of a
    1M-update time made the server 250 MB larger at their peak and left it 115 MB larger
    once closed. Arrow on the C heap and two arenas: +112 MB and +30 MB, with pull as fast
    (benchmarks/bench_stuck_streams.py). A fixed mmap threshold would save a little more
    and cost a third of the pull rate (page faults on every batch).
    """
    import ctypes

    import pyarrow as pa

    pa.set_memory_pool(pa.system_memory_pool())
    with contextlib.suppress(OSError, AttributeError):  # not glibc: its own policy stays
        ctypes.CDLL("libc.so.6").mallopt(-8, 2)  # M_ARENA_MAX


def run_server(config: ServerConfig) -> None:
    lean_memory()
    app = make_server_app(config)
    app.on_startup.append(settle)
    web.run_app(
        app,
        host=config.host,
        port=config.port,
        keepalive_timeout=config.idle_timeout,
        print=lambda s: print(s, flush=True),
    )
