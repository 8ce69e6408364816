"""Follow-mode latency on the product path: a 10-update file lands -> its commit.

For each table size N the benchmark loads N rows through a real ``tidefeed emit --follow
--key id`` process (Debezium JSON lines, local Spark), then drops K files of 10 updates
each, one at a time, and measures from the file's rename into the source folder to the
commit file that covers it (the commit file's modification time). In the same run it
measures the floor: a Structured Streaming query (file source, ``foreachBatch`` that
writes the 10 rows as Parquet) picking up the same kind of 10-line file, on the same
machine, in its own process.

    .venv/bin/python benchmarks/bench_follow.py [--sizes 10000,1000000] [--files 8] [--unkeyed]

``--unkeyed``: the emitter runs without ``--key``, and each file holds 10 inserts of new
rows (an unkeyed feed has no key to update by). ``--spark-path``: the emitter computes
every transaction in Spark (``--driver-txn-bytes 0``), the baseline of the driver engine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from feed.sources.inputs import FilePosition

SCHEMA = {
    "type": "record",
    "name": "record",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "owner", "type": "string"},
        {"name": "balance", "type": "long"},
    ],
}
TRIGGER = 0.2


def event(op: str, i: int, balance: int, lsn: int, xid: int) -> bytes:
    row = {"id": i, "owner": f"owner {i}", "balance": balance}
    return orjson.dumps(
        {
            "before": None,
            "after": row,
            "op": op,
            "source": {"lsn": lsn, "txId": xid, "sequence": f'["{lsn}", "{lsn}"]'},
        }
    )


def land(folder: Path, name: str, lines: list[bytes]) -> float:
    tmp = folder / f".{name}"
    tmp.write_bytes(b"\n".join(lines) + b"\n")
    os.rename(tmp, folder / name)
    return time.time()


def latest_commit(log: Path) -> tuple[int, float, dict]:
    commits = sorted((log / "t" / "_commits").glob("*.json"))
    if not commits:
        return 0, 0.0, {}
    p = commits[-1]
    try:
        return int(p.stem), p.stat().st_mtime, orjson.loads(p.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return 0, 0.0, {}


def wait_for_file(log: Path, name: str, timeout: float = 900) -> float:
    """The mtime of the first commit whose consumed files include ``name``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, mtime, cp = latest_commit(log)
        if FilePosition.from_source(cp.get("source") or {}).consumed(name):
            return mtime
        time.sleep(0.02)
    raise TimeoutError(f"no commit consumed {name}")


def bench_tidefeed(
    work: Path,
    size: int,
    files: int,
    conf: list[str],
    *,
    keyed: bool = True,
    spark: bool = False,
    pause: float = 1.0,
) -> list[float]:
    src, log = work / f"in-{size}", work / f"log-{size}"
    for d in (src, log):
        shutil.rmtree(d, ignore_errors=True)
    src.mkdir(parents=True)
    schema = work / "schema.avsc"
    schema.write_bytes(orjson.dumps(SCHEMA))
    chunk = 200_000
    lsn = 1
    for start in range(0, size, chunk):
        lines = [event("c", i, 0, lsn + i, 1) for i in range(start, min(size, start + chunk))]
        (src / f"load-{start:09d}.json").write_bytes(b"\n".join(lines) + b"\n")
    lsn += size
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "feed.cli.main",
            "emit",
            "--source",
            f"debezium:{src}",
            "--feed",
            "t",
            "--log",
            str(log),
            *(["--key", "id"] if keyed else []),
            "--schema",
            str(schema),
            "--clock",
            "logical",
            "--follow",
            "--trigger",
            str(TRIGGER),
            "--max-files-per-txn",
            "100000",
            *[x for c in conf for x in ("--conf", c)],
            *(["--driver-txn-bytes", "0"] if spark else []),
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(work / f"emit-{size}.log", "wb"),  # noqa: SIM115
    )
    try:
        t0 = time.monotonic()
        wait_for_file(log, f"load-{(size - 1) // chunk * chunk:09d}.json")
        print(f"  loaded {size} rows in {time.monotonic() - t0:.1f}s (incl. JVM start)")
        latencies = []
        for k in range(files):
            time.sleep(pause)
            lines = [
                event("u", (k * 7919 + j * 104729) % size, k + 1, lsn + j, 100 + k)
                if keyed
                else event("c", size + 10 * k + j, k + 1, lsn + j, 100 + k)
                for j in range(10)
            ]
            lsn += 10
            name = f"upd-{k:04d}.json"
            landed = land(src, name, lines)
            latencies.append(wait_for_file(log, name) - landed)
        return latencies
    finally:
        proc.terminate()
        proc.wait(timeout=120)


FLOOR = r"""
import os, sys, time, shutil
from feed.emit.session import get_spark
spark = get_spark("local[*]")
src, out, ckpt = sys.argv[1], sys.argv[2], sys.argv[3]
q = (spark.readStream.schema("value string").text(src).writeStream
     .foreachBatch(lambda df, i: df.write.mode("append").parquet(out))
     .option("checkpointLocation", ckpt).trigger(processingTime="200 milliseconds").start())
print("ready", flush=True)
sys.stdin.readline()
q.stop()
"""


def bench_floor(work: Path, files: int) -> list[float]:
    """Structured Streaming, same machine: a 10-line file lands -> its micro-batch done."""
    src, out, ckpt = work / "ss-in", work / "ss-out", work / "ss-ckpt"
    for d in (src, out, ckpt):
        shutil.rmtree(d, ignore_errors=True)
    src.mkdir(parents=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", FLOOR, str(src), str(out), str(ckpt)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        proc.stdout.readline()
        latencies = []
        commits = ckpt / "commits"
        for k in range(files + 1):
            time.sleep(1.0)
            before = len(list(commits.glob("[0-9]*"))) if commits.exists() else 0
            landed = land(src, f"f-{k:04d}.json", [b'{"x": 1}'] * 10)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                done = (
                    sorted(commits.glob("[0-9]*"), key=lambda p: int(p.name))
                    if commits.exists()
                    else []
                )
                if len(done) > before:
                    if k:  # the first batch warms the JVM up
                        latencies.append(done[-1].stat().st_mtime - landed)
                    break
                time.sleep(0.02)
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=60)
        return latencies
    finally:
        if proc.poll() is None:
            proc.kill()


def summary(xs: list[float]) -> str:
    return f"p50 {statistics.median(xs):.2f}s  max {max(xs):.2f}s  (n={len(xs)})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10000,1000000")
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--work", default="/tmp/tidefeed-bench-follow")
    ap.add_argument(
        "--conf", action="append", default=[], help="a Spark setting for the emitter (k=v)"
    )
    ap.add_argument("--no-floor", action="store_true", help="skip the floor's measurement")
    ap.add_argument("--unkeyed", action="store_true", help="an unkeyed feed of inserts")
    ap.add_argument("--spark-path", action="store_true", help="every transaction in Spark")
    ap.add_argument("--pause", type=float, default=1.0, help="seconds between files")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    floor = [0.0] if args.no_floor else bench_floor(work, args.files)
    print(f"floor: Structured Streaming, a 10-line file -> its micro-batch: {summary(floor)}")
    results = {}
    for size in (int(s) for s in args.sizes.split(",")):
        print(f"table of {size:,} rows:")
        lat = bench_tidefeed(
            work,
            size,
            args.files,
            args.conf,
            keyed=not args.unkeyed,
            spark=args.spark_path,
            pause=args.pause,
        )
        results[size] = lat
        print(f"  tidefeed emit --follow, a 10-update file -> its commit: {summary(lat)}")
        print(f"  p50 above the floor: {statistics.median(lat) - statistics.median(floor):+.2f}s")
    sizes = sorted(results)
    if len(sizes) > 1:
        growth = statistics.median(results[sizes[-1]]) / statistics.median(results[sizes[0]])
        print(f"p50 growth {sizes[0]:,} -> {sizes[-1]:,} rows: {growth:.2f}x")


if __name__ == "__main__":
    main()
