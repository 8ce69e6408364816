"""The reliability harness (``make reliability``): attack the running system, count losses.

Real ``tidefeed`` processes: a keyed ``emit --follow --push`` (transaction granularity,
logical clock) pushing through a fault-injecting TCP proxy into receiver A; a ``serve`` with
a push subscription into receiver B; Debezium files arriving a few at a time. While they
run, the harness SIGKILLs and restarts random processes (and ``compact`` runs it starts),
injects faults (proxy resets, stalls, 500s and cut answers; the receiver's SQLite locked by
another process; an empty newest commit file), fuzzes every decoder and HTTP endpoint with
bad input, and keeps pull followers streaming. At the end every consumer must hold exactly
the source table.

Prints one line: ``reliability: crashes=N faults=F lost=L duplicated=D bad_inputs=B
rejected=R load_ok=yes|no`` (exit 0 only when nothing was lost or duplicated, every bad
input was rejected and the load held). ``RELIABILITY=long`` runs the long profile.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from feed.checkpoint import CheckpointStore
from feed.demo_data import ACCOUNTS_SCHEMA, generate_bank
from feed.log import FeedLog
from protocol import record_key

from ..e2e.helpers import free_port, start, write_parts_at_transactions
from ..feed.model import debezium_truth
from .fuzz import fuzz_all
from .proxy import FaultProxy


@dataclass(frozen=True)
class Profile:
    transactions: int
    files: int
    kills: int
    followers: int
    seconds_between_kills: tuple[float, float]
    fuzz_examples: int


PROFILES = {
    "quick": Profile(120, 24, 30, 10, (1.0, 4.0), 150),
    "long": Profile(1200, 240, 300, 50, (1.0, 4.0), 2000),
}


@dataclass
class Tally:
    crashes: int = 0
    faults: int = 0
    kinds: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    def kill(self, what: str) -> None:
        self.crashes += 1
        self.kinds[f"kill {what}"] += 1

    def fault(self, what: str) -> None:
        self.faults += 1
        self.kinds[f"fault {what}"] += 1


class Proc:
    """A restartable ``tidefeed`` process."""

    def __init__(self, name: str, args: list[str], log: Path) -> None:
        self.name, self.args, self.logfile = name, args, log
        self.p: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.p = start(*self.args, log=self.logfile)

    def kill(self) -> None:
        if self.p is not None and self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
            self.p.wait(timeout=30)

    def stop(self) -> None:
        if self.p is not None and self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()

    def alive(self) -> bool:
        return self.p is not None and self.p.poll() is None


def _get(url: str, timeout: float = 10) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        return None, str(e).encode()


def _collection(port: int) -> Counter:
    status, body = _get(f"http://127.0.0.1:{port}/v1/collections/bank", timeout=60)
    if status != 200:
        return Counter()
    return Counter(
        {record_key(r["data"]): r["count"] for r in map(orjson.loads, body.splitlines())}
    )


def _frontier(port: int) -> int | None:
    status, body = _get(f"http://127.0.0.1:{port}/v1/push/bank")
    return orjson.loads(body).get("frontier") if status == 200 else None


def _wait_healthy(port: int, proc: Proc, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _get(f"http://127.0.0.1:{port}/healthz", timeout=2)[0] == 200:
            return
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited: see {proc.logfile}")
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name} did not come up: see {proc.logfile}")


def _differ(truth: Counter, got: Counter) -> tuple[int, int]:
    lost = sum(max(0, n - got.get(r, 0)) for r, n in truth.items())
    dup = sum(max(0, n - truth.get(r, 0)) for r, n in got.items())
    return lost, dup


def _lock_sqlite(db: Path, seconds: float) -> None:
    """Hold the receiver's database locked from another process (a backup tool, say)."""
    code = (
        "import sqlite3, sys, time; c = sqlite3.connect(sys.argv[1], timeout=30);"
        " c.execute('BEGIN EXCLUSIVE'); time.sleep(float(sys.argv[2])); c.rollback()"
    )
    subprocess.run([sys.executable, "-c", code, str(db), str(seconds)], check=False, timeout=90)


class Followers:
    """Pull consumers streaming ``follow=true`` from the feed server, reconnecting from
    their last progress when the server is killed. Each keeps its own accumulated
    collection; at the end each must equal the table."""

    def __init__(self, n: int, port: int) -> None:
        self.n, self.port = n, port
        self.collections = [Counter() for _ in range(n)]
        self.frontiers: list[int | None] = [None] * n
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    async def _main(self) -> None:
        import aiohttp

        from protocol import Progress, Updates, get_codec

        async def one(i: int) -> None:
            codec = get_codec("ndjson")
            pending: Counter = Counter()
            while not self._stop.is_set():
                after = self.frontiers[i]
                q = f"?follow=true&format=ndjson{'' if after is None else f'&after={after}'}"
                try:
                    timeout = aiohttp.ClientTimeout(total=None, sock_read=30)
                    async with (
                        aiohttp.ClientSession(timeout=timeout) as s,
                        s.get(f"http://127.0.0.1:{self.port}/v1/feeds/bank/changes{q}") as r,
                    ):
                        if r.status != 200:
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
                                elif isinstance(m, Progress) and m.counts:
                                    # a time is complete: fold its updates in
                                    self.collections[i].update(pending)
                                    pending.clear()
                                    self.frontiers[i] = m.upper
                                elif isinstance(m, Progress) and not m.is_announcement():
                                    self.frontiers[i] = m.upper
                except (aiohttp.ClientError, TimeoutError, OSError):
                    await asyncio.sleep(0.5)
                except Exception as e:
                    self.errors.append(f"follower {i}: {type(e).__name__}: {e}")
                    await asyncio.sleep(0.5)

        await asyncio.gather(*(one(i) for i in range(self.n)))

    def results(self) -> list[Counter]:
        return [+c for c in self.collections]


class Monitor:
    """Samples, every 0.2 s: each process's RSS (peak kept per role) and, for every new
    committed frontier, how long until receivers A and B ACK it (commit -> ACK latency)."""

    def __init__(self, procs: dict[str, Proc], store: CheckpointStore, ports: list[int]) -> None:
        self.procs, self.store, self.ports = procs, store, ports
        self.peak_rss: Counter = Counter()
        self.latencies: list[float] = []
        self._seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _rss(self, pid: int) -> int:
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
            for name, proc in self.procs.items():
                if proc.alive() and proc.p is not None:
                    self.peak_rss[name] = max(self.peak_rss[name], self._rss(proc.p.pid))
            with contextlib.suppress(Exception):
                cp = self.store.latest()
                now = time.monotonic()
                if cp is not None and cp.frontier not in self._seen:
                    self._seen[cp.frontier] = now
                acked = [_frontier(p) for p in self.ports]
                for f, t0 in list(self._seen.items()):
                    if t0 > 0 and all(a is not None and a >= f for a in acked):
                        self.latencies.append(now - t0)
                        self._seen[f] = -1.0

    def figures(self) -> dict[str, Any]:
        lat = sorted(self.latencies)

        def q(x: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(x * len(lat)))], 2) if lat else None

        return {
            "commit_to_ack_p50_s": q(0.5),
            "commit_to_ack_p99_s": q(0.99),
            "acked_commits": len(lat),
            "peak_rss_mb": {k: round(v / 2**20) for k, v in self.peak_rss.items()},
        }


def run(profile: Profile, work: Path, seed: int = 1) -> int:
    import logging

    # the harness reads the log while it is attacked: expected warnings are not findings
    logging.getLogger("tidefeed").setLevel(logging.ERROR)
    rnd = random.Random(seed)
    tally = Tally()
    bank = generate_bank(transactions=profile.transactions, seed=seed)
    truth = Counter({record_key(r): 1 for r in debezium_truth(bank.events)[0].values()})
    staged = write_parts_at_transactions(work / "staged", bank.events, profile.files)
    src, log, logs = work / "in", work / "log", work / "logs"
    src.mkdir()
    logs.mkdir()
    (work / "accounts.avsc").write_bytes(orjson.dumps(ACCOUNTS_SCHEMA))
    pa_, pb, ps, pproxy = free_port(), free_port(), free_port(), free_port()
    proxy = FaultProxy(pproxy, pa_, seed=seed)
    proxy.start()
    ra = Proc(
        "receiver A", ["receive", "--db", str(work / "a.db"), "--port", str(pa_)], logs / "a.log"
    )
    rb = Proc(
        "receiver B", ["receive", "--db", str(work / "b.db"), "--port", str(pb)], logs / "b.log"
    )
    server = Proc("server", ["serve", "--log", str(log), "--port", str(ps)], logs / "serve.log")
    emit = Proc(
        "emitter",
        [
            "emit",
            "--source",
            f"debezium:{src}",
            "--feed",
            "bank",
            "--log",
            str(log),
            "--key",
            "id",
            "--clock",
            "logical",
            "--granularity",
            "transaction",
            "--schema",
            str(work / "accounts.avsc"),
            "--follow",
            "--trigger",
            "0.5",
            "--push",
            f"http://127.0.0.1:{pproxy}/v1/push/bank",
        ],
        logs / "emit.log",
    )
    for p, port in ((ra, pa_), (rb, pb)):
        p.start()
        _wait_healthy(port, p)
    emit.start()
    # the first file, so the feed exists before the server's subscription
    staged[0].rename(src / staged[0].name)
    store = CheckpointStore(FeedLog(str(log), "bank"))
    deadline = time.monotonic() + 180
    while store.latest() is None or store.latest().frontier == 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the emitter never committed: see {emit.logfile}")
        time.sleep(0.5)
    server.start()
    _wait_healthy(ps, server)
    req = urllib.request.Request(
        f"http://127.0.0.1:{ps}/v1/feeds/bank/subscriptions/b",
        data=orjson.dumps({"url": f"http://127.0.0.1:{pb}/v1/push/bank"}),
        method="PUT",
    )
    urllib.request.urlopen(req, timeout=10).close()
    followers = Followers(profile.followers, ps)
    followers.start()
    monitor = Monitor(
        {"emitter": emit, "server": server, "receiver A": ra, "receiver B": rb}, store, [pa_, pb]
    )
    monitor.start()

    # ---- attack while the files arrive -------------------------------------------------
    procs = {"emitter": emit, "server": server, "receiver A": ra, "receiver B": rb}
    ports = {"server": ps, "receiver A": pa_, "receiver B": pb}
    pending_files = staged[1:]
    kills_left = profile.kills
    compactions = 0
    while kills_left > 0 or pending_files:
        for _ in range(rnd.randint(0, 2)):
            if pending_files:
                f = pending_files.pop(0)
                f.rename(src / f.name)
        time.sleep(rnd.uniform(*profile.seconds_between_kills))
        if kills_left <= 0:
            continue
        action = rnd.random()
        if action < 0.12:
            # a compaction killed at a random moment (or refused: a subscription's ACK)
            cp = store.latest()
            acked = _sub_ack(ps)
            if cp is not None and acked is not None and acked > 1:
                c = start("compact", "--log", str(log), "--feed", "bank", "--to", str(acked - 1))
                time.sleep(rnd.uniform(0, 1.5))
                if c.poll() is None:
                    c.send_signal(signal.SIGKILL)
                    tally.kill("compact")
                    kills_left -= 1
                c.wait(timeout=60)
                compactions += 1
            continue
        if action < 0.18:
            tally.fault("sqlite locked")
            _lock_sqlite(work / "a.db", rnd.uniform(1, 4))
            continue
        if action < 0.22 and emit.alive():
            # an empty newest commit file left behind (an old version, an object store)
            emit.kill()
            tally.kill("emitter")
            kills_left -= 1
            cp = store.latest()
            if cp is not None:
                commits = log / "bank" / "_commits"
                if rnd.random() < 0.5:
                    (commits / f"{cp.seq + 1:020d}.json").write_bytes(b"")
                    tally.fault("empty newest commit")
                else:  # cut mid-file, as a copy to a store without atomic publication leaves it
                    whole = (commits / f"{cp.seq:020d}.json").read_bytes()
                    (commits / f"{cp.seq + 1:020d}.json").write_bytes(whole[: len(whole) // 2])
                    tally.fault("truncated newest commit")
            emit.start()
            continue
        name = rnd.choice(list(procs))
        proc = procs[name]
        proc.kill()
        tally.kill(name)
        kills_left -= 1
        time.sleep(rnd.uniform(0, 1))
        proc.start()
        if name in ports:
            with contextlib.suppress(RuntimeError):
                _wait_healthy(ports[name], proc, timeout=30)
        for p in procs.values():  # a process that died by itself is a finding
            if p.p is not None and p.p.poll() not in (None, -signal.SIGKILL):
                tally.notes.append(f"{p.name} exited {p.p.returncode} by itself")
                p.start()

    # ---- let everything settle, then compare ---------------------------------------------
    settle = time.monotonic() + 300
    final = None
    while time.monotonic() < settle:
        cp = store.latest()
        if cp is not None and cp.source.get("file") == staged[-1].name:
            final = cp.frontier
            if (
                _frontier(pa_) == final
                and _frontier(pb) == final
                and all(f == final for f in followers.frontiers)
            ):
                break
        for p in procs.values():
            if not p.alive():
                tally.notes.append(f"{p.name} was found dead while settling")
                p.start()
        time.sleep(1)
    else:
        tally.notes.append(
            f"not settled in 300 s: feed frontier {final}, receiver A {_frontier(pa_)}, "
            f"receiver B {_frontier(pb)}, followers {followers.frontiers}"
        )
    followers.stop()
    monitor.stop()
    tally.faults += proxy.faults
    for k, v in proxy.kinds.items():
        tally.kinds[f"fault proxy {k}"] += v
    got = {"receiver A": _collection(pa_), "receiver B": _collection(pb)}
    pulled = _pull(ps)
    got["pull"] = pulled
    for i, c in enumerate(followers.results()):
        got[f"follower {i}"] = c
    lost = dup = 0
    for name, c in got.items():
        lo, du = _differ(truth, c)
        if lo or du:
            tally.notes.append(f"{name}: lost {lo}, duplicated {du}")
        lost += lo
        dup += du
    for p in procs.values():
        p.stop()
    proxy.stop()
    print(
        f"reliability: crash phase: crashes={tally.crashes} faults={tally.faults} lost={lost} "
        f"duplicated={dup}",
        file=sys.stderr,
        flush=True,
    )
    for note in tally.notes:
        print(f"reliability: note: {note}", file=sys.stderr, flush=True)

    # ---- bad input ----------------------------------------------------------------------
    fuzz = fuzz_all(profile.fuzz_examples, work / "fuzz", seed=seed, log=log)
    tally.notes += fuzz.notes

    load_ok = not followers.errors and all(f == final for f in followers.frontiers)
    tally.notes += followers.errors
    (work / "reliability.json").write_text(
        json.dumps(
            {
                "profile": profile.__dict__,
                "kinds": dict(tally.kinds),
                "compactions_started": compactions,
                "final_frontier": final,
                "load": monitor.figures(),
                "notes": tally.notes,
            },
            indent=2,
        )
    )
    for note in fuzz.notes + followers.errors:
        print(f"reliability: note: {note}", file=sys.stderr)
    load = monitor.figures()
    print(
        f"reliability: {dict(tally.kinds)}; commit->ACK p50 {load['commit_to_ack_p50_s']}s "
        f"p99 {load['commit_to_ack_p99_s']}s over {load['acked_commits']} commits; "
        f"{profile.followers} pull followers; peak RSS MB {load['peak_rss_mb']}",
        file=sys.stderr,
    )
    print(
        f"reliability: crashes={tally.crashes} faults={tally.faults} lost={lost} "
        f"duplicated={dup} bad_inputs={fuzz.bad_inputs} rejected={fuzz.rejected} "
        f"load_ok={'yes' if load_ok else 'no'}"
    )
    ok = lost == 0 and dup == 0 and fuzz.rejected == fuzz.bad_inputs and load_ok
    return 0 if ok else 1


def _sub_ack(port: int) -> int | None:
    status, body = _get(f"http://127.0.0.1:{port}/v1/feeds/bank/subscriptions/b")
    return orjson.loads(body).get("acked") if status == 200 else None


def _pull(port: int) -> Counter:
    """A fresh pull consumer reading the whole feed (a snapshot at since, then the tail)."""
    from protocol import Updates, get_codec

    status, body = _get(f"http://127.0.0.1:{port}/v1/feeds/bank/changes?format=ndjson", 120)
    out: Counter = Counter()
    if status != 200:
        return out
    for m in get_codec("ndjson").decode(body):
        if isinstance(m, Updates):
            for u in m:
                out[record_key(u.record)] += u.diff
    return +out


def main() -> int:
    name = os.environ.get("RELIABILITY", "quick")
    if name not in PROFILES:
        raise SystemExit(f"RELIABILITY must be one of {', '.join(PROFILES)}, not {name!r}")
    work = Path(tempfile.mkdtemp(prefix="tidefeed-reliability-"))
    started = time.monotonic()
    try:
        code = run(PROFILES[name], work)
    finally:
        print(
            f"reliability: profile {name}, {time.monotonic() - started:.0f}s, work in {work}",
            file=sys.stderr,
        )
    if code == 0 and not os.environ.get("RELIABILITY_KEEP"):
        shutil.rmtree(work, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
