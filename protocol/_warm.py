"""The receiver's warm-up: one made-up large time, decoded and applied at start-up.

A receiver's first large push was slower than the ones after it: it is where the process
first grew to the working size of a body's apply. The worker threads' heaps grow to hold
a body's hashes, their sorted runs and masks; Polars starts its threads for the string
hashes; Arrow's pool takes its first large blocks. The memory freed after a push is kept
for the next one (:func:`protocol._http.keep_freed_memory`), so later pushes do not pay.

:func:`warm_up` pays for it before the receiver listens. It applies a time of
:data:`WARM_UPDATES` updates, in bodies of :data:`WARM_BODY`, to a consumer in memory,
through the same steps as a push: an Arrow body is decoded in a worker thread, then
applied in another. Nothing reaches the database, and no feed sees it. The cost: about
0.2 s of CPU at start-up, and some 70 MB more resident at rest (what a large push would
have kept anyway). ``tidefeed receive --no-warm-up`` skips it.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .codecs import get_codec
from .messages import Progress, Updates, announcement
from .state import Consumer
from .stores import MemoryStore

__all__ = ["WARM_BODY", "WARM_UPDATES", "warm_up"]

log = logging.getLogger("tidefeed.receive")

#: updates in the made-up time: two bodies, so that the second is looked up among the
#: first's pending updates. A time of 1M (five bodies) did no better in alternating
#: starts and kept 145 MB more at rest, against 72 MB
WARM_UPDATES = 400_000
#: updates per made-up body: a publisher's bound
WARM_BODY = 200_000


def _made_up(start: int, n: int) -> pa.Table:
    """``n`` inserts at time 1 of records with an integer, a text and a small integer."""
    ids = np.arange(start, start + n, dtype=np.int64)
    names = pc.binary_join_element_wise(
        pa.array(np.full(n, "record "), pa.string()), pa.array(ids).cast(pa.string()), ""
    )
    data = pa.StructArray.from_arrays(
        [pa.array(ids), names, pa.array(ids % 977)], ["id", "name", "n"]
    )
    ones = pa.array(np.ones(n, dtype=np.int64))
    return pa.table({"data": data, "time": ones, "diff": ones})


def _bodies(updates: int, per_body: int) -> list[bytes]:
    """The Arrow bodies of a push of one time of ``updates`` inserts."""
    codec = get_codec("arrow")
    bodies = [codec.encode([announcement(1)])]
    for start in range(0, updates, per_body):
        n = min(per_body, updates - start)
        messages: list[Updates | Progress] = [Updates.from_arrow(_made_up(start, n))]
        if start + n == updates:
            messages.append(Progress(1, 2, ((1, updates),)))
        bodies.append(codec.encode(messages))
    return bodies


async def warm_up(updates: int = WARM_UPDATES, per_body: int = WARM_BODY) -> int:
    """Decode and apply a made-up time of ``updates`` inserts, body by body, to a consumer
    in memory. Returns the updates it committed (all of them; anything else is a bug,
    raised as such)."""
    t0 = time.monotonic()
    codec = get_codec("arrow")
    bodies = await asyncio.to_thread(_bodies, updates, per_body)
    consumer = Consumer(MemoryStore(accumulate=False))
    committed = 0
    for body in bodies:
        messages = await asyncio.to_thread(codec.decode, body)
        result = await asyncio.to_thread(consumer.apply, messages, epoch=1)
        committed += sum(t.num_rows for t in result.committed)
    if committed != updates or consumer.frontier != 2:
        raise AssertionError(f"warm-up committed {committed} of {updates} updates")
    log.debug("warmed up: %d updates applied in %.2fs", committed, time.monotonic() - t0)
    return committed
