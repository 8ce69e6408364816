"""What the table-shape check costs the Debezium parse (feed/sources/shapes.py).

Wrapped Debezium events (``{"schema", "payload"}``, as ``tidefeed capture postgres``
writes them) are parsed by :func:`feed.sources.debezium.read_debezium` in one Spark session, twice
per round, in alternating order: once with the shape hash (``_shape``) used, once without
it (Spark then prunes the schema text from the parse: the baseline, in the same run). The
ratio of the two medians is the cost of the check.

    .venv/bin/python benchmarks/bench_shape.py [--events 300000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from feed.demo.data import ACCOUNTS_SCHEMA, generate_bank


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=300_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from pyspark.sql import functions as F

    from feed.emit.session import get_spark
    from feed.sources.debezium import read_debezium
    from feed.sources.rows import spark_record_type

    work = Path(tempfile.mkdtemp(prefix="tidefeed-bench-shape-"))
    lines: list[bytes] = []
    txns = 1000
    while len(lines) < args.events:
        lines = generate_bank(transactions=txns, wrapped_every=1).events
        txns *= 2
    path = work / "events.json"
    path.write_bytes(b"".join(e + b"\n" for e in lines[: args.events]))
    spark = get_spark("local[*]")
    record = spark_record_type(ACCOUNTS_SCHEMA)
    options = {"schema": ACCOUNTS_SCHEMA}

    def run(with_shape: bool) -> float:
        df = read_debezium(spark, [str(path)], record, ("id",), options)
        cols = [c for c in df.columns if c not in ("_raw", "_shape")]
        if with_shape:
            cols.append("_shape")
        t = time.perf_counter()
        df.agg(F.count(F.lit(1)), F.max(F.xxhash64(*cols))).collect()
        return time.perf_counter() - t

    run(True), run(False)  # warm up
    timed: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for with_shape in (r % 2 == 0, r % 2 != 0):
            timed[with_shape].append(run(with_shape))
    base, shaped = statistics.median(timed[False]), statistics.median(timed[True])
    print(
        f"{args.events} wrapped events: parse {base:.2f} s without the shape hash, "
        f"{shaped:.2f} s with it: {shaped / base:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
