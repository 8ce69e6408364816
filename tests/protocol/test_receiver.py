"""The reference receiver over real HTTP on 127.0.0.1: ACKs, collections, every error status."""

from __future__ import annotations

import logging

import aiohttp
import orjson
import pytest
from aiohttp import web

from protocol import Progress, Update, Updates, announcement, get_codec
from protocol.push import PushClient, PushRejected
from protocol.receiver import ReceiverConfig, make_receiver_app

ROWS = [{"id": i, "name": f"n{i}", "tags": ["x"] * (i % 3)} for i in range(6)]
FEED = [
    announcement(0),
    Updates.of([Update(ROWS[0], 1, 1), Update(ROWS[1], 1, 1)]),
    Progress(0, 2, ((1, 2),)),
    Updates.of([Update(ROWS[1], 3, -1), Update(ROWS[2], 3, 2)]),
    Progress(2, 4, ((3, 2),)),
]


@pytest.fixture
async def receiver(tmp_path):
    servers = []

    async def start(**kw):
        cfg = ReceiverConfig(db=str(tmp_path / "r.db"), **kw)
        runner = web.AppRunner(make_receiver_app(cfg))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        servers.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for r in servers:
        await r.cleanup()


async def state(base, feed="f"):
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{base}/v1/push/{feed}") as r:
            head = await r.json()
        async with s.get(f"{base}/v1/collections/{feed}") as r:
            coll = await r.text()
    return head, coll


@pytest.mark.parametrize("fmt", ["ndjson", "avro", "arrow"])
async def test_push_in_each_format_acks_and_accumulates(receiver, fmt):
    base = await receiver()
    async with PushClient(f"{base}/v1/push/f", fmt=fmt) as c:
        assert await c.handshake() == (None, 0)
        ack = await c.push(FEED[:3], epoch=1)
        assert (ack.frontier, ack.pending) == (2, 0)
        ack = await c.push(FEED[3:4], epoch=1)
        assert (ack.frontier, ack.pending) == (2, 2)
        ack = await c.push(FEED[3:], epoch=1)  # a retried body: duplicates are ignored
        assert (ack.frontier, ack.pending) == (4, 0)
        assert await c.handshake() == (4, 1)
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{base}/v1/collections/f") as r:
            lines = (await r.read()).splitlines()
        got = sorted((orjson.loads(x)["data"]["id"], orjson.loads(x)["count"]) for x in lines)
        assert got == [(0, 1), (2, 2)]
        async with s.get(f"{base}/v1/collections/f?at=2") as r:
            got = sorted(orjson.loads(x)["data"]["id"] for x in (await r.read()).splitlines())
        assert got == [0, 1]
        # times out of the 64-bit range, or not numbers, are the client's mistake: 400
        for at in ("-1", str(-(10**30)), str(10**30), "9" * 5000, "x"):
            async with s.get(f"{base}/v1/collections/f", params={"at": at}) as r:
                assert r.status == 400, (at[:20], r.status, await r.text())


async def raw_post(base, body, *, ctype="application/x-ndjson", epoch="1", feed="f", headers=None):
    h = {"Content-Type": ctype, **(headers or {})}
    if epoch is not None:
        h["Tidefeed-Epoch"] = epoch
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{base}/v1/push/{feed}", data=body, headers=h) as r,
    ):
        return r.status, await r.json(), r.headers


NDJSON = get_codec("ndjson")


@pytest.mark.parametrize(
    ("body", "kw", "status", "code"),
    [
        (b"{oops\n", {}, 400, "malformed_body"),
        (NDJSON.encode(FEED[:3]), {"epoch": None}, 400, "missing_epoch"),
        (NDJSON.encode(FEED[:3]), {"epoch": str(1 << 63)}, 400, "missing_epoch"),  # > 64 bits
        (NDJSON.encode(FEED[:3]), {"ctype": "text/csv"}, 415, "unsupported_content_type"),
        (NDJSON.encode(FEED[:3]), {"feed": "..x"}, 404, "unknown_feed"),
        (NDJSON.encode([announcement(0), Progress(5, 6, ())]), {}, 409, "gap"),
        (NDJSON.encode([Progress(2, 4, ((3, 5),))]), {}, 409, "count_mismatch"),
        (
            NDJSON.encode(
                [announcement(2), Updates.of([Update(ROWS[0], 2, 1), Update(ROWS[0], 2, -1)])]
            ),
            {},
            409,
            "conflict",
        ),
        (NDJSON.encode(FEED[:3]), {"epoch": "0"}, 409, "stale_epoch"),
    ],
)
async def test_each_error_status_changes_no_state(receiver, body, kw, status, code):
    base = await receiver()
    ok, ack, _ = await raw_post(base, NDJSON.encode(FEED[:3]), epoch="1")
    assert ok == 200 and ack["frontier"] == 2
    # something pending, to see that a refused body does not drop it either
    ok, ack, _ = await raw_post(base, NDJSON.encode(FEED[3:4]), epoch="1")
    assert ack["pending"] == 2
    before = await state(base)
    got, err, _ = await raw_post(base, body, **kw)
    assert (got, err["error"]) == (status, code), err
    assert isinstance(err["detail"], str) and err["detail"]
    assert await state(base) == before
    _, ack, _ = await raw_post(base, NDJSON.encode(FEED[4:]), epoch="1")
    assert ack == {"frontier": 4, "pending": 0}  # the pending updates survived


async def test_a_body_cut_short_changes_nothing_and_a_chunked_one_is_read(receiver, caplog):
    """A body read by its declared length whose client stops sending halfway: no answer,
    nothing changed, no server error logged (a refusal, not a traceback), and the
    receiver goes on; a chunked body (no length) is read whole."""
    import asyncio

    base = await receiver()
    ok, ack, _ = await raw_post(base, NDJSON.encode(FEED[:3]), epoch="1")
    assert ok == 200 and ack["frontier"] == 2
    before = await state(base)
    body = NDJSON.encode(FEED[3:5])
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"POST /v1/push/f HTTP/1.1\r\nHost: {host}\r\nContent-Type: {NDJSON.content_type}\r\n"
        f"Tidefeed-Epoch: 1\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body[: len(body) // 2])
    await writer.drain()
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()
    assert await state(base) == before
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]

    async def chunks():
        for i in range(0, len(body), 7):
            yield body[i : i + 7]

    headers = {"Content-Type": NDJSON.content_type, "Tidefeed-Epoch": "1"}
    url = f"{base}/v1/push/f"
    async with aiohttp.ClientSession() as s, s.post(url, data=chunks(), headers=headers) as r:
        assert r.status == 200 and await r.json() == {"frontier": 4, "pending": 0}


@pytest.mark.parametrize("fmt", ["ndjson", "arrow"])
async def test_a_body_sent_in_many_slices_arrives_whole(receiver, fmt, monkeypatch):
    """The push client writes a body as slices of itself: with slices of 7 bytes, every
    body goes in many writes, and the receiver gets each whole (the ACK and the
    collection say so)."""
    import protocol.push

    monkeypatch.setattr(protocol.push, "SEND_SLICE", 7)
    base = await receiver()
    rows = [{"id": i, "name": f"n{i}" * 50, "tags": []} for i in range(300)]
    async with PushClient(f"{base}/v1/push/f", fmt=fmt) as c:
        ups = Updates.of([Update(r, 1, 1) for r in rows])
        ack = await c.push([announcement(0), ups, Progress(0, 2, ((1, 300),))], epoch=1)
        assert (ack.frontier, ack.pending) == (2, 0)
        assert c.bytes_sent > 300 * 50 * 2  # (many slices of 7 bytes)
    async with aiohttp.ClientSession() as s, s.get(f"{base}/v1/collections/f") as r:
        got = sorted(orjson.loads(x)["data"]["id"] for x in (await r.read()).splitlines())
    assert got == list(range(300))


async def test_a_chunked_body_over_the_bound_is_413_and_changes_nothing(receiver):
    """A body with no declared length is refused once the bytes read pass the bound, with
    the same answer as a declared one; the receiver's state is as before."""
    base = await receiver(max_body=2000)
    ok, _, _ = await raw_post(base, NDJSON.encode(FEED[:3]), epoch="1")
    assert ok == 200
    before = await state(base)

    async def chunks():
        for _ in range(100):
            yield b"x" * 100

    headers = {"Content-Type": NDJSON.content_type, "Tidefeed-Epoch": "1"}
    url = f"{base}/v1/push/f"
    async with aiohttp.ClientSession() as s, s.post(url, data=chunks(), headers=headers) as r:
        assert r.status == 413
        assert (await r.json())["error"] == "body_too_large"
    assert await state(base) == before


async def test_token_body_limit_and_high_watermark(receiver):
    base = await receiver(token="s3cret", max_body=2000, pending_high_watermark=2)
    body = NDJSON.encode(FEED[:2])
    status, err, hdr = await raw_post(base, body)
    assert (status, err["error"]) == (401, "unauthorized")
    auth = {"Authorization": "Bearer s3cret"}
    status, err, _ = await raw_post(base, b"x" * 5000, headers=auth)
    assert (status, err["error"]) == (413, "body_too_large")
    status, ack, _ = await raw_post(base, body, headers=auth)
    assert status == 200 and ack["pending"] == 2
    # more updates are refused while 2 are pending (the progress alone would pass)
    status, err, hdr = await raw_post(base, NDJSON.encode(FEED[3:4]), headers=auth)
    assert (status, err["error"]) == (429, "too_many_pending")
    assert hdr["Retry-After"] == "1"
    async with aiohttp.ClientSession() as s, s.get(f"{base}/healthz") as r:
        assert r.status == 200  # health needs no token


async def test_pending_bounds_per_feed_and_over_all_feeds(receiver):
    base = await receiver(pending_high_watermark=10, max_pending_total=3)
    two = NDJSON.encode(FEED[:2])  # an announcement and 2 updates, left pending
    assert (await raw_post(base, two, feed="a"))[1]["pending"] == 2
    assert (await raw_post(base, two, feed="b"))[1]["pending"] == 2  # 4 over both feeds
    status, err, hdr = await raw_post(base, two, feed="c")
    assert (status, err["error"], hdr["Retry-After"]) == (429, "too_many_pending", "1")
    assert "over all feeds (limit 3)" in err["detail"]
    assert (await state(base, "c"))[0] == {"frontier": None, "epoch": 0, "pending": 0}
    # the progress that completes a feed's pending updates always gets through
    status, ack, _ = await raw_post(base, NDJSON.encode(FEED[2:3]), feed="a")
    assert status == 200 and ack == {"frontier": 2, "pending": 0}
    status, ack, _ = await raw_post(base, two, feed="c")  # room again
    assert status == 200 and ack["pending"] == 2


async def test_push_client_maps_statuses(receiver):
    base = await receiver(token="t")
    async with PushClient(f"{base}/v1/push/f", token="wrong") as c:
        with pytest.raises(PushRejected) as e:
            await c.push(FEED, epoch=1)
        assert e.value.fatal and e.value.status == 401
    async with PushClient(f"{base}/v1/push/f", token="t") as c:
        with pytest.raises(PushRejected) as e:
            await c.push([announcement(0), Progress(3, 4, ())], epoch=1)
        assert not e.value.fatal and not e.value.retry and e.value.code == "gap"
    async with PushClient("http://127.0.0.1:9/v1/push/f") as c:
        with pytest.raises(PushRejected) as e:
            await c.handshake()
        assert e.value.retry


async def test_state_survives_a_restart(receiver, tmp_path):
    base = await receiver()
    await raw_post(base, NDJSON.encode(FEED))
    base2 = await receiver()  # a second server on the same database file
    head, coll = await state(base2)
    assert head == {"frontier": 4, "epoch": 1, "pending": 0}
    assert len(coll.splitlines()) == 2


async def test_a_storage_failure_is_503_with_retry_after_and_commits_nothing(receiver, tmp_path):
    import sqlite3

    base = await receiver(busy_timeout=0.2)
    await raw_post(base, NDJSON.encode(FEED[:3]))
    before = await state(base)
    other = sqlite3.connect(str(tmp_path / "r.db"), isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another writer holds the database
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                f"{base}/v1/push/f",
                data=NDJSON.encode(FEED[3:]),
                headers={"Content-Type": "application/x-ndjson", "Tidefeed-Epoch": "1"},
            ) as r,
        ):
            assert r.status == 503
            assert r.headers["Retry-After"] == "1"
            assert (await r.json())["error"] == "storage_unavailable"
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert await state(base) == before  # nothing committed, nothing pending
    status, ack, _ = await raw_post(base, NDJSON.encode(FEED[3:]))  # the retry goes through
    assert (status, ack["frontier"]) == (200, 4)


async def test_a_status_get_racing_the_first_push_never_commits_a_time_twice(receiver):
    import asyncio

    base = await receiver()
    body = get_codec("ndjson").encode(FEED[:3])
    headers = {"Content-Type": "application/x-ndjson", "Tidefeed-Epoch": "1"}
    async with aiohttp.ClientSession() as s:
        for n in range(40):
            feed = f"race{n}"

            async def get(feed=feed):
                async with s.get(f"{base}/v1/push/{feed}") as r:
                    assert r.status == 200

            async def post(feed=feed):
                async with s.post(f"{base}/v1/push/{feed}", data=body, headers=headers) as r:
                    assert r.status == 200, await r.text()

            await asyncio.gather(*[get() for _ in range(4)], post(), *[get() for _ in range(4)])
            # the same time again: the receiver must answer from the one consumer that
            # committed it (a duplicate below the frontier is ignored)
            await post()
            async with s.get(f"{base}/v1/collections/{feed}") as r:
                rows = [orjson.loads(x) for x in (await r.read()).splitlines()]
            assert sorted(x["count"] for x in rows) == [1, 1], (feed, rows)


async def test_the_collection_of_an_unknown_feed_is_404(receiver):
    base = await receiver()
    async with aiohttp.ClientSession() as s, s.get(f"{base}/v1/collections/nobody") as r:
        assert r.status == 404
        assert (await r.json())["error"] == "unknown_feed"


async def test_background_folds_run_in_a_thread_of_lower_priority(tmp_path, monkeypatch):
    import asyncio
    import os
    import threading

    import protocol.receiver as receiver_module
    from protocol.sqlite_store import SqliteDatabase

    monkeypatch.setattr(receiver_module, "FOLD_IDLE_SECONDS", 0.05)
    app = make_receiver_app(ReceiverConfig(db=str(tmp_path / "r.db")))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with PushClient(f"{base}/v1/push/f", fmt="arrow") as client:
            await client.push(FEED, epoch=1)
        store = app[receiver_module.DB].store("f")
        for _ in range(200):  # the fold runs once pushes pause
            if not store._unfolded_rows():
                break
            await asyncio.sleep(0.02)
        assert not store._unfolded_rows()
        _, coll = await state(base)
        niceness = app[receiver_module.FOLDER].submit(
            lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        )
        main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    finally:
        await runner.cleanup()
    assert niceness.result() == main + receiver_module.FOLD_NICENESS
    # what was folded is the collection: read back from the database alone
    again = SqliteDatabase(str(tmp_path / "r.db")).store("f")
    kept = {orjson.loads(k)["id"]: n for k, n in again.current()}
    assert kept == {0: 1, 2: 2}
    assert sorted(orjson.loads(line)["data"]["id"] for line in coll.splitlines()) == [0, 2]


async def test_refused_requests_are_logged_a_line_each_rate_limited_per_client(
    receiver, caplog, monkeypatch
):
    import protocol._http as http

    clock = [100.0]
    monkeypatch.setattr(http, "REFUSALS", http.RefusalLog(every=10.0, clock=lambda: clock[0]))
    base = await receiver()
    caplog.set_level(logging.WARNING, "tidefeed.http")
    headers = {"Content-Type": "application/x-ndjson", "Tidefeed-Epoch": "1"}
    async with aiohttp.ClientSession() as s:
        for _ in range(50):  # garbage in a loop: one line for all of it
            async with s.post(f"{base}/v1/push/f", data=b"{nope\n", headers=headers) as r:
                assert r.status == 400
        lines = [r.getMessage() for r in caplog.records if r.name == "tidefeed.http"]
        assert len(lines) == 1, lines
        assert lines[0].startswith("refused POST /v1/push/f from 127.0.0.1: 400")
        clock[0] += 11  # later, the next refusal says how many were held back
        gz = {**headers, "Content-Encoding": "gzip"}
        async with s.post(f"{base}/v1/push/f", data=b"x", headers=gz) as r:
            assert r.status == 415
        lines = [r.getMessage() for r in caplog.records if r.name == "tidefeed.http"]
        assert len(lines) == 2 and "415" in lines[1]
        assert "(49 more refused from it since)" in lines[1]
        # protocol answers (a gap, a stale epoch) are normal work: not logged
        async with s.get(f"{base}/v1/push/nofeed") as r:
            assert r.status in (200, 404)
    assert len([r for r in caplog.records if r.name == "tidefeed.http"]) == 2
    head, _ = await state(base)
    assert head["frontier"] is None  # nothing refused changed the feed


def scrape(text: str) -> dict[str, float]:
    """The samples of a Prometheus text page: ``name{labels}`` -> value."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def test_metrics_count_bodies_commits_and_refusals_and_show_each_feeds_state(
    receiver, tmp_path
):
    base = await receiver()
    body = NDJSON.encode(FEED[:4])  # time 1 committed, time 3's updates pending
    assert (await raw_post(base, body))[0] == 200
    bad = NDJSON.encode([Progress(0, 9, ((5, 1),))])  # counts an update it never sent
    assert (await raw_post(base, bad))[0] == 409
    assert (await raw_post(base, bad, feed="nobody"))[0] == 409  # no such feed before it
    async with aiohttp.ClientSession() as s, s.get(f"{base}/metrics") as r:
        assert r.status == 200
        m = scrape(await r.text())
    assert m['tidefeed_receiver_frontier{feed="f"}'] == 2
    assert m['tidefeed_receiver_epoch{feed="f"}'] == 1
    assert m['tidefeed_receiver_pending_updates{feed="f"}'] == 2
    assert m['tidefeed_receiver_commits_total{feed="f"}'] == 1
    assert m['tidefeed_receiver_committed_updates_total{feed="f"}'] == 2
    assert m['tidefeed_receiver_bodies_total{feed="f",outcome="accepted"}'] == 1
    assert m['tidefeed_receiver_bodies_total{feed="f",outcome="409_count_mismatch"}'] == 1
    # a refused body naming a feed the receiver did not hold adds no series of its own
    assert not any('feed="nobody"' in k for k in m if "bodies" in k or "bytes" in k)
    assert m['tidefeed_receiver_body_bytes_total{feed="f"}'] == len(body) + len(bad)
    # a restarted receiver shows the feeds its database holds before any push
    base2 = await receiver()
    async with aiohttp.ClientSession() as s, s.get(f"{base2}/metrics") as r:
        m2 = scrape(await r.text())
    assert m2['tidefeed_receiver_frontier{feed="f"}'] == 2
    assert m2["tidefeed_receiver_feeds"] >= 1


def _sparse_body(time: int, updates: list[tuple[dict, int]]) -> bytes:
    """A body as a producer of JSON documents writes it: a nested field is left out of
    the records that do not have it (not written as null)."""
    lines = [
        orjson.dumps({"updates": [{"data": r, "time": time, "diff": d} for r, d in updates]}),
        orjson.dumps(
            {
                "progress": {
                    "lower": [time],
                    "upper": [time + 1],
                    "counts": [{"time": time, "count": len(updates)}],
                }
            }
        ),
    ]
    return b"\n".join(lines) + b"\n"


@pytest.mark.parametrize("others", [1, 3_000], ids=["small bodies", "large bodies"])
async def test_a_record_is_the_same_whatever_nested_fields_the_body_around_it_has(receiver, others):
    """Read into Arrow, a body's records get one type: a nested field one of them has is
    null in every other. The record must stay itself: its retraction, in a body whose
    records have other nested fields, takes it out of the collection, and a record with a
    null nested field is the record without it. (Large bodies go through pyarrow's
    reader, small ones through Python rows: both must key records alike.)"""
    base = await receiver()
    city = {"id": 0, "addr": {"city": "X"}}
    extra = [{"id": i, "addr": {"city": "Y", "geo": {"lat": i}}} for i in range(1, others + 1)]
    zipped = [{"id": -i, "addr": {"zip": str(i), "geo": {}}} for i in range(1, others + 1)]
    bodies = [
        _sparse_body(1, [(city, 1), *((r, 1) for r in extra)]),
        # city retracted beside records with other nested fields, and written again with a
        # nested null: the same record, so once in, once out, once in
        _sparse_body(2, [(city, -1), *((r, 1) for r in zipped)]),
        _sparse_body(3, [({"id": 0, "addr": {"city": "X", "zip": None}}, 1)]),
        _sparse_body(4, [(r, -1) for r in extra]),
    ]
    for n, body in enumerate(bodies, start=1):
        status, ack, _ = await raw_post(base, body)
        assert status == 200 and ack == {"frontier": n + 1, "pending": 0}, ack
    async with aiohttp.ClientSession() as s, s.get(f"{base}/v1/collections/f") as r:
        got = [orjson.loads(x) for x in (await r.read()).splitlines()]
    assert all(x["count"] == 1 for x in got), [x for x in got if x["count"] != 1]
    assert sorted(x["data"]["id"] for x in got) == sorted([0, *(r["id"] for r in zipped)])


_REUSE = """
import resource, sys
from protocol._http import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    body = bytes(bytearray(20 << 20))  # a 20 MB body, every page touched
    del body
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(kept, *faults)
"""


def test_servers_keep_freed_memory_for_the_next_bodies():
    """Told to keep freed memory, a process takes its pages' faults for the first 20 MB
    body only; the next ones reuse them. Left as glibc starts, every body faults again
    (which is what the setting is for)."""
    import subprocess
    import sys

    def run(mode):
        out = subprocess.run(
            [sys.executable, "-c", _REUSE, mode], capture_output=True, text=True, check=True
        ).stdout.split()
        return out[0], [int(x) for x in out[1:]]

    kept, faults = run("keep")
    if kept != "True":
        pytest.skip("not glibc: no mallopt")
    assert faults[0] > 4000  # 20 MB is 5 120 pages
    assert max(faults[1:]) < faults[0] // 20
    _, plain = run("plain")
    assert min(plain[1:]) > plain[0] // 2


async def test_the_warm_up_applies_a_made_up_time_and_says_so(caplog):
    from protocol._warm import warm_up

    caplog.set_level(logging.DEBUG, "tidefeed.receive")
    assert await warm_up(10_000, 3_000) == 10_000  # four bodies, the last one short
    assert "warmed up: 10000 updates applied" in caplog.text


async def test_a_warm_up_that_commits_less_than_it_made_fails_loudly(monkeypatch):
    from protocol import _warm

    made = _warm._bodies
    monkeypatch.setattr(_warm, "_bodies", lambda n, per: made(n, per)[:-1])  # no progress
    with pytest.raises(AssertionError, match="committed 0 of 10000"):
        await _warm.warm_up(10_000, 3_000)
