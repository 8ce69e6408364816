"""Durable subscriptions of a feed: push (a receiver URL), named pull, and the emitter's hold.

Each subscription is a small JSON file ``<log>/<feed>/_subscriptions/<name>.json`` with its
URL, format, the last ACKed frontier and its status. ACKs arrive many times a second while
a subscription catches up, so positions are kept in memory and written in batches (at most
every :data:`FLUSH_SECONDS`), never per request. A lost batch only means a receiver is asked
again for its frontier, which the push session does anyway.

The emitter's own ``--push`` target is a subscription too (:class:`PushHold`, named
:data:`EMITTER_HOLD`): the emitter writes its receiver's ACKs there, so retention keeps what
that receiver still needs exactly as it does for the server's subscriptions. It has no
``url`` (the server does not push to it) and ``held_by`` names the receiver.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from feed.log.store import FeedLog
from protocol import CODECS, CheckpointError

__all__ = [
    "EMITTER_HOLD",
    "FLUSH_SECONDS",
    "PushHold",
    "Subscription",
    "SubscriptionStore",
    "read_subscription",
    "valid_subscription",
]

FLUSH_SECONDS = 2.0
#: the name of the subscription that holds retention for ``tidefeed emit --push``
EMITTER_HOLD = "emit-push"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def valid_subscription(name: str) -> bool:
    return bool(_NAME.fullmatch(name)) and ".." not in name


def read_subscription(log: FeedLog, path: str) -> Subscription:
    """The subscription in file ``path``; a file that is not one (damaged or edited by
    hand) is a :class:`~protocol.CheckpointError` naming it: nothing starts on a guess
    about what a receiver holds, and retention folds nothing meanwhile."""
    try:
        d = orjson.loads(log.read_bytes(path))
        sub = Subscription(**d)
        stem = path.rsplit("/", 1)[-1].removesuffix(".json")
        if sub.name != stem or not valid_subscription(stem):
            raise TypeError(f"its name is {sub.name!r}, not the file's")
        if not isinstance(sub.feed, str):
            raise TypeError("'feed' must be a string")
        if sub.acked is not None and (type(sub.acked) is not int or sub.acked < 0):
            raise TypeError(f"'acked' must be a frontier, got {sub.acked!r}")
    except (orjson.JSONDecodeError, TypeError) as e:
        raise CheckpointError(
            f"subscription file {path} is damaged ({e}); restore it, or delete it to drop "
            "that subscription (its receiver then starts again from a snapshot)"
        ) from None
    return sub


@dataclass(slots=True)
class Subscription:
    name: str
    feed: str
    url: str | None = None  # None: a named pull subscriber that ACKs by POST
    format: str = "ndjson"
    token: str | None = None
    acked: int | None = None
    acked_at: float | None = None
    status: str = "active"  # active | stopped
    reason: str = ""
    created: float = field(default_factory=time.time)
    last_error: str = ""  # push: the last failure (kept after recovery, for operators)
    retrying_since: float | None = None  # push: failing since then; None once an ACK came
    held_by: str = ""  # the emitter's hold: the receiver its --push delivers to

    def failed(self, error: str) -> None:
        """A delivery failed (it is retried): keep the error, and since when it fails."""
        self.last_error = error[:1000]
        if self.retrying_since is None:
            self.retrying_since = time.time()

    @property
    def kind(self) -> str:
        return "push" if self.url else "emitter push" if self.held_by else "pull"

    def public(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("token")
        if not self.held_by:
            d.pop("held_by")
        d["kind"] = self.kind
        return d

    @classmethod
    def from_request(cls, feed: str, name: str, body: Any) -> Subscription:
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        url = body.get("url")
        if url is not None and (
            not isinstance(url, str) or not url.startswith(("http://", "https://"))
        ):
            raise ValueError("'url' must be an http(s) URL")
        fmt = body.get("format", "ndjson")
        if fmt not in CODECS:
            raise ValueError(f"'format' must be one of {', '.join(CODECS)}")
        token = body.get("token")
        if token is not None and not isinstance(token, str):
            raise ValueError("'token' must be a string")
        if token is not None and not token.strip():
            # an empty bearer token is no token: leave it out for a receiver without one
            raise ValueError("'token' is empty: leave it out, or give the receiver's token")
        return cls(name=name, feed=feed, url=url, format=fmt, token=token)


class SubscriptionStore:
    """The subscriptions of one feed, in memory, written to the log in batches."""

    def __init__(self, log: FeedLog) -> None:
        self.log = log
        self.dir = log.path("_subscriptions")
        self.subs: dict[str, Subscription] = {}
        self._dirty: set[str] = set()
        self._last_flush = 0.0
        for info in log.list_dir(self.dir):
            if info.base_name.endswith(".json"):
                sub = read_subscription(log, info.path)
                self.subs[sub.name] = sub

    def put(self, sub: Subscription) -> None:
        self.subs[sub.name] = sub
        self._write(sub)

    def delete(self, name: str) -> bool:
        if self.subs.pop(name, None) is None:
            return False
        self._dirty.discard(name)
        self.log.delete_file(f"{self.dir}/{name}.json")
        return True

    def ack(self, name: str, frontier: int | None) -> None:
        sub = self.subs.get(name)
        if sub is None:
            return
        if frontier is not None and (sub.acked is None or frontier > sub.acked):
            sub.acked, sub.acked_at = frontier, time.time()
            self._dirty.add(name)
        self.flush()

    def stop(self, name: str, reason: str) -> None:
        sub = self.subs.get(name)
        if sub is not None:
            sub.status, sub.reason = "stopped", reason
            self._write(sub)

    def flush(self, *, force: bool = False) -> None:
        """Write the changed positions, at most every FLUSH_SECONDS unless forced."""
        now = time.monotonic()
        if not self._dirty or (not force and now - self._last_flush < FLUSH_SECONDS):
            return
        for name in list(self._dirty):
            sub = self.subs.get(name)
            if sub is not None:
                self._write(sub)
        self._dirty.clear()
        self._last_flush = now

    def lowest_ack(self) -> int | None:
        """The lowest ACKed frontier of all subscriptions (what retention must keep)."""
        acks = [s.acked or 0 for s in self.subs.values()]
        return min(acks) if acks else None

    def _write(self, sub: Subscription) -> None:
        # (it may hold the receiver's bearer token)
        self.log.write_bytes(f"{self.dir}/{sub.name}.json", orjson.dumps(asdict(sub)), private=True)


class PushHold:
    """The emitter's ``--push`` receiver as a subscription (:data:`EMITTER_HOLD`), so that
    retention never folds a time it has not ACKed.

    Made before the emitter's first delivery: it keeps the last run's ACK when the receiver
    is the same one, and holds everything (no ACK) for a new receiver until it answers.
    ACKs are written at most every :data:`FLUSH_SECONDS` (and by :meth:`flush`): the file
    may lag behind the receiver, which only keeps more than needed."""

    def __init__(self, log: FeedLog, url: str) -> None:
        self.log = log
        self.path = f"{log.path('_subscriptions')}/{EMITTER_HOLD}.json"
        old = None
        if log.exists(self.path):
            old = read_subscription(log, self.path)
        if old is not None and old.held_by == url:
            self.sub = old
            self.sub.status, self.sub.reason = "active", ""
        else:
            self.sub = Subscription(name=EMITTER_HOLD, feed=log.feed, held_by=url)
        self._dirty = False
        self._last = 0.0
        self._write()

    def ack(self, frontier: int | None) -> None:
        sub = self.sub
        if frontier is not None and (sub.acked is None or frontier > sub.acked):
            sub.acked, sub.acked_at, sub.retrying_since = frontier, time.time(), None
            self._dirty = True
        if self._dirty and time.monotonic() - self._last >= FLUSH_SECONDS:
            self._write()

    def failed(self, error: str) -> None:
        self.sub.failed(error)
        self._dirty = True  # (shown by tidefeed status)
        if time.monotonic() - self._last >= FLUSH_SECONDS:
            self._write()

    def stop(self, reason: str) -> None:
        self.sub.status, self.sub.reason = "stopped", reason[:1000]
        self._write()

    def flush(self) -> None:
        if self._dirty:
            self._write()

    def _write(self) -> None:
        self.log.write_bytes(self.path, orjson.dumps(asdict(self.sub)), private=True)
        self._dirty, self._last = False, time.monotonic()
