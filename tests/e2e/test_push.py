"""emit --push -> tidefeed receive, as real processes on 127.0.0.1.

The receiver's accumulated collection must equal the source table, in each format, and
after the receiver is SIGKILLed in the middle of the pushes and restarted.
"""

from __future__ import annotations

import contextlib
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import orjson
import pytest

from feed.demo.data import ACCOUNTS_SCHEMA, generate_bank
from protocol import record_key

from ..feed.model import collection_of
from .helpers import free_port, start, tidefeed, wait_up, write_parts

pytestmark = pytest.mark.slow

BANK = generate_bank(transactions=40, seed=41)


def collection(port: int, feed: str = "bank") -> dict[bytes, int]:
    """The receiver's collection; empty while no producer has pushed the feed (404)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/collections/{feed}") as r:
            rows = [orjson.loads(x) for x in r.read().splitlines()]
    except urllib.error.HTTPError as e:
        if e.code != 404:
            raise
        return {}
    return {record_key(x["data"]): x["count"] for x in rows}


TRUTH = {record_key(r): 1 for r in BANK.final.values()}


def setup_input(tmp_path: Path, parts: int) -> tuple[Path, Path]:
    src = tmp_path / "in"
    write_parts(src, BANK.events, parts)
    schema = tmp_path / "accounts.avsc"
    schema.write_bytes(orjson.dumps(ACCOUNTS_SCHEMA))
    return src, schema


def test_emit_push_and_serve_subscriptions_in_every_format_equal_the_table(tmp_path):
    """emit --push (ndjson) into one receiver, then tidefeed serve pushes the same feed
    as avro and arrow subscriptions into two more; all three equal the table."""
    src, schema = setup_input(tmp_path, 2)
    ports = {fmt: free_port() for fmt in ("ndjson", "avro", "arrow")}
    sport = free_port()
    receivers = {
        fmt: start(
            "receive",
            "--db",
            str(tmp_path / f"{fmt}.db"),
            "--port",
            str(port),
            log=tmp_path / f"receiver-{fmt}.log",
        )
        for fmt, port in ports.items()
    }
    server = None
    try:
        for port in ports.values():
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
            f"http://127.0.0.1:{ports['ndjson']}/v1/push/bank",
            "--format",
            "ndjson",
        )
        assert out.returncode == 0, out.stderr.decode()[-3000:]
        assert collection(ports["ndjson"]) == TRUTH
        server = start(
            "serve",
            "--log",
            str(tmp_path / "log"),
            "--port",
            str(sport),
            log=tmp_path / "server.log",
        )
        wait_up(sport)
        for fmt in ("avro", "arrow"):
            body = orjson.dumps(
                {"url": f"http://127.0.0.1:{ports[fmt]}/v1/push/bank", "format": fmt}
            )
            req = urllib.request.Request(
                f"http://127.0.0.1:{sport}/v1/feeds/bank/subscriptions/{fmt}",
                data=body,
                method="PUT",
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req) as r:
                assert r.status == 201
        for fmt in ("avro", "arrow"):
            _wait(lambda f=fmt: collection(ports[f]) == TRUTH, tmp_path / "server.log")
        # a second emit with nothing new re-announces and leaves its receiver as it was
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
            f"http://127.0.0.1:{ports['ndjson']}/v1/push/bank",
        )
        assert again.returncode == 0, again.stderr.decode()[-3000:]
        assert collection(ports["ndjson"]) == TRUTH
    finally:
        for p in [*receivers.values(), *([server] if server else [])]:
            p.terminate()
            p.wait(timeout=30)


def log_collection(log: Path) -> dict[bytes, int]:
    """What the emitter has committed to the log so far."""
    from feed.log.reader import FeedReader
    from protocol import CheckpointError

    try:
        reader = FeedReader(str(log), "bank")
    except CheckpointError:
        return {}
    return {k: n for k, n in collection_of(reader).items() if n}


def test_receiver_sigkilled_mid_push_the_feed_goes_on_and_the_receiver_catches_up(tmp_path):
    """A dead receiver never holds back the commits (the emitter's publisher runs beside
    them): with the receiver SIGKILLed after its first ACK, the emitter commits the whole
    input; the restarted receiver then gets all of it, exactly once. (The input after
    the first file arrives once the receiver is dead: the emitter would otherwise have
    committed and pushed all of it before the kill.)"""
    staged, schema = setup_input(tmp_path, 4)
    src = tmp_path / "arriving"
    src.mkdir()
    parts = sorted(staged.iterdir())
    parts[0].rename(src / parts[0].name)
    port = free_port()
    db = str(tmp_path / "r.db")
    rlog = tmp_path / "receiver.log"
    log = tmp_path / "log"
    receiver = start("receive", "--db", db, "--port", str(port), log=rlog)
    wait_up(port)
    emitter = start(
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
        for part in parts[1:]:
            part.rename(src / part.name)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and log_collection(log) != TRUTH:
            time.sleep(0.5)
        emitted = (tmp_path / "emit.log").read_text()
        assert log_collection(log) == TRUTH, emitted[-3000:]  # committed, receiver or not
        assert "retrying" in emitted, emitted[-3000:]  # (the receiver was down meanwhile)
        receiver = start("receive", "--db", db, "--port", str(port), log=rlog)
        wait_up(port)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if collection(port) == TRUTH:
                break
            time.sleep(0.5)
        assert collection(port) == TRUTH, (tmp_path / "emit.log").read_text()[-3000:]
        emitter.send_signal(signal.SIGTERM)
        assert emitter.wait(timeout=120) == 143  # stopped cleanly by SIGTERM
    finally:
        for p in (emitter, receiver):
            if p.poll() is None:
                p.kill()
                p.wait()
    # the receiver's ACK is the emitter's hold on retention
    from feed.log.reader import FeedReader

    hold = orjson.loads((log / "bank" / "_subscriptions" / "emit-push.json").read_bytes())
    assert hold["held_by"] == f"http://127.0.0.1:{port}/v1/push/bank"
    # (it covers every update: a wallclock feed's idle progress may come after the last ACK)
    reader = FeedReader(str(log), "bank")
    assert hold["acked"] <= reader.frontier
    acked = collection_of(reader, at=hold["acked"] - 1)
    assert {k: n for k, n in acked.items() if n} == TRUTH


@contextlib.contextmanager
def three_transactions(tmp_path: Path):
    """A receiver process, and the emit command line that pushes the bank feed to it in
    three transactions (input cut between source transactions)."""
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
        yield args, port
    finally:
        receiver.terminate()
        receiver.wait(timeout=30)


def test_emitter_sigkilled_after_eager_pushes_and_during_publish_then_restarted(tmp_path):
    """Three transactions, two crashes, one receiver.

    1. ``--eager``, SIGKILL after the executors pushed the 2nd transaction and before its
       commit: the receiver holds those updates pending.
    2. committed delivery, SIGKILL while publishing the redone 2nd transaction (the
       receiver kept the body, the emitter never learned): the start-up announcement
       dropped the eager leftovers, and the receiver has 2 of the 3 transactions.
    3. ``--eager`` to the end: the 3rd transaction is closed by a progress alone, and
       the receiver's collection equals the table.
    """
    with three_transactions(tmp_path) as (args, port):
        eager = [*args, "--eager", "--format", "avro"]
        killed = tidefeed(*eager, env={"TIDEFEED_TEST_KILL_AT": "after_write:2"})
        assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
        state = receiver_state(port)
        assert state["frontier"] > 0 and state["pending"] > 0
        first = collection(port)

        killed = tidefeed(*args, env={"TIDEFEED_TEST_KILL_AT": "during_publish:2"})
        assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
        partial = collection(port)
        assert first != partial != TRUTH  # one more transaction, not all of them
        assert receiver_state(port)["pending"] == 0

        again = tidefeed(*eager)
        err = again.stderr.decode()
        assert again.returncode == 0, err[-3000:]
        assert collection(port) == TRUTH
        assert "eager: pushed" in err and "resending" not in err
        assert receiver_state(port)["pending"] == 0


def test_a_restarted_feed_server_resumes_its_subscriptions(tmp_path):
    from .helpers import write_parts_at_transactions

    staged = write_parts_at_transactions(tmp_path / "staged", BANK.events, 2)
    src = tmp_path / "in"
    src.mkdir()
    staged[0].rename(src / staged[0].name)
    schema = tmp_path / "accounts.avsc"
    schema.write_bytes(orjson.dumps(ACCOUNTS_SCHEMA))
    log = str(tmp_path / "log")
    emit = [
        "emit",
        "--source",
        f"debezium:{src}",
        "--feed",
        "bank",
        "--log",
        log,
        "--key",
        "id",
        "--schema",
        str(schema),
    ]
    first = tidefeed(*emit)
    assert first.returncode == 0, first.stderr.decode()[-2000:]
    rport, sport = free_port(), free_port()
    receiver = start(
        "receive",
        "--db",
        str(tmp_path / "r.db"),
        "--port",
        str(rport),
        log=tmp_path / "receiver.log",
    )
    server = start("serve", "--log", log, "--port", str(sport), log=tmp_path / "server.log")
    try:
        wait_up(rport)
        wait_up(sport)
        body = orjson.dumps({"url": f"http://127.0.0.1:{rport}/v1/push/bank", "format": "avro"})
        req = urllib.request.Request(
            f"http://127.0.0.1:{sport}/v1/feeds/bank/subscriptions/mv",
            data=body,
            method="PUT",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req) as r:
            assert r.status == 201
        half_truth = {record_key(r): 1 for r in _truth_of(src / staged[0].name).values()}
        _wait(lambda: collection(rport) == half_truth, tmp_path / "server.log")
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=30)
        staged[1].rename(src / staged[1].name)
        second = tidefeed(*emit)  # more commits while no server runs
        assert second.returncode == 0, second.stderr.decode()[-2000:]
        server = start("serve", "--log", log, "--port", str(sport), log=tmp_path / "server.log")
        wait_up(sport)
        _wait(lambda: collection(rport) == TRUTH, tmp_path / "server.log")
    finally:
        for p in (server, receiver):
            p.terminate()
            p.wait(timeout=30)


def _truth_of(path: Path) -> dict:
    from ..feed.model import debezium_truth

    final, _ = debezium_truth([x for x in path.read_bytes().splitlines() if x])
    return final


def _wait(cond, log_path: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError("timed out; server log:\n" + log_path.read_text()[-3000:])


def receiver_state(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/push/bank") as r:
        return orjson.loads(r.read())
