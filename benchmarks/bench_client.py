"""The Python client (protocol.FeedClient) on the product path: ``tidefeed serve`` streams a
feed made by ``tidefeed emit``, and the client hands it over as complete times, per format.

Beside each figure, in the same run: the raw transfer of the same stream (urllib reading
every byte, nothing decoded) and transfer plus decoding (the codec's decoder over the
stream, no state machine): the client's own cost is what it takes beyond them. Two feeds:
one time of N updates (``--updates``, 1 M by default) and 100 times of 10 000. Each figure
is the median of ``--repeats`` runs.

    .venv/bin/python benchmarks/bench_client.py [--updates 1000000] [--formats arrow,ndjson]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_push import TIDEFEED, make_feed
from bench_receiver import free_port, wait_up

from protocol import FeedClient, Updates, get_codec


def raw(url: str) -> tuple[float, int]:
    t0 = time.monotonic()
    n = 0
    with urllib.request.urlopen(url, timeout=600) as r:
        while chunk := r.read(1 << 20):
            n += len(chunk)
    return time.monotonic() - t0, n


def decoded(url: str, fmt: str) -> tuple[float, int]:
    t0 = time.monotonic()
    with urllib.request.urlopen(url, timeout=600) as r:
        n = sum(len(m) for m in get_codec(fmt).decoder(r) if isinstance(m, Updates))
    return time.monotonic() - t0, n


def client(base: str, feed: str, fmt: str) -> tuple[float, int, int]:
    t0 = time.monotonic()
    times = updates = 0
    for t in FeedClient(base, feed, fmt=fmt).times(follow=False):
        times += 1
        updates += t.updates.num_rows
    return time.monotonic() - t0, times, updates


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=1_000_000, help="the one big time's size")
    ap.add_argument("--formats", default="arrow,ndjson,avro")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", default="/tmp/tidefeed-bench-client")
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shapes = {"one": (1, args.updates), "many": (100, 10_000)}
    for feed, (times, per) in shapes.items():
        log, took = make_feed(work, feed, times, per)
        print(f"tidefeed emit: feed {feed!r}, {times} time(s) of {per:,} inserts, {took:.1f}s")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEFEED_")}
    server = subprocess.Popen(
        [*TIDEFEED, "serve", "--log", str(log), "--port", str(port), "--log-level", "warning"],
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_up(port)
        print(
            "| feed | format | client, median | transfer only | transfer + decode | "
            "client / transfer+decode |"
        )
        print("|---|---|---|---|---|---|")
        for feed, (times, per) in shapes.items():
            total = times * per
            for fmt in args.formats.split(","):
                url = f"{base}/v1/feeds/{feed}/changes?format={fmt}"
                c, r, d = [], [], []
                for _ in range(args.repeats):
                    took, got_times, got = client(base, feed, fmt)
                    assert (got_times, got) == (times, total), (feed, fmt, got_times, got)
                    c.append(took)
                    r.append(raw(url)[0])
                    took, n = decoded(url, fmt)
                    assert n == total
                    d.append(took)
                cm, rm, dm = (statistics.median(x) for x in (c, r, d))
                print(
                    f"| {times} x {per:,} | {fmt} | {total / cm / 1e6:.2f} M/s ({cm:.2f} s) | "
                    f"{total / rm / 1e6:.2f} M/s | {total / dm / 1e6:.2f} M/s | "
                    f"{dm / cm:.2f} |",
                    flush=True,
                )
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
