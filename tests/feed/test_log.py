"""The feed log's exclusive create: whole files or none, even under SIGKILL."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import orjson

from feed.log.store import FeedLog

WRITER = """
import sys, orjson
from feed.log.store import FeedLog
log = FeedLog(sys.argv[1], "t")
payload = "x" * (24 << 20)  # writing takes long enough for kills to land inside
print("writing", flush=True)
seq = 1
while True:
    data = orjson.dumps({"seq": seq, "payload": payload})
    if log.create_exclusive(log.path("_commits", f"{seq:020d}.json"), data):
        seq += 1
"""


def test_a_killed_writer_leaves_only_whole_commit_files(tmp_path):
    rng = random.Random(5)
    for _ in range(10):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE
        )
        # (the kill lands among the writes, however long the start took on a busy machine)
        assert proc.stdout is not None and proc.stdout.readline() == b"writing\n"
        time.sleep(0.3 + rng.random() * 0.7)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    commits = tmp_path / "t" / "_commits"
    names = sorted(n for n in os.listdir(commits) if not n.startswith("."))
    assert names, "the writer never committed"
    for n in names:
        body = orjson.loads((commits / n).read_bytes())  # raises on an empty or cut file
        assert body["seq"] == int(n.split(".")[0])
    # each restart went on after the last whole file: no seq is missing
    assert [int(n.split(".")[0]) for n in names] == list(range(1, len(names) + 1))


def test_create_exclusive_refuses_an_existing_file(tmp_path):
    log = FeedLog(str(tmp_path), "t")
    path = log.path("_commits", f"{1:020d}.json")
    assert log.create_exclusive(path, b'{"a": 1}')
    assert not log.create_exclusive(path, b'{"a": 2}')
    assert orjson.loads(log.read_bytes(path)) == {"a": 1}
    assert [n for n in os.listdir(tmp_path / "t" / "_commits")] == [f"{1:020d}.json"]


def test_a_rollback_of_many_times_is_logged_as_runs():
    from feed.log.commits import time_ranges

    assert time_ranges(range(3, 3609)) == "3-3608"
    assert time_ranges([9, 1, 2, 3, 5, 7, 8]) == "1-3, 5, 7-9"
    many = [t for t in range(0, 40, 2)]  # twenty runs of one time
    assert time_ranges(many, most=3) == "0, 2, 4 and 17 more run(s)"
    assert time_ranges([]) == "none"
