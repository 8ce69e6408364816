"""The feed server's shared parts: its configuration, its metrics, and the per-feed readers
and subscription stores every endpoint uses (``feed/serve/server.py`` assembles the app)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from feed.log.checkpoint import CheckpointStore
from feed.log.reader import FeedReader
from feed.log.store import FeedLog, feed_names, valid_feed_name
from feed.log.subscriptions import SubscriptionStore
from feed.serve.limits import COMPACT_SECONDS, MAX_STREAMS, MAX_STREAMS_PER_CLIENT, STALL_SECONDS
from feed.serve.watch import FeedWatch
from protocol import CheckpointError
from protocol._http import IDLE_TIMEOUT, HttpError
from protocol.destinations import DEFAULT_PUSH_ALLOW, Destinations

__all__ = [
    "COMPACT_SECONDS",
    "CONFIG",
    "MAX_STREAMS",
    "MAX_STREAMS_PER_CLIENT",
    "STALL_SECONDS",
    "STATE",
    "ServerConfig",
    "ServerState",
    "state_of",
]

POLL_SECONDS = 0.5
HEARTBEAT_SECONDS = 5.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    log: str
    host: str = "127.0.0.1"
    port: int = 8080
    token: str | None = None
    poll_seconds: float = POLL_SECONDS
    heartbeat_seconds: float = HEARTBEAT_SECONDS
    #: automatic retention (DESIGN §8): keep this many time units below each frontier
    #: (milliseconds with the wallclock clock) and compact what is older; None: keep all
    retain: int | None = None
    compact_seconds: float = COMPACT_SECONDS
    #: where push subscriptions may point (``--push-allow``; protocol/destinations.py)
    push_allow: Destinations = field(default_factory=lambda: Destinations.parse(DEFAULT_PUSH_ALLOW))
    #: pull streams open at a time, in all and from one client address (429/503 past them)
    max_streams: int = MAX_STREAMS
    max_streams_per_client: int = MAX_STREAMS_PER_CLIENT
    #: a pull stream whose consumer takes none of a write for this long is closed
    stall_seconds: float = STALL_SECONDS
    #: a connection that sends no whole request for this many seconds is closed
    idle_timeout: float = IDLE_TIMEOUT


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # subscription: a push subscription's name; "" for a pull stream
        self.updates = Counter(
            "tidefeed_updates_served",
            "Updates sent to consumers (push: ACKed by the receiver)",
            ["feed", "subscription", "via"],
            registry=r,
        )
        self.bytes = Counter(
            "tidefeed_bytes_sent",
            "Body bytes sent to consumers (push: ACKed by the receiver)",
            ["feed", "subscription", "via"],
            registry=r,
        )
        self.push_errors = Counter(
            "tidefeed_push_errors", "Failed pushes", ["feed", "subscription"], registry=r
        )
        self.lag_times = Gauge(
            "tidefeed_subscriber_lag_times",
            "Feed frontier minus the subscriber's ACKed frontier",
            ["feed", "subscription"],
            registry=r,
        )
        self.lag_seconds = Gauge(
            "tidefeed_subscriber_lag_seconds",
            "Seconds the subscriber has been behind the feed's frontier (0: caught up)",
            ["feed", "subscription"],
            registry=r,
        )
        self.quarantined = Gauge(
            "tidefeed_quarantined_rows",
            "Input rows the emitter set aside as bad, in committed transactions",
            ["feed"],
            registry=r,
        )

    def forget(self, feed: str, subscription: str) -> None:
        """Drop every series of a deleted subscription (a lag left behind would keep
        growing, and an alert on it would never clear)."""
        for metric in (self.updates, self.bytes):
            for via in ("push", "pull"):
                with contextlib.suppress(KeyError):
                    metric.remove(feed, subscription, via)
        for gauge in (self.lag_times, self.lag_seconds):
            with contextlib.suppress(KeyError):
                gauge.remove(feed, subscription)
        with contextlib.suppress(KeyError):
            self.push_errors.remove(feed, subscription)


CONFIG = web.AppKey("config", ServerConfig)


class ServerState:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.streams: collections.Counter[str] = collections.Counter()  # open, by client
        self.metrics = Metrics()
        self.readers: dict[str, FeedReader] = {}
        self.subs: dict[str, SubscriptionStore] = {}
        #: per feed, the one poll of its commits that its followers wait on
        self.watches: dict[str, FeedWatch] = {}
        self.tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._quarantine: dict[str, dict[int, int]] = {}  # feed -> quarantine folder -> rows
        #: set when the server shuts down: following streams end at once (aiohttp waits
        #: for running handlers, and a followed stream never ends by itself); the event
        #: binds to the server's loop when first waited on
        self.stopping = asyncio.Event()

    def feed_names(self) -> list[str]:
        return feed_names(self.config.log)

    def reader(self, feed: str) -> FeedReader:
        if not valid_feed_name(feed):
            raise HttpError(404, "unknown_feed", f"{feed!r} is not a valid feed name")
        r = self.readers.get(feed)
        if r is None:
            try:
                r = FeedReader(self.config.log, feed)
            except CheckpointError:
                raise HttpError(404, "unknown_feed", f"no feed {feed!r} in this log") from None
            self.readers[feed] = r
        else:
            r.refresh()
        return r

    def count_quarantined(self) -> None:
        """Set the quarantined-rows gauge of every feed: the rows in the quarantine folders
        of committed transactions (a folder is read once). A folder of a transaction that
        did not commit is not counted, whether its seq is still free or was taken by a
        claim or a compaction: the emitter's next start deletes it."""
        for feed in self.feed_names():
            reader = self.reader(feed)
            fl, seen = reader.log, self._quarantine.setdefault(feed, {})
            committed = reader.checkpoint.seq if reader.checkpoint else 0
            commits = CheckpointStore(fl)
            for n in fl.numbered_dirs("quarantine"):
                if n > committed or n in seen:
                    continue
                if commits.made_by(n) in ("claim", "compaction"):
                    continue  # (no transaction committed at n; not kept in seen)
                rows = 0
                for info in fl.list_dir(fl.path("quarantine", str(n))):
                    if info.base_name.endswith(".json"):
                        with fl.fs.open_input_stream(info.path) as f:
                            rows += f.read().count(b"\n")
                seen[n] = rows
            self.metrics.quarantined.labels(feed).set(sum(seen.values()))

    def watch(self, feed: str) -> FeedWatch:
        """The watch of ``feed``'s commits (a valid feed name: a reader of it exists)."""
        w = self.watches.get(feed)
        if w is None:
            commits = CheckpointStore(FeedLog(self.config.log, feed))
            w = self.watches[feed] = FeedWatch(commits, self.config.poll_seconds)
        return w

    def sub_store(self, feed: str) -> SubscriptionStore:
        if feed not in self.subs:
            self.subs[feed] = SubscriptionStore(self.reader(feed).log)
        return self.subs[feed]


STATE = web.AppKey("state", ServerState)


def state_of(request: web.Request) -> ServerState:
    return request.app[STATE]
