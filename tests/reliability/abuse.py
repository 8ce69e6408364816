"""The abuse phase: hostile clients against the running servers while transactions flow.

Three kinds at once, for the length of the phase:

- **unread followers**: ``follow=true`` pull streams of the whole feed whose clients never
  read a byte (each from its own loopback address, so the per-client cap does not stop
  them: the total cap and the stall timeout must);
- **slow headers**: connections to the server and every receiver that drip a request's
  headers a byte at a time and never finish them (the idle timeout must close them);
- **decompression bombs and deep nesting**: bodies that inflate a thousandfold or nest
  30,000 levels, sent to the receivers and the server in turn (each must get a 4xx).

Meanwhile :class:`Abuse` samples the server's and the receivers' RSS: the figures say
what the attacks cost, and whether the server gave the memory back once its streams were
closed. The harness then checks, as after every phase, that no consumer lost or
duplicated anything.
"""

from __future__ import annotations

import contextlib
import gzip
import http.client
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from protocol import cdcv2_schema

from ..corpus.make_corpus import avro_container, deflate

__all__ = ["Abuse", "AbuseFigures"]

AVRO = "application/vnd.tidefeed.cdcv2+avro"
NDJSON = "application/x-ndjson"
#: the feed the bombs are aimed at on the receivers: refused bodies must leave it absent
TARGET = "abuse"
RECORD = {"type": "record", "name": "data", "fields": [{"name": "id", "type": "long"}]}


def _avro_deflate_bomb(inflated: int = 64 << 20) -> bytes:
    """One deflate block of zeros: ~64 KB on the wire, ``inflated`` bytes once inflated."""
    schema = orjson.dumps(cdcv2_schema(RECORD))
    return avro_container(schema, b"deflate", deflate(b"\x00" * inflated), 1000)


def _bombs() -> list[tuple[str, str, str, dict[str, str], bytes]]:
    """(what, method, content type, headers, body); the path is filled in per target."""
    return [
        (
            "gzip bomb",
            "POST",
            NDJSON,
            {"Content-Encoding": "gzip"},
            gzip.compress(b" " * (32 << 20)),
        ),
        ("avro deflate bomb", "POST", AVRO, {}, _avro_deflate_bomb()),
        ("ndjson 30000 deep", "POST", NDJSON, {}, b"[" * 30_000 + b"]" * 30_000 + b"\n"),
    ]


def _rss(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass
class AbuseFigures:
    unread_streams: int = 0
    unread_refused: int = 0  # answered 429/503 at once (a cap)
    slow_connections: int = 0
    slow_closed: int = 0  # closed by the server before the phase ended
    bombs: int = 0
    bombs_refused: int = 0  # a 4xx
    notes: list[str] = field(default_factory=list)
    #: per role: RSS before the phase, its peak during it, and after the streams closed
    rss_mb: dict[str, dict[str, int]] = field(default_factory=dict)
    #: the server's /healthz answer times during the phase (ms): p99 and worst
    healthz_ms: dict[str, float] = field(default_factory=dict)
    healthz_failed: int = 0

    def ok(self) -> bool:
        return self.bombs_refused == self.bombs and self.slow_closed == self.slow_connections

    def line(self) -> str:
        rss = ", ".join(
            f"{role} idle {r['idle']} peak {r['peak']} after {r['after']}"
            for role, r in self.rss_mb.items()
        )
        return (
            f"abuse phase: {self.unread_streams} unread followers ({self.unread_refused} "
            f"refused by a cap), {self.slow_connections} slow-header connections "
            f"({self.slow_closed} closed by the idle timeout), {self.bombs} bombs "
            f"({self.bombs_refused} refused 4xx); server /healthz p99 "
            f"{self.healthz_ms.get('p99')} ms, worst {self.healthz_ms.get('worst')} ms "
            f"({self.healthz_failed} failed); "
            f"RSS MB {rss}"
        )


class Abuse:
    """Runs the attacks on a thread; :meth:`finish` closes them and returns the figures.

    ``pids()`` gives the current ``{role: pid}`` of the processes to watch (a process the
    harness restarted is followed under its role)."""

    def __init__(
        self,
        *,
        server: int,
        receivers: list[int],
        feed: str,
        unread: int,
        slow: int,
        pids: Callable[[], dict[str, int]],
    ) -> None:
        self.server, self.receivers, self.feed = server, receivers, feed
        self.unread, self.slow, self.pids = unread, slow, pids
        self.figures = AbuseFigures()
        self._socks: list[socket.socket] = []
        self._slow: list[socket.socket] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._peak: Counter[str] = Counter()
        self._idle: dict[str, int] = {}
        self._health: list[float] = []

    # ---- the attacks ----------------------------------------------------------------
    def _open_unread(self) -> None:
        path = f"/v1/feeds/{self.feed}/changes?after=0&follow=true&format=ndjson"
        for i in range(self.unread):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.bind((f"127.0.9.{i + 1}", 0))
            s.connect(("127.0.0.1", self.server))
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            self._socks.append(s)
        self.figures.unread_streams = len(self._socks)

    def _drip(self) -> None:
        """Every slow connection gets one more header byte every half second."""
        head = b"POST /v1/push/x HTTP/1.1\r\nHost: a\r\nX-Slow: " + b"a" * 100_000
        ports = [self.server, *self.receivers]
        for i in range(self.slow):
            s = socket.create_connection(("127.0.0.1", ports[i % len(ports)]), timeout=5)
            s.setblocking(False)
            self._slow.append(s)
        self.figures.slow_connections = len(self._slow)
        closed: set[int] = set()
        at = 0
        while not self._stop.wait(0.5):
            for i, s in enumerate(self._slow):
                if i in closed:
                    continue
                try:
                    if s.recv(1024) == b"":
                        closed.add(i)
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    closed.add(i)
                    continue
                try:
                    s.send(head[at : at + 1])
                except OSError:
                    closed.add(i)
            at += 1
        self.figures.slow_closed = len(closed)

    def _bomb(self) -> None:
        bombs = _bombs()
        targets = [(p, f"/v1/push/{TARGET}") for p in self.receivers]
        targets.append((self.server, f"/v1/feeds/{self.feed}/subscriptions/{TARGET}"))
        n = 0
        while not self._stop.wait(1.0):
            what, method, ctype, headers, body = bombs[n % len(bombs)]
            port, path = targets[n % len(targets)]
            if port == self.server:
                method = "PUT"
            n += 1
            self.figures.bombs += 1
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                conn.request(
                    method,
                    path,
                    body=body,
                    headers={"Content-Type": ctype, "Tidefeed-Epoch": "1", **headers},
                )
                status = conn.getresponse().status
                conn.close()
            except OSError as e:
                self.figures.notes.append(f"abuse: {what} to :{port}: {e}")
                continue
            if 400 <= status < 500:
                self.figures.bombs_refused += 1
            else:
                self.figures.notes.append(f"abuse: {what} to :{port}{path} got {status}")

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            for role, pid in self.pids().items():
                self._peak[role] = max(self._peak[role], _rss(pid))
            began = time.monotonic()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.server, timeout=10)
                conn.request("GET", "/healthz")
                conn.getresponse().read()
                conn.close()
                self._health.append((time.monotonic() - began) * 1000)
            except OSError:
                self.figures.healthz_failed += 1

    # ---- the phase --------------------------------------------------------------------
    def start(self) -> None:
        self._idle = {role: _rss(pid) for role, pid in self.pids().items()}
        self._peak.update(self._idle)
        self._open_unread()
        for target in (self._drip, self._bomb, self._sample):
            t = threading.Thread(target=target, daemon=True)
            t.start()
            self._threads.append(t)

    def finish(self, settle: float = 10.0) -> AbuseFigures:
        """Close the unread streams, stop the attacks, and give the server ``settle``
        seconds to let go of what they held."""
        # which unread streams a cap refused at once: those the server answered and closed
        for s in self._socks:
            s.setblocking(False)
            with contextlib.suppress(OSError):
                first = s.recv(64)
                if first.startswith((b"HTTP/1.1 429", b"HTTP/1.1 503")):
                    self.figures.unread_refused += 1
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
        for s in [*self._socks, *self._slow]:
            with contextlib.suppress(OSError):
                s.close()
        if self._health:
            ranked = sorted(self._health)
            self.figures.healthz_ms = {
                "p99": round(ranked[min(len(ranked) - 1, int(0.99 * len(ranked)))], 1),
                "worst": round(ranked[-1], 1),
            }
        time.sleep(settle)
        after = {role: _rss(pid) for role, pid in self.pids().items()}
        self.figures.rss_mb = {
            role: {
                "idle": self._idle.get(role, 0) >> 20,
                "peak": self._peak[role] >> 20,
                "after": after[role] >> 20,
            }
            for role in after
        }
        return self.figures
