"""The feed server against hostile clients: push subscriptions that would make it a proxy
(SSRF), secrets on disk, names and Authorization headers built to confuse. Real servers on
127.0.0.1; every refusal leaves no state behind."""

from __future__ import annotations

import asyncio
import os
import socket
import stat

import aiohttp
import pytest
from aiohttp import web

from feed.serve.server import ServerConfig, make_server_app
from protocol.destinations import Destinations

from ..e2e.helpers import free_port, tidefeed
from .test_server import feed_log, serve  # noqa: F401  (the fixture)

SECRET = "the internal service's answer, never to be shown"


async def _until(get, cond, what):
    for _ in range(300):
        st = await get()
        if cond(st):
            return st
        await asyncio.sleep(0.1)
    pytest.fail(f"{what}: {st}")


@pytest.mark.parametrize(
    "url",
    [
        "http://10.1.2.3:9/v1/push/bank",  # a private network
        "http://169.254.169.254/latest/meta-data",  # a cloud metadata address
        "http://[fd00::1]:9/x",
        "http://0x7f000001.example.invalid/x",  # does not resolve
    ],
)
async def test_a_subscription_to_a_destination_not_allowed_is_refused(feed_log, url):  # noqa: F811
    log, _ = feed_log
    base, runner = await serve(make_server_app(ServerConfig(log=str(log))))
    try:
        async with aiohttp.ClientSession() as s:
            async with s.put(f"{base}/v1/feeds/bank/subscriptions/x", json={"url": url}) as r:
                body = await r.json()
                assert r.status == 400 and body["error"] == "push_not_allowed", body
            async with s.get(f"{base}/v1/feeds/bank/subscriptions/x") as r:
                assert r.status == 404  # nothing was made
        assert not (log / "bank" / "_subscriptions" / "x.json").exists()
    finally:
        await runner.cleanup()


async def test_redirects_are_not_followed_and_answers_are_not_shown(feed_log):  # noqa: F811
    """A receiver URL on an allowed address that redirects to another: the feed server
    does not follow it, stops the subscription, and shows no byte of either answer."""
    log, _ = feed_log
    hits: list[str] = []

    async def inner(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(text=SECRET)

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(location=f"{inner_base}/internal", text=SECRET)

    inner_app, redirect_app = web.Application(), web.Application()
    inner_app.router.add_route("*", "/{tail:.*}", inner)
    redirect_app.router.add_route("*", "/{tail:.*}", redirect)
    inner_base, inner_runner = await serve(inner_app)
    red_base, red_runner = await serve(redirect_app)
    base, runner = await serve(make_server_app(ServerConfig(log=str(log), poll_seconds=0.1)))
    try:
        async with aiohttp.ClientSession() as s:

            async def status() -> dict:
                async with s.get(f"{base}/v1/feeds/bank/subscriptions/r") as r:
                    return await r.json()

            sub = {"url": f"{red_base}/v1/push/bank", "token": "receiver-secret"}
            async with s.put(f"{base}/v1/feeds/bank/subscriptions/r", json=sub) as r:
                assert r.status == 201
            st = await _until(status, lambda st: st["status"] == "stopped", "not stopped")
            assert "HTTP 307" in st["last_error"] and "not followed" in st["last_error"]
            assert SECRET not in str(st) and "receiver-secret" not in str(st)
            assert hits == []  # the redirect's target was never asked
        # the subscription file holds the receiver's token: its owner alone may read it
        mode = os.stat(log / "bank" / "_subscriptions" / "r.json").st_mode
        assert stat.S_IMODE(mode) == 0o600
    finally:
        for r in (runner, red_runner, inner_runner):
            await r.cleanup()


async def test_names_and_authorization_headers_that_confuse(feed_log):  # noqa: F811
    log, _ = feed_log
    base, runner = await serve(make_server_app(ServerConfig(log=str(log), token="t0ken")))
    try:
        async with aiohttp.ClientSession() as s:
            # the scheme is case-insensitive
            for auth in ("Bearer t0ken", "bearer t0ken", "BEARER  t0ken"):
                async with s.get(f"{base}/v1/feeds", headers={"Authorization": auth}) as r:
                    assert r.status == 200, auth
            for auth in ("Bearer t0ke", "Basic t0ken", "t0ken", "Bearer t0kén"):
                async with s.get(f"{base}/v1/feeds", headers={"Authorization": auth}) as r:
                    assert r.status == 401, auth
            # a name ending in a newline is not a name
            ok = {"Authorization": "Bearer t0ken"}
            async with s.put(f"{base}/v1/feeds/bank/subscriptions/x%0A", json={}, headers=ok) as r:
                assert r.status == 400
        assert not (log / "bank" / "_subscriptions").exists() or not any(
            (log / "bank" / "_subscriptions").iterdir()
        )
    finally:
        await runner.cleanup()


def test_push_allow_lists_parse_and_match():
    d = Destinations.parse("127.0.0.0/8, ::1 ,receiver.internal,10.0.0.5")
    assert d.allows_address("127.0.0.9") and d.allows_address("::1")
    assert d.allows_address("::ffff:127.0.0.1") and d.allows_address("10.0.0.5")
    assert not d.allows_address("10.0.0.6") and not d.allows_address("not an address")
    assert d.allows_name("Receiver.Internal.") and not d.allows_name("other.internal")
    # what a connection uses without a resolver: a literal address outside the list
    assert d.refuses_literal("10.0.0.6") and d.refuses_literal("::2")
    assert not d.refuses_literal("127.0.0.1") and not d.refuses_literal("receiver.internal")
    assert not d.refuses_literal("other.example")  # a name: the resolver decides
    d.check("http://receiver.internal:9/x")  # named: allowed without asking DNS
    with pytest.raises(ValueError, match="not an allowed push destination"):
        d.check("http://10.0.0.6/x")
    for bad in ("", " , ", "exa mple", "a/b/c"):
        with pytest.raises(ValueError, match="--push-allow"):
            Destinations.parse(bad)


@pytest.mark.parametrize("command", ["serve", "receive"])
def test_an_empty_token_is_refused_at_start(tmp_path, command):
    where = ["--log", str(tmp_path)] if command == "serve" else ["--db", str(tmp_path / "r.db")]
    for args, env in (
        (["--token", ""], None),
        ([], {"TIDEFEED_TOKEN": ""}),
    ):
        out = tidefeed(command, *where, "--port", str(free_port()), *args, env=env, timeout=60)
        assert out.returncode != 0
        assert b"--token is empty" in out.stderr


@pytest.fixture(scope="module")
def big_log(spark, tmp_path_factory):
    """A feed of 30,000 rows in one time: several MB in any format, more than the sockets
    between a server and a consumer that reads nothing can hold."""
    from .model import run_emitter

    tmp = tmp_path_factory.mktemp("big")
    src = tmp / "in"
    src.mkdir()
    lines = b"".join(
        b'{"record":{"id":%d,"note":"%s"},"delta":1}\n' % (i, b"x" * 60) for i in range(30_000)
    )
    (src / "part-0.json").write_bytes(lines)
    run_emitter(
        spark,
        source_kind="weighted",
        source_path=str(src),
        feed="big",
        log=str(tmp / "log"),
        clock="logical",
    )
    return tmp / "log"


def _unread_stream(port: int, path: str) -> socket.socket:
    """A client that asks for a stream and never reads a byte of it (a tiny receive
    window, so the server's writes soon wait)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return sock


async def test_streams_are_capped_per_client_and_in_all(big_log):
    config = ServerConfig(log=str(big_log), max_streams=3, max_streams_per_client=2)
    app = make_server_app(config)
    base, runner = await serve(app)
    port = runner.addresses[0][1]
    held: list[socket.socket] = []
    try:
        from feed.serve.state import STATE

        st = app[STATE]
        for _ in range(2):
            held.append(_unread_stream(port, "/v1/feeds/big/changes?follow=true"))
        await _until(lambda: _value(sum(st.streams.values())), lambda n: n == 2, "2 streams")
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{base}/v1/feeds/big/changes") as r:
                assert r.status == 429
                assert r.headers["Retry-After"]
                assert "--max-streams-per-client" in (await r.json())["detail"]
            # the whole server's cap (3): this client's 1 and another client's 2
            held.pop().close()
            await _until(lambda: _value(sum(st.streams.values())), lambda n: n == 1, "1 left")
            st.streams["192.0.2.1"] = 2
            async with s.get(f"{base}/v1/feeds/big/changes") as r:
                assert r.status == 503
                assert "--max-streams" in (await r.json())["detail"]
            del st.streams["192.0.2.1"]
            for sock in held:
                sock.close()
            held.clear()
            await _until(lambda: _value(sum(st.streams.values())), lambda n: n == 0, "released")
            async with s.get(f"{base}/v1/feeds/big/changes?format=arrow") as r:
                assert r.status == 200
                assert len(await r.read()) > 1_000_000
    finally:
        for sock in held:
            sock.close()
        await runner.cleanup()


async def test_a_stream_whose_consumer_reads_nothing_is_closed(big_log, caplog):
    config = ServerConfig(log=str(big_log), stall_seconds=1.0)
    app = make_server_app(config)
    _, runner = await serve(app)
    port = runner.addresses[0][1]
    try:
        from feed.serve.state import STATE

        st = app[STATE]
        sock = _unread_stream(port, "/v1/feeds/big/changes")
        try:
            await _until(lambda: _value(sum(st.streams.values())), lambda n: n == 1, "open")
            # it stalls on a write, and the server lets it go (its reader and files too)
            await _until(lambda: _value(sum(st.streams.values())), lambda n: n == 0, "closed")
            assert "took nothing for 1 s: stream closed" in caplog.text
        finally:
            sock.close()
    finally:
        await runner.cleanup()


async def _value(v):
    return v
