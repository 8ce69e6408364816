"""The feed server on 127.0.0.1: feed info, pull (after/follow/snapshot) in every format,
push subscriptions into a real receiver, pull ACKs, errors and metrics."""

from __future__ import annotations

import asyncio
import io
import os
from collections import Counter

import aiohttp
import orjson
import pytest
from aiohttp import web

from feed.demo.data import ACCOUNTS_SCHEMA, generate_bank
from feed.log.checkpoint import CheckpointStore
from feed.log.compaction import compact
from feed.log.reader import FeedReader
from feed.log.store import FeedLog
from feed.serve.server import ServerConfig, make_server_app
from protocol import Progress, Updates, check_messages, get_codec, record_key
from protocol.receiver import ReceiverConfig, make_receiver_app

from ..e2e.helpers import free_port
from .model import DDReader, as_multiset, debezium_truth, run_emitter
from .test_publisher import _collection_at

BANK = generate_bank(transactions=40, seed=51)
THIRD = len(BANK.events) // 3


def write(path, lines):
    path.write_bytes(b"".join(x + b"\n" for x in lines))


@pytest.fixture
def feed_log(spark, tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    write(src / "part-0000.json", BANK.events[:THIRD])
    write(src / "part-0001.json", BANK.events[THIRD : 2 * THIRD])
    e, _ = run_emitter(
        spark,
        source_kind="debezium",
        source_path=str(src),
        feed="bank",
        log=str(tmp_path / "log"),
        key=("id",),
        schema=ACCOUNTS_SCHEMA,
        clock="logical",
        max_files_per_txn=1,
    )

    def more() -> None:
        write(src / "part-0002.json", BANK.events[2 * THIRD :])
        e.run()

    return tmp_path / "log", more


async def serve(app: web.Application, port: int = 0) -> tuple[str, web.AppRunner]:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return f"http://127.0.0.1:{runner.addresses[0][1]}", runner


def accumulate(messages) -> Counter:
    c: Counter = Counter()
    for m in messages:
        if isinstance(m, Updates):
            for u in m:
                c[record_key(u.record)] += u.diff
    return +c


TRUTH_2, _ = debezium_truth(BANK.events[: 2 * THIRD])


@pytest.mark.parametrize("fmt", ["ndjson", "avro", "arrow"])
async def test_pull_in_each_format_and_resume_with_after(feed_log, fmt):
    log, _ = feed_log
    base, runner = await serve(make_server_app(ServerConfig(log=str(log))))
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{base}/v1/feeds/bank/changes?format={fmt}") as r:
                assert r.status == 200
                assert r.headers["Content-Type"] == get_codec(fmt).content_type
                body = await r.read()
            msgs = get_codec(fmt).decode(body)
            assert check_messages(msgs, key=["id"]) == []
            assert accumulate(msgs) == as_multiset(TRUTH_2.values())
            frontier = msgs[-1].upper
            # resume from the middle: exactly the times >= T
            mid = frontier // 2
            async with s.get(f"{base}/v1/feeds/bank/changes?after={mid}&format={fmt}") as r:
                tail = get_codec(fmt).decode(await r.read())
            times = sorted({u.time for m in tail if isinstance(m, Updates) for u in m})
            all_times = sorted({u.time for m in msgs if isinstance(m, Updates) for u in m})
            assert times == [t for t in all_times if t >= mid]
            assert tail[0].lower == tail[0].upper == mid
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("fmt", ["ndjson", "avro", "arrow"])
async def test_a_large_time_streams_in_bounded_chunks(feed_log, fmt, monkeypatch):
    """A time (and a snapshot) larger than one chunk is sent as several update messages
    before its progress, each encoded off the event loop; the stream stays exact."""
    import feed.serve.stream as pull

    monkeypatch.setattr(pull, "STREAM_CHUNK_UPDATES", 3)
    log, _ = feed_log
    counts = FeedReader(str(log), "bank").counts()
    base, runner = await serve(make_server_app(ServerConfig(log=str(log))))
    try:
        async with aiohttp.ClientSession() as s:
            for query in ("", "&snapshot=true"):
                async with s.get(f"{base}/v1/feeds/bank/changes?format={fmt}{query}") as r:
                    msgs = get_codec(fmt).decode(await r.read())
                assert check_messages(msgs, key=["id"]) == []
                assert accumulate(msgs) == as_multiset(TRUTH_2.values())
                assert all(len(m) <= 3 for m in msgs if isinstance(m, Updates))
            async with s.get(f"{base}/v1/feeds/bank/changes?format={fmt}") as r:
                msgs = get_codec(fmt).decode(await r.read())
        big = max(counts, key=counts.get)
        assert counts[big] > 3
        parts = [m for m in msgs if isinstance(m, Updates) and next(iter(m)).time == big]
        assert len(parts) == -(-counts[big] // 3)
    finally:
        await runner.cleanup()


async def _pull_spied(feed_log, monkeypatch, consumer, fmt):
    """A whole pull of the feed whose writes go through ``consumer(write, data)``: its
    messages, checked exact, and each read of a time's files as (rows, skip)."""
    write, reads = web.StreamResponse.write, []
    batches = FeedReader._batches  # what the committed loop reads a time's files with

    async def written(self, data):
        return await consumer(lambda d: write(self, d), data)

    def spied(self, seg, rows, skip):
        reads.append((rows, skip))
        return batches(self, seg, rows, skip)

    monkeypatch.setattr(web.StreamResponse, "write", written)
    monkeypatch.setattr(FeedReader, "_batches", spied)
    log, _ = feed_log
    base, runner = await serve(make_server_app(ServerConfig(log=str(log))))
    try:
        url = f"{base}/v1/feeds/bank/changes?format={fmt}"
        async with aiohttp.ClientSession() as s, s.get(url) as r:
            msgs = get_codec(fmt).decode(await r.read())
    finally:
        await runner.cleanup()
    assert check_messages(msgs, key=["id"]) == []
    assert accumulate(msgs) == as_multiset(TRUTH_2.values())
    return msgs, reads


async def test_a_stream_waiting_on_its_consumer_lets_its_files_go_and_goes_on_exact(
    feed_log, monkeypatch
):
    """A write the consumer does not take within the release delay closes the time's
    files; the stream opens them again after what it sent: nothing lost or repeated."""
    import feed.serve.stream as pull

    monkeypatch.setattr(pull, "STREAM_CHUNK_UPDATES", 2)
    monkeypatch.setattr(pull, "RELEASE_SECONDS", 0.05)
    writes = [0]

    async def slow_consumer(write, data):  # every third write waits past the delay
        writes[0] += 1
        if writes[0] % 3 == 0:
            await asyncio.sleep(0.2)
        return await write(data)

    _, reads = await _pull_spied(feed_log, monkeypatch, slow_consumer, "arrow")
    assert any(skip > 0 for _, skip in reads)  # files let go in mid-time, opened again


@pytest.mark.parametrize("keeps_up", [True, False])
async def test_a_consumer_that_keeps_up_gets_larger_chunks_and_the_stream_stays_exact(
    feed_log, monkeypatch, keeps_up
):
    """A consumer that took FAST_AFTER_BYTES without a write waiting for it gets chunks
    of STREAM_FAST_UPDATES: the stream opens its files again with them after what it sent
    (mid-time), nothing lost or repeated. One whose writes wait keeps the small chunks."""
    import feed.serve.stream as pull

    monkeypatch.setattr(pull, "STREAM_CHUNK_UPDATES", 2)
    monkeypatch.setattr(pull, "STREAM_FAST_UPDATES", 5)
    monkeypatch.setattr(pull, "FAST_AFTER_BYTES", 1)

    async def consumer(write, data):
        if not keeps_up:
            await asyncio.sleep(0.03)  # each write waits (past _PROMPT_SECONDS)
        return await write(data)

    msgs, reads = await _pull_spied(feed_log, monkeypatch, consumer, "ndjson")
    sizes = [len(m) for m in msgs if isinstance(m, Updates)]
    if keeps_up:
        assert max(sizes) > 2 and all(n <= 5 for n in sizes), sizes
        assert (5, 0) not in reads[:1] and any(rows == 5 for rows, _ in reads), reads
    else:
        assert all(n <= 2 for n in sizes), sizes
        assert all(rows == 2 for rows, _ in reads), reads


async def test_feed_list_info_snapshot_and_errors(feed_log):
    log, _ = feed_log
    base, runner = await serve(make_server_app(ServerConfig(log=str(log), token="tok")))
    auth = {"Authorization": "Bearer tok"}
    try:
        async with aiohttp.ClientSession(headers=auth) as s:
            async with s.get(f"{base}/v1/feeds") as r:
                feeds = (await r.json())["feeds"]
            assert [f["name"] for f in feeds] == ["bank"]
            async with s.get(f"{base}/v1/feeds/bank") as r:
                info = await r.json()
            assert info["since"] == 0 and info["frontier"] > 0
            assert sum(c["count"] for c in info["counts"]) > 0
            async with s.get(f"{base}/v1/feeds/bank/changes?snapshot=true") as r:
                snap = get_codec("ndjson").decode(await r.read())
            assert check_messages(snap, key=["id"]) == []
            assert accumulate(snap) == as_multiset(TRUTH_2.values())
            assert len([m for m in snap if isinstance(m, Updates)]) == 1
            # a complete history for a reader that holds nothing (differential dataflow's)
            dd = DDReader().read(snap)
            assert dd.frontier == info["frontier"]
            assert dd.collection() == as_multiset(TRUTH_2.values())
            async with s.get(f"{base}/v1/feeds/bank/changes?after=0") as r:
                dd = DDReader().read(get_codec("ndjson").decode(await r.read()))
            assert dd.frontier == info["frontier"]
            assert dd.collection() == as_multiset(TRUTH_2.values())
            for path, status, code in [
                ("/v1/feeds/nope", 404, "unknown_feed"),
                ("/v1/feeds/bank/changes?after=x", 400, "bad_request"),
                (f"/v1/feeds/bank/changes?after={1 << 63}", 400, "bad_request"),  # fuzzing
                ("/v1/feeds/bank/changes?format=csv", 415, "unsupported_format"),
                ("/v1/feeds/bank/subscriptions/none", 404, "unknown_subscription"),
            ]:
                async with s.get(base + path) as r:
                    assert (r.status, (await r.json())["error"]) == (status, code), path
        async with aiohttp.ClientSession() as s, s.get(f"{base}/v1/feeds") as r:
            assert r.status == 401
    finally:
        await runner.cleanup()


async def test_follow_streams_new_commits(feed_log):
    log, more = feed_log
    base, runner = await serve(
        make_server_app(ServerConfig(log=str(log), poll_seconds=0.1, heartbeat_seconds=0.5))
    )
    truth_all, _ = debezium_truth(BANK.events)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{base}/v1/feeds/bank/changes?follow=true") as r:
                buf = io.BytesIO()
                committing = None
                deadline = asyncio.get_running_loop().time() + 120
                while asyncio.get_running_loop().time() < deadline:
                    line = await r.content.readline()
                    buf.write(line)
                    msgs = get_codec("ndjson").decode(buf.getvalue())
                    if committing is None and accumulate(msgs) == as_multiset(TRUTH_2.values()):
                        committing = asyncio.get_running_loop().run_in_executor(None, more)
                    if (
                        committing is not None
                        and committing.done()
                        and isinstance(msgs[-1], Progress)
                        and accumulate(msgs) == as_multiset(truth_all.values())
                    ):
                        break
                else:
                    pytest.fail("the followed stream never reached the new commit")
            assert check_messages(msgs, key=["id"]) == []
    finally:
        await runner.cleanup()


async def test_an_idle_followed_stream_gets_its_heartbeats(feed_log):
    """Nothing committed: the stream still says where it is every heartbeat (it waits on
    the feed's watch, which wakes it for a commit, a heartbeat or a stop)."""
    log, _ = feed_log
    base, runner = await serve(
        make_server_app(ServerConfig(log=str(log), poll_seconds=0.1, heartbeat_seconds=0.3))
    )
    try:
        url = f"{base}/v1/feeds/bank/changes?follow=true"
        async with aiohttp.ClientSession() as s, s.get(url) as r:
            buf = io.BytesIO()
            loop = asyncio.get_running_loop()
            caught_up = None
            while loop.time() < (caught_up or loop.time()) + 1.6:
                buf.write(await asyncio.wait_for(r.content.readline(), 10))
                msgs = get_codec("ndjson").decode(buf.getvalue())
                if caught_up is None and accumulate(msgs) == as_multiset(TRUTH_2.values()):
                    caught_up, first = loop.time(), len(msgs)
        # (the progress that completes the catch-up has counts; a heartbeat has none)
        beats = [m for m in msgs[first:] if isinstance(m, Progress) and not m.counts]
        # about five in 1.6 s; a stream that waited for commits alone would send none
        assert 3 <= len(beats) <= 8, beats
        frontier = max(m.upper for m in msgs if isinstance(m, Progress))
        assert {(b.lower, b.upper) for b in beats} == {(frontier, frontier)}
    finally:
        await runner.cleanup()


async def test_push_subscription_into_a_receiver_and_pull_acks(feed_log, tmp_path):
    log, more = feed_log
    rbase, rrunner = await serve(make_receiver_app(ReceiverConfig(db=str(tmp_path / "r.db"))))
    base, runner = await serve(make_server_app(ServerConfig(log=str(log), poll_seconds=0.1)))
    truth_all, _ = debezium_truth(BANK.events)

    async def receiver_collection(s):
        async with s.get(f"{rbase}/v1/collections/bank") as r:
            if r.status == 404:  # nothing pushed yet
                return Counter()
            rows = [orjson.loads(x) for x in (await r.read()).splitlines()]
        return Counter({record_key(x["data"]): x["count"] for x in rows})

    async def wait_for(s, want):
        for _ in range(600):
            if await receiver_collection(s) == want:
                return
            await asyncio.sleep(0.1)
        pytest.fail("the receiver never caught up")

    try:
        async with aiohttp.ClientSession() as s:
            sub = {"url": f"{rbase}/v1/push/bank", "format": "arrow"}
            async with s.put(f"{base}/v1/feeds/bank/subscriptions/mv", json=sub) as r:
                assert r.status == 201, await r.text()
            await wait_for(s, as_multiset(TRUTH_2.values()))
            await asyncio.get_running_loop().run_in_executor(None, more)
            await wait_for(s, as_multiset(truth_all.values()))
            async with s.get(f"{base}/v1/feeds/bank/subscriptions/mv") as r:
                state = await r.json()
            assert state["kind"] == "push" and state["status"] == "active"
            async with s.get(f"{base}/metrics") as r:
                text = await r.text()
            async with s.get(f"{base}/v1/feeds/bank") as r:
                total = sum(c["count"] for c in (await r.json())["counts"])
            # every update pushed once, counted once the receiver ACKed it
            pushed = f'{{feed="bank",subscription="mv",via="push"}} {float(total)}'
            assert f"tidefeed_updates_served_total{pushed}" in text, text
            assert 'tidefeed_bytes_sent_total{feed="bank",subscription="mv",via="push"}' in text
            # a named pull subscriber
            async with s.put(f"{base}/v1/feeds/bank/subscriptions/nb", json={}) as r:
                assert (await r.json())["kind"] == "pull"
            async with s.post(
                f"{base}/v1/feeds/bank/subscriptions/nb/ack", json={"frontier": 3}
            ) as r:
                assert (await r.json())["acked"] == 3
            async with s.post(
                f"{base}/v1/feeds/bank/subscriptions/nb/ack", json={"frontier": 10**9}
            ) as r:
                assert (r.status, (await r.json())["error"]) == (409, "ack_ahead")
            async with s.delete(f"{base}/v1/feeds/bank/subscriptions/nb") as r:
                assert r.status == 200
            async with s.get(f"{base}/v1/feeds/bank/subscriptions/nb") as r:
                assert r.status == 404
    finally:
        await runner.cleanup()
        await rrunner.cleanup()
    # the subscription and its position were kept in the log
    saved = orjson.loads((log / "bank" / "_subscriptions" / "mv.json").read_bytes())
    assert saved["url"].endswith("/v1/push/bank") and saved["acked"] is not None
    # tidefeed status reads the same from the log alone
    from feed.cli.status import log_status

    (bank,) = log_status(str(log))
    frontier = FeedReader(str(log), "bank").frontier
    assert (bank["feed"], bank["frontier"]) == ("bank", frontier)
    assert [(s["name"], s["kind"], s["acked"], s["lag_times"]) for s in bank["subscriptions"]] == [
        ("mv", "push", saved["acked"], frontier - saved["acked"])
    ]
    # the fixture's emitter is still open in this process: it holds the feed
    assert bank["emitter"]["pid"] == os.getpid() and bank["emitter"]["live"]
    assert bank["last_commit"] is not None


async def test_the_documented_pull_consumer_runs_and_resumes(feed_log, tmp_path):
    """docs/examples/pull_consumer.py, run as the consumer guide says, twice."""
    import ast
    import sys
    from pathlib import Path

    log, more = feed_log
    base, runner = await serve(make_server_app(ServerConfig(log=str(log))))
    example = Path(__file__).parents[2] / "docs" / "examples" / "pull_consumer.py"
    db = tmp_path / "consumer.db"

    async def run_example() -> str:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(example),
            base,
            "bank",
            str(db),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        return out.decode()

    try:
        first = await run_example()
        assert "bank at frontier" in first and f": {len(TRUTH_2)} rows" in first
        # it counts updates (not Arrow tables) and lists rows in key order (numbers as such)
        committed = [int(x.split()[1]) for x in first.splitlines() if x.startswith("committed ")]
        assert sum(committed) == sum(FeedReader(str(log), "bank").counts().values())
        listed = [x for x in first.splitlines() if x.startswith("  ")]
        shown = [ast.literal_eval(x.split(None, 1)[1])["id"] for x in listed]
        assert shown == sorted(TRUTH_2)[:10]
        await asyncio.get_running_loop().run_in_executor(None, more)
        second = await run_example()  # resumes from its durable frontier
        truth_all, _ = debezium_truth(BANK.events)
        assert f": {len(truth_all)} rows" in second
    finally:
        await runner.cleanup()


async def _lag(s, base) -> tuple[float, float]:
    """The subscription ``down``'s lag in times and in seconds, from /metrics."""
    async with s.get(f"{base}/metrics") as r:
        text = await r.text()
    found = {}
    for line in text.splitlines():
        for kind in ("times", "seconds"):
            if line.startswith(f"tidefeed_subscriber_lag_{kind}{{") and '"down"' in line:
                found[kind] = float(line.rsplit(" ", 1)[1])
    return found["times"], found["seconds"]


async def test_a_failing_push_is_shown_retried_and_recovers(feed_log, tmp_path):
    """A receiver that is down, then a feed file that goes missing: the subscription shows
    the error and when it started failing, keeps retrying, and delivers once it can."""
    log, _ = feed_log
    port = free_port()  # nothing listens there yet
    base, runner = await serve(make_server_app(ServerConfig(log=str(log), poll_seconds=0.1)))
    rrunner = None
    reader = FeedReader(str(log), "bank")
    segment = reader._manifests.segments(reader.manifest)[0].files[0]
    hidden = log / "bank" / f"{segment}.away"

    async def status(s) -> dict:
        async with s.get(f"{base}/v1/feeds/bank/subscriptions/down") as r:
            return await r.json()

    async def until(s, cond, what):
        for _ in range(300):
            st = await status(s)
            if cond(st):
                return st
            await asyncio.sleep(0.1)
        pytest.fail(f"{what}: {st}")

    try:
        async with aiohttp.ClientSession() as s:
            sub = {"url": f"http://127.0.0.1:{port}/v1/push/bank"}
            async with s.put(f"{base}/v1/feeds/bank/subscriptions/down", json=sub) as r:
                assert r.status == 201
            st = await until(s, lambda st: st["retrying_since"], "no error shown")
            assert "Connect" in st["last_error"] and st["status"] == "active"
            async with s.get(f"{base}/metrics") as r:
                assert 'tidefeed_push_errors_total{feed="bank",subscription="down"}' in (
                    await r.text()
                )
            # behind since the subscription began: lag in times and in growing seconds
            first = await _lag(s, base)
            await asyncio.sleep(0.3)
            second = await _lag(s, base)
            assert first[0] == second[0] == reader.frontier and 0 < first[1] < second[1]
            # a segment goes missing: not a push error, the supervisor shows it all the same
            (log / "bank" / segment).rename(hidden)
            rbase, rrunner = await serve(
                make_receiver_app(ReceiverConfig(db=str(tmp_path / "r.db"))), port=port
            )
            await until(s, lambda st: "missing" in st["last_error"], "missing file not shown")
            hidden.rename(log / "bank" / segment)
            st = await until(s, lambda st: st["acked"] == reader.frontier, "never delivered")
            assert st["retrying_since"] is None and st["status"] == "active"
            for _ in range(50):  # caught up: no lag (the gauge is set at the next poll)
                if await _lag(s, base) == (0, 0):
                    break
                await asyncio.sleep(0.1)
            assert await _lag(s, base) == (0, 0)
            assert await _collection_at(rbase, "bank") == as_multiset(TRUTH_2.values())
            # deleted: its series go with it (a lag left behind would grow for ever)
            async with s.delete(f"{base}/v1/feeds/bank/subscriptions/down") as r:
                assert r.status == 200
            async with s.get(f"{base}/metrics") as r:
                text = await r.text()
            assert 'subscription="down"' not in text, text
            assert "tidefeed_subscriber_lag_seconds" in text  # the metric itself stays
    finally:
        await runner.cleanup()
        if rrunner is not None:
            await rrunner.cleanup()


async def test_metrics_count_the_quarantined_rows_of_committed_transactions(spark, tmp_path):
    from .test_emitter import BAD_LINES

    src = tmp_path / "in"
    src.mkdir()
    write(src / "part-0000.json", BANK.events[:THIRD])
    (src / "part-0001.json").write_bytes(b"\n".join(BAD_LINES) + b"\n")
    log = tmp_path / "log"
    args = dict(
        source_kind="debezium",
        source_path=str(src),
        feed="bank",
        log=str(log),
        key=("id",),
        schema=ACCOUNTS_SCHEMA,
        clock="logical",
        max_files_per_txn=1,
    )
    run_emitter(spark, **args)
    quarantine = log / "bank" / "quarantine"
    rows = [x for f in quarantine.rglob("*.json") for x in f.read_bytes().splitlines()]
    # every bad line but the delete at LSN 4, which is below the committed position: a
    # redelivery, dropped and counted as such
    assert len(rows) == len(BAD_LINES) - 1
    commits = CheckpointStore(FeedLog(str(log), "bank"))
    counted = f'tidefeed_quarantined_rows{{feed="bank"}} {float(len(rows))}'

    def stray(seq: int) -> None:
        """A crashed transaction's quarantined rows, meant for commit ``seq``."""
        folder = quarantine / str(seq)
        folder.mkdir()
        (folder / "part-0.json").write_bytes(b'{"raw": "x"}\n' * 4)

    async def gauge() -> str:
        base, runner = await serve(make_server_app(ServerConfig(log=str(log))))
        try:
            async with aiohttp.ClientSession() as s, s.get(f"{base}/metrics") as r:
                return await r.text()
        finally:
            await runner.cleanup()

    def start_again() -> None:  # (no new input: the start's claim, and no transaction)
        run_emitter(spark, **args)

    # a quarantine folder at a seq no commit has taken is not counted
    stray(commits.latest().seq + 1)
    assert counted in await gauge()
    # nor one whose seq a later commit took: a start's claim (the start itself deletes
    # what it finds: these came after it), a compaction
    start_again()
    claim = commits.latest().seq
    assert commits.made_by(claim) == "claim"
    stray(claim)
    stray(claim + 1)
    compact(str(log), "bank", commits.latest().frontier - 1)
    assert commits.made_by(claim + 1) == "compaction"
    assert counted in await gauge()
    # the next start deletes them, and keeps the rows of committed transactions
    start_again()
    left = [x for f in quarantine.rglob("*.json") for x in f.read_bytes().splitlines()]
    assert sorted(left) == sorted(rows)


async def test_a_consumer_leaving_during_a_snapshot_is_one_log_line(feed_log, monkeypatch, caplog):
    """A client gone in the middle of the opening snapshot: the server notes it in one line,
    with no traceback (the reliability harness's fuzzing found one there)."""
    import logging
    import socket
    import struct

    import feed.serve.stream as pull

    monkeypatch.setattr(pull, "STREAM_CHUNK_UPDATES", 1)  # a write per update
    log, _ = feed_log
    base, runner = await serve(make_server_app(ServerConfig(log=str(log))))
    host, port = base.removeprefix("http://").split(":")
    caplog.set_level(logging.INFO)
    try:
        for _ in range(5):
            loop = asyncio.get_running_loop()
            sock = socket.create_connection((host, int(port)))
            sock.setblocking(False)
            request = b"GET /v1/feeds/bank/changes?snapshot=true HTTP/1.1\r\nHost: x\r\n\r\n"
            await loop.sock_sendall(sock, request)
            assert (await loop.sock_recv(sock, 1024)).startswith(b"HTTP/1.1 200")
            # leave at once, with a reset
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        for _ in range(100):
            if sum("a consumer went away" in r.getMessage() for r in caplog.records) == 5:
                break
            await asyncio.sleep(0.05)
    finally:
        await runner.cleanup()
    assert sum("a consumer went away" in r.getMessage() for r in caplog.records) == 5
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_new_schema_version_reaches_pull_and_push_consumers_whole(spark, tmp_path):
    """A feed whose table gains a column and then loses one (its rows rewritten at the
    drop's time): a push subscriber's collection equals the feed's, an Avro follow stream
    ends at the first new version (resumed from there with the new schema), an NDJSON one
    goes on through both, and the feed's info lists every version."""
    from .test_debezium import (
        CONNECT_COLUMNS,
        end,
        event,
        open_emitter,
        snapshot,
        wrapped,
    )
    from .test_debezium import write as write_lines

    src = tmp_path / "in"
    write_lines(src, "part-0.json", [*[wrapped(e) for e in snapshot(1)]])
    e = open_emitter(spark, tmp_path)
    e.run()
    log = tmp_path / "log"
    rbase, rrunner = await serve(make_receiver_app(ReceiverConfig(db=str(tmp_path / "r.db"))))
    base, runner = await serve(make_server_app(ServerConfig(log=str(log), poll_seconds=0.1)))
    try:
        async with aiohttp.ClientSession() as s:
            sub = {"url": f"{rbase}/v1/push/t", "format": "avro"}
            async with s.put(f"{base}/v1/feeds/t/subscriptions/mv", json=sub) as r:
                assert r.status == 201, await r.text()
            avro = await s.get(f"{base}/v1/feeds/t/changes?format=avro&follow=true")
            ndjson = await s.get(f"{base}/v1/feeds/t/changes?format=ndjson&follow=true")
            # the new shapes: qty added, then doc dropped (a row that held a doc is
            # rewritten at the drop's time)
            more = [*CONNECT_COLUMNS, {"field": "qty", "type": "int64", "optional": True}]
            gone = [c for c in more if c["field"] != "doc"]
            add = event(
                "c", {"id": 20, "owner": "b", "doc": None, "qty": 2**40}, 400, xid=8, order=1
            )
            upd = event("u", {"id": 10, "owner": "c", "qty": 5}, 500, xid=9, order=1)
            write_lines(
                src,
                "part-1.json",
                [
                    wrapped(event("c", {"id": 10, "owner": "a", "doc": None}, 300, xid=7, order=1)),
                    end(7, 310, {"accounts": 1}),
                    wrapped(add, more),
                ],
            )
            write_lines(src, "part-2.json", [end(8, 410, {"accounts": 1})])
            write_lines(src, "part-3.json", [wrapped(upd, gone), end(9, 510, {"accounts": 1})])
            await asyncio.get_running_loop().run_in_executor(None, e.run)
            reader = FeedReader(str(log), "t")
            want: Counter = Counter()
            for r in reader.snapshot().to_pylist():
                want[record_key({k: v for k, v in r.items() if k != "count"})] += r["count"]
            # the snapshot (1), txn 7 (2), qty (3), txn 8 (4), doc gone (5), txn 9 (6)
            assert [v.start for v in reader.info.history()] == [0, 3, 5]
            assert reader.counts()[5] == 2  # -{id 0, doc d0} +{id 0}: the doc is gone
            async with s.get(f"{base}/v1/feeds/t") as r:
                info = await r.json()
            assert [(v["from"], v["added"], v["dropped"]) for v in info["schemas"]] == [
                (0, [], []),
                (3, ["qty"], []),
                (5, [], ["doc"]),
            ]
            for _ in range(300):  # the push subscriber ends equal to the feed
                async with s.get(f"{rbase}/v1/collections/t") as r:
                    if r.status == 200:
                        rows = [orjson.loads(x) for x in (await r.read()).splitlines()]
                        got = Counter({record_key(x["data"]): x["count"] for x in rows})
                        if got == want:
                            break
                await asyncio.sleep(0.1)
            else:
                pytest.fail(f"the receiver never caught up: {got} != {want}")
            # the Avro stream ended where the first new version begins: whole times only
            body = await asyncio.wait_for(avro.read(), 30)
            msgs = get_codec("avro").decode(body)
            assert check_messages(msgs) == [] and msgs[-1].upper == 3
            async with s.get(f"{base}/v1/feeds/t/changes?format=avro&after=3") as r:
                rest = get_codec("avro").decode(await r.read())
            assert accumulate([*msgs, *rest]) == +want
            # the NDJSON stream went on through both versions
            lines: list = []
            while not any(b'"upper":[7]' in x for x in lines):
                line = await asyncio.wait_for(ndjson.content.readline(), 30)
                assert line, b"".join(lines)  # (not the end of the stream)
                lines.append(line)
            ndjson.close()
            decoded = get_codec("ndjson").decode(b"".join(lines))
            assert accumulate(decoded) == +want
    finally:
        await runner.cleanup()
        await rrunner.cleanup()
        e.close()
