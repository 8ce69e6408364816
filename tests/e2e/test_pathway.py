"""Pathway as a real downstream engine: a program reads a growing feed through
``feed.pathway.read`` and keeps views that must equal the truth at every complete time.

Pathway needs ``pyarrow<26``, so it lives in an environment of its own (``make
test-engines`` builds ``.venv-pathway``); the program runs there as a process, against a
``tidefeed serve`` and a ``tidefeed emit --follow`` of this environment. Without that
environment these tests skip, unless ``TIDEFEED_REQUIRE_PATHWAY=1`` (``.ci/run``), which
makes the skip a failure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from feed.demo.data import ACCOUNTS_SCHEMA, generate_bank
from feed.log.reader import FeedReader
from protocol import CheckpointError

from .helpers import (
    bank_emit_args,
    free_port,
    start,
    tidefeed,
    wait_up,
    write_parts_at_transactions,
)

pytestmark = [pytest.mark.slow, pytest.mark.engines, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
BANK = generate_bank(transactions=30, seed=21)
#: the region of every owner: the static table of the join
REGIONS = {"ada": "north", "chen": "east", "dolores": "south", "émile": "south", "grace": "north"}

EXAMPLE = ROOT / "docs" / "examples" / "pathway_views.py"  # the documented program


def pathway_python() -> str:
    python = os.environ.get("TIDEFEED_PATHWAY_PYTHON", str(ROOT / ".venv-pathway/bin/python"))
    found = (
        Path(python).exists()
        and subprocess.run([python, "-c", "import pathway"], capture_output=True).returncode == 0
    )
    if not found:
        reason = f"no Pathway environment at {python} (make test-engines builds it)"
        if os.environ.get("TIDEFEED_REQUIRE_PATHWAY"):
            pytest.fail(reason + " (TIDEFEED_REQUIRE_PATHWAY is set)")
        pytest.skip(reason)
    return python


def truth(reader: FeedReader, t: int) -> dict[str, Counter]:
    """The three views over the feed's collection at time ``t``, as multisets of rows."""
    rows = reader.snapshot(t).drop_columns(["count"]).to_pylist()  # (keyed: each once)
    owners: dict[str, list[int]] = {}
    regions: dict[str, int] = {}
    for r in rows:
        owners.setdefault(r["owner"], []).append(r["balance"])
        if r["owner"] in REGIONS:
            regions[REGIONS[r["owner"]]] = regions.get(REGIONS[r["owner"]], 0) + r["balance"]
    return {
        "accounts": Counter(
            orjson.dumps({("id_" if k == "id" else k): v for k, v in r.items()}) for r in rows
        ),
        "by_owner": Counter(
            orjson.dumps({"owner": o, "total": sum(b), "n": len(b)}) for o, b in owners.items()
        ),
        "by_region": Counter(orjson.dumps({"region": g, "total": s}) for g, s in regions.items()),
    }


def weighted_feed(tmp_path: Path, feed: str, schema: dict, steps: list, *flags: str) -> Path:
    """A feed made by ``tidefeed emit`` from weighted input, one file per step (a list of
    ``(record, delta)``), one time per file; its log."""
    src = tmp_path / "in"
    src.mkdir()
    for i, rows in enumerate(steps):
        lines = [orjson.dumps({"record": r, "delta": d}) for r, d in rows]
        (src / f"part-{i}.json").write_bytes(b"\n".join(lines) + b"\n")
    (tmp_path / f"{feed}.avsc").write_bytes(orjson.dumps(schema))
    log = tmp_path / "log"
    made = tidefeed(
        "emit", "--source", f"weighted:{src}", "--schema", str(tmp_path / f"{feed}.avsc"),
        "--feed", feed, "--log", str(log), "--clock", "logical", "--max-files-per-txn", "1",
        *flags,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr.decode()[-3000:]
    return log


def wait_first_commit(log: Path, feed: str, emit_log: Path) -> None:
    """Wait until the emitter has committed a first time of ``feed`` (the feed's folder
    appears before its settings are written: until then there is no feed to read)."""
    deadline = time.monotonic() + 120
    while True:
        with contextlib.suppress(CheckpointError):
            if FeedReader(str(log), feed).frontier > 0:
                return
        assert time.monotonic() < deadline, emit_log.read_text()[-3000:]
        time.sleep(0.2)


@contextlib.contextmanager
def served(log: Path, tmp_path: Path) -> Iterator[str]:
    """A ``tidefeed serve`` of ``log`` while the block runs: its URL."""
    port = free_port()
    server = start("serve", "--log", str(log), "--port", str(port), log=tmp_path / "serve.log")
    try:
        wait_up(port)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait(timeout=30)


def test_a_pathway_program_over_a_growing_feed_equals_the_truth_at_every_time(tmp_path):
    """An emitter follows the bank's files as they arrive and a server serves its log;
    a Pathway program reads the feed while it grows, is stopped by SIGTERM midway and
    started again on its persisted state. Each complete time is one Pathway commit, none
    is read twice, and after each the table and the views (a groupby and a join with a
    static table) equal the views of the feed's collection at that time."""
    python = pathway_python()
    src, log = tmp_path / "in", tmp_path / "log"
    src.mkdir()
    (tmp_path / "accounts.avsc").write_bytes(orjson.dumps(ACCOUNTS_SCHEMA))
    staged = write_parts_at_transactions(tmp_path / "staged", BANK.events, 5)
    emitter = start(
        *bank_emit_args(src, log, "--granularity", "transaction", "--follow", "--trigger", "0.2"),
        log=tmp_path / "emit.log",
    )
    out, written = tmp_path / "views.jsonl", tmp_path / "by_owner"
    program = server = None
    try:
        staged[0].rename(src / staged[0].name)
        wait_first_commit(log, "bank", tmp_path / "emit.log")
        port = free_port()
        server = start("serve", "--log", str(log), "--port", str(port), log=tmp_path / "serve.log")
        wait_up(port)
        # the whole feed ends with one time per source transaction (logical clock)
        until = 1 + BANK.transactions
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("PYSPARK_SUBMIT_ARGS", None)

        regions = tmp_path / "regions.json"
        regions.write_bytes(orjson.dumps(REGIONS))

        def run(until: int) -> subprocess.Popen:
            args = [f"http://127.0.0.1:{port}", "bank", "--regions", str(regions)]
            args += ["--changes", str(out), "--state", str(tmp_path / "state")]
            args += ["--write-back", str(written), *(["--until", str(until)] if until else [])]
            return subprocess.Popen(
                [python, str(EXAMPLE), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )

        program = run(0)  # follows until it is stopped
        for part in staged[1:3]:  # more arrives while Pathway reads
            time.sleep(1.5)
            part.rename(src / part.name)
        time.sleep(2)
        program.send_signal(signal.SIGTERM)
        output, _ = program.communicate(timeout=120)
        assert program.returncode == 143, output.decode()[-3000:]  # Pathway's clean stop
        first = len(out.read_bytes().splitlines())
        program = run(until)  # the same program again, on its persisted state
        for part in staged[3:]:
            time.sleep(1.5)
            part.rename(src / part.name)
        output, _ = program.communicate(timeout=300)
        assert program.returncode == 0, output.decode()[-3000:]
    finally:
        for p in (program, emitter, server):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()

    reader = FeedReader(str(log), "bank")
    assert reader.frontier == until
    assert 0 < first < len(out.read_bytes().splitlines())  # each run read some of it
    changes: dict[int, list] = {}
    for line in out.read_bytes().splitlines():
        view, pw_time, added, row = orjson.loads(line)
        changes.setdefault(pw_time, []).append((view, added, row))
    # one Pathway commit per complete time: the Pathway times with changes to the table,
    # in order, are the feed's times with updates, in order
    feed_times = reader.times()
    table_times = sorted(t for t, cs in changes.items() if any(v == "accounts" for v, *_ in cs))
    assert len(table_times) == len(feed_times) > 10
    assert set(changes) <= set(table_times)  # no view moves without the table
    held: dict[str, Counter] = {v: Counter() for v in ("accounts", "by_owner", "by_region")}
    owner_states = []  # the groupby after each Pathway time that changed it
    for pw_time, t in zip(table_times, feed_times, strict=True):
        for view, added, row in changes[pw_time]:
            held[view][orjson.dumps(row)] += 1 if added else -1
        current = {v: +c for v, c in held.items()}  # (drop what netted to zero)
        assert current == truth(reader, t), f"time {t}"
        if any(v == "by_owner" for v, *_ in changes[pw_time]):
            owner_states.append(current["by_owner"])

    # the round trip: the groupby written back is a valid feed, equal to it at every time
    args = ["--source", f"weighted:{written}", "--schema", f"{written}.avsc", "--feed", "owners"]
    made = tidefeed(
        "emit", *args, "--log", str(tmp_path / "log2"), "--clock", "logical",
        "--max-files-per-txn", "1",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr.decode()[-3000:]
    inspected = tidefeed("inspect", "--log", str(tmp_path / "log2"), "--feed", "owners",
                         "--format", "ndjson")  # fmt: skip
    assert inspected.returncode == 0, inspected.stderr.decode()
    checked = tidefeed("check", "--key", "owner", "-", stdin=inspected.stdout)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    owners = FeedReader(str(tmp_path / "log2"), "owners")
    assert len(owners.times()) == len(owner_states) > 10  # one time per Pathway time
    for t, state in zip(owners.times(), owner_states, strict=True):
        rows = owners.snapshot(t).to_pylist()
        assert all(r.pop("count") == 1 for r in rows)
        assert Counter(orjson.dumps(r) for r in rows) == state, f"time {t}"


def test_write_refuses_a_column_it_cannot_type_before_the_program_runs(tmp_path):
    """A column of a type a feed's weighted input cannot carry is named in the error,
    raised by write() itself: no folder or schema file is left behind."""
    python = pathway_python()
    program = r"""
import datetime, sys
import pathway as pw
from feed.pathway import write
t = pw.debug.table_from_rows(
    pw.schema_from_types(n=int, at=pw.DateTimeNaive), [(1, datetime.datetime(2026, 1, 1))]
)
write(t, sys.argv[1])
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [python, "-c", program, str(tmp_path / "out")], env=env, capture_output=True, timeout=120
    )
    assert done.returncode == 1
    assert b"TypeError: feed.pathway.write: column 'at' is" in done.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.avsc").exists()


def test_a_feed_without_a_key_is_a_row_per_copy(tmp_path):
    """A multiset feed (records there 2 and 3 times, copies taken away one by one) read
    by Pathway: at every time the table holds one row per copy, numbered by ``copy_``,
    and its records counted equal the feed's collection. Started again on its persisted
    state, the program refuses: the copy numbers were the first run's."""
    python = pathway_python()
    steps = [  # one file, one time each
        [({"k": "a", "v": 1}, 2), ({"k": "b", "v": 2}, 1)],
        [({"k": "a", "v": 1}, -1), ({"k": "c", "v": 3}, 3)],
        [({"k": "a", "v": 1}, -1), ({"k": "b", "v": 2}, -1), ({"k": "c", "v": 3}, -1)],
        [({"k": "a", "v": 1}, 1)],
    ]
    schema = {"type": "record", "name": "r", "fields": [
        {"name": "k", "type": "string"}, {"name": "v", "type": "long"}]}  # fmt: skip
    log = weighted_feed(tmp_path, "m", schema, steps)
    program = r"""
import sys, orjson
import pathway as pw
from feed.pathway import read
t = read(sys.argv[1], "m", follow=False)
out = open(sys.argv[2], "ab")
def on_change(key, row, time, is_addition):
    out.write(orjson.dumps([time, is_addition, row]) + b"\n")
    out.flush()
pw.io.subscribe(t, on_change=on_change)
state = pw.persistence.Config(pw.persistence.Backend.filesystem(sys.argv[3]))
pw.run(monitoring_level=pw.MonitoringLevel.NONE, persistence_config=state)
"""
    out = tmp_path / "rows.jsonl"
    with served(log, tmp_path) as url:
        run = [python, "-c", program, url, str(out), str(tmp_path / "state")]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(run, env=env, capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr.decode()[-3000:]
        read_once = out.read_bytes()
        # started again on its persisted state: the copy numbers lived in the first run
        again = subprocess.run(run, env=env, capture_output=True, timeout=120)
        assert again.returncode != 0
        assert b"has no key: its copies are numbered by this program" in again.stderr
        assert out.read_bytes() == read_once  # nothing more reached Pathway's output
    by_time: dict[int, list] = {}
    for line in out.read_bytes().splitlines():
        pw_time, added, row = orjson.loads(line)
        by_time.setdefault(pw_time, []).append((added, row))
    reader = FeedReader(str(log), "m")
    assert len(by_time) == len(reader.times()) == len(steps)
    rows: Counter = Counter()
    for pw_time, t in zip(sorted(by_time), reader.times(), strict=True):
        for added, row in by_time[pw_time]:
            rows[orjson.dumps(row)] += 1 if added else -1
        held = [orjson.loads(r) for r, n in rows.items() if n]
        assert all(rows[r] in (0, 1) for r in rows)  # every row once: copies are rows
        copies: dict[tuple, list[int]] = {}
        for r in held:
            copies.setdefault((r["k"], r["v"]), []).append(r["copy_"])
        want = {(r["k"], r["v"]): r["count"] for r in reader.snapshot(t).to_pylist()}
        assert {k: sorted(c) for k, c in copies.items()} == {
            k: list(range(n)) for k, n in want.items()
        }, f"time {t}"


def test_no_server_is_one_clear_error_before_pathway_starts(tmp_path):
    python = pathway_python()
    (tmp_path / "regions.json").write_bytes(b"{}")
    args = [f"http://127.0.0.1:{free_port()}", "bank", "--regions", str(tmp_path / "regions.json")]
    done = subprocess.run(
        [python, str(EXAMPLE), *args, "--changes", str(tmp_path / "c.jsonl")],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert b"ClientError: feed 'bank': cannot reach a feed server at" in done.stderr
    assert not (tmp_path / "c.jsonl").exists()  # nothing ran


def test_a_new_record_schema_under_a_running_program_stops_it_saying_so(tmp_path):
    """The feed takes a column more while a Pathway program follows it: the program
    stops with an error naming the time and the two record types, after handing Pathway
    every time of the old shape."""
    from ..feed.test_debezium import CONNECT_COLUMNS, SCHEMA, end, event, snapshot, wrapped
    from ..feed.test_debezium import write as write_events

    python = pathway_python()
    staged, src, log = tmp_path / "staged", tmp_path / "in", tmp_path / "log"
    src.mkdir()
    more = [*CONNECT_COLUMNS, {"field": "qty", "type": "int64", "optional": True}]
    old = [wrapped(e) for e in snapshot(1)]
    old += [wrapped(event("c", {"id": 10, "owner": "a", "doc": None}, 300, xid=7, order=1))]
    write_events(staged, "part-0.json", [*old, end(7, 310, {"accounts": 1})])
    new = event("c", {"id": 20, "owner": "b", "doc": None, "qty": 5}, 400, xid=8, order=1)
    write_events(staged, "part-1.json", [wrapped(new, more), end(8, 410, {"accounts": 1})])
    (tmp_path / "schema.avsc").write_bytes(orjson.dumps(SCHEMA))
    args = ["--source", f"debezium:{src}", "--log", str(log), "--feed", "t", "--key", "id"]
    args += ["--table", "public.accounts", "--clock", "logical", "--schema"]
    args += [str(tmp_path / "schema.avsc"), "--follow", "--trigger", "0.2"]
    emitter = start("emit", *args, log=tmp_path / "emit.log")
    server = program = None
    try:
        (staged / "part-0.json").rename(src / "part-0.json")
        wait_first_commit(log, "t", tmp_path / "emit.log")
        port = free_port()
        server = start("serve", "--log", str(log), "--port", str(port), log=tmp_path / "serve.log")
        wait_up(port)
        code = """
import sys, pathway as pw
from feed.pathway import read
t = read(sys.argv[1], "t")
pw.io.subscribe(t, on_change=lambda key, row, time, is_addition: print("row", row, flush=True))
pw.run(monitoring_level=pw.MonitoringLevel.NONE)
"""
        program = subprocess.Popen(
            [python, "-c", code, f"http://127.0.0.1:{port}"],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        time.sleep(3)  # (the program holds the old shape's times)
        (staged / "part-1.json").rename(src / "part-1.json")
        output, _ = program.communicate(timeout=120)
    finally:
        for p in (program, emitter, server):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    text = output.decode()
    assert program.returncode not in (0, None), text[-3000:]
    assert "has records of another schema than when this program started" in text, text[-3000:]
    assert "start the program again to read the new columns" in text
    assert "'id_': 10" in text  # what came before the change reached Pathway


TYPED_SCHEMA = {
    "type": "record",
    "name": "r",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal",
                                    "precision": 12, "scale": 2}},
        {"name": "at", "type": ["null", {"type": "long", "logicalType": "timestamp-micros"}],
         "default": None},
        {"name": "local", "type": {"type": "long", "logicalType": "local-timestamp-micros"}},
        {"name": "day", "type": {"type": "int", "logicalType": "date"}},
        {"name": "ratio", "type": "double"},
        {"name": "tags", "type": {"type": "array", "items": "string"}},
    ],
}  # fmt: skip


def test_columns_arrive_as_pathway_types(tmp_path):
    """Decimals, timestamps, local timestamps, dates, doubles and nested values of a feed
    are Pathway columns of the documented types, with their values; ``id`` is ``id_``."""
    python = pathway_python()
    rows = [
        {"id": 1, "amount": "12.34", "at": "2026-01-02T03:04:05.123456Z",
         "local": "2026-01-02T03:04:05", "day": "2026-01-02", "ratio": 0.5, "tags": ["a", "b"]},
        {"id": 2, "amount": "-0.01", "at": None, "local": "1999-12-31T23:59:59",
         "day": "1999-12-31", "ratio": -1.25, "tags": []},
    ]  # fmt: skip
    log = weighted_feed(tmp_path, "typed", TYPED_SCHEMA, [[(r, 1) for r in rows]], "--key", "id")
    program = r"""
import sys, pathway as pw
from feed.pathway import read
t = read(sys.argv[1], "typed", follow=False)
print("types", {c: str(h) for c, h in t.schema.typehints().items()}, flush=True)
pw.io.subscribe(t, on_change=lambda key, row, time, is_addition: print("row", repr(row)))
pw.run(monitoring_level=pw.MonitoringLevel.NONE)
"""
    with served(log, tmp_path) as url:
        done = subprocess.run(
            [python, "-c", program, url],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            timeout=120,
        )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    out = done.stdout.decode()
    types = next(line for line in out.splitlines() if line.startswith("types "))
    for column in [
        "'id_': \"<class 'int'>\"",
        "'amount': \"<class 'float'>\"",
        "'at': 'pathway.internals.datetime_types.DateTimeUtc | None'",
        "'local': \"<class 'pathway.internals.datetime_types.DateTimeNaive'>\"",
        "'day': \"<class 'pathway.internals.datetime_types.DateTimeNaive'>\"",
        "'ratio': \"<class 'float'>\"",
        "'tags': \"<class 'pathway.internals.json.Json'>\"",
    ]:
        assert column in types, (column, types)
    got = sorted(line for line in out.splitlines() if line.startswith("row "))
    assert got == [
        "row {'id_': 1, 'amount': 12.34, 'at': Timestamp('2026-01-02 03:04:05.123456+0000', "
        "tz='tzutc()'), 'local': Timestamp('2026-01-02 03:04:05'), 'day': "
        "Timestamp('2026-01-02 00:00:00'), 'ratio': 0.5, 'tags': pw.Json(['a', 'b'])}",
        "row {'id_': 2, 'amount': -0.01, 'at': None, 'local': Timestamp('1999-12-31 "
        "23:59:59'), 'day': Timestamp('1999-12-31 00:00:00'), 'ratio': -1.25, 'tags': "
        "pw.Json([])}",
    ]
