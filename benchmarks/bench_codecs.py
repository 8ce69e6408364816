"""Codec throughput against the raw library doing the same work, measured in the same run.

For each format, encode and decode N updates through tidefeed's codec and through the bare
library (orjson on the list of rows, a fastavro writer/reader with the same schema, Arrow IPC
of the same table), and report updates/s and the ratio. Best of R repeats.

    .venv/bin/python benchmarks/bench_codecs.py [--updates N] [--repeats R]
"""

from __future__ import annotations

import argparse
import gc
import io
import time
from collections.abc import Callable

import fastavro
import orjson
import pyarrow as pa

from feed.demo.data import ACCOUNTS_SCHEMA
from protocol import Updates, cdcv2_schema, get_codec, progress
from protocol.messages import update_schema
from protocol.schema import avro_to_arrow

SCHEMA = ACCOUNTS_SCHEMA
CHUNK = 10_000


def best(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of ``repeats`` runs, with the cyclic GC off while timing (both sides
    build many small objects, and a collection landing in one side's run is noise)."""
    times = []
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        finally:
            gc.enable()
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    n, r = args.updates, args.repeats
    rows = [
        {
            "data": {
                "id": i,
                "owner": f"owner-{i % 97}",
                "balance": i * 7,
                "active": i % 3 == 0,
                "note": None if i % 5 else "vip",
            },
            "time": 1_700_000_000_000 + i // 1000,
            "diff": 1 if i % 4 else -1,
        }
        for i in range(n)
    ]
    chunks = [rows[i : i + CHUNK] for i in range(0, n, CHUNK)]
    data_type = avro_to_arrow(SCHEMA)
    table = pa.Table.from_pylist(rows, schema=update_schema(data_type))
    parsed = fastavro.parse_schema(cdcv2_schema(SCHEMA))

    results = []

    def measure(
        fmt: str, messages: list, raw_enc: Callable[[], bytes], raw_dec: Callable[[bytes], object]
    ) -> None:
        codec = get_codec(fmt)
        body = codec.encode(messages, schema=SCHEMA)
        raw_body = raw_enc()
        enc = best(lambda: codec.encode(messages, schema=SCHEMA), r)
        enc_raw = best(raw_enc, r)
        dec = best(lambda: sum(1 for _ in codec.decode(body, schema=SCHEMA)), r)
        dec_raw = best(lambda: raw_dec(raw_body), r)
        results.append((fmt, "encode", n / enc, n / enc_raw))
        results.append((fmt, "decode", n / dec, n / dec_raw))

    # NDJSON: tidefeed messages hold the rows as decoded; raw = orjson on the same lists
    nd_msgs = [Updates.from_rows(c) for c in chunks] + [progress(1, n)]

    def nd_raw_enc() -> bytes:
        return b"".join(orjson.dumps({"updates": c}) + b"\n" for c in chunks)

    def nd_raw_dec(body: bytes) -> object:
        return [orjson.loads(line) for line in body.splitlines()]

    measure("ndjson", nd_msgs, nd_raw_enc, nd_raw_dec)

    def avro_raw_enc() -> bytes:
        buf = io.BytesIO()
        fastavro.writer(buf, parsed, chunks)
        return buf.getvalue()

    def avro_raw_dec(body: bytes) -> object:
        return list(fastavro.reader(io.BytesIO(body)))

    measure("avro", nd_msgs, avro_raw_enc, avro_raw_dec)

    arrow_msgs = [Updates.from_arrow(table.slice(i, CHUNK)) for i in range(0, n, CHUNK)]
    arrow_msgs.append(progress(1, n))

    def arrow_raw_enc() -> bytes:
        sink = io.BytesIO()
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table, max_chunksize=CHUNK)
        return sink.getvalue()

    def arrow_raw_dec(body: bytes) -> object:
        # the same streaming read a decoder must do: batch by batch, with metadata
        reader = pa.ipc.open_stream(body)
        out = []
        while True:
            try:
                out.append(reader.read_next_batch_with_custom_metadata())
            except StopIteration:
                return out

    measure("arrow", arrow_msgs, arrow_raw_enc, arrow_raw_dec)

    print(f"{n} updates, best of {r}")
    print(f"{'format':8} {'op':7} {'tidefeed upd/s':>15} {'raw upd/s':>15} {'ratio':>6}")
    for fmt, op, ours, raw in results:
        print(f"{fmt:8} {op:7} {ours:15,.0f} {raw:15,.0f} {ours / raw:6.0%}")


if __name__ == "__main__":
    main()
