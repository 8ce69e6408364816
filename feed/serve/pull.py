"""Feed info and pull streaming (DESIGN §7): ``GET /v1/feeds``, ``GET /v1/feeds/{feed}`` and
``GET /v1/feeds/{feed}/changes?after=T&follow=…&snapshot=…&format=…``: a streamed response —
the announcement, then every committed time ``>= T`` (or one consolidated snapshot, then the
live tail), with heartbeats while idle. ``T`` below ``since`` is 410. Reading and encoding
run in worker threads, a bounded chunk at a time."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
from typing import Any

import orjson
from aiohttp import web

from feed.log.reader import FeedReader
from feed.serve.state import ServerState, state_of
from protocol import (
    CODECS,
    CheckpointError,
    Compacted,
    Progress,
    Updates,
    announcement,
    fingerprint,
    get_codec,
)
from protocol._http import HttpError, json_response

__all__ = ["changes", "feed_info", "list_feeds"]

log = logging.getLogger("tidefeed.serve")

#: updates per encoded chunk of a pull stream (bounded bytes per write and per loop turn)
STREAM_CHUNK_UPDATES = 4_096

#: seconds a write may wait for its consumer before the stream lets go of its open files
#: (readers of 50 stuck streams held ~2 MB each); they are opened again after the updates
#: sent, at the cost of reading again up to one row group
RELEASE_SECONDS = 2.0


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
        return await _stream(request, st, feed, reader, opening, lower, snapshot, follow, fmt)
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


class _SchemaMoved(Exception):
    """An Avro or Arrow stream met a newer schema version: it ends after its last whole
    time (``at``: where a resume with ``after`` goes on)."""

    def __init__(self, at: int) -> None:
        super().__init__(at)
        self.at = at


class _TimeFiles:
    """The batches (and so the open files) of the time a stream is sending, if open."""

    def __init__(self) -> None:
        self.batches: Any = None

    def release(self) -> None:
        """Close the files; the stream opens them again after what it sent."""
        if self.batches is not None:
            with contextlib.suppress(ValueError):  # (a generator still running in its thread)
                self.batches.close()
            self.batches = None


class _Stalled(Exception):
    """A consumer took nothing of a write for ``--stall-timeout`` seconds."""


async def _stream(
    request: web.Request,
    st: ServerState,
    feed: str,
    reader: FeedReader,
    opening: list[Any],
    lower: int,
    snapshot: bool,
    follow: bool,
    fmt: str,
) -> web.StreamResponse:
    codec = get_codec(fmt)
    resp = web.StreamResponse(headers={"Content-Type": codec.content_type})
    await resp.prepare(request)

    files = _TimeFiles()

    async def write(data: bytes) -> None:
        """One write. A consumer that takes none of it for ``RELEASE_SECONDS`` has the
        stream let go of its open files (reopened where it was once the write is
        taken); one that takes none for ``stall_seconds`` has the stream abandoned and
        the connection dropped."""
        task = asyncio.ensure_future(resp.write(data))
        try:
            done, _ = await asyncio.wait({task}, timeout=RELEASE_SECONDS)
            if not done:
                files.release()
                wait = max(0.0, st.config.stall_seconds - RELEASE_SECONDS)
                done, _ = await asyncio.wait({task}, timeout=wait)
                if not done:
                    raise _Stalled
            task.result()  # a consumer gone: ConnectionError
        finally:
            if not task.done():
                task.cancel()

    sink = io.BytesIO()
    encoder = codec.encoder(sink, schema=reader.info.schema)
    # an Avro or Arrow stream has one schema: it ends where a newer version is committed
    schema = reader.info.schema
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
                await write(data)

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

    async def send_time(t: int, lower: int) -> None:
        """Every update at committed time ``t``, a batch per write, read from its files
        as the consumer takes them (opened again where it was after a release); the last
        batch goes out with the time's progress."""
        count = await asyncio.to_thread(reader.count, t)

        def step(sent: int) -> tuple[int, bytes]:
            """The next batch read and encoded (one worker-thread turn): its size, bytes."""
            if files.batches is None:  # opened and counted at the first batch
                files.batches = reader.batches(t, STREAM_CHUNK_UPDATES, skip=sent)
            batch = next(files.batches, None)
            if batch is None:  # (the files were checked against the count)
                raise CheckpointError(f"feed {feed!r}: time {t} ended after {sent} updates")
            messages: list[Any] = [batch]
            if sent + len(batch) >= count:
                files.release()
                messages.append(Progress(lower, t + 1, ((t, sent + len(batch)),)))
            return len(batch), encode(messages)

        sent = 0
        try:
            while sent < count:
                try:
                    n, data = await asyncio.to_thread(step, sent)
                except CheckpointError:
                    # its files are gone: folded by a compaction since this stream listed it?
                    since = (await asyncio.to_thread(FeedReader, st.config.log, feed)).since
                    if since <= t:
                        raise
                    raise overtaken(t, since) from None
                sent += n
                m.updates.labels(feed, "", "pull").inc(n)
                m.bytes.labels(feed, "", "pull").inc(len(data))
                await write(data)  # (only the encoded bytes wait for the consumer)
            if not count:
                await send([Progress(lower, t + 1, ())])
        finally:  # the time's open files, at once, also when the consumer is gone
            files.release()

    async def catch_up() -> None:
        nonlocal lower
        if fmt != "ndjson" and reader.info.schema != schema:
            raise _SchemaMoved(lower)
        frontier = reader.frontier  # one checkpoint for the times listed and the closing
        if reader.since > lower:
            raise overtaken(lower, reader.since)
        for t in await asyncio.to_thread(reader.times, lower, frontier):
            await send_time(t, lower)
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
                await write(orjson.dumps(line) + b"\n")
        except _SchemaMoved as e:
            log.info(
                "feed %s: a %s stream ends at %d, where a new schema version begins: the "
                "consumer resumes from there with the new schema",
                feed,
                fmt,
                e.at,
            )
        encoder.close()
        tail = sink.getvalue()
        if tail:
            await write(tail)
        await resp.write_eof()
    except ConnectionError:  # reset, broken pipe, or aiohttp's "Connection lost" in a drain
        log.info("feed %s: a consumer went away", feed)
    except _Stalled:
        log.warning(
            "feed %s: the consumer at %s took nothing for %.0f s: stream closed",
            feed,
            request.remote,
            st.config.stall_seconds,
        )
        if request.transport is not None:
            request.transport.abort()
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
