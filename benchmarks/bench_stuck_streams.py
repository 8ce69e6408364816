"""What pull streams whose consumers never read cost a real ``tidefeed serve``.

Starts ``tidefeed serve`` on an existing log, reads one whole pull of ``--feed`` (so that
what a first stream loads is counted in the idle figure), then opens ``--streams``
``follow=true`` streams of the whole feed from raw sockets with a 4 KiB receive buffer
that never read a byte, samples the server's RSS and ``/healthz`` answer times while they
are open, closes them and measures again. Make a log with one large time first, e.g.::

    python benchmarks/bench_push.py --formats arrow --shapes one --repeats 1
    python benchmarks/bench_stuck_streams.py --log /tmp/tidefeed-bench-push/log --feed one
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.helpers import TIDEFEED, free_port


def rss_mb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


def healthz_ms(port: int) -> float:
    began = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=30) as r:
        r.read()
    return (time.monotonic() - began) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", required=True)
    ap.add_argument("--feed", required=True)
    ap.add_argument("--streams", type=int, default=50)
    ap.add_argument("--format", default="arrow")
    args = ap.parse_args()
    port = free_port()
    server = subprocess.Popen(
        [*TIDEFEED, "serve", "--log", args.log, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    path = f"/v1/feeds/{args.feed}/changes?after=0&format={args.format}"
    try:
        for _ in range(150):
            try:
                healthz_ms(port)
                break
            except OSError:
                time.sleep(0.2)
        cold = rss_mb(server.pid)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}") as r:
            while r.read(1 << 20):
                pass
        time.sleep(2)
        warm = rss_mb(server.pid)
        socks = []
        for i in range(args.streams):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.bind((f"127.0.8.{i + 1}", 0))  # one client address each: the per-client cap
            s.connect(("127.0.0.1", port))
            s.sendall(f"GET {path}&follow=true HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            socks.append(s)
        peak, answers = warm, []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            peak = max(peak, rss_mb(server.pid))
            answers.append(healthz_ms(port))
            time.sleep(0.1)
        for s in socks:
            s.close()
        time.sleep(5)
        after = rss_mb(server.pid)
        answers.sort()
        p99 = answers[min(len(answers) - 1, int(0.99 * len(answers)))]
        print(
            f"{args.streams} unread {args.format} streams of feed {args.feed}: server RSS "
            f"cold {cold} MB, after one whole pull {warm} MB, with them {peak} MB "
            f"(+{peak - warm}), once closed {after} MB (+{after - warm}); /healthz p99 "
            f"{p99:.1f} ms, worst {answers[-1]:.1f} ms over {len(answers)}"
        )
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
