"""The emitter's own delivery (``tidefeed emit --push URL``): a publisher in a thread of its
own, so that a receiver's trouble never holds back the feed.

The emitter commits as it would without ``--push`` and tells the publisher each new
frontier (:meth:`BackgroundPublisher.notify`, which never waits). The publisher runs push
sessions (:class:`~feed.serve.publisher.Publisher`: the same exactly-once rules as the
server's subscriptions) from the receiver's frontier up to the log's, retries a receiver
that is down or busy with back-off for as long as the emitter runs, and writes its ACKs to
the emitter's hold (:class:`~feed.log.subscriptions.PushHold`), so that retention keeps
whatever the receiver has not ACKed. A refusal that retrying cannot fix (a 4xx other than
409/413/429, or a receiver below the feed's ``since``) stops delivery with its reason in
the hold; the commits go on.

At the end of a run the emitter waits for the receiver to ACK the last commit
(:meth:`finish`, at most ``--push-timeout`` seconds). What is not delivered by then is in
the log and goes out at the next start, or through a subscription of ``tidefeed serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable

from feed.log.reader import FeedReader
from feed.log.subscriptions import PushHold
from feed.serve.publisher import BACKOFF_MAX, BACKOFF_START, DeliveryStopped, Publisher
from protocol.push import Ack, PushClient

__all__ = ["BackgroundPublisher"]

log = logging.getLogger("tidefeed.publish")

POLL = 0.05  # seconds between checks while the emitter waits in finish()


class BackgroundPublisher:
    """Delivers one feed to one receiver from a thread, as the emitter commits."""

    def __init__(self, log_uri: str, feed: str, url: str, *, fmt: str, token: str | None) -> None:
        self.url = url
        self.fmt = fmt
        self.token = token
        self.reader = FeedReader(log_uri, feed)
        self.hold = PushHold(self.reader.log, url)
        self.acked: int | None = None  # the receiver's last ACK
        self.wanted = 0  # the frontier to deliver (the emitter's last commit)
        self.stopped: str | None = None  # why delivery stopped for good
        self._busy = False
        self._shown: int | None = None  # the last ACK announced on stderr
        self._wake = asyncio.Event()
        self._loop = asyncio.new_event_loop()
        self._task: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self._run, name="tidefeed-push", daemon=True)

    # ---- the emitter's side (its main thread) -------------------------------------------

    def start(self, frontier: int) -> None:
        """Deliver what is committed (and announce this producer's epoch) from now on."""
        self.wanted = frontier
        self._wake.set()  # (the loop does not run yet: no thread-safe call needed)
        self._thread.start()

    def notify(self, frontier: int) -> None:
        """A commit up to ``frontier``: deliver it when the receiver can take it."""
        self.wanted = max(self.wanted, frontier)
        with contextlib.suppress(RuntimeError):  # the loop has ended (delivery stopped)
            self._loop.call_soon_threadsafe(self._wake.set)

    def idle(self) -> bool:
        """No session under way and the receiver has ACKed everything notified so far
        (an eager push may go straight to it)."""
        return not self._busy and self.acked is not None and self.acked >= self.wanted

    def acked_directly(self, frontier: int) -> None:
        """The receiver ACKed ``frontier`` to a push the emitter made itself (eager)."""
        if self.acked is None or frontier > self.acked:
            self.acked = frontier
        self.hold.ack(frontier)
        self._announce()

    def finish(self, timeout: float, stop: Callable[[], bool]) -> bool:
        """Wait until the receiver has ACKed the last commit; ``False`` when delivery
        stopped, ``timeout`` seconds passed or ``stop()`` turned true first."""
        deadline = time.monotonic() + timeout
        while not self.idle():
            if self.stopped is not None or stop() or time.monotonic() >= deadline:
                return False
            time.sleep(POLL)
        return True

    def close(self) -> None:
        """Stop delivering (the receiver keeps what it ACKed) and write the last ACK."""
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._cancel)
            self._thread.join(timeout=10)
        elif self._thread.ident is None:  # never started
            self._loop.close()
        self.hold.flush()

    def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # ---- the publisher's thread ----------------------------------------------------------

    def _run(self) -> None:
        self._task = self._loop.create_task(self._main())
        try:
            with contextlib.suppress(asyncio.CancelledError):
                self._loop.run_until_complete(self._task)
        finally:
            self._loop.close()

    async def _main(self) -> None:
        """Supervised: any failure is logged, kept in the hold and retried with back-off;
        only :class:`DeliveryStopped` ends delivery."""
        async with PushClient(
            self.url, fmt=self.fmt, schema=self.reader.info.schema, token=self.token
        ) as client:
            backoff = BACKOFF_START
            while True:
                await self._wake.wait()
                self._wake.clear()
                self._busy = True
                try:
                    await self._deliver(client)
                    backoff = BACKOFF_START
                except DeliveryStopped as e:
                    self._stop(str(e))
                    return
                except Exception as e:  # the supervisor's job is to survive anything
                    self.hold.failed(f"{type(e).__name__}: {e}")
                    log.exception("push to %s failed; retrying in %.1fs", self.url, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, BACKOFF_MAX)
                    self._wake.set()
                finally:
                    self._busy = False

    async def _deliver(self, client: PushClient) -> None:
        """Sessions until the receiver has ACKed the log's frontier (commits made while
        one runs are taken by the next)."""
        while True:
            await asyncio.to_thread(self.reader.refresh)
            frontier = self.reader.frontier
            if self.acked is not None and self.acked >= frontier:
                break
            epoch = self.reader.checkpoint.epoch if self.reader.checkpoint else 0
            publisher = Publisher(
                self.reader, client, epoch=epoch, on_ack=self._on_ack, on_error=self._on_error
            )
            await publisher.deliver()  # retries a receiver that is down, for as long as needed
        self.hold.flush()
        self._announce()

    def _on_ack(self, ack: Ack) -> None:
        if ack.frontier is not None and (self.acked is None or ack.frontier > self.acked):
            self.acked = ack.frontier
        self.hold.ack(ack.frontier)

    def _on_error(self, e: Exception) -> None:
        self.hold.failed(f"{type(e).__name__}: {e}")

    def _stop(self, reason: str) -> None:
        self.stopped = reason
        self.hold.stop(reason)
        print(
            f"tidefeed emit: delivery to {self.url} stopped: {reason}. The feed goes on being "
            "committed; the receiver gets it from its frontier at the next start of emit "
            "once the cause is fixed (or through a subscription of tidefeed serve)",
            file=sys.stderr,
        )

    def _announce(self) -> None:
        if self.acked is not None and self.acked != self._shown:
            self._shown = self.acked
            print(f"tidefeed emit: {self.url} ACKed frontier {self.acked}", file=sys.stderr)
