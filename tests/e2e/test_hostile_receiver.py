"""The crashers of issue 29 against a real ``tidefeed receive`` process: each body gets a
4xx, the process stays alive, its peak memory stays within a bounded distance of what it
took at rest, and the feed it was sent to is left as it was (no frontier, no updates)."""

from __future__ import annotations

import gzip
import http.client
import signal
import socket
import time

import orjson
import pyarrow as pa
import pytest

from protocol import cdcv2_schema

from ..corpus.make_corpus import avro_container, deflate
from .helpers import free_port, receiver_frontier, start, wait_up

RECORD = {"type": "record", "name": "data", "fields": [{"name": "id", "type": "long"}]}
AVRO = "application/vnd.tidefeed.cdcv2+avro"
ARROW = "application/vnd.apache.arrow.stream"
NDJSON = "application/x-ndjson"
#: what the receiver may grow past its resting peak while refusing all of them
MAX_GROWTH = 120 << 20


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _avro_deflate_bomb() -> bytes:
    """One deflate block of zeros, 160 KB on the wire, 160 MiB inflated."""
    schema = orjson.dumps(cdcv2_schema(RECORD))
    return avro_container(schema, b"deflate", deflate(b"\x00" * (160 << 20)), 1000)


def _arrow_patched_counts() -> bytes:
    batch = pa.record_batch(
        [pa.array([{"id": 1}]), pa.array([1], pa.int64()), pa.array([1], pa.int64())],
        names=["data", "time", "diff"],
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    raw = bytearray(sink.getvalue().to_pybytes())
    # the record batch's length (a little-endian 1 in the message): claim 2**40 rows
    at = raw.index((1).to_bytes(8, "little"), 200)
    raw[at : at + 8] = (1 << 40).to_bytes(8, "little")
    return bytes(raw)


CASES = [
    # (what, content type, extra headers, body)
    ("gzip bomb", NDJSON, {"Content-Encoding": "gzip"}, gzip.compress(b" " * (64 << 20))),
    ("avro deflate bomb", AVRO, {}, _avro_deflate_bomb()),
    ("ndjson nested 30000 deep", NDJSON, {}, b"[" * 30_000 + b"]" * 30_000 + b"\n"),
    ("arrow patched row count", ARROW, {}, _arrow_patched_counts()),
    ("avro 11-byte long", AVRO, {}, b"Obj\x01" + b"\x82" + b"\x80" * 9 + b"\x00"),
]


@pytest.mark.slow
def test_crashers_get_a_4xx_and_the_receiver_lives_on(tmp_path):
    port = free_port()
    # (no warm-up: its peak would hide a body's growth under the resting peak)
    args = ["--db", str(tmp_path / "r.db"), "--port", str(port), "--no-warm-up"]
    proc = start("receive", *args, log=tmp_path / "r.log")
    try:
        wait_up(port)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", "/v1/push/bank")
        resting = _peak_rss(proc.pid)
        assert orjson.loads(conn.getresponse().read())["frontier"] is None
        conn.close()
        for what, ctype, headers, body in CASES:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request(
                "POST",
                "/v1/push/bank",
                body=body,
                headers={"Content-Type": ctype, "Tidefeed-Epoch": "1", **headers},
            )
            answer = conn.getresponse()
            text = answer.read()
            assert 400 <= answer.status < 500, (what, answer.status, text[:300])
            assert proc.poll() is None, f"{what}: the receiver died"
            conn.close()
        grown = _peak_rss(proc.pid) - resting
        assert grown < MAX_GROWTH, f"peak RSS grew {grown >> 20} MiB"
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", "/v1/push/bank")
        assert orjson.loads(conn.getresponse().read())["frontier"] is None
        conn.request("GET", "/healthz")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def _closed_within(port: int, seconds: float) -> float:
    """Open a connection that drips a request's headers a byte every 0.2 s and never ends
    them; return how long the receiver took to close it."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=seconds)
    began = time.monotonic()
    try:
        for byte in b"POST /v1/push/bank HTTP/1.1\r\nHost: a\r\nX-Slow: " + b"a" * 1000:
            try:
                sock.sendall(bytes([byte]))
            except OSError:  # closed under us: a reset while sending
                return time.monotonic() - began
            sock.settimeout(0.2)
            try:
                if sock.recv(1024) == b"":
                    return time.monotonic() - began
            except TimeoutError:
                pass
            except ConnectionError:  # closed with bytes of ours unread: a reset, not a FIN
                return time.monotonic() - began
            if time.monotonic() - began > seconds:
                break
    finally:
        sock.close()
    raise AssertionError(f"a connection with unfinished headers lived {seconds} s")


@pytest.mark.slow
def test_unfinished_headers_are_closed_after_the_idle_timeout(tmp_path):
    port = free_port()
    proc = start(
        "receive",
        "--db",
        str(tmp_path / "r.db"),
        "--port",
        str(port),
        "--idle-timeout",
        "1",
        log=tmp_path / "r.log",
    )
    try:
        wait_up(port)
        took = _closed_within(port, 20)
        assert took < 10, took
        assert proc.poll() is None
        assert receiver_frontier(port) is None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
