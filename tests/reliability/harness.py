"""The reliability harness (``make reliability``): attack the running system, count losses.

Real ``tidefeed`` processes: a keyed ``emit --follow --push`` (transaction granularity,
logical clock, with and without ``--eager``) pushing through a fault-injecting TCP proxy into
receiver A; a ``serve --retain`` (automatic compaction) with a push subscription into
receiver B; Debezium files arriving a few at a time. While they run, the harness SIGKILLs
and restarts random processes (the server also in the middle of a retention compaction, and
``compact`` runs it starts), injects faults (proxy resets, stalls, 500s and cut answers; the
receiver's SQLite locked by another process; an empty or cut newest commit file), and keeps
pull followers streaming (named ones that ACK, anonymous ones that start again from a
snapshot when compaction overtakes them). A load phase follows: no attacks, more push
subscriptions, a transaction a second. Then it fuzzes every decoder and HTTP endpoint with
bad input. At the end every consumer must hold exactly the source table.

Prints one line: ``reliability: crashes=N faults=F lost=L duplicated=D bad_inputs=B
rejected=R load_ok=yes|no`` (exit 0 only when nothing was lost or duplicated, every bad
input was rejected and the load held). ``RELIABILITY=long`` runs the long profile.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from feed.demo.data import ACCOUNTS_SCHEMA, generate_bank
from feed.log.checkpoint import CheckpointStore
from feed.log.store import FeedLog
from protocol import record_key

from ..e2e.helpers import free_port, start, write_parts, write_parts_at_transactions
from ..feed.model import debezium_truth
from .abuse import TARGET as ABUSE_TARGET
from .abuse import Abuse
from .consumers import Followers, Monitor, get, put_json, receiver_frontier
from .fuzz import fuzz_all
from .proxy import FaultProxy


@dataclass(frozen=True)
class Profile:
    transactions: int  # in the crash phase
    files: int  # the crash phase's input arrives in this many files
    kills: int
    followers: int  # pull followers, the whole run
    named_followers: int  # of which named pull subscriptions that ACK
    seconds_between_kills: tuple[float, float]
    load_seconds: int  # the load phase: one transaction (one file) a second
    push_subscriptions: int  # extra push subscriptions (receivers) in the load phase
    fuzz_examples: int
    retain: int = 8  # serve --retain (logical times)
    compact_every: float = 2.0
    # the abuse phase (tests/reliability/abuse.py): one transaction a second meanwhile;
    # longer than the servers' idle timeout (30 s), which must close the slow headers
    abuse_seconds: int = 40
    unread_followers: int = 50
    slow_headers: int = 6


FORMATS = ("ndjson", "avro", "arrow")  # the load phase's subscriptions take turns

PROFILES = {
    "quick": Profile(120, 24, 30, 20, 5, (1.0, 4.0), 120, 4, 150),
    "long": Profile(1200, 240, 300, 50, 10, (1.0, 4.0), 600, 10, 2000),
    # two minutes: for changing it
    "smoke": Profile(30, 6, 8, 6, 2, (1.0, 3.0), 20, 2, 20, abuse_seconds=35, unread_followers=10),
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
    """A restartable ``tidefeed`` process; ``args`` may be a function, to start it with
    other flags each time (the emitter with and without ``--eager``)."""

    def __init__(self, name: str, args: list[str] | Callable[[], list[str]], log: Path) -> None:
        self.name, self.args, self.logfile = name, args, log
        self.p: subprocess.Popen[bytes] | None = None
        self.last_args: list[str] = []

    def start(self) -> None:
        self.last_args = self.args() if callable(self.args) else self.args
        self.p = start(*self.last_args, log=self.logfile)

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


def _collection(port: int) -> Counter:
    status, body = get(f"http://127.0.0.1:{port}/v1/collections/bank", timeout=60)
    if status != 200:
        return Counter()
    return Counter(
        {record_key(r["data"]): r["count"] for r in map(orjson.loads, body.splitlines())}
    )


def _wait_healthy(port: int, proc: Proc, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if get(f"http://127.0.0.1:{port}/healthz", timeout=2)[0] == 200:
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


def _stage(work: Path, profile: Profile, events: list[bytes]) -> tuple[list[Path], list[Path]]:
    """The input files: the crash phase's transactions in ``profile.files`` files cut at
    transaction boundaries, then one file per transaction for the load phase."""

    def tx(line: bytes) -> object:
        e = orjson.loads(line)
        return e.get("payload", e)["source"]["txId"]

    groups: list[list[bytes]] = []
    for line in events:
        if not groups or tx(groups[-1][-1]) != tx(line):
            groups.append([])
        groups[-1].append(line)
    crash = [line for g in groups[: profile.transactions] for line in g]
    staged = write_parts_at_transactions(work / "staged", crash, profile.files)
    load = [
        write_parts(work / "staged", g, 1, start=profile.files + n)[0]
        for n, g in enumerate(groups[profile.transactions :])
    ]
    return staged, load


def run(profile: Profile, work: Path, seed: int = 1) -> int:
    import logging

    # the harness reads the log while it is attacked: expected warnings are not findings
    logging.getLogger("tidefeed").setLevel(logging.ERROR)
    rnd = random.Random(seed)
    tally = Tally()
    bank = generate_bank(
        transactions=profile.transactions + profile.load_seconds + profile.abuse_seconds,
        seed=seed,
    )
    truth = Counter({record_key(r): 1 for r in debezium_truth(bank.events)[0].values()})
    staged, load_files = _stage(work, profile, bank.events)
    load_files, abuse_files = load_files[: profile.load_seconds], load_files[profile.load_seconds :]
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
    server = Proc(
        "server",
        [
            "serve",
            "--log",
            str(log),
            "--port",
            str(ps),
            "--retain",
            str(profile.retain),
            "--compact-every",
            str(profile.compact_every),
            # every follower runs on this one host: more streams from one address than
            # the default cap (16) lets in
            "--max-streams-per-client",
            str(profile.followers + 8),
        ],
        logs / "serve.log",
    )
    emit_args = [
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
    ]
    # every restart is with or without --eager (updates pushed before their commit)
    emit = Proc(
        "emitter", lambda: emit_args + ["--eager"] * (rnd.random() < 0.5), logs / "emit.log"
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
    put_json(
        f"http://127.0.0.1:{ps}/v1/feeds/bank/subscriptions/b",
        {"url": f"http://127.0.0.1:{pb}/v1/push/bank"},
    )
    followers = Followers(profile.followers, ps, named=profile.named_followers)
    followers.subscribe()
    followers.start()
    procs = {"emitter": emit, "server": server, "receiver A": ra, "receiver B": rb}
    ports = {"server": ps, "receiver A": pa_, "receiver B": pb}
    extra: list[Proc] = []  # the load phase's receivers
    extra_ports: list[int] = []
    monitor = Monitor(
        # roles and processes; the load receivers share one role (their peak is kept)
        lambda: [*procs.items(), *(("receiver L", p) for p in extra)],
        store,
        lambda: [pa_, pb, *extra_ports],
        followers,
    )
    monitor.start()

    # ---- attack while the files arrive -------------------------------------------------
    pending_files = staged[1:]
    kills_left = profile.kills
    compactions = 0
    emit_eager: Counter[str] = Counter()
    while kills_left > 0 or pending_files:
        for _ in range(rnd.randint(0, 2)):
            if pending_files:
                f = pending_files.pop(0)
                f.rename(src / f.name)
        time.sleep(rnd.uniform(*profile.seconds_between_kills))
        if kills_left <= 0:
            continue
        action = rnd.random()
        if action < 0.10:
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
        if action < 0.16:
            tally.fault("sqlite locked")
            _lock_sqlite(work / "a.db", rnd.uniform(1, 4))
            continue
        if action < 0.24 and server.alive():
            # the server SIGKILLed inside a retention pass: when its compaction folder appears
            when = _kill_mid_compaction(server, log, store, profile.compact_every + 3, rnd)
            if when:
                tally.kill(f"server mid-compaction, {when}")
            else:
                server.kill()
                tally.kill("server")
            kills_left -= 1
            server.start()
            with contextlib.suppress(RuntimeError):
                _wait_healthy(ps, server, timeout=30)
            continue
        if action < 0.28 and emit.alive():
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
        if name == "emitter":
            emit_eager["eager" if "--eager" in emit.last_args else "plain"] += 1
        proc.kill()
        tally.kill(name)
        kills_left -= 1
        time.sleep(rnd.uniform(0, 1))
        proc.start()
        if name in ports:
            with contextlib.suppress(RuntimeError):
                _wait_healthy(ports[name], proc, timeout=30)
        _restart_dead(procs.values(), tally)

    settled = _settle(store, staged[-1].name, procs, followers, [pa_, pb], tally)

    # ---- load: no attacks, more push subscriptions, a transaction a second -------------
    monitor.phase = "load"
    for i in range(profile.push_subscriptions):
        port = free_port()
        p = Proc(
            f"receiver L{i}",
            ["receive", "--db", str(work / f"l{i}.db"), "--port", str(port)],
            logs / f"l{i}.log",
        )
        p.start()
        _wait_healthy(port, p)
        put_json(
            f"http://127.0.0.1:{ps}/v1/feeds/bank/subscriptions/l{i}",
            {"url": f"http://127.0.0.1:{port}/v1/push/bank", "format": FORMATS[i % 3]},
        )
        extra.append(p)
        extra_ports.append(port)
    load_started = time.monotonic()
    for n, f in enumerate(load_files):
        time.sleep(max(0.0, load_started + n + 1 - time.monotonic()))
        f.rename(src / f.name)
        _restart_dead([*procs.values(), *extra], tally)
    load_took = time.monotonic() - load_started
    last = load_files[-1].name if load_files else staged[-1].name
    final = _settle(store, last, {**procs}, followers, [pa_, pb, *extra_ports], tally)
    load_settled = final is not None

    # ---- abuse: hostile clients while transactions still flow ------------------------
    monitor.phase = "abuse"
    watched = {"server": server, "receiver A": ra, "receiver B": rb}
    abuse = Abuse(
        server=ps,
        receivers=[pa_, pb],
        feed="bank",
        unread=profile.unread_followers,
        slow=profile.slow_headers,
        pids=lambda: {r: p.p.pid for r, p in watched.items() if p.alive() and p.p is not None},
    )
    abuse.start()
    abuse_started = time.monotonic()
    for n, f in enumerate(abuse_files):
        time.sleep(max(0.0, abuse_started + n + 1 - time.monotonic()))
        f.rename(src / f.name)
        _restart_dead([*procs.values(), *extra], tally)
    abused = abuse.finish()
    tally.notes += abused.notes
    tally.notes += [
        f"abuse: receiver :{port} holds feed {ABUSE_TARGET!r} after refusing every body"
        for port in (pa_, pb)
        if receiver_frontier(port, ABUSE_TARGET) is not None
    ]
    if abuse_files:
        final = _settle(
            store, abuse_files[-1].name, {**procs}, followers, [pa_, pb, *extra_ports], tally
        )
        load_settled = load_settled and final is not None

    followers.stop()
    monitor.stop()
    tally.faults += proxy.faults
    for k, v in proxy.kinds.items():
        tally.kinds[f"fault proxy {k}"] += v
    got = {"receiver A": _collection(pa_), "receiver B": _collection(pb)}
    for i, port in enumerate(extra_ports):
        got[f"receiver L{i}"] = _collection(port)
    got["pull"] = _pull(ps)
    for i, c in enumerate(followers.results()):
        got[f"follower {i}"] = c
    lost = dup = 0
    for name, c in got.items():
        lo, du = _differ(truth, c)
        if lo or du:
            tally.notes.append(f"{name}: lost {lo}, duplicated {du}")
        lost += lo
        dup += du
    for p in [*procs.values(), *extra]:
        p.stop()
    end = store.latest()
    since_at_end = end.since if end is not None else 0
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

    load_ok = (
        settled is not None
        and load_settled
        and not followers.errors
        and all(f == final for f in followers.frontiers)
    )
    tally.notes += followers.errors
    figures = monitor.figures()
    (work / "reliability.json").write_text(
        json.dumps(
            {
                "profile": profile.__dict__,
                "kinds": dict(tally.kinds),
                "emitter_killed_while": dict(emit_eager),
                "compactions_started": compactions,
                "final_frontier": final,
                "final_since": since_at_end,
                "followers_restarted_from_snapshot": followers.overtaken,
                "load_transactions": len(load_files),
                "load_seconds": round(load_took),
                "abuse": abused.__dict__,
                "figures": figures,
                "notes": tally.notes,
            },
            indent=2,
        )
    )
    for note in fuzz.notes + followers.errors:
        print(f"reliability: note: {note}", file=sys.stderr)
    print(f"reliability: {abused.line()}; lost={lost} duplicated={dup}", file=sys.stderr)
    crash, steady = figures["crash"], figures["load"]
    print(
        f"reliability: {dict(tally.kinds)}; emitter killed {dict(emit_eager)}; "
        f"{followers.overtaken} follower restarts from a snapshot; compacted to {since_at_end}",
        file=sys.stderr,
    )
    print(
        f"reliability: crash phase: commit->ACK p50 {crash['commit_to_ack_p50_s']}s "
        f"p99 {crash['commit_to_ack_p99_s']}s over {crash['commits_acked_by_every_receiver']} "
        f"commits; load phase ({len(load_files)} transactions in {load_took:.0f}s, "
        f"{len(extra_ports) + 2} receivers, "
        f"{profile.followers} followers): commit->ACK p50 {steady['commit_to_ack_p50_s']}s "
        f"p99 {steady['commit_to_ack_p99_s']}s over {steady['commits_acked_by_every_receiver']} "
        f"commits, commit->every follower p50 {steady['commit_to_every_follower_p50_s']}s "
        f"p99 {steady['commit_to_every_follower_p99_s']}s; peak RSS MB {figures['peak_rss_mb']}",
        file=sys.stderr,
    )
    print(
        f"reliability: crashes={tally.crashes} faults={tally.faults} lost={lost} "
        f"duplicated={dup} bad_inputs={fuzz.bad_inputs} rejected={fuzz.rejected} "
        f"load_ok={'yes' if load_ok else 'no'}"
    )
    ok = (
        lost == 0
        and dup == 0
        and fuzz.rejected == fuzz.bad_inputs
        and load_ok
        and abused.ok()
        and not abused.notes
    )
    return 0 if ok else 1


def _restart_dead(procs: Iterable[Proc], tally: Tally) -> None:
    """A process that died by itself (not by the harness's SIGKILL) is a finding."""
    for p in procs:
        if p.p is not None and p.p.poll() not in (None, -signal.SIGKILL):
            tally.notes.append(f"{p.name} exited {p.p.returncode} by itself")
            p.start()


def _settle(
    store: CheckpointStore,
    last_file: str,
    procs: dict[str, Proc],
    followers: Followers,
    receivers: list[int],
    tally: Tally,
    seconds: float = 300,
) -> int | None:
    """Wait until the feed has taken ``last_file`` and every receiver and follower is at
    its frontier; returns that frontier, or None (with a note) when they never get there."""
    deadline = time.monotonic() + seconds
    final = None
    while time.monotonic() < deadline:
        cp = store.latest()
        if cp is not None and cp.source.get("file") == last_file:
            final = cp.frontier
            if all(receiver_frontier(p) == final for p in receivers) and all(
                f == final for f in followers.frontiers
            ):
                return final
        for p in procs.values():
            if not p.alive():
                tally.notes.append(f"{p.name} was found dead while settling")
                p.start()
        time.sleep(1)
    tally.notes.append(
        f"not settled in {seconds:.0f} s: feed frontier {final}, receivers "
        f"{[receiver_frontier(p) for p in receivers]}, followers {followers.frontiers}"
    )
    return None


def _kill_mid_compaction(
    server: Proc, log: Path, store: CheckpointStore, wait: float, rnd: random.Random
) -> str | None:
    """SIGKILL the server while a retention pass compacts: as soon as a compaction folder
    above the committed ``since`` appears. Returns where the kill fell (before or after the
    compaction's commit), or None when no pass started within ``wait``."""
    folder = log / "bank" / "compacted"
    cp = store.latest()
    since = cp.since if cp is not None else 0
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if any(int(d.name) > since for d in folder.iterdir() if d.name.isdigit()):
                time.sleep(rnd.uniform(0, 0.02))
                server.kill()
                after = store.latest()
                committed = after is not None and after.since > since
                return "after its commit" if committed else "before its commit"
        time.sleep(0.005)
    return None


def _sub_ack(port: int) -> int | None:
    status, body = get(f"http://127.0.0.1:{port}/v1/feeds/bank/subscriptions/b")
    return orjson.loads(body).get("acked") if status == 200 else None


def _pull(port: int) -> Counter:
    """A fresh pull consumer reading the whole feed (a snapshot at since, then the tail)."""
    from protocol import Updates, get_codec

    status, body = get(f"http://127.0.0.1:{port}/v1/feeds/bank/changes?format=ndjson", 120)
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
