"""Feed info and pull streaming (DESIGN §7): ``GET /v1/feeds``, ``GET /v1/feeds/{feed}`` and
``GET /v1/feeds/{feed}/changes?after=T&follow=…&snapshot=…&format=…``: a streamed response —
the announcement, then every committed time ``>= T`` (or one consolidated snapshot, then the
live tail), with heartbeats while idle. ``T`` below ``since`` is 410. This module checks the
request and admits the stream; feed/serve/stream.py sends it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from aiohttp import web

from feed.log.reader import FeedReader
from feed.serve.state import ServerState, state_of
from feed.serve.stream import stream
from protocol import (
    CODECS,
    Compacted,
    fingerprint,
)
from protocol._http import HttpError, json_response

__all__ = ["changes", "feed_info", "list_feeds"]

log = logging.getLogger("tidefeed.serve")


def _describe(r: FeedReader, *, counts: bool) -> dict[str, Any]:
    d: dict[str, Any] = {
        "name": r.name,
        "schema": r.info.schema,
        # every version: a record at time t has the newest one from t or before
        "schemas": [
            {"from": v.start, "fingerprint": fingerprint(v.schema), **v.changes()}
            for v in r.info.history()
        ],
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
    st = state_of(request)

    def describe_all() -> list[dict[str, Any]]:
        return [_describe(st.reader(f), counts=False) for f in st.feed_names()]

    return json_response({"feeds": await asyncio.to_thread(describe_all)})


async def feed_info(request: web.Request) -> web.Response:
    st = state_of(request)
    feed = request.match_info["feed"]
    return json_response(await asyncio.to_thread(lambda: _describe(st.reader(feed), counts=True)))


def _int_param(request: web.Request, name: str) -> int | None:
    raw = request.query.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise HttpError(
            400, "bad_request", f"'{name}' must be an integer, got {raw[:40]!r}"
        ) from None
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
    st = state_of(request)
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
    peer = request.remote or "unknown"
    _admit(st, peer)
    st.streams[peer] += 1
    try:
        return await stream(request, st, feed, reader, opening, lower, snapshot, follow, fmt)
    finally:
        st.streams[peer] -= 1
        if st.streams[peer] <= 0:
            del st.streams[peer]
        if not st.streams:
            # the last stream is gone: give what the streams held back to the system
            # (freed memory stays with the allocators otherwise: 50 stuck streams kept
            # the server 200 MB larger after they closed)
            await asyncio.to_thread(release_memory)


def release_memory() -> None:
    """Return freed memory to the system: Arrow's pool, then the C heap (glibc)."""
    import ctypes

    import pyarrow as pa

    pa.default_memory_pool().release_unused()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: it keeps what it keeps
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _admit(st: ServerState, peer: str) -> None:
    """Refuse a stream past the caps: 429 for a client with too many, 503 for a full
    server (each stream holds a reader, open files and a batch in memory)."""
    cfg = st.config
    if st.streams[peer] >= cfg.max_streams_per_client:
        raise HttpError(
            429,
            "too_many_streams",
            f"{st.streams[peer]} streams from {peer} are open already, at most "
            f"{cfg.max_streams_per_client} (serve --max-streams-per-client): close one first",
            headers={"Retry-After": "5"},
        )
    if sum(st.streams.values()) >= cfg.max_streams:
        raise HttpError(
            503,
            "too_many_streams",
            f"the server has {cfg.max_streams} streams open, its limit (serve --max-streams)",
            headers={"Retry-After": "5"},
        )
