"""One look at a feed's commits per poll, for every push subscription and followed stream
of the feed.

Each push subscription and each ``follow=true`` stream used to re-read its feed's newest
commit every ``poll_seconds`` on its own: a listing of the commit folder and a read of the
newest commit file, per reader, twice a second. A server with 600 idle subscriptions of
one feed spent about a third of a core on it, and on an object store each look is a LIST
and a GET. A :class:`FeedWatch` lists the folder once per poll while anyone waits, and
wakes the waiters when the newest commit changes. Only then does each re-read its commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from feed.log.checkpoint import CheckpointStore

__all__ = ["UNSEEN", "FeedWatch"]

log = logging.getLogger("tidefeed.serve")

#: a token no listing matches: a wait with it returns at the first listing (for a waiter
#: that looked at the feed before it could take :attr:`FeedWatch.seen`)
UNSEEN = -1


class FeedWatch:
    """The newest commit of one feed, listed every ``poll_seconds`` while a waiter waits."""

    def __init__(self, commits: CheckpointStore, poll_seconds: float) -> None:
        self._commits = commits
        self._poll_seconds = poll_seconds
        #: the newest commit seq the last listing found (None: none yet, or no commit)
        self.seen: int | None = None
        self._listed = False
        self._changed = asyncio.Event()
        self._waiters = 0
        self._task: asyncio.Task[None] | None = None

    async def changed(
        self, since: int | None, timeout: float, stop: asyncio.Event | None = None
    ) -> int | None:
        """Wait until the newest commit is no longer ``since`` (a value of :attr:`seen`
        taken before the caller's last look at the feed), for at most ``timeout`` seconds,
        or until ``stop`` is set. Returns the newest commit seq known then."""
        if self._listed and self.seen != since:
            return self.seen
        self._waiters += 1
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._poll(), name="feed watch")
        changed = self._changed
        waits = [asyncio.ensure_future(changed.wait())]
        if stop is not None:
            waits.append(asyncio.ensure_future(stop.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._waiters -= 1
            for w in waits:
                w.cancel()
        return self.seen

    async def _poll(self) -> None:
        """List the commits now and every poll while anyone waits; wake them on a change."""
        try:
            while self._waiters:
                try:
                    seqs = await asyncio.to_thread(self._commits.seqs)
                except Exception as e:  # a waiter's own look will name it; go on polling
                    log.debug("feed %s: listing its commits failed: %s", self._feed, e)
                else:
                    newest = seqs[-1] if seqs else None
                    if not self._listed or newest != self.seen:
                        self.seen, self._listed = newest, True
                        self._changed.set()
                        self._changed = asyncio.Event()
                await asyncio.sleep(self._poll_seconds)
        finally:
            self._task = None

    @property
    def _feed(self) -> str:
        return self._commits.log.feed

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
