"""Emitter throughput on a large Debezium batch, next to Spark's bare JSON read of it.

Generates N bank events (cached under the work folder), runs ``tidefeed emit`` over them in
one batch transaction (keyed, local Spark) and reports events/s. The baseline, measured in
the same run on the same files, is Spark parsing the same JSON lines with the same schema and
counting them: the floor any Spark emitter pays before doing any CDC work.

    .venv/bin/python benchmarks/bench_emit.py [--events 2000000] [--files 8] [--work DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from feed.demo_data import ACCOUNTS_SCHEMA, generate_bank


def make_input(folder: Path, events: int, files: int) -> int:
    marker = folder / f".complete-{events}-{files}"
    if marker.exists():
        return events
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    # about 1.6 events per transaction in the generator
    bank = generate_bank(transactions=int(events / 1.6) + 10, seed=99)
    lines = bank.events[:events]
    size = -(-len(lines) // files)
    for i in range(files):
        with open(folder / f"part-{i:04d}.json", "wb") as f:
            f.write(b"\n".join(lines[i * size : (i + 1) * size]) + b"\n")
    marker.write_text("ok")
    return len(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=2_000_000)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--work", default="/tmp/tidefeed-bench-emit")
    ap.add_argument("--master", default="local[*]")
    args = ap.parse_args()
    work = Path(args.work)
    src = work / "in"
    t0 = time.perf_counter()
    n = make_input(src, args.events, args.files)
    print(f"input: {n} events in {args.files} files ({time.perf_counter() - t0:.1f}s to make)")
    schema = work / "accounts.avsc"
    schema.write_bytes(orjson.dumps(ACCOUNTS_SCHEMA))

    # baseline: Spark parses the same lines with the same schema, in the same kind of process
    base_code = f"""
import time
from feed.session import get_spark
from feed.sources import spark_record_type
from feed.demo_data import ACCOUNTS_SCHEMA
from pyspark.sql import functions as F, types as T
spark = get_spark({args.master!r})
rec = spark_record_type(ACCOUNTS_SCHEMA)
env = T.StructType([T.StructField("before", rec), T.StructField("after", rec),
                    T.StructField("op", T.StringType())])
t = time.perf_counter()
n = spark.read.text({str(src)!r}).select(F.from_json("value", env).alias("e")).where(
    F.col("e.op").isNotNull()).count()
print(time.perf_counter() - t, n)
"""
    out = subprocess.run(
        [sys.executable, "-c", base_code], capture_output=True, text=True, check=True
    )
    base_s, base_n = out.stdout.split()[-2:]
    base_rate = int(base_n) / float(base_s)

    log = work / "log"
    shutil.rmtree(log, ignore_errors=True)
    t = time.perf_counter()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "feed.cli",
            "emit",
            "--source",
            f"debezium:{src}",
            "--feed",
            "bank",
            "--log",
            str(log),
            "--key",
            "id",
            "--schema",
            str(schema),
            "--master",
            args.master,
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ),
    )
    wall = time.perf_counter() - t
    if run.returncode != 0:
        errors = [x for x in run.stderr.splitlines() if "Error" in x or "Exception" in x]
        print("\n".join(errors[:20]))
        print(run.stderr[-3000:])
        raise SystemExit(1)
    txn_lines = [line for line in run.stderr.splitlines() if ": txn " in line]
    print("\n".join(txn_lines))
    # the transaction's own time (read+compute+write+commit), without JVM start-up
    txn_s = 0.0
    for line in txn_lines:
        for part in line.split():
            if part.endswith("s") and "=" in part:
                txn_s += float(part.split("=")[1][:-1])
    print(f"baseline (Spark parse+count): {base_rate:,.0f} events/s")
    print(
        f"tidefeed emit, transaction:   {n / txn_s:,.0f} events/s "
        f"({txn_s:.1f}s; {n / txn_s / base_rate:.0%} of baseline)"
    )
    print(f"tidefeed emit, whole process: {n / wall:,.0f} events/s ({wall:.1f}s incl. JVM start)")


if __name__ == "__main__":
    main()
