"""Signals and operator errors, with real ``tidefeed`` processes.

SIGINT and SIGTERM during ``emit`` finish the transaction under way (or, for a second
signal, abandon it) with no traceback and the shell's exit code, and the feed is whole
after a restart; SIGTERM stops a push to an unreachable receiver at once.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import orjson
import pytest

from feed._faults import PAUSE_ENV
from feed.demo.data import ACCOUNTS_SCHEMA, generate_bank
from feed.log.checkpoint import CheckpointStore
from feed.log.reader import FeedReader
from feed.log.store import FeedLog
from protocol import check_messages, get_codec

from ..feed.model import as_multiset, collection_of
from .helpers import (
    bank_emit_args,
    free_port,
    signal_main_thread,
    start,
    tidefeed,
    wait_stopped,
    wait_up,
    write_parts_at_transactions,
)

pytestmark = pytest.mark.slow

BANK = generate_bank(transactions=30, seed=23)


def stderr_of(path: Path) -> str:
    return path.read_text(errors="replace")


def bank_input(tmp_path: Path, parts: int) -> tuple[Path, list[Path]]:
    """The bank's events in ``parts`` transaction-aligned files, and the schema beside."""
    (tmp_path / "accounts.avsc").write_bytes(orjson.dumps(ACCOUNTS_SCHEMA))
    src = tmp_path / "in"
    return src, write_parts_at_transactions(src, BANK.events, parts)


def wait_for_text(path: Path, needle: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while needle not in stderr_of(path):
        assert time.monotonic() < deadline and proc.poll() is None, stderr_of(path)[-2000:]
        time.sleep(0.05)


def assert_valid_then_whole_after_a_restart(src: Path, log: Path) -> None:
    """The committed feed passes the checker, and a new run finishes it exactly."""
    assert check_messages(FeedReader(str(log), "bank").messages(), key=["id"]) == []
    again = tidefeed(*bank_emit_args(src, log))
    assert again.returncode == 0, again.stderr.decode()[-3000:]
    assert collection_of(FeedReader(str(log), "bank")) == as_multiset(BANK.final.values())


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_emit_finishes_the_transaction_and_the_feed_restarts_whole(tmp_path, sig):
    src, files = bank_input(tmp_path, 4)
    log, err = tmp_path / "log", tmp_path / "emit.err"
    # stopped inside the second transaction, signalled there, then let go on
    proc = start(*bank_emit_args(src, log), log=err, env={PAUSE_ENV: "after_read:2"})
    try:
        wait_stopped(proc)
        proc.send_signal(sig)
        proc.send_signal(signal.SIGCONT)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = stderr_of(err)
    assert code == 128 + sig, text[-2000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert "stopping after the transaction under way" in text
    cp = CheckpointStore(FeedLog(str(log), "bank")).latest()
    # the epoch claim and two transactions committed: the one under way was finished
    assert cp is not None and cp.seq == 3, text[-2000:]
    assert cp.source["file"] == files[1].name
    assert_valid_then_whole_after_a_restart(src, log)


def test_a_second_ctrl_c_abandons_the_transaction_at_once(tmp_path):
    src, _ = bank_input(tmp_path, 4)
    log, err = tmp_path / "log", tmp_path / "emit.err"
    # the second transaction stops after its read, and again before its write
    pauses = {PAUSE_ENV: "after_read:2,before_write:2"}
    proc = start(*bank_emit_args(src, log), log=err, env=pauses)
    try:
        for _ in range(2):
            wait_stopped(proc)
            signal_main_thread(proc, signal.SIGINT)
            proc.send_signal(signal.SIGCONT)
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = stderr_of(err)
    assert code == 130 and "Traceback" not in text, text[-2000:]
    assert "stopping now; the transaction under way is rolled back at the next start" in text
    cp = CheckpointStore(FeedLog(str(log), "bank")).latest()
    assert cp is not None and cp.seq == 2, text[-2000:]  # the first transaction alone
    assert_valid_then_whole_after_a_restart(src, log)


def test_a_dead_push_target_holds_back_no_commit_and_sigterm_ends_the_wait_at_once(tmp_path):
    """emit --push to a receiver that is not there: the whole input is committed all the
    same; the end-of-run wait for the receiver stops at once on SIGTERM (143), and runs
    out after --push-timeout with exit 1 and a line saying the log has everything."""
    src, _ = bank_input(tmp_path, 2)
    log, err = tmp_path / "log", tmp_path / "emit.err"
    dead = f"http://127.0.0.1:{free_port()}/v1/push/bank"  # nothing listens there
    proc = start(*bank_emit_args(src, log, "--push", dead, "--push-timeout", "300"), log=err)
    try:
        wait_for_text(err, "retrying", proc)  # the publisher is backing off
        # and the emitter, done committing, waits for it
        wait_for_text(err, "waiting up to 300s", proc)
        assert collection_of(FeedReader(str(log), "bank")) == as_multiset(BANK.final.values())
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    text = stderr_of(err)
    assert code == 143, text[-2000:]
    assert took < 5, f"SIGTERM took {took:.1f}s"
    assert "Traceback" not in text, text[-3000:]
    again = tidefeed(*bank_emit_args(src, log, "--push", dead, "--push-timeout", "1"))
    text = again.stderr.decode()
    assert again.returncode == 1, text[-3000:]
    assert f"{dead} did not ACK the last commit within --push-timeout (1s" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


def test_a_port_in_use_is_one_line_and_exit_1(tmp_path):
    import socket

    (tmp_path / "log").mkdir()  # (serve refuses a log that is not there first)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        for args in (
            ["serve", "--log", str(tmp_path / "log")],
            ["receive", "--db", str(tmp_path / "r.db")],
        ):
            out = tidefeed(*args, "--port", str(busy), timeout=60)
            err = out.stderr.decode().strip()
            assert out.returncode == 1, err
            assert err.splitlines() == [
                f"tidefeed {args[0]}: cannot listen on 127.0.0.1:{busy}: the address is "
                "already in use"
            ]


def test_a_missing_source_path_fails_before_spark_starts(tmp_path):
    out = tidefeed(
        "emit", "--source", f"debezium:{tmp_path / 'nope'}", "--feed", "f", "--log", str(tmp_path)
    )
    err = out.stderr.decode()
    assert out.returncode == 1
    assert err.strip().splitlines() == [
        f"tidefeed emit: source path '{tmp_path / 'nope'}' does not exist"
    ]
    assert "spark" not in err.lower()  # the session logs its settings once it starts
    assert not (tmp_path / "f").exists()


def test_a_new_feed_over_an_empty_folder_without_a_schema_fails_before_spark_starts(tmp_path):
    (tmp_path / "in").mkdir()
    log = tmp_path / "log"
    out = tidefeed(
        "emit", "--source", f"debezium:{tmp_path / 'in'}", "--feed", "f", "--log", str(log)
    )
    err = out.stderr.decode()
    assert out.returncode == 1, err
    assert err.strip().splitlines() == [
        f"tidefeed emit: feed 'f' is new and {tmp_path / 'in'} holds no input files to "
        "infer its record schema from: give --schema FILE, or run once files are there"
    ]
    assert "spark" not in err.lower()
    assert not (log / "f").exists()  # no settings written, the lease let go, no trace left


@pytest.fixture
def small_fs(tmp_path):
    """A 24 MiB tmpfs (root on Linux; elsewhere the test is skipped and says why)."""
    where = tmp_path / "small"
    where.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(where)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_log_filesystem_fails_one_line_and_loses_nothing(tmp_path, small_fs):
    """The feed log's filesystem fills up during a transaction: emit exits 1 with one line
    naming the cause, the committed feed stays whole, and once space is freed the next run
    finishes the feed exactly."""
    src = tmp_path / "in"
    src.mkdir()
    (tmp_path / "accounts.avsc").write_bytes(orjson.dumps(ACCOUNTS_SCHEMA))
    staged = write_parts_at_transactions(tmp_path / "staged", BANK.events, 3)
    staged[0].rename(src / staged[0].name)
    log = small_fs / "log"
    first = tidefeed(*bank_emit_args(src, log), timeout=600)
    assert first.returncode == 0, first.stderr.decode()[-2000:]
    # leave nothing free, then the rest of the input arrives
    ballast = small_fs / "ballast"
    with open(ballast, "wb", buffering=0) as f, pytest.raises(OSError):  # ENOSPC
        while True:
            f.write(b"\0" * (1 << 16))
    store = CheckpointStore(FeedLog(str(log), "bank"))
    before = store.latest()
    for p in staged[1:]:
        p.rename(src / p.name)
    out = tidefeed(*bank_emit_args(src, log), timeout=600)
    err = out.stderr.decode()
    assert out.returncode == 1, err[-2000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("tidefeed emit: ") and "No space left on device" in last, err[-2000:]
    # the committed feed is whole; nothing of the failed transaction counts
    assert store.latest().frontier == before.frontier
    assert check_messages(FeedReader(str(log), "bank").messages(), key=["id"]) == []
    ballast.unlink()
    again = tidefeed(*bank_emit_args(src, log), timeout=600)
    assert again.returncode == 0, again.stderr.decode()[-2000:]
    assert collection_of(FeedReader(str(log), "bank")) == as_multiset(BANK.final.values())


def test_sigterm_stops_a_server_with_a_following_consumer_at_once(tmp_path):
    """serve's streams of consumers that follow never end by themselves, and the web
    server waits for running requests when it stops: SIGTERM must end them, after whole
    times, instead of waiting out the shutdown timeout (it took two minutes)."""
    import urllib.request

    src, _ = bank_input(tmp_path, 2)
    log = tmp_path / "log"
    made = tidefeed(*bank_emit_args(src, log))
    assert made.returncode == 0, made.stderr.decode()[-2000:]
    port = free_port()
    server = start("serve", "--log", str(log), "--port", str(port), log=tmp_path / "serve.log")
    try:
        wait_up(port)
        url = f"http://127.0.0.1:{port}/v1/feeds/bank/changes?follow=true"
        with urllib.request.urlopen(url, timeout=60) as stream:
            lines = [stream.readline()]  # the stream is open and under way
            sent = time.monotonic()
            server.send_signal(signal.SIGTERM)
            lines += stream.read().splitlines()  # to its end: the server closed it
        code = server.wait(timeout=60)
        took = time.monotonic() - sent
    finally:
        if server.poll() is None:
            server.kill()
    assert code == 0, stderr_of(tmp_path / "serve.log")[-2000:]
    assert took < 10, f"SIGTERM took {took:.1f}s"
    messages = [orjson.loads(x) for x in lines if x.strip()]
    assert "progress" in messages[-1], messages[-1]  # it ended after a whole time
    assert check_messages(get_codec("ndjson").decode(b"\n".join(lines) + b"\n")) == []
