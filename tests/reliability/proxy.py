"""A fault-injecting TCP proxy on loopback, between a publisher and its receiver.

Per chunk of traffic it may: reset the connection before the request reaches the receiver,
stall it a few seconds, answer ``500`` itself, or cut the receiver's answer short (the body
was taken, the publisher never learns it). Each is counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from collections import Counter

__all__ = ["FaultProxy"]

#: chance of each fault per chunk of a request (and of a cut per answer)
RATES = {"reset": 0.03, "stall": 0.03, "http 500": 0.03, "cut answer": 0.03}


class FaultProxy:
    def __init__(self, port: int, target: int, *, seed: int = 0) -> None:
        self.port, self.target = port, target
        self.rnd = random.Random(seed)
        self.kinds: Counter[str] = Counter()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.AbstractServer | None = None

    @property
    def faults(self) -> int:
        return sum(self.kinds.values())

    def start(self) -> None:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._conn, "127.0.0.1", self.port), self._loop
        )
        self._server = fut.result(timeout=10)

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _roll(self, kind: str) -> bool:
        if self.rnd.random() < RATES[kind]:
            self.kinds[kind] += 1
            return True
        return False

    async def _conn(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            cw.close()
            return

        async def up() -> None:
            while data := await cr.read(1 << 16):
                if self._roll("reset"):
                    raise ConnectionResetError
                if self._roll("stall"):
                    await asyncio.sleep(self.rnd.uniform(1, 4))
                if self._roll("http 500"):
                    cw.write(
                        b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n"
                        b"Content-Length: 14\r\nConnection: close\r\n\r\ninjected fault"
                    )
                    await cw.drain()
                    raise ConnectionResetError
                sw.write(data)
                await sw.drain()

        async def down() -> None:
            while data := await sr.read(1 << 16):
                if self._roll("cut answer"):
                    cw.write(data[: len(data) // 2])
                    await cw.drain()
                    raise ConnectionResetError
                cw.write(data)
                await cw.drain()

        tasks = [asyncio.create_task(up()), asyncio.create_task(down())]
        with contextlib.suppress(Exception):
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
        for w in (cw, sw):
            with contextlib.suppress(Exception):
                w.close()
