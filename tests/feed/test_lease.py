"""An emitter's lease on its feed (feed/log/lease.py): a second emitter is refused while the
first lives, unless it takes the feed over; a dead holder's lease is no obstacle."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import orjson
import pytest

import feed.log.lease as lease_module
from feed.log.lease import Lease
from feed.log.store import FeedLog
from protocol import CheckpointError

LOG = logging.getLogger("test")


def _lease_file(fl: FeedLog, **fields) -> None:
    body = {"host": "elsewhere", "pid": 1, "since": "then", "token": "theirs", **fields}
    fl.write_bytes(fl.path("_lease.json"), orjson.dumps({"renewed": time.time(), **body}))


def _holder(fl: FeedLog) -> dict:
    return orjson.loads(fl.read_bytes(fl.path("_lease.json")))


@pytest.fixture
def fl(tmp_path):
    return FeedLog(str(tmp_path), "f")


@pytest.fixture
def other_process():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p.pid
    p.kill()
    p.wait()


def test_a_live_holder_is_named_and_refused_unless_taken_over(fl, other_process):
    import socket

    _lease_file(fl, host=socket.gethostname(), pid=other_process)
    with pytest.raises(CheckpointError, match=rf"pid {other_process} on .*--take-over"):
        Lease(fl, take_over=False, log=LOG).acquire()
    assert _holder(fl)["pid"] == other_process  # untouched
    mine = Lease(fl, take_over=True, log=LOG)
    mine.acquire()
    assert _holder(fl)["token"] == mine.me["token"]
    mine.release()
    assert not fl.exists(fl.path("_lease.json"))


def test_a_holder_on_another_host_is_refused_while_it_renews(fl):
    _lease_file(fl)
    with pytest.raises(CheckpointError, match="pid 1 on elsewhere"):
        Lease(fl, take_over=False, log=LOG).acquire()


@pytest.mark.parametrize(
    "stale",
    [
        {"renewed": 0.0},  # not renewed for long: its holder is gone
        {"host": None, "pid": 2**22 + 12345},  # this host (set below), its process gone
    ],
)
def test_a_dead_holder_is_no_obstacle(fl, stale):
    import socket

    if stale.get("host", "x") is None:
        stale = {**stale, "host": socket.gethostname()}
    _lease_file(fl, **stale)
    mine = Lease(fl, take_over=False, log=LOG)
    mine.acquire()
    assert _holder(fl)["token"] == mine.me["token"]
    mine.release()


def test_the_same_process_may_open_the_feed_again(fl):
    first = Lease(fl, take_over=False, log=LOG)
    first.acquire()
    second = Lease(fl, take_over=False, log=LOG)
    second.acquire()  # a group's members, a test: one process
    # the first one's release leaves the second's lease in place
    first.release()
    assert _holder(fl)["token"] == second.me["token"]
    second.release()


def test_a_held_lease_is_renewed_and_left_to_one_that_took_it(fl, monkeypatch):
    monkeypatch.setattr(lease_module, "RENEW_SECONDS", 0.05)
    mine = Lease(fl, take_over=False, log=LOG)
    mine.acquire()
    first = _holder(fl)["renewed"]
    deadline = time.monotonic() + 10
    while _holder(fl)["renewed"] == first and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _holder(fl)["renewed"] > first
    # taken over just after a renewal, while the holder waits for its next one (a long
    # wait: on a loaded machine this loop may see a renewal late, and a take-over that
    # lands inside the holder's next read-then-write is written over, which the lease
    # allows: the epochs fence, feed/log/lease.py)
    monkeypatch.setattr(lease_module, "RENEW_SECONDS", 1.5)
    renewed = _holder(fl)["renewed"]
    while _holder(fl)["renewed"] == renewed and time.monotonic() < deadline:
        time.sleep(0.01)
    _lease_file(fl)
    time.sleep(1.8)  # past the holder's next renewal, which must leave it alone
    assert _holder(fl)["token"] == "theirs"  # not written over by the old holder
    mine.release()
    assert _holder(fl)["token"] == "theirs"


def test_a_late_renewal_of_the_holder_taken_over_is_taken_back(fl):
    """The old holder read its own lease just before a take-over and writes its renewal
    just after it: the new holder's next renewal writes its lease back (it used to
    leave the feed to the old one, which then stopped at its next commit and deleted
    the lease, leaving the feed without one), and the old holder then yields."""
    old = Lease(fl, take_over=False, log=LOG)
    old._write()  # (held without its renewing thread: the turns are taken by hand)
    new = Lease(fl, take_over=True, log=LOG)
    new.me["pid"] = old.me["pid"] + 1  # (another process's, as far as the lease can tell)
    old.me["host"] = new.me["host"] = "elsewhere"
    old._write()
    new.acquire()
    new._stop.set()  # (its thread stops: the turns below are taken by hand)
    assert _holder(fl)["token"] == new.me["token"]
    old._write()  # the old holder's renewal, read before the take-over
    assert new.renew_once() is True
    assert _holder(fl)["token"] == new.me["token"]
    assert old.renew_once() is False  # the old holder yields at its next turn
    assert _holder(fl)["token"] == new.me["token"]
    # a third emitter's take-over is obeyed as before
    _lease_file(fl, token="third")
    assert new.renew_once() is False
    assert _holder(fl)["token"] == "third"


@pytest.mark.slow
def test_a_second_emit_is_refused_while_the_first_follows_and_not_once_it_is_killed(tmp_path):
    """Real processes: an ``emit --follow`` holds the feed; a second ``emit`` of it says
    who holds it and exits 1 having changed nothing; once the first is SIGKILLed the
    second runs at once (its holder's process is gone) and goes on from its commits."""
    import signal

    from feed.demo.data import generate_bank
    from feed.log.reader import FeedReader

    from ..e2e.helpers import start, tidefeed, write_parts

    src, log = tmp_path / "in", tmp_path / "log"
    write_parts(src, generate_bank(transactions=10, seed=4).events, 1)
    emit = ["emit", "--source", f"debezium:{src}", "--feed", "bank", "--log", str(log)]
    emit += ["--clock", "logical"]
    follower = start(*emit, "--key", "id", "--follow", "--trigger", "0.5", log=tmp_path / "f.log")
    try:
        deadline = time.monotonic() + 240
        while not (log / "bank" / "_lease.json").exists() or not _committed(log):
            assert follower.poll() is None, (tmp_path / "f.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the follower never committed"
            time.sleep(0.5)
        frontier = FeedReader(str(log), "bank").frontier
        refused = tidefeed(*emit)
        assert refused.returncode == 1, refused.stderr
        assert f"pid {follower.pid}".encode() in refused.stderr
        assert b"--take-over" in refused.stderr
        assert FeedReader(str(log), "bank").checkpoint.epoch == 1  # no epoch claimed
        follower.send_signal(signal.SIGKILL)
        follower.wait()
        again = tidefeed(*emit)
        assert again.returncode == 0, again.stderr
        reader = FeedReader(str(log), "bank")
        assert reader.frontier == frontier and reader.checkpoint.epoch == 2
        assert not (log / "bank" / "_lease.json").exists()  # released at its end
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()


def _committed(log) -> bool:
    from feed.log.reader import FeedReader

    try:
        return FeedReader(str(log), "bank").frontier > 0
    except Exception:
        return False
