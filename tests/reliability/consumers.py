"""The consumers the reliability harness keeps running next to its attacks: pull followers
(named ones that ACK and hold retention, anonymous ones that start again from a snapshot
when compaction overtakes them) and a monitor of commit -> ACK latency and peak RSS."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from feed.log.checkpoint import CheckpointStore
from protocol import record_key


def get(url: str, timeout: float = 10) -> tuple[int | None, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        return None, str(e).encode()


def put_json(url: str, body: dict[str, Any]) -> None:
    req = urllib.request.Request(url, data=orjson.dumps(body), method="PUT")
    urllib.request.urlopen(req, timeout=10).close()


def receiver_frontier(port: int, feed: str = "bank") -> int | None:
    status, body = get(f"http://127.0.0.1:{port}/v1/push/{feed}")
    return orjson.loads(body).get("frontier") if status == 200 else None


def quantile(values: list[float], q: float) -> float | None:
    v = sorted(values)
    return round(v[min(len(v) - 1, int(q * len(v)))], 2) if v else None


class Followers:
    """``follow=true`` pull consumers of the feed server, reconnecting from their last
    complete time when the server dies. The first ``named`` of them are named pull
    subscriptions (``pull-<i>``) that ACK every complete time, so retention must keep what
    they still need: one overtaken by compaction is an error. The others are anonymous: when
    compaction overtakes one (a last ``compacted`` line, or a 410 on reconnecting) it drops
    its collection and starts again from a snapshot, as a consumer holding nothing does; the
    last one goes away for 5-15 s at a time, so that this happens.
    Each keeps its own accumulated collection; at the end each must equal the table."""

    def __init__(self, n: int, port: int, *, named: int = 0, feed: str = "bank") -> None:
        self.n, self.port, self.named, self.feed = n, port, named, feed
        self.collections = [Counter() for _ in range(n)]
        self.frontiers: list[int | None] = [None] * n
        #: when each follower first held each frontier (monotonic), for the lag figures
        self.reached: list[dict[int, float]] = [{} for _ in range(n)]
        self.overtaken = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    @property
    def wanderer(self) -> int | None:
        """The follower that goes away now and then (the last one, when anonymous)."""
        return self.n - 1 if self.n > self.named else None

    def name(self, i: int) -> str | None:
        return f"pull-{i}" if i < self.named else None

    def subscribe(self) -> None:
        for i in range(self.named):
            url = f"http://127.0.0.1:{self.port}/v1/feeds/{self.feed}/subscriptions/pull-{i}"
            put_json(url, {})

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _restart_from_snapshot(self, i: int) -> None:
        self.collections[i].clear()
        self.frontiers[i] = None
        self.overtaken += 1

    async def _main(self) -> None:
        import aiohttp

        from protocol import Compacted, Progress, Updates, get_codec

        base = f"http://127.0.0.1:{self.port}/v1/feeds/{self.feed}"
        timeout = aiohttp.ClientTimeout(total=None, sock_read=30)

        async def ack(s: aiohttp.ClientSession, name: str, frontier: int) -> None:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                async with s.post(f"{base}/subscriptions/{name}/ack", json={"frontier": frontier}):
                    pass

        async def one(i: int) -> None:
            codec = get_codec("ndjson")
            pending: Counter = Counter()
            name = self.name(i)
            # the last follower is anonymous and goes away for a while now and then, as a
            # consumer on a laptop does: retention compacts past it, and it must start over
            wanders = i == self.wanderer
            rnd = random.Random(i)
            while not self._stop.is_set():
                after = self.frontiers[i]
                q = f"?follow=true&format=ndjson{'' if after is None else f'&after={after}'}"
                try:
                    async with (
                        asyncio.timeout(rnd.uniform(5, 15) if wanders else None),
                        aiohttp.ClientSession(timeout=timeout) as s,
                        s.get(f"{base}/changes{q}") as r,
                    ):
                        if r.status == 410 and name is None:
                            self._restart_from_snapshot(i)
                            continue
                        if r.status != 200:
                            if r.status == 410:
                                self.errors.append(f"follower {name}: 410 at {after}")
                            await asyncio.sleep(0.5)
                            continue
                        pending.clear()
                        async for line in r.content:
                            if self._stop.is_set():
                                return
                            if not line.strip():
                                continue
                            for m in codec.decode(line):
                                if isinstance(m, Updates):
                                    for u in m:
                                        pending[record_key(u.record)] += u.diff
                                elif isinstance(m, Progress) and not m.is_announcement():
                                    if m.counts:  # a time is complete: fold its updates in
                                        self.collections[i].update(pending)
                                        pending.clear()
                                    self.frontiers[i] = m.upper
                                    self.reached[i].setdefault(m.upper, time.monotonic())
                                    if name is not None:
                                        await ack(s, name, m.upper)
                except Compacted as e:
                    if name is not None:
                        self.errors.append(f"follower {name} overtaken by compaction: {e}")
                        await asyncio.sleep(0.5)
                    else:
                        self._restart_from_snapshot(i)
                except TimeoutError:
                    await asyncio.sleep(rnd.uniform(5, 15) if wanders else 0.5)
                except (aiohttp.ClientError, OSError):
                    await asyncio.sleep(0.5)
                except Exception as e:
                    self.errors.append(f"follower {i}: {type(e).__name__}: {e}")
                    await asyncio.sleep(0.5)

        await asyncio.gather(*(one(i) for i in range(self.n)))

    def results(self) -> list[Counter]:
        return [+c for c in self.collections]


#: the harness's phases: recovery from kills, steady load, hostile clients
PHASES = ("crash", "load", "abuse")


class Monitor:
    """Samples, every 0.2 s: each process's RSS (peak kept per role) and, for every new
    committed frontier, how long until every receiver ACKs it and every follower holds it.
    Latencies are kept per phase (:data:`PHASES`)."""

    def __init__(
        self,
        procs: Callable[[], list[tuple[str, Any]]],
        store: CheckpointStore,
        receivers: Callable[[], list[int]],
        followers: Followers,
    ) -> None:
        self.procs, self.store, self.receivers, self.followers = procs, store, receivers, followers
        self.phase = "crash"
        self.peak_rss: Counter = Counter()
        self.ack_latency: dict[str, list[float]] = {p: [] for p in PHASES}
        self.follow_latency: dict[str, list[float]] = {p: [] for p in PHASES}
        self._committed: dict[int, tuple[float, str]] = {}  # frontier -> (seen at, phase)
        self._acked: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    @staticmethod
    def rss(pid: int) -> int:
        total = 0
        pids = [pid]
        with contextlib.suppress(OSError):  # the JVM is a child of the emitter
            pids += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        for p in pids:
            with contextlib.suppress(OSError, ValueError):
                for line in Path(f"/proc/{p}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for role, proc in self.procs():
                if proc.alive() and proc.p is not None:
                    self.peak_rss[role] = max(self.peak_rss[role], self.rss(proc.p.pid))
            with contextlib.suppress(Exception):
                cp = self.store.latest()
                now = time.monotonic()
                if cp is not None and cp.frontier not in self._committed:
                    self._committed[cp.frontier] = (now, self.phase)
                acked = [receiver_frontier(p) for p in self.receivers()]
                for f, (t0, phase) in self._committed.items():
                    if f not in self._acked and all(a is not None and a >= f for a in acked):
                        self.ack_latency[phase].append(now - t0)
                        self._acked.add(f)

    def follower_lags(self) -> dict[str, list[float]]:
        """Per phase: for every committed frontier, how long until the slowest follower
        held it (a follower that restarted from a snapshot may skip it: the time it first
        held anything at or above it counts). The wanderer, away on purpose, is left out."""
        out: dict[str, list[float]] = {p: [] for p in PHASES}
        steady = [r for i, r in enumerate(self.followers.reached) if i != self.followers.wanderer]
        for f, (t0, phase) in self._committed.items():
            worst = 0.0
            for reached in steady:
                later = [t for g, t in reached.items() if g >= f]
                if not later:
                    break
                worst = max(worst, min(later) - t0)
            else:
                out[phase].append(max(0.0, worst))
        return out

    def figures(self) -> dict[str, Any]:
        lags = self.follower_lags()
        out: dict[str, Any] = {}
        for phase in PHASES:
            acks = self.ack_latency[phase]
            out[phase] = {
                "commits_acked_by_every_receiver": len(acks),
                "commit_to_ack_p50_s": quantile(acks, 0.5),
                "commit_to_ack_p99_s": quantile(acks, 0.99),
                "commit_to_every_follower_p50_s": quantile(lags[phase], 0.5),
                "commit_to_every_follower_p99_s": quantile(lags[phase], 0.99),
            }
        out["peak_rss_mb"] = {k: round(v / 2**20) for k, v in self.peak_rss.items()}
        return out
