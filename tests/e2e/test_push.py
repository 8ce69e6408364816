"""emit --push -> tidefeed receive, as real processes on 127.0.0.1.

The receiver's accumulated collection must equal the source table, in each format, and
after the receiver is SIGKILLed in the middle of the pushes and restarted.
"""

from __future__ import annotations

import signal
import socket
import time
import urllib.request
from pathlib import Path

import orjson
import pytest

from feed.demo_data import ACCOUNTS_SCHEMA, generate_bank
from protocol import record_key

from .helpers import start, tidefeed, write_parts

pytestmark = pytest.mark.slow

BANK = generate_bank(transactions=40, seed=41)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_up(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"receiver on {port} did not start")


def collection(port: int, feed: str = "bank") -> dict[bytes, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/collections/{feed}") as r:
        rows = [orjson.loads(x) for x in r.read().splitlines()]
    return {record_key(x["data"]): x["count"] for x in rows}


TRUTH = {record_key(r): 1 for r in BANK.final.values()}


def setup_input(tmp_path: Path, parts: int) -> tuple[Path, Path]:
    src = tmp_path / "in"
    write_parts(src, BANK.events, parts)
    schema = tmp_path / "accounts.avsc"
    schema.write_bytes(orjson.dumps(ACCOUNTS_SCHEMA))
    return src, schema


@pytest.mark.parametrize("fmt", ["ndjson", "avro", "arrow"])
def test_emit_push_receive_equals_the_table(tmp_path, fmt):
    src, schema = setup_input(tmp_path, 2)
    port = free_port()
    receiver = start(
        "receive",
        "--db",
        str(tmp_path / "r.db"),
        "--port",
        str(port),
        log=tmp_path / "receiver.log",
    )
    try:
        wait_up(port)
        out = tidefeed(
            "emit",
            "--source",
            f"debezium:{src}",
            "--feed",
            "bank",
            "--log",
            str(tmp_path / "log"),
            "--key",
            "id",
            "--schema",
            str(schema),
            "--max-files-per-txn",
            "1",
            "--push",
            f"http://127.0.0.1:{port}/v1/push/bank",
            "--format",
            fmt,
        )
        assert out.returncode == 0, out.stderr.decode()[-3000:]
        assert collection(port) == TRUTH
        # a second run with nothing new re-announces and leaves the receiver as it was
        again = tidefeed(
            "emit",
            "--source",
            f"debezium:{src}",
            "--feed",
            "bank",
            "--log",
            str(tmp_path / "log"),
            "--key",
            "id",
            "--push",
            f"http://127.0.0.1:{port}/v1/push/bank",
            "--format",
            fmt,
        )
        assert again.returncode == 0, again.stderr.decode()[-3000:]
        assert collection(port) == TRUTH
    finally:
        receiver.terminate()
        receiver.wait(timeout=30)


def test_receiver_sigkilled_mid_push_ends_equal(tmp_path):
    src, schema = setup_input(tmp_path, 4)
    port = free_port()
    db = str(tmp_path / "r.db")
    rlog = tmp_path / "receiver.log"
    receiver = start("receive", "--db", db, "--port", str(port), log=rlog)
    wait_up(port)
    emitter = start(
        "emit",
        "--source",
        f"debezium:{src}",
        "--feed",
        "bank",
        "--log",
        str(tmp_path / "log"),
        "--key",
        "id",
        "--schema",
        str(schema),
        "--max-files-per-txn",
        "1",
        "--follow",
        "--trigger",
        "0.2",
        "--push",
        f"http://127.0.0.1:{port}/v1/push/bank",
        log=tmp_path / "emit.log",
    )
    try:
        # kill the receiver once it has ACKed part of the feed
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/push/bank") as r:
                f = orjson.loads(r.read())["frontier"]
            if f is not None and f > 0:
                break
            time.sleep(0.2)
        receiver.send_signal(signal.SIGKILL)
        receiver.wait(timeout=30)
        time.sleep(1.5)
        receiver = start("receive", "--db", db, "--port", str(port), log=rlog)
        wait_up(port)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if collection(port) == TRUTH:
                break
            time.sleep(0.5)
        assert collection(port) == TRUTH, (tmp_path / "emit.log").read_text()[-3000:]
        emitter.send_signal(signal.SIGTERM)
        assert emitter.wait(timeout=120) == 0
    finally:
        for p in (emitter, receiver):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_emitter_sigkilled_during_publish_then_restarted(tmp_path):
    from .helpers import write_parts_at_transactions

    src = tmp_path / "in"
    assert len(write_parts_at_transactions(src, BANK.events, 3)) == 3
    schema = tmp_path / "accounts.avsc"
    schema.write_bytes(orjson.dumps(ACCOUNTS_SCHEMA))
    port = free_port()
    receiver = start(
        "receive",
        "--db",
        str(tmp_path / "r.db"),
        "--port",
        str(port),
        log=tmp_path / "receiver.log",
    )
    args = [
        "emit",
        "--source",
        f"debezium:{src}",
        "--feed",
        "bank",
        "--log",
        str(tmp_path / "log"),
        "--key",
        "id",
        "--schema",
        str(schema),
        "--max-files-per-txn",
        "1",
        "--push",
        f"http://127.0.0.1:{port}/v1/push/bank",
    ]
    try:
        wait_up(port)
        killed = tidefeed(*args, env={"TIDEFEED_TEST_KILL_AT": "during_publish:2"})
        assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
        partial = collection(port)
        assert partial and partial != TRUTH  # some, not all, was delivered
        again = tidefeed(*args)
        assert again.returncode == 0, again.stderr.decode()[-3000:]
        assert collection(port) == TRUTH
    finally:
        receiver.terminate()
        receiver.wait(timeout=30)
