"""The hostile-request corpus (tests/corpus/http: bodies, headers, names, encodings) replayed
byte for byte against a real ``tidefeed receive`` and a real ``tidefeed serve``, both with a
token: every request gets the status ``expect.json`` names, both processes live through all
of them, and neither changes any state (the receiver's SQLite rows, the server's
subscriptions and its feed log's files)."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import signal
import socket
import sqlite3
from pathlib import Path

import orjson
import pytest

from feed.demo.data import ACCOUNTS_SCHEMA, generate_bank

from .helpers import free_port, start, wait_up

CORPUS = Path(__file__).parents[1] / "corpus" / "http"
TOKEN = "secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

pytestmark = pytest.mark.slow


def _send(port: int, raw: bytes) -> tuple[int | None, bytes]:
    """Send one raw request; the status of the answer (None: closed without one) and the
    answer's first bytes. Reading stops at the end of an answer of known length: after
    refusing a body it will not read, a server goes on reading and dropping what the
    client still sends for a while before it closes (aiohttp's lingering close, 10 s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        # (answered and closed before the whole body was sent: read the answer)
        with contextlib.suppress(OSError):
            s.sendall(raw)
        got = b""
        try:
            while not _whole(got):
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
        except OSError:
            pass
    line = got.split(b"\r\n", 1)[0].split()
    status = int(line[1]) if len(line) >= 2 and line[0].startswith(b"HTTP/") else None
    return status, got.partition(b"\r\n\r\n")[2]


def _whole(got: bytes) -> bool:
    """Whether ``got`` holds an answer's head and its first 2 KiB, or all of a shorter
    body its ``Content-Length`` announces."""
    head, sep, body = got.partition(b"\r\n\r\n")
    if not sep:
        return False
    if len(got) >= 2048:
        return True
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            return len(body) >= int(value)
    return False


def _receiver_state(db: Path, port: int) -> list:
    """The receiver's feeds (frontier, epoch), its pending parts (at or past a frontier:
    the committed ones are folded into the collection in the background) and the
    collection of ``bank`` as it serves it."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        feeds = conn.execute("SELECT feed, frontier, epoch FROM feeds ORDER BY feed").fetchall()
        pending = conn.execute(
            "SELECT p.feed, p.time, p.rows FROM parts p LEFT JOIN feeds f ON f.feed = p.feed "
            "WHERE f.frontier IS NULL OR p.time >= f.frontier ORDER BY p.feed, p.time"
        ).fetchall()
    finally:
        conn.close()
    http_conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    http_conn.request("GET", "/v1/collections/bank", headers=AUTH)
    answer = http_conn.getresponse()
    collection = (answer.status, sorted(answer.read().splitlines()))
    http_conn.close()
    return [feeds, pending, collection]


def _files(root: Path) -> dict[str, str]:
    """Every file under ``root`` with a hash of its bytes (the server's whole log; not the
    emitter's lease, which its holder renews)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "_lease.json"
    }


def _push_one_time(port: int) -> None:
    body = (
        orjson.dumps({"updates": [{"data": {"id": 1}, "time": 0, "diff": 1}]})
        + b"\n"
        + orjson.dumps(
            {"progress": {"lower": [0], "upper": [1], "counts": [{"time": 0, "count": 1}]}}
        )
        + b"\n"
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request(
        "POST",
        "/v1/push/bank",
        body=body,
        headers={"Content-Type": "application/x-ndjson", "Tidefeed-Epoch": "1", **AUTH},
    )
    answer = conn.getresponse()
    assert answer.status == 200, answer.read()
    conn.close()


@pytest.fixture(scope="module")
def servers(spark, tmp_path_factory):
    from tests.feed.model import run_emitter

    tmp = tmp_path_factory.mktemp("corpus")
    src = tmp / "in"
    src.mkdir()
    (src / "part-0000.json").write_bytes(
        b"".join(e + b"\n" for e in generate_bank(transactions=5, seed=3).events)
    )
    run_emitter(
        spark,
        source_kind="debezium",
        source_path=str(src),
        feed="bank",
        log=str(tmp / "log"),
        key=("id",),
        schema=ACCOUNTS_SCHEMA,
        clock="logical",
    )
    rport, sport = free_port(), free_port()
    receiver = start(
        "receive",
        "--db",
        str(tmp / "r.db"),
        "--port",
        str(rport),
        "--token",
        TOKEN,
        log=tmp / "receive.log",
    )
    server = start(
        "serve",
        "--log",
        str(tmp / "log"),
        "--port",
        str(sport),
        "--token",
        TOKEN,
        log=tmp / "serve.log",
    )
    try:
        wait_up(rport)
        wait_up(sport)
        _push_one_time(rport)
        yield {
            "receive": (rport, receiver),
            "serve": (sport, server),
            "db": tmp / "r.db",
            "log": tmp / "log",
        }
    finally:
        for p in (receiver, server):
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=30)


def test_the_corpus_covers_bodies_headers_names_and_encodings():
    expect = orjson.loads((CORPUS / "expect.json").read_bytes())
    assert {p.stem for p in CORPUS.glob("*.req")} == set(expect)
    kinds = {"-avro-", "-arrow-", "-ndjson-", "-token", "-name-", "encoding", "gzip", "header"}
    assert all(any(k in name for name in expect) for k in kinds)
    assert {c["target"] for c in expect.values()} == {"receive", "serve"}


def test_every_corpus_request_gets_its_status_and_changes_nothing(servers):
    expect = orjson.loads((CORPUS / "expect.json").read_bytes())
    rport = servers["receive"][0]
    receiver_before = _receiver_state(servers["db"], rport)
    log_before = _files(servers["log"])
    assert receiver_before[0] == [("bank", 1, 1)]
    assert receiver_before[2] == (200, [b'{"data":{"id":1},"count":1}'])
    wrong = {}
    for name, case in sorted(expect.items()):
        port, proc = servers[case["target"]]
        status, body = _send(port, (CORPUS / f"{name}.req").read_bytes())
        if status != case["status"] or case.get("says", "").encode() not in body:
            wrong[name] = (status, body[:300])
        assert proc.poll() is None, f"{name}: tidefeed {case['target']} died"
    assert wrong == {}, "got (status, answer) for each case above"
    assert _receiver_state(servers["db"], rport) == receiver_before
    assert _files(servers["log"]) == log_before
    for target in ("receive", "serve"):
        port, _ = servers[target]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/healthz", headers=AUTH)
        assert conn.getresponse().status == 200
        conn.close()
