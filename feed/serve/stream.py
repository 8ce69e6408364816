"""One pull stream (DESIGN §7), from its opening to its end: every committed time as
whole times (the updates in bounded batches, then the time's progress), the live tail with
heartbeats, and the end a consumer can resume from. Reading and encoding run in worker
threads, one batch per turn; a stream waiting on its consumer lets its files go."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
from collections.abc import Generator
from typing import Any

import orjson
from aiohttp import web

from feed.log.reader import FeedReader
from feed.serve.state import ServerState
from feed.serve.watch import UNSEEN
from protocol import (
    CheckpointError,
    Compacted,
    Message,
    Progress,
    Updates,
    announcement,
    get_codec,
)

__all__ = ["RELEASE_SECONDS", "STREAM_CHUNK_UPDATES", "stream"]

log = logging.getLogger("tidefeed.serve")

#: updates per encoded chunk of a pull stream (bounded bytes per write and per loop turn)
STREAM_CHUNK_UPDATES = 4_096
#: updates per chunk once the consumer has taken :data:`FAST_AFTER_BYTES` without a write
#: waiting for it: a 1 M-update time pulls about 1.6x faster in chunks this size, and a
#: consumer that reads nothing never gets there (the socket buffers hold a few MiB)
STREAM_FAST_UPDATES = 32_768
FAST_AFTER_BYTES = 16 << 20
#: a write taken within this many seconds did not wait for its consumer
_PROMPT_SECONDS = 0.02

#: seconds a write may wait for its consumer before the stream lets go of its open files
#: (readers of 50 stuck streams held ~2 MB each); they are opened again after the updates
#: sent, at the cost of reading again up to one row group
RELEASE_SECONDS = 2.0


class _SchemaMoved(Exception):
    """An Avro or Arrow stream met a newer schema version: it ends after its last whole
    time (``at``: where a resume with ``after`` goes on)."""

    def __init__(self, at: int) -> None:
        super().__init__(at)
        self.at = at


class _OpenTurns:
    """The committed turns (and so the open files) a stream is sending, if open."""

    def __init__(self) -> None:
        self.turns: Generator[list[Message], None, None] | None = None

    def release(self) -> None:
        """Close the files; the stream opens them again after what it sent."""
        if self.turns is not None:
            with contextlib.suppress(ValueError):  # (a generator still running in its thread)
                self.turns.close()
            self.turns = None


class _Stalled(Exception):
    """A consumer took nothing of a write for ``--stall-timeout`` seconds."""


async def stream(
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
    stream = _PullStream(st, feed, reader, resp, fmt, lower)
    try:  # a consumer may go away at any write, the opening's too
        await stream.run(opening, snapshot, follow)
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


class _PullStream:
    """One pull stream: its opening, every committed time from ``lower`` on as whole
    times (updates, then their progress), and with ``follow`` the times committed later."""

    def __init__(
        self,
        st: ServerState,
        feed: str,
        reader: FeedReader,
        resp: web.StreamResponse,
        fmt: str,
        lower: int,
    ) -> None:
        self.st, self.feed, self.reader, self.resp, self.fmt = st, feed, reader, resp, fmt
        self.lower = lower  # where the next time's progress starts
        self.sent = 0  # updates already encoded of the first time from ``lower`` on
        self.files = _OpenTurns()
        self.rows = STREAM_CHUNK_UPDATES  # updates per turn's chunk
        self.taken = 0  # bytes the consumer took since a write last waited for it
        self.sink = io.BytesIO()
        self.encoder = get_codec(fmt).encoder(self.sink, schema=reader.info.schema)
        # an Avro or Arrow stream has one schema: it ends where a newer version is committed
        self.schema = reader.info.schema
        self.metrics = st.metrics

    async def run(self, opening: list[Any], snapshot: bool, follow: bool) -> None:
        try:
            if snapshot and self.reader.frontier > 0:
                self.lower = self.reader.frontier
                opening = await asyncio.to_thread(self.reader.snapshot_opening, self.lower)
            await self.send(opening)
            await self.catch_up()
            await _follow(
                self.st, self.reader, follow, lambda: self.lower, self.catch_up, self.send
            )
        except Compacted as e:
            # never an empty or partial time: the stream ends after its last whole message,
            # NDJSON with a last line saying why (Avro and Arrow have no place for it)
            log.info(
                "feed %s: a stream at %d was overtaken by compaction to %d",
                self.feed,
                self.lower,
                e.since,
            )
            if self.fmt == "ndjson":
                line = {"error": "compacted", "detail": str(e), "since": e.since}
                await self.write(orjson.dumps(line) + b"\n")
        except _SchemaMoved as e:
            log.info(
                "feed %s: a %s stream ends at %d, where a new schema version begins: the "
                "consumer resumes from there with the new schema",
                self.feed,
                self.fmt,
                e.at,
            )
        self.encoder.close()
        tail = self.sink.getvalue()
        if tail:
            await self.write(tail)
        await self.resp.write_eof()

    async def write(self, data: bytes) -> None:
        """One write. A consumer that takes none of it for ``RELEASE_SECONDS`` has the
        stream let go of its open files (reopened where it was once the write is
        taken); one that takes none for ``stall_seconds`` has the stream abandoned and
        the connection dropped."""
        task = asyncio.ensure_future(self.resp.write(data))
        began = time.monotonic()
        try:
            done, _ = await asyncio.wait({task}, timeout=RELEASE_SECONDS)
            prompt = time.monotonic() - began < _PROMPT_SECONDS
            self.taken = self.taken + len(data) if done and prompt else 0
            if not done:
                self.files.release()
                self.rows = STREAM_CHUNK_UPDATES
                wait = max(0.0, self.st.config.stall_seconds - RELEASE_SECONDS)
                done, _ = await asyncio.wait({task}, timeout=wait)
                if not done:
                    raise _Stalled
            task.result()  # a consumer gone: ConnectionError
        finally:
            if not task.done():
                task.cancel()

    def encode(self, messages: list[Any]) -> bytes:
        for msg in messages:
            self.encoder.write(msg)
        self.encoder.flush()
        data = self.sink.getvalue()
        self.sink.seek(0)
        self.sink.truncate()
        return data

    def count_sent(self, updates: int, data: bytes) -> None:
        if updates:
            self.metrics.updates.labels(self.feed, "", "pull").inc(updates)
        if data:
            self.metrics.bytes.labels(self.feed, "", "pull").inc(len(data))

    async def send(self, messages: list[Any]) -> None:
        """Encode in a worker thread, a bounded chunk at a time: a large time never holds
        the event loop (other streams, pushes, /healthz) and never becomes one huge
        write; each chunk is an update message of its own (consumers take any number
        before the progress)."""
        for chunk in _chunks(messages):
            data = await asyncio.to_thread(self.encode, chunk)
            self.count_sent(sum(len(x) for x in chunk if isinstance(x, Updates)), data)
            if data:
                await self.write(data)

    def overtaken(self, at: int, since: int) -> Compacted:
        return Compacted(
            f"feed {self.feed!r} was compacted to {since} while this stream was at {at}: "
            f"resume from a snapshot (snapshot=true), or pull from after={since} if you "
            f"hold everything below {since}",
            since=since,
        )

    async def catch_up(self) -> None:
        """Every time committed since the last call, then the frontier: the reader's
        committed turns (a batch, or a time's last batch with its progress), each read and
        encoded in a worker thread, then written as the consumer takes it."""
        if self.fmt != "ndjson" and self.reader.info.schema != self.schema:
            # the times before the first newer version are whole in this stream's schema:
            # sent through it, then the stream ends where that version begins
            at = min(
                (v.start for v in self.reader.info.versions if v.start >= self.lower),
                default=self.lower,
            )
            if at > self.lower:  # (read through the version of the times below ``at``)
                newest = self.reader.info
                self.reader.info = newest.at(at)
                try:
                    await self._send_below(at)
                finally:
                    self.reader.info = newest
            raise _SchemaMoved(self.lower)
        # (one checkpoint for the times listed and the closing)
        await self._send_below(self.reader.frontier)

    async def _send_below(self, frontier: int) -> None:
        """The committed times from the stream's place below ``frontier``, then a progress
        up to it."""
        if self.reader.since > self.lower:
            raise self.overtaken(self.lower, self.reader.since)
        try:
            while True:
                try:
                    turn = await asyncio.to_thread(self.turn, frontier)
                except CheckpointError:
                    # its files are gone: folded by a compaction since this stream listed it?
                    log_ = self.st.config.log
                    since = (await asyncio.to_thread(FeedReader, log_, self.feed)).since
                    if since <= self.lower:
                        raise
                    raise self.overtaken(self.lower, since) from None
                if turn is None:
                    break
                n, data = turn
                self.count_sent(n, data)
                if data:
                    await self.write(data)  # (only the encoded bytes wait for the consumer)
                if self.rows < STREAM_FAST_UPDATES and self.taken >= FAST_AFTER_BYTES:
                    self.rows = STREAM_FAST_UPDATES  # (opened again after what was sent)
                    self.files.release()
        finally:  # the open files, at once, also when the consumer is gone
            self.files.release()

    def turn(self, frontier: int) -> tuple[int, bytes] | None:
        """The next turn below ``frontier`` read and encoded (one worker-thread call): its
        number of updates and its bytes; None after the last. The turns are opened again
        where the stream is when its files were let go."""
        turns = self.files.turns
        if turns is None:
            turns = self.files.turns = self.reader.committed(
                self.lower, frontier, self.rows, skip=self.sent
            )
        messages = next(turns, None)
        if messages is None:
            return None
        n = sum(len(m) for m in messages if isinstance(m, Updates))
        self.sent += n
        if isinstance(messages[-1], Progress):  # a time (or the frontier) complete
            self.lower, self.sent = messages[-1].upper, 0
        return n, self.encode(messages)


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
    """Keep streaming new commits; a heartbeat announcement when nothing came for a while.
    Ends when the server shuts down (after the whole times it sent: the consumer resumes
    from there)."""
    idle_since = time.monotonic()
    stopping = st.stopping
    watch = st.watch(reader.name)
    seen: int | None = UNSEEN  # (the times sent so far were read before any listing)
    while follow:
        # wakes on a new commit of the feed, when a heartbeat is due, or at a stop
        due = st.config.heartbeat_seconds - (time.monotonic() - idle_since)
        seen = await watch.changed(seen, max(due, 0.0), stop=stopping)
        if stopping.is_set():
            return
        before = position()
        await asyncio.to_thread(reader.refresh)
        await catch_up()
        if position() != before:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since >= st.config.heartbeat_seconds:
            # heartbeat: an announcement is legal anywhere and nothing is pending here
            await send([announcement(position())])
            idle_since = time.monotonic()
