"""A feed's commits are listed once per poll for all who wait on them (feed/serve/watch.py)."""

from __future__ import annotations

import asyncio
import types

import pytest

from feed.serve.watch import UNSEEN, FeedWatch

POLL = 0.05


class Commits:
    """Stands in for a feed's CheckpointStore: its listing, counted (and made to fail)."""

    def __init__(self, seqs: list[int]) -> None:
        self.now = list(seqs)
        self.listings = 0
        self.fail = False
        self.log = types.SimpleNamespace(feed="bank")

    def seqs(self) -> list[int]:
        self.listings += 1
        if self.fail:
            raise OSError("the store is down")
        return list(self.now)


async def test_many_waiters_share_one_listing_per_poll_and_all_wake_on_a_commit():
    commits = Commits([1, 2])
    watch = FeedWatch(commits, POLL)  # type: ignore[arg-type]
    assert await watch.changed(UNSEEN, 5) == 2  # the first listing answers an unseen token
    waiters = [asyncio.create_task(watch.changed(2, 30)) for _ in range(50)]
    await asyncio.sleep(10 * POLL)
    assert not any(w.done() for w in waiters)
    # about one listing per poll, not one per waiter per poll (500)
    assert commits.listings <= 15, commits.listings
    commits.now.append(3)
    done, _ = await asyncio.wait(waiters, timeout=5)
    assert len(done) == 50 and {w.result() for w in done} == {3}


async def test_a_stale_token_returns_at_once_and_a_lower_newest_commit_is_a_change():
    commits = Commits([4])
    watch = FeedWatch(commits, POLL)  # type: ignore[arg-type]
    assert await watch.changed(UNSEEN, 5) == 4
    listed = commits.listings
    assert await asyncio.wait_for(watch.changed(3, 30), 1) == 4  # known newer: no wait
    assert commits.listings == listed
    # a newest commit file renamed away (written in part): the newest is now 3, a change
    waiter = asyncio.create_task(watch.changed(4, 30))
    commits.now = [3]
    assert await asyncio.wait_for(waiter, 5) == 3


async def test_a_wait_ends_at_its_timeout_or_its_stop_and_the_poll_ends_with_the_waiters():
    commits = Commits([])
    watch = FeedWatch(commits, POLL)  # type: ignore[arg-type]
    assert await watch.changed(UNSEEN, 5) is None  # a feed with no commit yet
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await watch.changed(None, 0.2) is None
    assert 0.15 < loop.time() - t0 < 5
    stop = asyncio.Event()
    waiter = asyncio.create_task(watch.changed(None, 30, stop=stop))
    await asyncio.sleep(2 * POLL)
    stop.set()
    assert await asyncio.wait_for(waiter, 5) is None
    await asyncio.sleep(3 * POLL)
    listed = commits.listings
    await asyncio.sleep(5 * POLL)
    assert commits.listings == listed  # nobody waits: nothing is listed


async def test_a_failed_listing_wakes_nobody_and_the_poll_goes_on(caplog):
    commits = Commits([7])
    watch = FeedWatch(commits, POLL)  # type: ignore[arg-type]
    assert await watch.changed(UNSEEN, 5) == 7
    commits.fail = True
    waiter = asyncio.create_task(watch.changed(7, 30))
    await asyncio.sleep(5 * POLL)
    assert not waiter.done()
    commits.fail, commits.now = False, [7, 8]
    assert await asyncio.wait_for(waiter, 5) == 8
    await watch.close()


@pytest.mark.parametrize("waiters", [1, 20])
async def test_each_commit_wakes_each_waiter_once(waiters):
    """Waiters that look again after every wake see every commit, none twice."""
    commits = Commits([1])
    watch = FeedWatch(commits, POLL)  # type: ignore[arg-type]
    seen_by: list[list[int | None]] = [[] for _ in range(waiters)]

    async def follow(i: int) -> None:
        token: int | None = UNSEEN
        while token != 4:
            token = await watch.changed(token, 30)
            seen_by[i].append(token)

    tasks = [asyncio.create_task(follow(i)) for i in range(waiters)]
    for seq in (2, 3, 4):
        await asyncio.sleep(4 * POLL)
        commits.now.append(seq)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert all(s == [1, 2, 3, 4] for s in seen_by), seen_by
