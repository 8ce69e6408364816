"""protocol.client.FeedClient against a real feed server on 127.0.0.1: complete times in
every format, resume tokens, until, snapshots, a connection dropped mid-stream, a named
subscription's ACKs, and a feed that grows while it is followed."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import aiohttp
import pytest
from aiohttp import web

from feed.demo.data import ACCOUNTS_SCHEMA, generate_bank
from feed.log.reader import FeedReader
from feed.serve.server import ServerConfig, make_server_app
from protocol import ClientError, FeedClient, record_key

from .model import as_multiset, debezium_truth, run_emitter
from .test_server import serve, write

BANK = generate_bank(transactions=40, seed=52)
HALF = len(BANK.events) // 2
TRUTH_HALF = as_multiset(debezium_truth(BANK.events[:HALF])[0].values())
TRUTH_ALL = as_multiset(debezium_truth(BANK.events)[0].values())


def make_feed(spark, root):
    """A feed with one time per source transaction of the first half of the bank; the
    returned ``more`` commits the second half."""
    src = root / "in"
    src.mkdir()
    write(src / "part-0000.json", BANK.events[:HALF])
    e, _ = run_emitter(
        spark,
        source_kind="debezium",
        source_path=str(src),
        feed="bank",
        log=str(root / "log"),
        key=("id",),
        schema=ACCOUNTS_SCHEMA,
        clock="logical",
        granularity="transaction",
    )

    def more() -> None:
        write(src / "part-0001.json", BANK.events[HALF:])
        e.run()

    return root / "log", more


@pytest.fixture(scope="module")
def half_feed(spark, tmp_path_factory):
    """The first half, for the tests that only read it."""
    log, _ = make_feed(spark, tmp_path_factory.mktemp("client"))
    return log


@pytest.fixture
def growing_feed(spark, tmp_path):
    return make_feed(spark, tmp_path)


def accumulate(items) -> Counter:
    c: Counter = Counter()
    for item in items:
        for row in item.rows():
            c[record_key(row["data"])] += row["diff"]
    return +c


def follow_to_the_end(client, first: int, got: list, caught_up: threading.Event) -> None:
    """Follow ``client`` until it holds the whole bank, setting ``caught_up`` once it is
    past the frontier ``first``."""
    for item in client.times(follow=True):
        got.append(item)
        if item.frontier >= first:
            caught_up.set()
        if accumulate(got) == TRUTH_ALL:
            return


def pulled(base: str, **kw):
    options = {k: kw.pop(k) for k in ("fmt", "name") if k in kw}
    return asyncio.to_thread(lambda: list(FeedClient(base, "bank", **options).times(**kw)))


async def test_complete_times_in_every_format_then_resumed_and_cut_by_until(half_feed):
    log = half_feed
    r = FeedReader(str(log), "bank")
    counts = {t: n for t, n in r.counts().items() if n}
    base, runner = await serve(make_server_app(ServerConfig(log=str(log))))
    try:
        for fmt in ("arrow", "ndjson", "avro"):
            items = await pulled(base, fmt=fmt, follow=False)
            assert [i.time for i in items] == sorted(counts), fmt
            assert {i.time: i.updates.num_rows for i in items} == counts, fmt
            assert items[-1].frontier == r.frontier
            assert accumulate(items) == TRUTH_HALF, fmt
            # consolidated: no record twice at one time
            for i in items:
                keys = [(record_key(row["data"]), row["time"]) for row in i.rows()]
                assert len(keys) == len(set(keys))
        k = len(items) // 2
        rest = await pulled(base, after=items[k].frontier, follow=False)
        assert [i.time for i in rest] == [i.time for i in items[k + 1 :]]  # nothing twice
        assert accumulate(items[: k + 1] + rest) == TRUTH_HALF
        cut = items[k].time + 1
        head = await pulled(base, until=cut)  # (follow=True, but until ends it)
        assert [i.time for i in head] == [i.time for i in items[: k + 1]]
        assert head[-1].frontier >= cut
        snap = await pulled(base, snapshot=True, follow=False)
        assert len(snap) == 1 and snap[0].time == r.frontier - 1  # the collection, one time
        assert accumulate(snap) == TRUTH_HALF
    finally:
        await runner.cleanup()


async def test_a_connection_dropped_mid_stream_is_resumed_with_nothing_twice(half_feed):
    log = half_feed
    base, runner = await serve(make_server_app(ServerConfig(log=str(log))))
    cuts: list[int] = []

    async def cutting(request: web.Request) -> web.StreamResponse:
        """Forwards to the server; the first two streams are cut after 1.5 KB."""
        async with aiohttp.ClientSession() as s, s.get(base + request.path_qs) as up:
            resp = web.StreamResponse(
                status=up.status, headers={"Content-Type": up.headers["Content-Type"]}
            )
            await resp.prepare(request)
            sent = 0
            async for chunk in up.content.iter_chunked(512):
                if "/changes" in request.path and len(cuts) < 2 and sent > 1500:
                    cuts.append(sent)
                    assert request.transport is not None
                    request.transport.close()  # the connection drops
                    return resp
                await resp.write(chunk)
                sent += len(chunk)
            await resp.write_eof()
            return resp

    app = web.Application()
    app.router.add_get("/{tail:.*}", cutting)
    front, front_runner = await serve(app)
    try:
        for fmt in ("ndjson", "arrow"):
            cuts.clear()
            client = FeedClient(front, "bank", fmt=fmt)
            items = await asyncio.to_thread(lambda c=client: list(c.times(follow=False)))
            assert len(cuts) == 2 and client.reconnects >= 2, fmt
            times = [i.time for i in items]
            assert times == sorted(set(times)), fmt  # no time twice
            assert accumulate(items) == TRUTH_HALF, fmt
    finally:
        await front_runner.cleanup()
        await runner.cleanup()


async def test_a_named_subscription_follows_a_growing_feed_and_holds_its_place(growing_feed):
    log, more = growing_feed
    base, runner = await serve(make_server_app(ServerConfig(log=str(log))))
    first = FeedReader(str(log), "bank").frontier
    got: list = []
    caught_up = threading.Event()
    client = FeedClient(base, "bank", name="view", ack_seconds=0)

    def follow() -> None:
        follow_to_the_end(client, first, got, caught_up)
        client.ack()

    try:
        reading = asyncio.ensure_future(asyncio.to_thread(follow))
        assert await asyncio.to_thread(caught_up.wait, 120)
        assert accumulate(got) == TRUTH_HALF
        await asyncio.to_thread(more)  # the emitter commits more while the client follows
        await asyncio.wait_for(reading, 120)
        end = FeedReader(str(log), "bank").frontier
        assert accumulate(got) == TRUTH_ALL
        times = [i.time for i in got]
        assert times == sorted(set(times))
        async with (
            aiohttp.ClientSession() as s,
            s.get(f"{base}/v1/feeds/bank/subscriptions/view") as resp,
        ):
            sub = await resp.json()
        assert sub["kind"] == "pull" and sub["acked"] == client.frontier == got[-1].frontier
        # a new client of the same subscription starts from its ACK: nothing is handed twice
        again = await pulled(base, name="view", follow=False)
        assert [i.time for i in again] == [t for t in times if t >= got[-1].frontier]
        assert got[-1].frontier <= end
    finally:
        await runner.cleanup()


async def test_refusals_are_client_errors_naming_the_cause(half_feed):
    log = half_feed
    base, runner = await serve(make_server_app(ServerConfig(log=str(log), token="s3cret")))
    try:
        with pytest.raises(ClientError, match="401") as e:
            await pulled(base, follow=False)
        assert e.value.status == 401
        with pytest.raises(ClientError, match="404"):
            await asyncio.to_thread(
                lambda: list(FeedClient(base, "nope", token="s3cret").times(follow=False))
            )
        items = await asyncio.to_thread(
            lambda: list(FeedClient(base, "bank", token="s3cret").times(follow=False))
        )
        assert accumulate(items) == TRUTH_HALF
    finally:
        await runner.cleanup()


def test_a_server_killed_mid_stream_and_restarted_loses_and_repeats_nothing(growing_feed):
    """A client follows a real ``tidefeed serve``; the server is SIGKILLed, the feed
    grows while it is down, and a new server starts on the same port: the client
    reconnects by itself and ends with every time once."""
    import signal

    from ..e2e.helpers import free_port, start, wait_up

    log, more = growing_feed
    port = free_port()
    args = ("serve", "--log", str(log), "--port", str(port))
    server = start(*args)
    first = FeedReader(str(log), "bank").frontier
    client = FeedClient(f"http://127.0.0.1:{port}", "bank", retry_for=120)
    got: list = []
    caught_up = threading.Event()

    try:
        wait_up(port)
        reading = threading.Thread(
            target=follow_to_the_end, args=(client, first, got, caught_up), daemon=True
        )
        reading.start()
        assert caught_up.wait(120)
        assert accumulate(got) == TRUTH_HALF
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=30)
        more()  # the emitter commits the rest while no server runs
        server = start(*args)
        reading.join(180)
        assert not reading.is_alive(), "the client did not come back after the restart"
    finally:
        server.kill()
        server.wait(timeout=30)
    assert client.reconnects >= 1
    times = [i.time for i in got]
    assert times == sorted(set(times))  # nothing twice
    assert accumulate(got) == TRUTH_ALL


async def test_a_feed_compacted_past_the_client_is_compacted_and_a_snapshot_goes_on(
    growing_feed,
):
    """A client resumes after the feed was compacted past its frontier: the server says
    410, the client raises Compacted with the feed's ``since``, and the documented way on,
    a new iteration with ``snapshot=True``, takes the collection and is exact."""
    from feed.log.compaction import compact
    from protocol import Compacted

    log, more = growing_feed
    base, runner = await serve(make_server_app(ServerConfig(log=str(log))))
    try:
        items = await pulled(base, follow=False)
        token = items[-1].frontier
        await asyncio.to_thread(more)
        cut = FeedReader(str(log), "bank").times()[-3]
        assert cut > token
        await asyncio.to_thread(compact, str(log), "bank", cut)
        with pytest.raises(Compacted) as e:
            await pulled(base, after=token, follow=False)
        assert e.value.since == cut
        restarted = await pulled(base, snapshot=True, follow=False)
        end = FeedReader(str(log), "bank").frontier
        # the collection, consolidated at the last complete time, in one item
        assert [(i.time, i.frontier) for i in restarted] == [(end - 1, end)]
        assert accumulate(restarted) == TRUTH_ALL
    finally:
        await runner.cleanup()
