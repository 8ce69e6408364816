"""Eager pushes from executors are best-effort: any failure is counted, never raised."""

from __future__ import annotations

import socket
import threading

import pyarrow as pa
import pytest

from feed.emit.eager import _push_batches

SCHEMA = {"type": "record", "name": "r", "fields": [{"name": "id", "type": "long"}]}


def _cutting_server(answer: bytes) -> tuple[int, threading.Event]:
    """A server that reads one request, writes ``answer`` and closes the connection."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    done = threading.Event()

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(10)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = int(
                next(
                    line.split(b":")[1]
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
            )
            while len(body) < length:
                body += conn.recv(65536)
            conn.sendall(answer)
        srv.close()
        done.set()

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1], done


@pytest.mark.parametrize(
    "answer",
    [
        # the status line and headers, then the connection closes before the body
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 29\r\n\r\n",
        b'HTTP/1.1 200 OK\r\nContent-Length: 29\r\n\r\n{"frontier"',
        b"garbage, not HTTP\r\n\r\n",
        b"",
    ],
    ids=["no body", "half a body", "not http", "nothing"],
)
def test_an_answer_cut_short_is_counted_as_failed_not_raised(answer):
    port, done = _cutting_server(answer)
    run = _push_batches(f"http://127.0.0.1:{port}/v1/push/f", "ndjson", None, SCHEMA, 1)
    batch = pa.record_batch(
        {
            "id": pa.array([1, 2, 3], pa.int64()),
            "diff": pa.array([1, 1, 1], pa.int64()),
            "time": pa.array([5, 5, 5], pa.int64()),
        }
    )
    (out,) = list(run(iter([batch])))
    assert out.to_pydict() == {"pushed": [0], "failed": [3]}
    assert done.wait(10)
