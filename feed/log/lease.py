"""An emitter's lease on its feed: a second emitter started by mistake is refused.

Epochs already make two emitters safe (the newer one fences the older out at its next
commit: feed/log/commits.py), but a second ``emit --follow`` started by mistake silently
took a running one's feed. So a running emitter holds ``<log>/<feed>/_lease.json``
(``{"host", "pid", "since", "renewed", "token"}``), written when it opens the feed and
renewed every :data:`RENEW_SECONDS` by a thread. Another emitter is refused, with a
message naming the holder, while the lease is live; ``--take-over`` takes it anyway
(the holder is then fenced out by the epoch at its next commit, as before).

A lease is dead when it was not renewed for :data:`LEASE_SECONDS` (its holder died, or
lost the log), or when its holder ran on this host and its process is gone (a SIGKILLed
emitter restarted at once is not kept waiting). The same process may open a feed again
(tests, a group's members): only another process is refused.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import orjson

from feed.log.store import FeedLog
from protocol import CheckpointError

__all__ = ["LEASE_SECONDS", "RENEW_SECONDS", "Lease", "read_lease"]

LEASE_SECONDS = 30.0
RENEW_SECONDS = 10.0
_FILE = "_lease.json"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: it exists
    return True


def read_lease(feedlog: FeedLog) -> dict[str, Any] | None:
    """The feed's lease file as written (None: none, or a torn write)."""
    try:
        d = orjson.loads(feedlog.read_bytes(feedlog.path(_FILE)))
    except (FileNotFoundError, orjson.JSONDecodeError, OSError):
        return None
    return d if isinstance(d, dict) else None


class Lease:
    """The lease of one feed, held from :meth:`acquire` to :meth:`release`."""

    def __init__(self, feedlog: FeedLog, *, take_over: bool, log: logging.Logger) -> None:
        self.feedlog, self.take_over, self.log = feedlog, take_over, log
        self.path = feedlog.path(_FILE)
        self.me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": datetime.now(UTC).isoformat(timespec="seconds"),
            "token": uuid.uuid4().hex,
        }
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: the token of the lease this one took over: a late renewal of that holder may
        #: still write over this lease once, and is written over again
        self._took: str | None = None

    def _read(self) -> dict[str, Any] | None:
        return read_lease(self.feedlog)  # none, or a torn write: no live holder to name

    def holder(self) -> dict[str, Any] | None:
        """The live lease of another process, if any."""
        d = self._read()
        if d is None or d.get("token") == self.me["token"]:
            return None
        same_host = d.get("host") == self.me["host"]
        if same_host and d.get("pid") == self.me["pid"]:
            return None  # this process
        if time.time() - float(d.get("renewed", 0)) > LEASE_SECONDS:
            return None  # not renewed: its holder is gone
        if same_host and isinstance(d.get("pid"), int) and not _running(d["pid"]):
            return None  # its process is gone
        return d

    def _write(self) -> None:
        self.feedlog.write_bytes(self.path, orjson.dumps({**self.me, "renewed": time.time()}))

    def acquire(self) -> None:
        held = self.holder()
        if held is not None:
            age = time.time() - float(held.get("renewed", 0))
            who = f"pid {held.get('pid')} on {held.get('host')} since {held.get('since')}"
            if not self.take_over:
                raise CheckpointError(
                    f"feed {self.feedlog.feed!r} is being emitted by {who} (its lease was "
                    f"renewed {age:.0f} s ago): stop that emitter first, or give "
                    "--take-over to take the feed from it (it stops at its next commit)"
                )
            self.log.warning("feed %s: taking it over from %s", self.feedlog.feed, who)
            self._took = held.get("token")
        self._write()
        self._thread = threading.Thread(target=self._renew, daemon=True, name="tidefeed-lease")
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_SECONDS) and self.renew_once():
            pass

    def renew_once(self) -> bool:
        """One renewal; False once another emitter took the feed over (left to it). The
        holder this one took over from may have read its lease just before the take-over
        and renewed it just after: that write is written over here, not obeyed."""
        d = self._read()
        held = self.me["token"] if d is None else d.get("token")
        if held != self.me["token"]:
            if self._took is None or held != self._took:
                return False  # taken over: leave it to the new holder
            self.log.warning(
                "feed %s: its lease was renewed by the emitter it took over from; taken back",
                self.feedlog.feed,
            )
        try:
            self._write()
        except OSError as e:  # the log is away for a moment: the next turn tries again
            self.log.warning("feed %s: cannot renew its lease: %s", self.feedlog.feed, e)
        return True

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        d = self._read()
        if d is not None and d.get("token") == self.me["token"]:
            with contextlib.suppress(OSError):
                self.feedlog.delete_file(self.path)
