"""The publisher: delivers a committed feed to one receiver, exactly once (DESIGN §6).

A session: ``GET`` the receiver's frontier ``F``; send the announcement ``progress(F, F)``
with the producer's epoch (the receiver drops any partial time); then every committed time
at or above ``F`` as its updates and its progress, several times per body up to a bound;
finally an empty progress up to the feed's frontier. Every answer is an ACK (the receiver's
durable frontier). On 409 the next session starts afresh from the receiver's frontier; on
429/503/5xx/network errors it backs off (exponentially, with jitter) and starts again; on
another 4xx it stops with the reason.

Bodies are bounded in updates (``max_body_updates``) and in bytes (``max_body_bytes``,
estimated from the bodies sent so far, whatever the format): a time larger than one body
is split across bodies — its updates, then its progress after the last of them. A 413
halves the bound and starts a new session; only a single update larger than the receiver
accepts stops delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

from feed._faults import maybe_die
from feed.log.reader import FeedReader
from protocol import Compacted, Message, Updates
from protocol.push import Ack, PushClient, PushRejected

__all__ = ["DeliveryStopped", "Publisher", "SessionReport", "deliver_log"]

log = logging.getLogger("tidefeed.publish")

#: a body's bound in updates (the byte bound below holds too): a body costs the receiver a
#: round trip and a commit whatever its size; at 50 000 the 100 x 10 k push spent a fifth
#: of its time on them
MAX_BODY_UPDATES = 200_000
MAX_BODY_BYTES = 16 << 20  # a quarter of the reference receiver's default limit
BACKOFF_START = 0.2
BACKOFF_MAX = 10.0
STOP_POLL = 0.1  # seconds between checks of a blocking delivery's stop()


class DeliveryStopped(PushRejected):
    """The receiver refused in a way retrying cannot fix (a 4xx other than 409/429)."""


@dataclass(slots=True)
class SessionReport:
    frontier: int | None
    bodies: int = 0
    updates: int = 0


class Publisher:
    """Pushes one feed to one receiver; :meth:`deliver` returns once it ACKed the frontier."""

    def __init__(
        self,
        reader: FeedReader,
        client: PushClient,
        *,
        epoch: int,
        max_body_updates: int = MAX_BODY_UPDATES,
        max_body_bytes: int = MAX_BODY_BYTES,
        logger: logging.Logger | None = None,
        on_ack: Callable[[Ack], None] | None = None,
        on_error: Callable[[Exception], None] | None = None,
        on_sent: Callable[[int, int], None] | None = None,
    ) -> None:
        self.reader = reader
        self.client = client
        self.epoch = epoch
        self.max_body_updates = max_body_updates
        self.max_body_bytes = max_body_bytes
        self._bytes_per_update = 0.0  # measured on the bodies sent
        self.log = logger or log
        self.on_ack = on_ack
        self.on_error = on_error  # told of every failure that is retried
        self.on_sent = on_sent  # told (updates, bytes) of every body the receiver ACKed
        self.acked: int | None = None
        self._in_flight: asyncio.Task[None] | None = None

    async def session(self) -> SessionReport:
        """One push session from the receiver's frontier up to the feed's frontier.

        Bodies are pipelined: while one is on its way (sent, read and applied by the
        receiver), the next is read from the log and encoded. They are still sent one at
        a time, each after the previous one's ACK, so the receiver takes them in order."""
        try:
            report = await self._session()
            await self._drain()
            return report
        finally:
            if self._in_flight is not None and not self._in_flight.done():
                self._in_flight.cancel()
                with contextlib.suppress(asyncio.CancelledError, PushRejected):
                    await self._in_flight
            self._in_flight = None

    async def _session(self) -> SessionReport:
        self.reader.refresh()
        # every time goes out through the feed's newest schema version (Avro and Arrow
        # bodies carry it: a receiver meets a grown schema at the next body)
        self.client.schema = self.reader.info.schema
        frontier, _ = await self.client.handshake()
        report = SessionReport(frontier=frontier)
        try:
            body, lower = await asyncio.to_thread(self.reader.opening, frontier)
        except Compacted as e:
            raise DeliveryStopped(
                f"the receiver's frontier {frontier} is below the feed's since {e.since}: {e}",
                code="compacted",
                fatal=True,
            ) from e
        in_body = sum(len(m) for m in body if isinstance(m, Updates))
        frontier = self.reader.frontier  # the times listed and the closing progress agree
        turns = self.reader.committed(lower, frontier, self.max_body_updates)
        n = 0  # the updates of the current time so far
        while (turn := await asyncio.to_thread(next, turns, None)) is not None:
            for m in turn:
                if not isinstance(m, Updates):
                    body.append(m)  # the time's progress (or the last one, to the frontier)
                    report.updates += n
                    n = 0
                    continue
                size = len(m)
                if not self._bytes_per_update and m.has_table():
                    # before any body is measured: a guess from the in-memory size
                    self._bytes_per_update = 1.5 * m.table().nbytes / size
                if not n and in_body and in_body + size > self.body_limit():
                    # a time that fits a body of its own is not split across two
                    await self._send(body, report)
                    body, in_body = [], 0
                start = 0
                while size - start > self.body_limit() - in_body:
                    # more than this body holds: fill it, send it, go on in the next
                    take = self.body_limit() - in_body
                    if take > 0:
                        body.append(m.slice(start, take))
                        start += take
                    await self._send(body, report, updates=in_body + max(take, 0))
                    body, in_body = [], 0
                if size - start:
                    body.append(m.slice(start, size - start) if start else m)
                    in_body += size - start
                n += size
            if in_body >= self.body_limit():  # full: on its way now, not after the next read
                await self._send(body, report)
                body, in_body = [], 0
        if body:
            await self._send(body, report)
        return report

    def body_limit(self) -> int:
        """Updates per body: the update bound, and the byte bound at the measured size."""
        limit = self.max_body_updates
        if self._bytes_per_update > 0:
            limit = min(limit, int(self.max_body_bytes / self._bytes_per_update))
        return max(1, limit)

    async def _send(
        self, body: list[Message], report: SessionReport, *, updates: int | None = None
    ) -> None:
        """Encode ``body`` (while the previous body is on its way), wait for the previous
        body's ACK, then start sending this one."""
        if updates is None:
            updates = sum(len(m) for m in body if isinstance(m, Updates))
        data = await asyncio.to_thread(self.client.encode, body)
        if updates:
            self._bytes_per_update = len(data) / updates
        await self._drain()
        self._in_flight = asyncio.create_task(self._post(data, report, updates))

    async def _drain(self) -> None:
        """Wait for the body on its way; its failure is raised here."""
        task, self._in_flight = self._in_flight, None
        if task is not None:
            await task

    async def _post(self, data: bytes | memoryview, report: SessionReport, updates: int) -> None:
        ack = await self.client.post(data, epoch=self.epoch)
        maybe_die("during_publish")  # the receiver kept it; this process never learns
        if self.on_sent is not None:
            self.on_sent(updates, len(data))
        report.bodies += 1
        report.frontier = ack.frontier
        self.acked = ack.frontier
        if self.on_ack is not None:
            self.on_ack(ack)

    async def deliver(self, *, give_up_after: float | None = None) -> int | None:
        """Run sessions until the receiver has ACKed the feed's frontier.

        Retries retryable failures with back-off; raises :class:`DeliveryStopped` on a fatal
        refusal, or the last :class:`PushRejected` when ``give_up_after`` seconds passed.
        """
        loop = asyncio.get_running_loop()
        deadline = None if give_up_after is None else loop.time() + give_up_after
        delay = BACKOFF_START
        while True:
            try:
                report = await self.session()
                if report.frontier is not None and report.frontier >= self.reader.frontier:
                    return report.frontier
                delay = BACKOFF_START  # progress was made: go again at once
                continue
            except PushRejected as e:
                if self.on_error is not None and not e.fatal:
                    self.on_error(e)
                if e.status == 413:
                    if self.body_limit() <= 1:
                        raise DeliveryStopped(
                            f"{e} (a single update is larger than the receiver accepts)",
                            status=413,
                            code=e.code,
                            fatal=True,
                        ) from e
                    self.max_body_updates = max(1, self.body_limit() // 2)
                    self.log.warning(
                        "receiver %s refused a body as too large; bodies of at most %d "
                        "update(s) from now on",
                        self.client.url,
                        self.max_body_updates,
                    )
                    continue
                if e.fatal:
                    self.log.error("delivery to %s stopped: %s", self.client.url, e)
                    raise DeliveryStopped(str(e), status=e.status, code=e.code, fatal=True) from e
                if not e.retry:  # 409: a fresh session from the receiver's frontier
                    self.log.warning("receiver rejected a body, starting over: %s", e)
                    wait = 0.0
                else:
                    wait = e.retry_after if e.retry_after is not None else delay
                    wait *= random.uniform(0.5, 1.5)
                    delay = min(delay * 2, BACKOFF_MAX)
                    self.log.warning(
                        "push to %s failed (%s); retrying in %.1fs", self.client.url, e, wait
                    )
                if deadline is not None and loop.time() + wait > deadline:
                    raise
                await asyncio.sleep(wait)


def deliver_log(
    log: str,
    feed: str,
    url: str,
    *,
    epoch: int,
    fmt: str = "ndjson",
    token: str | None = None,
    give_up_after: float | None = None,
    stop: Callable[[], bool] | None = None,
) -> int | None:
    """Deliver everything committed in ``feed`` to the receiver at ``url`` and return its ACK
    (blocking: runs its own event loop). Raises as :meth:`Publisher.deliver` does. When
    ``stop()`` turns true (checked every :data:`STOP_POLL` seconds) the delivery is
    abandoned at once and ``None`` is returned: the receiver keeps what it ACKed, the rest
    is delivered by the next session."""

    async def go() -> int | None:
        reader = FeedReader(log, feed)
        async with PushClient(url, fmt=fmt, schema=reader.info.schema, token=token) as client:
            publisher = Publisher(reader, client, epoch=epoch)
            task = asyncio.ensure_future(publisher.deliver(give_up_after=give_up_after))
            while not task.done():
                await asyncio.wait({task}, timeout=STOP_POLL)
                if stop is not None and stop() and not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    return None
            return task.result()

    return asyncio.run(go())
