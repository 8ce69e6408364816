"""A feed log on an object store against the same log on local disk: issue 34's measure.

One real ``tidefeed emit`` process per log, over the same Debezium backlog at a time per
source transaction (``--granularity transaction``), keyed on ``id``, every transaction in
Spark (``--driver-txn-bytes 0``), one transaction for the whole input: once into a local
folder, once into a bucket of moto's S3 server on 127.0.0.1 (a real S3 API over HTTP, in
Python: slower than MinIO or S3 per request, so the ratio is an upper bound), each in both
layouts (``--layout times``, a folder per time, and ``--layout packs``). It reports each
run's wall time and the transaction's stages, how many objects (files) the log holds
afterwards and per time, and the ratios of the writes. Every feed must have the same
updates at the same times.

    .venv/bin/python benchmarks/bench_store.py [--transactions 1500] [--layout packs]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pyarrow.fs as pafs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_emit import stages, timed
from feed.demo.data import ACCOUNTS_SCHEMA, generate_bank
from feed.log.reader import FeedReader


def objects(fs: pafs.FileSystem, root: str) -> int:
    found = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    return sum(1 for i in found if i.type == pafs.FileType.File)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--transactions", type=int, default=1500)
    ap.add_argument("--layout", choices=("times", "packs"), action="append")
    args = ap.parse_args()
    import logging

    import orjson
    from moto import server as moto_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # (a line per request otherwise)

    work = Path(tempfile.mkdtemp(prefix="tidefeed-bench-store-"))
    src = work / "in"
    src.mkdir()
    bank = generate_bank(transactions=args.transactions, seed=34, wrapped_every=0)
    (src / "part-0000.json").write_bytes(b"\n".join(bank.events) + b"\n")
    schema = work / "accounts.avsc"
    schema.write_bytes(orjson.dumps(ACCOUNTS_SCHEMA))
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        os.environ.update(AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s", AWS_REGION="us-east-1")
        query = f"endpoint_override={host}:{port}&scheme=http"
        s3, _ = pafs.FileSystem.from_uri(f"s3://logs?{query}&allow_bucket_creation=true")
        s3.create_dir("logs")
        logs = {}
        for layout in args.layout or ("times", "packs"):
            logs[f"disk, {layout}"] = (str(work / f"log-{layout}"), layout)
            logs[f"S3, {layout}"] = (f"s3://logs/{layout}?{query}", layout)
        print(f"{len(bank.events):,} events in {args.transactions:,} source transactions")
        results = {}
        for name, (log, layout) in logs.items():
            cmd = [sys.executable, "-m", "feed.cli.main", "emit", "--source", f"debezium:{src}"]
            cmd += ["--feed", "bank", "--log", log, "--key", "id", "--schema", str(schema)]
            cmd += ["--clock", "logical", "--granularity", "transaction", "--layout", layout]
            cmd += ["--driver-txn-bytes", "0", "--max-files-per-txn", "1"]
            wall, out = timed(cmd, f"emit into {name}")
            secs = stages(out)
            fs, root = (
                pafs.FileSystem.from_uri(log) if "://" in log else (pafs.LocalFileSystem(), log)
            )
            reader = FeedReader(log, "bank")
            times = reader.times()
            results[name] = (wall, secs, objects(fs, root), times, reader)
            shown = " ".join(f"{k}={v:.1f}s" for k, v in secs.items())
            n, per = results[name][2], results[name][2] / len(times)
            print(f"  {name:<13} {wall:6.1f}s  {shown}")
            print(f"  {'':<13} {n:,} objects for {len(times):,} times ({per:.2f} a time)")
        first = next(iter(results.values()))
        for name, (_, _, _, times, reader) in results.items():
            assert times == first[3], f"{name}: other times"
            for t in times:
                got = reader.table(t).sort_by([("id", "ascending"), ("diff", "ascending")])
                want = first[4].table(t).sort_by([("id", "ascending"), ("diff", "ascending")])
                assert got.equals(want.select(got.column_names)), f"{name}: time {t} differs"
        disk = {k.split(", ")[1]: v for k, v in results.items() if k.startswith("disk")}
        for name, (wall, secs, *_) in results.items():
            if name.startswith("S3"):
                base = disk[name.split(", ")[1]]
                print(
                    f"{name} / disk, same layout: write {secs['write'] / base[1]['write']:.1f}x,"
                    f" whole run {wall / base[0]:.1f}x"
                )
        if "S3, packs" in results and "disk, times" in results:
            packed, plain = results["S3, packs"], results["disk, times"]
            print(
                f"S3, packs / disk, times: write {packed[1]['write'] / plain[1]['write']:.1f}x,"
                f" whole run {packed[0] / plain[0]:.1f}x"
            )
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
