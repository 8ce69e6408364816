"""A Python client of a feed server: the complete times of a feed, one at a time.

:class:`FeedClient` pulls ``GET /v1/feeds/{feed}/changes`` from ``tidefeed serve`` and
applies every message through the consumer state machine (:class:`~protocol.state.Consumer`,
DESIGN §3): announcements and rollbacks drop pending updates, heartbeats move the frontier,
each time's count is checked against its progress. What comes out is only what is
complete::

    client = FeedClient("http://127.0.0.1:8080", "accounts")
    for t in client.times(after=None, follow=True):
        apply(t.updates)       # data, time, diff: the time's consolidated updates
        save(t.frontier)       # the resume token: times(after=t.frontier) goes on from here

* ``after``: a resume token (a frontier from an earlier item) or ``None`` to start from
  the beginning; with ``snapshot=True`` a new consumer starts with the collection instead
  of the whole history.
* ``until=F`` stops once the frontier has reached ``F``; ``follow=False`` stops at the
  frontier the server had when the stream began.
* A dropped connection is resumed from the frontier reached, with back-off, and nothing
  is yielded twice; a feed compacted past that point raises :class:`~protocol.Compacted`
  (start again with ``snapshot=True``).
* ``name=``: a named pull subscription on the server (made if missing). The iteration
  starts from its ACK, and the frontier of every item the caller has moved past is ACKed
  (at most every ``ack_seconds``, and at :meth:`ack`), so the server's retention keeps
  what this consumer has not finished.

:meth:`FeedClient.atimes` is the same as an async iterator. Only the standard library,
pyarrow and the codecs are needed: no Spark.
"""

from __future__ import annotations

import asyncio
import http.client
import logging
import random
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import pyarrow as pa

from ._consolidate import by_time
from .codecs import get_codec
from .errors import CodecError, Compacted, TidefeedError
from .messages import Message, Updates
from .state import Consumer
from .stores import StoreState

__all__ = ["ClientError", "CompleteTime", "FeedClient"]

log = logging.getLogger("tidefeed.client")

BACKOFF_START = 0.2
BACKOFF_MAX = 10.0
#: updates the consumer state machine takes in one step: each step sorts what the time
#: holds pending, so one step per batch (4 096 updates) was quadratic in a large time
BODY_UPDATES = 1 << 18


class ClientError(TidefeedError):
    """The server refused (a 4xx other than 410), or could not be reached in time."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class CompleteTime:
    """One complete time of the feed: its consolidated updates (``data``, ``time``,
    ``diff``) and the frontier reached with it, the token to resume after it."""

    time: int
    updates: pa.Table
    frontier: int

    def rows(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self.updates.to_pylist(maps_as_pydicts="strict")
        return rows


class _Handover:
    """A consumer's store that keeps nothing but hands each commit to the client."""

    def __init__(self, frontier: int | None) -> None:
        self.state = StoreState(frontier=frontier, epoch=0)
        self.committed: list[pa.Table] = []

    def load(self) -> StoreState:
        return self.state

    def commit(
        self,
        *,
        updates: list[pa.Table],
        frontier: int | None,
        epoch: int,
        pending: Sequence[pa.Table] = (),
    ) -> None:
        self.committed.extend(updates)
        self.state = StoreState(frontier=frontier, epoch=epoch)


class FeedClient:
    """Iterates over the complete times of one feed of a feed server (see the module)."""

    def __init__(
        self,
        base_url: str,
        feed: str,
        *,
        token: str | None = None,
        fmt: str = "arrow",
        name: str | None = None,
        timeout: float = 60.0,
        retry_for: float | None = 300.0,
        ack_seconds: float = 1.0,
    ) -> None:
        self.base = base_url.rstrip("/")
        self.feed = feed
        self.token = token
        self.codec = get_codec(fmt)
        self.name = name
        self.timeout = timeout
        self.retry_for = retry_for  # seconds of failed reconnects before giving up
        self.ack_seconds = ack_seconds
        self.frontier: int | None = None  # reached by the items handed out so far
        self.reconnects = 0
        self._acked: int | None = None
        self._acked_at = 0.0

    # ---- HTTP ----------------------------------------------------------------------------

    def _url(self, path: str, **query: Any) -> str:
        feed = urllib.parse.quote(self.feed, safe="")
        q = urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        return f"{self.base}/v1/feeds/{feed}{path}" + (f"?{q}" if q else "")

    def _request(self, url: str, *, method: str = "GET", body: Any = None) -> Any:
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            data = orjson.dumps(body)
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        return urllib.request.urlopen(request, timeout=self.timeout)

    def _json(self, url: str, *, method: str = "GET", body: Any = None) -> Any:
        try:
            with self._request(url, method=method, body=body) as r:
                return orjson.loads(r.read())
        except urllib.error.HTTPError as e:
            raise _refusal(e, url) from None

    def info(self) -> dict[str, Any]:
        """The feed's description (``GET /v1/feeds/{feed}``): schema, frontier, since."""
        info: dict[str, Any] = self._json(self._url(""))
        return info

    def subscription_ack(self) -> int | None:
        """The named subscription's ACK, making the subscription when it is missing."""
        assert self.name is not None
        path = f"/subscriptions/{urllib.parse.quote(self.name, safe='')}"
        try:
            with self._request(self._url(path)) as r:
                acked: int | None = orjson.loads(r.read()).get("acked")
                return acked
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise _refusal(e, self._url(path)) from None
        self._json(self._url(path), method="PUT", body={})
        return None

    def ack(self, frontier: int | None = None) -> None:
        """ACK ``frontier`` (default: the frontier of the items handed out so far) on the
        named subscription: the consumer has finished every time below it."""
        frontier = self.frontier if frontier is None else frontier
        if self.name is None or frontier is None or frontier == self._acked:
            return
        path = f"/subscriptions/{urllib.parse.quote(self.name, safe='')}/ack"
        self._json(self._url(path), method="POST", body={"frontier": frontier})
        self._acked, self._acked_at = frontier, time.monotonic()

    # ---- iteration -----------------------------------------------------------------------

    def times(
        self,
        *,
        after: int | None = None,
        snapshot: bool = False,
        follow: bool = True,
        until: int | None = None,
        from_ack: bool = True,
    ) -> Generator[CompleteTime, None, None]:
        """The complete times from ``after`` (see the module); each item's ``frontier`` is
        the token to resume after it. ``from_ack=False``: with ``name=``, the subscription
        is only ACKed, the iteration starts at ``after`` even when that is None (a
        consumer that keeps its own resume point, such as a Pathway program's persisted
        offset)."""
        if self.name is not None:
            acked = self.subscription_ack()
            if after is None and from_ack:
                after = acked
        store = _Handover(after)
        consumer = Consumer(store, feed=self.feed)
        self.frontier = after
        stop_at = until
        failing_since: float | None = None
        backoff = BACKOFF_START
        while stop_at is None or consumer.frontier is None or consumer.frontier < stop_at:
            url = self._url(
                "/changes",
                after=consumer.frontier,
                follow=str(follow).lower(),
                snapshot=str(snapshot and consumer.frontier is None).lower(),
                format=self.codec.name,
            )
            try:
                with self._stream(url) as stream:
                    if not follow and stop_at is None:
                        stop_at = self.info()["frontier"]  # where this stream ends
                    body: list[Message] = []  # updates are applied together, up to a bound
                    held = 0
                    for message in self.codec.decoder(stream, tables=True):
                        failing_since, backoff = None, BACKOFF_START
                        body.append(message)
                        if isinstance(message, Updates):
                            held += len(message)
                            if held < BODY_UPDATES:
                                continue
                        yield from self._apply(consumer, store, body)
                        body, held = [], 0
                        if stop_at is not None and (consumer.frontier or 0) >= stop_at:
                            break
                if stop_at is not None and (consumer.frontier or 0) >= stop_at:
                    break
                raise ConnectionError(f"the stream ended at frontier {consumer.frontier}")
            except (OSError, http.client.HTTPException, CodecError) as e:
                # a dropped connection or a body cut short: resume from the frontier reached
                now = time.monotonic()
                failing_since = failing_since or now
                if self.retry_for is not None and now - failing_since > self.retry_for:
                    raise ClientError(
                        f"feed {self.feed!r}: {self.base} unreachable for {self.retry_for:g}s: {e}"
                    ) from e
                wait = backoff * random.uniform(0.5, 1.5)
                why = getattr(e, "reason", e)  # (urllib wraps a refused connection)
                log.warning(
                    "feed %s: %s: %s; retrying from %s in %.1fs%s",
                    self.feed,
                    self.base,
                    why,
                    "the start" if consumer.frontier is None else f"frontier {consumer.frontier}",
                    wait,
                    "" if self.retry_for is None else f" (gives up after {self.retry_for:g}s)",
                )
                time.sleep(wait)
                backoff = min(backoff * 2, BACKOFF_MAX)
                self.reconnects += 1
        if self.name is not None:
            self.ack()

    def _stream(self, url: str) -> Any:
        try:
            return self._request(url)
        except urllib.error.HTTPError as e:
            if e.code == 410:
                body = orjson.loads(e.read() or b"{}")
                raise Compacted(
                    f"feed {self.feed!r}: {body.get('detail', 'compacted')}",
                    since=int(body.get("since", 0)),
                ) from None
            if e.code in (429, 503) or e.code >= 500:
                raise ConnectionError(f"{url}: {e.code}") from None  # retried
            raise _refusal(e, url) from None

    def _apply(
        self, consumer: Consumer, store: _Handover, body: list[Message]
    ) -> Iterator[CompleteTime]:
        before = consumer.frontier
        consumer.apply(body)
        if consumer.frontier == before:
            return
        tables, store.committed = store.committed, []
        frontier = consumer.frontier
        assert frontier is not None
        items = list(by_time(pa.concat_tables(tables))) if tables else []
        for i, (t, table) in enumerate(items):
            # resuming after an item must not skip the later times of the same progress
            token = items[i + 1][0] if i + 1 < len(items) else frontier
            self._ack_now_and_then()  # what the caller has moved past
            self.frontier = token
            yield CompleteTime(t, table, token)
        self.frontier = frontier
        if not items:
            self._ack_now_and_then()  # (a heartbeat: the frontier moved on, nothing to hand)

    def _ack_now_and_then(self) -> None:
        if self.name is not None and time.monotonic() - self._acked_at >= self.ack_seconds:
            self.ack()

    async def atimes(
        self,
        *,
        after: int | None = None,
        snapshot: bool = False,
        follow: bool = True,
        until: int | None = None,
        from_ack: bool = True,
    ) -> AsyncIterator[CompleteTime]:
        """:meth:`times` as an async iterator (the blocking reads run in a worker thread)."""
        it = self.times(
            after=after, snapshot=snapshot, follow=follow, until=until, from_ack=from_ack
        )
        end = object()
        try:
            while (item := await asyncio.to_thread(next, it, end)) is not end:
                assert isinstance(item, CompleteTime)
                yield item
        finally:
            await asyncio.to_thread(it.close)


def _refusal(e: urllib.error.HTTPError, url: str) -> ClientError:
    try:
        body = orjson.loads(e.read(1 << 16) or b"{}")
        detail = f"{body.get('error', '')}: {body.get('detail', '')}".strip(": ")
    except (orjson.JSONDecodeError, AttributeError, OSError):
        detail = ""
    return ClientError(f"{url}: {e.code} {detail}".rstrip(), status=e.code)
