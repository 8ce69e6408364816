"""Bad input, generated: every decoder, the receiver's and the server's HTTP endpoints, and
Debezium lines through the real ``tidefeed emit``.

An input counts as *rejected* when it got what a bad input must get — a ``CodecError``
from a decoder, a 4xx with a JSON error from an endpoint and no change of the receiver's
state, a quarantined row with a reason — or was in fact valid and was taken as such. A 5xx,
a traceback, any other exception or a state change counts against it and is noted.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feed.demo.data import ACCOUNTS_SCHEMA, generate_bank
from protocol import CodecError, Progress, Updates, get_codec, record_key

from ..e2e.helpers import tidefeed
from ..feed.model import debezium_truth

__all__ = ["FuzzResult", "fuzz_all"]

SAMPLE = [
    Progress(0, 0, ()),
    Updates.from_rows([{"data": {"id": 1, "owner": "a", "balance": 5}, "time": 1, "diff": 1}]),
    Progress(0, 2, ((1, 1),)),
]
SCHEMA = {
    "type": "record",
    "name": "r",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "owner", "type": ["null", "string"]},
        {"name": "balance", "type": ["null", "long"]},
    ],
}


@dataclass
class FuzzResult:
    bad_inputs: int = 0
    rejected: int = 0
    notes: list[str] = field(default_factory=list)

    def judge(self, ok: bool, what: str) -> None:
        self.bad_inputs += 1
        if ok:
            self.rejected += 1
        elif len(self.notes) < 20:
            self.notes.append(what)


def _mutations(body: bytes) -> st.SearchStrategy[bytes]:
    """Bodies near a valid one: cut, with bytes flipped, inserted or repeated; and noise."""
    n = len(body)
    cut = st.integers(0, max(0, n - 1)).map(lambda i: body[:i])
    flip = st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, 255)), min_size=1).map(
        lambda fs: bytes(dict(fs).get(i, b) for i, b in enumerate(body))
    )
    insert = st.tuples(st.integers(0, n), st.binary(min_size=1, max_size=16)).map(
        lambda t: body[: t[0]] + t[1] + body[t[0] :]
    )
    return st.one_of(cut, flip, insert, st.binary(max_size=512), st.just(body * 2))


def _decode_one(codec: object, fmt: str, data: bytes, out: FuzzResult) -> None:
    try:
        codec.decode(data, schema=SCHEMA)  # type: ignore[attr-defined]
    except CodecError:
        pass  # rejected, as it must be
    except Exception as e:  # the finding
        out.judge(False, f"{fmt} decoder: {type(e).__name__}: {e} on {data[:60]!r}")
        return
    out.judge(True, "")  # rejected, or valid after all


def _mutate(body: bytes, rnd: random.Random) -> bytes:
    """One body near ``body`` (as :func:`_mutations`, drawn from a seeded generator, so a
    run is repeatable)."""
    n = len(body)
    kind = rnd.randrange(5)
    if kind == 0:
        return body[: rnd.randrange(max(1, n))]
    if kind == 1:
        out = bytearray(body)
        for _ in range(rnd.randint(1, 4)):
            out[rnd.randrange(n)] = rnd.randrange(256)
        return bytes(out)
    if kind == 2:
        i = rnd.randint(0, n)
        return body[:i] + rnd.randbytes(rnd.randint(1, 16)) + body[i:]
    if kind == 3:
        return rnd.randbytes(rnd.randint(0, 512))
    return body * 2


def _junk_text(rnd: random.Random) -> str:
    kind = rnd.randrange(4)
    if kind == 0:
        return "".join(chr(rnd.choice([rnd.randrange(32, 127), rnd.randrange(0x80, 0x3000)]))
                       for _ in range(rnd.randint(0, 12)))  # fmt: skip
    if kind == 1:
        return str(rnd.randint(-(2**70), 2**70))
    return rnd.choice(["", "-1", "true", "0"])


def fuzz_decoders(examples: int, out: FuzzResult) -> None:
    for fmt in ("ndjson", "avro", "arrow"):
        codec = get_codec(fmt)
        body = codec.encode(SAMPLE, schema=SCHEMA)

        def case(codec: object, fmt: str) -> Any:
            def test(data: bytes) -> None:
                _decode_one(codec, fmt, data, out)

            return test

        settings(max_examples=examples, deadline=None, database=None)(
            given(_mutations(body))(case(codec, fmt))
        )()


async def _receiver_endpoints(examples: int, folder: Path, out: FuzzResult) -> None:
    import aiohttp
    from aiohttp import web

    from protocol.receiver import ReceiverConfig, make_receiver_app

    runner = web.AppRunner(make_receiver_app(ReceiverConfig(db=str(folder / "fuzz.db"))))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    rnd = random.Random(3)
    try:
        async with aiohttp.ClientSession() as s:
            # a valid first time, so there is state to keep
            nd = get_codec("ndjson")
            async with s.post(
                f"{base}/v1/push/f",
                data=nd.encode(SAMPLE),
                headers={"Tidefeed-Epoch": "1", "Content-Type": nd.content_type},
            ) as r:
                assert r.status == 200, await r.text()

            async def state() -> tuple[bytes, bytes]:
                async with s.get(f"{base}/v1/push/f") as a, s.get(f"{base}/v1/collections/f") as b:
                    return await a.read(), await b.read()

            before = await state()
            bodies: list[tuple[str, bytes]] = []
            for fmt in ("ndjson", "avro", "arrow"):
                codec = get_codec(fmt)
                good = codec.encode(
                    [
                        Progress(2, 2, ()),
                        Updates.from_rows(
                            [{"data": {"id": 2, "owner": "b", "balance": 1}, "time": 5, "diff": 1}]
                        ),
                    ],
                    schema=SCHEMA,
                )
                for _ in range(examples):
                    bodies.append((codec.content_type, _mutate(good, rnd)))
            for ctype, data in bodies:
                headers = {"Content-Type": ctype, "Tidefeed-Epoch": str(rnd.choice([1, 1, 0, -3]))}
                if rnd.random() < 0.1:
                    headers["Content-Type"] = "text/plain"
                async with s.post(f"{base}/v1/push/f", data=data, headers=headers) as r:
                    status = r.status
                    raw = await r.read()
                if status == 200:
                    # valid after all: it may only have added pending updates; put it back
                    before = await state()
                    out.judge(True, "")
                    continue
                after = await state()
                ok = 400 <= status < 500 and raw.startswith(b"{") and after == before
                changed = after != before
                out.judge(ok, f"receiver POST {ctype}: {status}, changed {changed}: {data!r}")
    finally:
        await runner.cleanup()


async def _server_endpoints(examples: int, log: Path, out: FuzzResult) -> None:
    import aiohttp
    from aiohttp import web

    from feed.serve.server import ServerConfig, make_server_app

    runner = web.AppRunner(make_server_app(ServerConfig(log=str(log))))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    rnd = random.Random(7)
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(examples):
                q = {
                    k: _junk_text(rnd)
                    for k in ("after", "format", "follow", "snapshot")
                    if rnd.random() < 0.6
                }
                async with s.get(f"{base}/v1/feeds/bank/changes", params=q) as r:
                    if r.status == 200:
                        await r.content.readexactly(0)
                    status = r.status
                out.judge(status < 500, f"server GET changes {q}: {status}")
                body = (
                    rnd.randbytes(rnd.randint(0, 64))
                    if rnd.random() < 0.5
                    else orjson.dumps({_junk_text(rnd): _junk_text(rnd) for _ in range(3)})
                )
                async with s.put(f"{base}/v1/feeds/bank/subscriptions/z", data=body) as r:
                    status = r.status
                out.judge(status < 500, f"server PUT subscription {body[:60]!r}: {status}")
                async with s.delete(f"{base}/v1/feeds/bank/subscriptions/z") as r:
                    pass
                async with s.post(f"{base}/v1/feeds/bank/subscriptions/b/ack", data=body) as r:
                    status = r.status
                out.judge(status < 500, f"server POST ack {body[:60]!r}: {status}")
    finally:
        await runner.cleanup()


def _corrupt(line: bytes, rnd: random.Random) -> bytes:
    e = orjson.loads(line)
    p = e.get("payload", e)
    kind = rnd.randrange(4)
    if kind == 0:
        return line[: len(line) // 2]  # cut JSON
    if kind == 1:
        p["op"] = "zz"  # unknown op
    elif kind == 2:
        (p.get("after") or p.get("before") or {})["balance"] = "lots"  # a type mismatch
    else:
        p.pop("source")  # no position
    return orjson.dumps(e)


def fuzz_debezium(folder: Path, out: FuzzResult, *, corrupt: int = 40) -> None:
    """Corrupted Debezium lines among good ones, through the real CLI: each corrupted line
    is quarantined with a reason and the feed equals the table of the good lines."""
    from feed.log.reader import FeedReader

    rnd = random.Random(9)
    bank = generate_bank(transactions=60, seed=9)
    lines = list(bank.events)
    creates = [i for i, x in enumerate(lines) if b'"op":"c"' in x]
    picks = set(rnd.sample(range(len(lines)), min(corrupt, len(lines) // 4)))
    picks -= set(creates[:5])
    good = [x for i, x in enumerate(lines) if i not in picks]
    bad = {i: _corrupt(lines[i], rnd) for i in sorted(picks)}
    src = folder / "in"
    src.mkdir(parents=True)
    (src / "part-0.json").write_bytes(b"".join(bad.get(i, x) + b"\n" for i, x in enumerate(lines)))
    (folder / "schema.avsc").write_bytes(orjson.dumps(ACCOUNTS_SCHEMA))
    log = folder / "log"
    p = tidefeed(
        "emit", "--source", f"debezium:{src}", "--feed", "bank", "--log", str(log),
        "--key", "id", "--schema", str(folder / "schema.avsc"), "--clock", "logical",
    )  # fmt: skip
    if p.returncode != 0:
        for _ in picks:
            out.judge(False, f"emit failed: {p.stderr.decode()[-300:]}")
        return
    quarantined = []
    for f in sorted((log / "bank" / "quarantine").rglob("*.json")):
        quarantined += [orjson.loads(x) for x in f.read_bytes().splitlines() if x.strip()]
    raws = {(q.get("raw") or "").strip() for q in quarantined if q.get("reason")}
    for i, text in bad.items():
        found = text.decode(errors="replace").strip() in raws
        out.judge(found, f"corrupted line {i} not quarantined with a reason: {text[:80]!r}")
    truth = Counter(record_key(r) for r in debezium_truth(good)[0].values())
    got = Counter()
    reader = FeedReader(str(log), "bank")
    for m in reader.messages():
        if isinstance(m, Updates):
            for u in m:
                got[record_key(u.record)] += u.diff
    if +got != truth:
        out.notes.append("debezium fuzz: the feed differs from the table of the good lines")
        out.bad_inputs += 1  # counted as one unrejected input: the feed was harmed
    if len(quarantined) < len(picks):
        out.notes.append(f"debezium fuzz: {len(picks)} corrupted, {len(quarantined)} quarantined")


def fuzz_all(examples: int, folder: Path, *, seed: int = 0, log: Path | None = None) -> FuzzResult:
    folder.mkdir(parents=True, exist_ok=True)
    out = FuzzResult()
    settings.register_profile(
        "reliability", suppress_health_check=list(HealthCheck), database=None, derandomize=True
    )
    settings.load_profile("reliability")
    fuzz_decoders(examples, out)
    asyncio.run(_receiver_endpoints(examples // 3 + 1, folder, out))
    if log is not None:
        asyncio.run(_server_endpoints(examples // 3 + 1, log, out))
    fuzz_debezium(folder / "debezium", out)
    return out
