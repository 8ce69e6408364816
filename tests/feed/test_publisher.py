"""The publisher: a time larger than a body is split across bodies; a 413 shrinks them."""

from __future__ import annotations

import aiohttp
import orjson
import pytest
from aiohttp import web

from feed.log.reader import FeedReader
from feed.serve.publisher import Publisher
from protocol import record_key
from protocol.push import PushClient
from protocol.receiver import ReceiverConfig, make_receiver_app

from .model import run_emitter

ROWS = 30_000


@pytest.fixture(scope="module")
def big_time(spark, tmp_path_factory):
    """A feed whose first time holds ROWS inserts, then a small second time."""
    base = tmp_path_factory.mktemp("publisher")
    src = base / "in"
    src.mkdir()
    rows = [{"record": {"id": i, "name": f"n{i}" * (1 + i % 5)}, "delta": 1} for i in range(ROWS)]
    (src / "0.json").write_bytes(b"\n".join(orjson.dumps(r) for r in rows))
    (src / "1.json").write_bytes(orjson.dumps({"record": {"id": -1, "name": "x"}, "delta": 1}))
    run_emitter(
        spark,
        source_kind="weighted",
        source_path=str(src),
        feed="big",
        log=str(base / "log"),
        clock="logical",
        max_files_per_txn=1,
    )
    truth = {record_key(r["record"]): 1 for r in rows}
    truth[record_key({"id": -1, "name": "x"})] = 1
    return base / "log", truth


async def _receiver(tmp_path, **kw):
    runner = web.AppRunner(make_receiver_app(ReceiverConfig(db=str(tmp_path / "r.db"), **kw)))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return f"http://127.0.0.1:{runner.addresses[0][1]}", runner


async def _collection(base: str) -> dict[bytes, int]:
    return await _collection_at(base, "big")


async def _collection_at(base: str, feed: str) -> dict[bytes, int]:
    async with aiohttp.ClientSession() as s, s.get(f"{base}/v1/collections/{feed}") as r:
        assert r.status == 200
        rows = [orjson.loads(x) for x in (await r.read()).splitlines()]
    return {record_key(x["data"]): x["count"] for x in rows}


@pytest.mark.parametrize("fmt", ["ndjson", "avro", "arrow"])
async def test_a_time_larger_than_a_body_arrives_whole_in_several(big_time, tmp_path, fmt):
    log, truth = big_time
    base, runner = await _receiver(tmp_path)
    try:
        reader = FeedReader(str(log), "big")
        assert max(reader.counts().values()) == ROWS
        async with PushClient(f"{base}/v1/push/big", fmt=fmt, schema=reader.info.schema) as c:
            pub = Publisher(reader, c, epoch=1, max_body_updates=7_000)
            report = await pub.session()
        assert report.frontier == reader.frontier
        assert report.bodies >= ROWS // 7_000 + 1 and report.updates == ROWS + 1
        assert await _collection(base) == truth
    finally:
        await runner.cleanup()


async def test_a_413_halves_the_bodies_until_they_go_through(big_time, tmp_path, caplog):
    log, truth = big_time
    base, runner = await _receiver(tmp_path, max_body=400_000)  # ~10k NDJSON updates
    try:
        reader = FeedReader(str(log), "big")
        async with PushClient(f"{base}/v1/push/big", schema=reader.info.schema) as c:
            pub = Publisher(reader, c, epoch=1, max_body_bytes=1 << 30)
            acked = await pub.deliver(give_up_after=120)
        assert acked == reader.frontier
        assert pub.max_body_updates < 50_000  # it learned the receiver's limit
        assert "refused a body as too large" in caplog.text
        assert await _collection(base) == truth
    finally:
        await runner.cleanup()


async def test_bodies_are_bounded_in_bytes_too(big_time, tmp_path, caplog):
    log, truth = big_time
    base, runner = await _receiver(tmp_path, max_body=300_000)
    try:
        reader = FeedReader(str(log), "big")
        async with PushClient(f"{base}/v1/push/big", schema=reader.info.schema) as c:
            # a byte bound under the receiver's limit: no 413 at all after the first body
            pub = Publisher(reader, c, epoch=1, max_body_bytes=250_000)
            await pub.deliver(give_up_after=120)
        assert 1_000 < pub.body_limit() < 30_000  # bounded by bytes, not by the update count
        assert "too large" not in caplog.text  # the byte bound kept every body under it
        assert await _collection(base) == truth
    finally:
        await runner.cleanup()
