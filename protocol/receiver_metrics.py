"""The receiver's ``GET /metrics`` (Prometheus text): per feed, its frontier, epoch and
pending updates as they are when scraped, and counters of what pushes brought: bodies by
outcome, bytes, commits and committed updates.

A feed label is only ever a feed the receiver holds: a refused body naming no such feed
is counted under ``feed=""``, so a client cannot grow the series by inventing names."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .state import Consumer

__all__ = ["ReceiverMetrics"]


class ReceiverMetrics:
    def __init__(self, consumers: Callable[[], Mapping[str, Consumer]]) -> None:
        self.registry = CollectorRegistry()
        self.bodies = Counter(
            "tidefeed_receiver_bodies",
            "Push bodies by outcome: accepted, or the refusal's status and code",
            ["feed", "outcome"],
            registry=self.registry,
        )
        self.bytes = Counter(
            "tidefeed_receiver_body_bytes",
            "Bytes of push bodies read (as sent, before any Content-Encoding is undone)",
            ["feed"],
            registry=self.registry,
        )
        self.commits = Counter(
            "tidefeed_receiver_commits",
            "Pushes that moved a feed's frontier (one database transaction each)",
            ["feed"],
            registry=self.registry,
        )
        self.updates = Counter(
            "tidefeed_receiver_committed_updates",
            "Updates made durable at completed times",
            ["feed"],
            registry=self.registry,
        )
        self.registry.register(_Feeds(consumers))


class _Feeds(Collector):
    """The feeds' state, read from their consumers at each scrape."""

    def __init__(self, consumers: Callable[[], Mapping[str, Consumer]]) -> None:
        self.consumers = consumers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        # (a consumer of a name that never got a whole push holds nothing: not a feed)
        feeds = {f: c for f, c in self.consumers().items() if c.frontier is not None or c.pending}
        count = GaugeMetricFamily("tidefeed_receiver_feeds", "Feeds this receiver holds")
        count.add_metric([], len(feeds))
        yield count
        gauges = {
            "frontier": ("tidefeed_receiver_frontier", "The feed's committed frontier"),
            "epoch": ("tidefeed_receiver_epoch", "The newest producer epoch the feed accepted"),
            "pending": (
                "tidefeed_receiver_pending_updates",
                "Updates received at times not complete yet",
            ),
        }
        for attr, (name, doc) in gauges.items():
            family = GaugeMetricFamily(name, doc, labels=["feed"])
            for feed, c in sorted(feeds.items()):
                family.add_metric([feed], float(getattr(c, attr) or 0))
            yield family
