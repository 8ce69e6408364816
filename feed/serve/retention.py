"""The feed server's automatic retention (``serve --retain T``, DESIGN §8): every
``--compact-every`` seconds, each feed is compacted to ``frontier - 1 - T``, never past the
lowest ACK of any subscription (push, named pull, or an emitter's own ``--push``)."""

from __future__ import annotations

import asyncio
import logging

from feed.log.compaction import compact, retention_target
from feed.log.subscriptions import SubscriptionStore
from feed.serve.state import ServerState
from protocol import CheckpointError

__all__ = ["retention_loop"]

log = logging.getLogger("tidefeed.serve")


def _apply_retention(st: ServerState) -> list[str]:
    """One pass of the automatic policy over every feed; returns what it did."""
    assert st.config.retain is not None
    done = []
    for feed in st.feed_names():
        reader = st.reader(feed)
        store = st.sub_store(feed)
        store.flush(force=True)  # compaction checks the ACKs on disk
        try:
            # read back from disk: an emitter's --push hold is written by the emitter
            lowest = SubscriptionStore(reader.log).lowest_ack()
            target = retention_target(reader.frontier, reader.since, st.config.retain, lowest)
            if target is not None:
                done.append(compact(st.config.log, feed, target).summary())
        except CheckpointError as e:  # (this feed waits; the others go on)
            log.warning("retention: feed %s: %s", feed, e)
    return done


async def retention_loop(st: ServerState) -> None:
    while True:
        try:
            for line in await asyncio.to_thread(_apply_retention, st):
                log.info("retention: %s", line)
        except (OSError, CheckpointError) as e:
            log.error("retention pass failed: %s", e)
        await asyncio.sleep(st.config.compact_seconds)
