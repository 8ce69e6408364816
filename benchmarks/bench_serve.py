"""Delivery on the product path: ``tidefeed emit`` makes one time of N updates, ``tidefeed
serve`` pushes it to ``tidefeed receive`` through a push subscription (per format) and
streams it to a pull client; beside each figure, the same run measures a raw aiohttp
transfer of the same bytes (a server that only reads them) and how long the feed server's
``/healthz`` took to answer while the work went on (the event loop's responsiveness).

    .venv/bin/python benchmarks/bench_serve.py [--updates 1000000] [--formats ndjson,avro,arrow]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_follow import SCHEMA
from bench_push import RAW_SERVER, free_port, wait_up

TIDEFEED = [sys.executable, "-m", "feed.cli"]


def make_feed(work: Path, n: int) -> tuple[Path, float]:
    """One Debezium file of ``n`` inserts in one source transaction -> one time."""
    src, log = work / "in", work / "log"
    for d in (src, log):
        shutil.rmtree(d, ignore_errors=True)
    src.mkdir(parents=True)
    (work / "schema.avsc").write_bytes(orjson.dumps(SCHEMA))
    with open(src / "part-0000.json", "wb") as f:
        for start in range(0, n, 100_000):
            f.write(
                b"".join(
                    orjson.dumps(
                        {
                            "op": "c",
                            "after": {"id": i, "owner": f"owner {i}", "balance": i % 977},
                            "source": {"lsn": i + 1, "txId": 1},
                        }
                    )
                    + b"\n"
                    for i in range(start, min(n, start + 100_000))
                )
            )
    t0 = time.monotonic()
    subprocess.run(
        [
            *TIDEFEED,
            "emit",
            "--source",
            f"debezium:{src}",
            "--feed",
            "big",
            "--log",
            str(log),
            "--schema",
            str(work / "schema.avsc"),
            "--clock",
            "logical",
            "--log-level",
            "warning",
        ],
        check=True,
    )
    return log, time.monotonic() - t0


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return orjson.loads(r.read())


class HealthProbe:
    """Asks /healthz every 50 ms in a thread of its own; keeps the slowest answer."""

    def __init__(self, port: int) -> None:
        import threading

        self.url = f"http://127.0.0.1:{port}/healthz"
        self.worst = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            urllib.request.urlopen(self.url, timeout=60).read()
            self.worst = max(self.worst, time.monotonic() - t0)
            time.sleep(0.05)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def push(serve: int, receive: int, fmt: str, n: int, frontier: int) -> tuple[float, float]:
    name = f"big-{fmt}-{time.monotonic_ns()}"
    sub = {"url": f"http://127.0.0.1:{receive}/v1/push/{name}", "format": fmt}
    with HealthProbe(serve) as probe:
        t0 = time.monotonic()
        req = urllib.request.Request(
            f"http://127.0.0.1:{serve}/v1/feeds/big/subscriptions/{name}",
            data=orjson.dumps(sub),
            method="PUT",
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(req, timeout=30).read()
        while True:
            try:
                if get(f"http://127.0.0.1:{receive}/v1/push/{name}")["frontier"] == frontier:
                    break
            except urllib.error.HTTPError:
                pass
            status = get(f"http://127.0.0.1:{serve}/v1/feeds/big/subscriptions/{name}")
            if status.get("status") == "stopped":
                raise RuntimeError(f"subscription {name}: {status}")
            time.sleep(0.05)
        took = time.monotonic() - t0
    return n / took, probe.worst


async def pull(serve: int, fmt: str) -> tuple[bytes, float]:
    async with aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        async with s.get(f"http://127.0.0.1:{serve}/v1/feeds/big/changes?format={fmt}") as r:
            body = await r.read()
        return body, time.monotonic() - t0


async def raw_post(port: int, body: bytes) -> float:
    async with aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        async with s.post(f"http://127.0.0.1:{port}/v1/push/x", data=body) as r:
            await r.read()
        return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=1_000_000)
    ap.add_argument("--formats", default="ndjson,avro,arrow")
    ap.add_argument("--work", default="/tmp/tidefeed-bench-serve")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    n = args.updates
    log, emit_s = make_feed(work, n)
    print(f"tidefeed emit: {n:,} inserts -> one time in {emit_s:.1f}s (incl. JVM start)")
    sp, rp, raw = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEFEED_")}
    quiet = ["--log-level", "warning"]
    db = work / "receiver.db"
    for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
        p.unlink(missing_ok=True)
    procs = [
        subprocess.Popen(
            [*TIDEFEED, "serve", "--log", str(log), "--port", str(sp), *quiet], env=env
        ),
        subprocess.Popen(
            [*TIDEFEED, "receive", "--db", str(db), "--port", str(rp), *quiet], env=env
        ),
        subprocess.Popen([sys.executable, "-c", RAW_SERVER, str(raw)], env=env),
    ]
    try:
        for p in (sp, rp, raw):
            wait_up(p)
        frontier = get(f"http://127.0.0.1:{sp}/v1/feeds/big")["frontier"]
        print(
            f"{'format':8} {'push serve->receive':>22} {'/healthz worst':>15} "
            f"{'pull':>12} {'/healthz worst':>15} {'raw aiohttp':>12}"
        )
        for fmt in args.formats.split(","):
            rate, worst_push = push(sp, rp, fmt, n, frontier)
            with HealthProbe(sp) as probe:
                body, pull_s = asyncio.run(pull(sp, fmt))
            raw_s = statistics.median(asyncio.run(raw_post(raw, body)) for _ in range(3))
            print(
                f"{fmt:8} {rate / 1e6:17.2f}M u/s {worst_push:14.2f}s "
                f"{n / pull_s / 1e6:7.2f}M u/s {probe.worst:14.2f}s "
                f"{n / raw_s / 1e6:7.2f}M u/s   ({len(body) / n:.0f} B/update)"
            )
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=60)


if __name__ == "__main__":
    main()
