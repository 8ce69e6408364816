"""Batch throughput of ``tidefeed emit`` on flat Debezium JSON lines, beside two peers.

For each size (0.2 M and 2 M events by default) three real processes run over the same
files, each timed from its start to its exit:

- ``tidefeed emit``, one batch transaction, local Spark, one time for the batch
  (``--granularity batch``): unkeyed (trusting the images, the same consolidation as the
  peers) and keyed on ``id`` (the keyed state besides);
- a straightforward PySpark job: parse the lines with the record schema, turn each event into
  ``-before`` / ``+after``, ``groupBy`` the whole record, drop the zero sums, write Parquet;
- DuckDB doing the same consolidation in SQL and writing Parquet.

The input is flat (unwrapped) Debezium events, as a connector with the JSON converter's
``schemas.enable=false`` writes them. The marginal rate, (N2 - N1) / (T2 - T1), cancels each
process's start-up (the JVM, Spark's session), so it compares the work itself. The
transaction's own stages (from ``emit``'s log line) say where tidefeed's time goes, and the
number of updates each process wrote is compared: they must agree.

    .venv/bin/python benchmarks/bench_emit.py [--sizes 200000,2000000] [--files 8] [--metadata]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from feed.demo.data import ACCOUNTS_SCHEMA, generate_bank

RECORD_COLUMNS = ("id", "owner", "balance", "active", "note")

SPARK_JOB = """
import sys, time
from feed.emit.session import get_spark
from feed.sources.rows import spark_record_type
from feed.demo.data import ACCOUNTS_SCHEMA
from pyspark.sql import functions as F, types as T
src, out, master = sys.argv[1:4]
spark = get_spark(master)
t = time.perf_counter()
rec = spark_record_type(ACCOUNTS_SCHEMA)
env = T.StructType([
    T.StructField("before", rec), T.StructField("after", rec), T.StructField("op", T.StringType()),
    T.StructField("source", T.StructType([T.StructField("txId", T.LongType())])),
])
e = spark.read.text(src).select(F.from_json("value", env).alias("e")).select("e.*")
e = e.where(F.col("op").isNotNull())
updates = e.where(F.col("before").isNotNull()).select(
    F.col("before").alias("r"), F.lit(-1).alias("diff")
).unionByName(e.where(F.col("after").isNotNull()).select(
    F.col("after").alias("r"), F.lit(1).alias("diff")))
out_df = (updates.groupBy("r").agg(F.sum("diff").alias("diff"))
          .where(F.col("diff") != 0).select("r.*", F.lit(1).alias("time"), "diff"))
out_df.write.mode("overwrite").parquet(out)
print("job", time.perf_counter() - t)
"""

DUCKDB_JOB = """
import sys, time, duckdb
src, out = sys.argv[1:3]
rec = "STRUCT(id BIGINT, owner VARCHAR, balance BIGINT, active BOOLEAN, note VARCHAR)"
con = duckdb.connect()
t = time.perf_counter()
con.execute(f'''
COPY (
  WITH e AS (
    SELECT * FROM read_json('{src}/*.json', format='newline_delimited',
      columns={{'before': '{rec}', 'after': '{rec}', 'op': 'VARCHAR',
               'source': 'STRUCT(txId BIGINT)'}})
    WHERE op IS NOT NULL
  ), u AS (
    SELECT before AS r, -1 AS diff FROM e WHERE before IS NOT NULL
    UNION ALL
    SELECT after AS r, 1 AS diff FROM e WHERE after IS NOT NULL
  )
  SELECT r.*, 1 AS time, sum(diff)::BIGINT AS diff FROM u GROUP BY r HAVING sum(diff) <> 0
) TO '{out}' (FORMAT parquet)''')
print("job", time.perf_counter() - t)
"""


def with_metadata(lines: list[bytes]) -> list[bytes]:
    """The events with Debezium's transaction metadata: each event's ``transaction``
    block (id, ``total_order``) and an END record after each source transaction's last
    event, as the connector with ``provide.transaction.metadata`` writes them."""
    out: list[bytes] = []
    txn, n, last_lsn = None, 0, 0

    def end() -> None:
        out.append(
            orjson.dumps(
                {
                    "status": "END",
                    "id": f"{txn}:{last_lsn}",
                    "event_count": n,
                    "data_collections": [{"data_collection": "public.accounts", "event_count": n}],
                }
            )
        )

    for line in lines:
        e = orjson.loads(line)
        xid = e["source"]["txId"]
        if xid != txn and txn is not None:
            end()
        if xid != txn:
            txn, n = xid, 0
        n += 1
        last_lsn = e["source"]["lsn"]
        e["transaction"] = {"id": f"{xid}:{last_lsn}", "total_order": n}
        out.append(orjson.dumps(e))
    if txn is not None:
        end()
    return out


def make_input(folder: Path, events: int, files: int, metadata: bool = False) -> int:
    marker = folder / f".complete-flat-{events}-{files}{'-meta' if metadata else ''}"
    if marker.exists():
        return events
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    # about 1.6 events per transaction in the generator
    bank = generate_bank(transactions=int(events / 1.6) + 10, seed=99, wrapped_every=0)
    lines = bank.events[:events]
    if metadata:
        lines = with_metadata(lines)
    size = -(-len(lines) // files)
    for i in range(files):
        with open(folder / f"part-{i:04d}.json", "wb") as f:
            f.write(b"\n".join(lines[i * size : (i + 1) * size]) + b"\n")
    marker.write_text("ok")
    return len(lines)


def timed(cmd: list[str], what: str, cwd: str | None = None) -> tuple[float, str]:
    """Run one process to its end (in ``cwd``, with ``cwd`` first on its path when
    given); its wall time and its stderr (it must succeed)."""
    env = dict(os.environ)
    if cwd is not None:
        env["PYTHONPATH"] = cwd + os.pathsep + env.get("PYTHONPATH", "")
    t = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
    wall = time.perf_counter() - t
    if run.returncode != 0:
        print(f"{what} failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
        raise SystemExit(1)
    return wall, run.stdout + run.stderr


def stages(output: str) -> dict[str, float]:
    """The seconds per stage from emit's transaction lines (`read=1.23s ...`)."""
    out: dict[str, float] = {}
    for line in output.splitlines():
        if ": txn " not in line:
            continue
        for part in line.split():
            name, _, value = part.partition("=")
            if value.endswith("s") and value[:-1].replace(".", "", 1).isdigit():
                out[name] = out.get(name, 0.0) + float(value[:-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="200000,2000000")
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--work", default="/tmp/tidefeed-bench-emit")
    ap.add_argument("--master", default="local[*]")
    ap.add_argument(
        "--metadata",
        action="store_true",
        help="the events carry transaction metadata, with an END record after each "
        "source transaction (the peers skip END records as lines without an op)",
    )
    ap.add_argument(
        "--spark-parse-too",
        action="store_true",
        help="also run both tidefeed emits with --parse spark (Spark's JSON reader), the "
        "baseline of the parse in Spark's tasks",
    )
    ap.add_argument(
        "--baseline",
        metavar="CHECKOUT",
        help="also run the unkeyed tidefeed emit from another checkout of tidefeed (say, "
        "a `git worktree` of an earlier commit), with this one's Python: an A/B in one run",
    )
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    work = Path(args.work)
    schema = work / "accounts.avsc"
    work.mkdir(parents=True, exist_ok=True)
    schema.write_bytes(orjson.dumps(ACCOUNTS_SCHEMA))
    py = sys.executable
    walls: dict[str, list[float]] = {
        "tidefeed emit": [],
        "tidefeed --key id": [],
        **({"--parse spark": [], "--parse spark --key id": []} if args.spark_parse_too else {}),
        **({"baseline emit": []} if args.baseline else {}),
        "pyspark groupBy": [],
        "duckdb": [],
    }
    for n in sizes:
        src = work / f"in-{n}{'-meta' if args.metadata else ''}"
        t0 = time.perf_counter()
        make_input(src, n, args.files, args.metadata)
        size_mb = sum(p.stat().st_size for p in src.glob("*.json")) / 1e6
        print(
            f"\n{n:,} events, {size_mb:,.0f} MB in {args.files} files "
            f"({time.perf_counter() - t0:.1f}s to make)"
        )
        out = work / f"out-{n}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        written: dict[str, int] = {}
        here = str(Path(__file__).resolve().parents[1])
        runs = [("tidefeed emit", [], here), ("tidefeed --key id", ["--key", "id"], here)]
        if args.spark_parse_too:
            runs += [("--parse spark", ["--parse", "spark"], here)]
            runs += [("--parse spark --key id", ["--parse", "spark", "--key", "id"], here)]
        if args.baseline:
            runs += [("baseline emit", [], str(Path(args.baseline).resolve()))]
        for what, extra, tree in runs:
            log = out / ("log-" + "-".join(x.strip("-") for x in [*extra, what.split()[0]]))
            emit = [
                *(py, "-m", "feed.cli.main", "emit", "--source", f"debezium:{src}"),
                *("--feed", "bank", "--log", str(log), "--schema", str(schema)),
                *("--master", args.master, "--granularity", "batch", *extra),
            ]
            wall, text = timed(emit, what, cwd=tree)
            walls[what].append(wall)
            written[what] = sum(int(v) for v in re.findall(r" updates=(\d+)", text))
            secs = stages(text)
            print(
                f"  {what:18s}{wall:6.1f}s  stages: "
                + " ".join(f"{k}={v:.1f}s" for k, v in secs.items())
            )
        wall, _ = timed(
            [py, "-c", SPARK_JOB, str(src), str(out / "spark"), args.master], "pyspark groupBy"
        )
        walls["pyspark groupBy"].append(wall)
        written["pyspark groupBy"] = pq.ParquetDataset(out / "spark").read(columns=[]).num_rows
        print(f"  pyspark groupBy   {wall:6.1f}s")
        wall, _ = timed([py, "-c", DUCKDB_JOB, str(src), str(out / "duckdb.parquet")], "duckdb")
        walls["duckdb"].append(wall)
        written["duckdb"] = pq.ParquetFile(out / "duckdb.parquet").metadata.num_rows
        print(f"  duckdb            {wall:6.1f}s")
        print("  updates written: " + ", ".join(f"{k} {v:,}" for k, v in written.items()))
        if len(set(written.values())) != 1:
            print("  the processes disagree on the number of updates: the comparison is void")
            raise SystemExit(1)
    if len(sizes) < 2:
        return
    dn = sizes[-1] - sizes[0]
    rates = {k: dn / max(v[-1] - v[0], 1e-9) for k, v in walls.items()}
    print(f"\nmarginal rate, {sizes[0]:,} -> {sizes[-1]:,} events (start-up cancels):")
    for k, r in rates.items():
        print(f"  {k:18s} {r:12,.0f} events/s")
    for what in [k for k in walls if k.startswith(("tidefeed", "--parse", "baseline"))]:
        ours = rates[what]
        print(
            f"  {what}: {ours / rates['pyspark groupBy']:.2f}x the pyspark groupBy; "
            f"duckdb is {rates['duckdb'] / ours:.2f}x faster"
        )


if __name__ == "__main__":
    main()
