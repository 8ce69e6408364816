"""Writes the hostile-request corpus: ``tests/corpus/http/<name>.req``, each the exact bytes
of one HTTP request, and ``expect.json``: for each, the server it is sent to (``receive`` or
``serve``) and the status it must get. ``tests/e2e/test_corpus.py`` replays them against real
processes. Run ``python -m tests.corpus.make_corpus`` after changing a case; the files are
committed, so a case stays the same bytes from run to run.

Every request carries the right bearer token (``secret``) unless it is about the token, and
the right epoch for the receiver's feed ``bank``, so that each case is refused for the one
thing it gets wrong. A case is named by its target (``r-``/``s-``) and what it tries.
"""

from __future__ import annotations

import gzip
import io
import zlib
from pathlib import Path

import fastavro
import orjson
import pyarrow as pa

from protocol import cdcv2_schema
from protocol._avro_columns import avro_long

HERE = Path(__file__).parent / "http"
TOKEN = "secret"
RECORD = {"type": "record", "name": "data", "fields": [{"name": "id", "type": "long"}]}
AVRO = "application/vnd.tidefeed.cdcv2+avro"
ARROW = "application/vnd.apache.arrow.stream"
NDJSON = "application/x-ndjson"
JSON = "application/json"


def request(
    method: str,
    path: str,
    body: bytes = b"",
    *,
    ctype: str | None = None,
    headers: dict[str, str] | None = None,
    auth: bytes | None = b"Bearer " + TOKEN.encode(),
    length: int | None = None,
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1", b"Connection: close"]
    if auth is not None:
        lines.append(b"Authorization: " + auth)
    if ctype:
        lines.append(f"Content-Type: {ctype}".encode())
    for k, v in (headers or {}).items():
        lines.append(f"{k}: {v}".encode())
    if body or method in ("POST", "PUT"):
        lines.append(f"Content-Length: {len(body) if length is None else length}".encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def push(body: bytes, ctype: str = NDJSON, feed: str = "bank", **kw: object) -> bytes:
    headers = {"Tidefeed-Epoch": "1", **kw.pop("headers", {})}  # type: ignore[dict-item]
    return request("POST", f"/v1/push/{feed}", body, ctype=ctype, headers=headers, **kw)  # type: ignore[arg-type]


def ndjson(*updates: dict) -> bytes:
    """One NDJSON update message holding ``updates``."""
    return orjson.dumps({"updates": list(updates)}) + b"\n"


def _avro(records: list[dict], schema: dict | None = None, codec: str = "null") -> bytes:
    buf = io.BytesIO()
    fastavro.writer(
        buf,
        fastavro.parse_schema(schema or cdcv2_schema(RECORD)),
        records,
        codec=codec,
        sync_marker=b"S" * 16,  # the same bytes at every run
    )
    return buf.getvalue()


def avro_container(schema: bytes, codec: bytes, block: bytes, items: int) -> bytes:
    """An Avro container of one block written by hand (what fastavro would refuse to)."""
    sync = b"S" * 16
    meta = {"avro.schema": schema, "avro.codec": codec}
    out = bytearray(b"Obj\x01") + avro_long(len(meta))
    for k, v in meta.items():
        out += avro_long(len(k)) + k.encode() + avro_long(len(v)) + v
    out += avro_long(0) + sync + avro_long(items) + avro_long(len(block)) + block + sync
    return bytes(out)


def deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    return packer.compress(data) + packer.flush()


def _arrow(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _arrow_updates(times: list[int], data: pa.Array | None = None) -> bytes:
    data = data if data is not None else pa.array([{"id": i} for i in range(len(times))])
    n = len(times)
    return _arrow(
        pa.record_batch(
            [data, pa.array(times, pa.int64()), pa.array([1] * n, pa.int64())],
            names=["data", "time", "diff"],
        )
    )


def _arrow_patched() -> bytes:
    raw = bytearray(_arrow_updates([1]))
    at = raw.index((1).to_bytes(8, "little"), 200)
    raw[at : at + 8] = (1 << 40).to_bytes(8, "little")
    return bytes(raw)


def _update(data: object, time: object = 1, diff: object = 1) -> dict:
    return {"data": data, "time": time, "diff": diff}


def cases() -> dict[str, tuple[str, int, bytes]]:
    cdc = orjson.dumps(cdcv2_schema(RECORD))
    recursive = orjson.dumps(
        {
            "type": "record",
            "name": "node",
            "fields": [{"name": "next", "type": ["null", "node"]}],
        }
    )
    sub = orjson.dumps({"url": "http://127.0.0.1:9/v1/push/bank"})
    return {
        # ---- receiver: bodies -------------------------------------------------------
        "r-gzip-bomb": (
            "receive",
            415,
            push(gzip.compress(b" " * (16 << 20), mtime=0), headers={"Content-Encoding": "gzip"}),
        ),
        # (aiohttp's parser refuses an encoding it has no decoder for, before tidefeed's 415)
        "r-content-encoding-br": ("receive", 400, push(b"x", headers={"Content-Encoding": "br"})),
        "r-avro-deflate-bomb": (
            "receive",
            400,
            push(avro_container(cdc, b"deflate", deflate(b"\x00" * (32 << 20)), 1000), AVRO),
        ),
        "r-avro-bzip2-codec": (
            "receive",
            400,
            push(avro_container(cdc, b"bzip2", b"BZh9", 1), AVRO),
        ),
        "r-avro-recursive-schema": (
            "receive",
            400,
            push(avro_container(recursive, b"null", b"", 0), AVRO),
        ),
        "r-avro-11-byte-long": ("receive", 400, push(b"Obj\x01\x82" + b"\x80" * 9 + b"\x00", AVRO)),
        "r-avro-negative-time": (
            "receive",
            400,
            push(_avro([[{"data": {"id": 1}, "time": -1, "diff": 1}]]), AVRO),
        ),
        "r-avro-zero-width-items": (
            "receive",
            400,
            push(avro_container(cdc, b"null", avro_long(0) + avro_long(1 << 24), 1), AVRO),
        ),
        "r-arrow-patched-row-count": ("receive", 400, push(_arrow_patched(), ARROW)),
        "r-arrow-negative-time": ("receive", 400, push(_arrow_updates([-(1 << 63)]), ARROW)),
        "r-arrow-map-key-twice": (
            "receive",
            400,
            push(
                _arrow_updates(
                    [1],
                    pa.array(
                        [{"m": [("a", 1), ("a", 2)]}],
                        pa.struct([("m", pa.map_(pa.string(), pa.int64()))]),
                    ),
                ),
                ARROW,
            ),
        ),
        "r-arrow-uint64-beyond-int64": (
            "receive",
            400,
            push(
                _arrow_updates([1], pa.array([{"id": 1 << 63}], pa.struct([("id", pa.uint64())]))),
                ARROW,
            ),
        ),
        "r-arrow-garbage": ("receive", 400, push(b"\xff\xff\xff\xff" + b"\x00" * 60, ARROW)),
        "r-ndjson-nested-30000": ("receive", 400, push(b"[" * 30_000 + b"]" * 30_000 + b"\n")),
        "r-ndjson-int-beyond-int64": (
            "receive",
            400,
            push(b'{"updates":[{"data":{"id":1},"time":1,"diff":18446744073709551616}]}\n'),
        ),
        "r-ndjson-nan": (
            "receive",
            400,
            push(b'{"updates":[{"data":{"id":NaN},"time":1,"diff":1}]}\n'),
        ),
        "r-ndjson-invalid-utf8": (
            "receive",
            400,
            push(b'{"updates":[{"data":{"id":"\xff\xfe"},"time":1,"diff":1}]}\n'),
        ),
        "r-ndjson-negative-time": ("receive", 400, push(ndjson(_update({"id": 1}, time=-1)))),
        "r-ndjson-time-a-string": ("receive", 400, push(ndjson(_update({"id": 1}, time="1")))),
        "r-ndjson-not-json": ("receive", 400, push(b"this is not json\n")),
        "r-ndjson-progress-counts-negative": (
            "receive",
            409,
            push(
                orjson.dumps(
                    {"progress": {"lower": [0], "upper": [2], "counts": [{"time": 1, "count": -5}]}}
                )
                + b"\n"
            ),
        ),
        # ---- receiver: headers, names, sizes -------------------------------------------
        "r-no-epoch": (
            "receive",
            400,
            request("POST", "/v1/push/bank", ndjson(_update({"id": 1})), ctype=NDJSON),
        ),
        "r-epoch-not-a-number": ("receive", 400, push(b"", headers={"Tidefeed-Epoch": "one"})),
        "r-unknown-content-type": ("receive", 415, push(b"<xml/>", "application/xml")),
        "r-declared-length-huge": ("receive", 413, push(b"", length=1 << 40)),
        "r-name-ends-in-newline": (
            "receive",
            404,
            push(ndjson(_update({"id": 1})), feed="bank%0A"),
        ),
        "r-name-traversal": ("receive", 404, request("GET", "/v1/push/..%2F..%2Fetc%2Fpasswd")),
        "r-name-too-long": ("receive", 404, request("GET", "/v1/push/" + "a" * 300)),
        "r-no-token": ("receive", 401, request("GET", "/v1/push/bank", auth=None)),
        "r-wrong-token": ("receive", 401, request("GET", "/v1/push/bank", auth=b"Bearer nope")),
        "r-token-not-ascii": (
            "receive",
            401,
            request("GET", "/v1/push/bank", auth=b"Bearer s\xe9cret"),
        ),
        "r-basic-auth": ("receive", 401, request("GET", "/v1/push/bank", auth=b"Basic c2VjcmV0")),
        "r-bearer-lower-case": (
            "receive",
            200,
            request("GET", "/v1/push/bank", auth=b"bearer " + TOKEN.encode()),
        ),
        "r-at-beyond-int64": (
            "receive",
            400,
            request("GET", "/v1/collections/bank?at=" + "9" * 30),
        ),
        "r-at-negative": ("receive", 400, request("GET", "/v1/collections/bank?at=-1")),
        "r-header-100k": (
            "receive",
            400,
            request("GET", "/v1/push/bank", headers={"X-Big": "a" * 20_000}),
        ),
        "r-request-line-garbage": (
            "receive",
            400,
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
        ),
        # ---- server ------------------------------------------------------------------------
        "s-sub-gzip": (
            "serve",
            415,
            request(
                "PUT",
                "/v1/feeds/bank/subscriptions/x",
                gzip.compress(sub, mtime=0),
                ctype=JSON,
                headers={"Content-Encoding": "gzip"},
            ),
        ),
        "s-sub-url-metadata-service": (
            "serve",
            400,
            request(
                "PUT",
                "/v1/feeds/bank/subscriptions/x",
                orjson.dumps({"url": "http://169.254.169.254/latest/meta-data/"}),
                ctype=JSON,
            ),
        ),
        "s-sub-url-file-scheme": (
            "serve",
            400,
            request(
                "PUT",
                "/v1/feeds/bank/subscriptions/x",
                orjson.dumps({"url": "file:///etc/passwd"}),
                ctype=JSON,
            ),
        ),
        "s-sub-empty-token": (
            "serve",
            400,
            request(
                "PUT",
                "/v1/feeds/bank/subscriptions/x",
                orjson.dumps({"url": "http://127.0.0.1:9/v1/push/bank", "token": ""}),
                ctype=JSON,
            ),
        ),
        "s-sub-not-json": (
            "serve",
            400,
            request("PUT", "/v1/feeds/bank/subscriptions/x", b"{", ctype=JSON),
        ),
        "s-sub-json-nested-30000": (
            "serve",
            400,
            request(
                "PUT", "/v1/feeds/bank/subscriptions/x", b"[" * 30_000 + b"]" * 30_000, ctype=JSON
            ),
        ),
        "s-sub-declared-length-huge": (
            "serve",
            413,
            request("PUT", "/v1/feeds/bank/subscriptions/x", b"", ctype=JSON, length=1 << 40),
        ),
        "s-sub-name-newline": (
            "serve",
            400,
            request("PUT", "/v1/feeds/bank/subscriptions/x%0A", sub, ctype=JSON),
        ),
        "s-sub-feed-unknown": (
            "serve",
            404,
            request("PUT", "/v1/feeds/nope/subscriptions/x", sub, ctype=JSON),
        ),
        "s-ack-unknown-subscription": (
            "serve",
            404,
            request(
                "POST",
                "/v1/feeds/bank/subscriptions/ghost/ack",
                orjson.dumps({"frontier": 1}),
                ctype=JSON,
            ),
        ),
        "s-changes-after-beyond-int64": (
            "serve",
            400,
            request("GET", "/v1/feeds/bank/changes?after=" + "9" * 30),
        ),
        "s-changes-unknown-format": (
            "serve",
            415,
            request("GET", "/v1/feeds/bank/changes?format=xml"),
        ),
        "s-feed-traversal": ("serve", 404, request("GET", "/v1/feeds/..%2F..%2Fetc")),
        "s-no-token": ("serve", 401, request("GET", "/v1/feeds", auth=None)),
        "s-token-not-ascii": ("serve", 401, request("GET", "/v1/feeds", auth=b"Bearer s\xe9cret")),
        "s-bearer-lower-case": (
            "serve",
            200,
            request("GET", "/v1/feeds", auth=b"bearer " + TOKEN.encode()),
        ),
        "s-header-100k": (
            "serve",
            400,
            request("GET", "/v1/feeds", headers={"X-Big": "a" * 20_000}),
        ),
        "s-request-line-garbage": ("serve", 400, b"GET\x00/ HTTP/9.9\r\n\r\n"),
    }


#: what the answer must say, where the status alone does not show the case was refused
#: for the one thing it gets wrong
SAYS = {
    "r-arrow-map-key-twice": "key twice",
    "r-arrow-negative-time": "outside its range",
    "r-arrow-patched-row-count": "cannot read batch",
    "r-arrow-uint64-beyond-int64": "does not read as",
    "r-avro-11-byte-long": "longer than 10 bytes",
    "r-avro-bzip2-codec": "bzip2",
    "r-avro-deflate-bomb": "inflate to more than",
    "r-avro-negative-time": "outside the 64-bit range",
    "r-avro-recursive-schema": "writer schema",
    "r-declared-length-huge": "declared",
    "r-epoch-not-a-number": "Tidefeed-Epoch",
    "r-gzip-bomb": "Content-Encoding",
    "r-ndjson-int-beyond-int64": "beyond 64 bits",
    "r-ndjson-invalid-utf8": "invalid UTF-8",
    "r-ndjson-nan": "NaN",
    "r-ndjson-negative-time": "outside the 64-bit range",
    "r-ndjson-nested-30000": "nested deeper",
    "r-ndjson-progress-counts-negative": "must be positive",
    "s-sub-declared-length-huge": "declared",
    "s-sub-empty-token": "empty",
    "s-sub-url-metadata-service": "not an allowed push destination",
}


def main() -> None:
    HERE.mkdir(exist_ok=True)
    for old in HERE.glob("*.req"):
        old.unlink()
    expect = {}
    for name, (target, status, raw) in sorted(cases().items()):
        (HERE / f"{name}.req").write_bytes(raw)
        expect[name] = {"target": target, "status": status}
        if name in SAYS:
            expect[name]["says"] = SAYS[name]
    (HERE / "expect.json").write_bytes(orjson.dumps(expect, option=orjson.OPT_INDENT_2) + b"\n")
    print(f"{len(expect)} cases in {HERE}")


if __name__ == "__main__":
    main()
