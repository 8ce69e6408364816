"""The push client: one receiver's side of a DESIGN §6 push session.

:class:`PushClient` does the HTTP: ``GET`` the receiver's frontier, ``POST`` bodies with the
producer's epoch, read the ACK (the receiver's durable frontier). Bodies are encoded in a
worker thread. Answers map to errors a publisher can act on:

* 200 -> :class:`Ack`;
* 409 -> :class:`PushRejected` (``retry=False``): the receiver's state and ours disagree; start
  a fresh session from its frontier;
* 413 -> :class:`PushRejected` with ``retry=True`` and ``status`` 413: send smaller bodies;
* 429, 503, 5xx, connection errors, time-outs -> :class:`PushRejected` with ``retry=True``
  (and ``retry_after`` when the receiver says);
* any other 4xx -> :class:`PushRejected` with ``fatal=True``: stop the subscription and log why.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from .codecs import get_codec
from .errors import TidefeedError
from .messages import Message

__all__ = ["Ack", "PushClient", "PushRejected"]

EPOCH_HEADER = "Tidefeed-Epoch"


@dataclass(frozen=True, slots=True)
class Ack:
    frontier: int | None
    pending: int = 0


class PushRejected(TidefeedError):
    """A push did not go through; ``retry``/``fatal`` say what the publisher should do."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str = "",
        retry: bool = False,
        fatal: bool = False,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.retry = retry
        self.fatal = fatal
        self.retry_after = retry_after


class PushClient:
    """Talks to one receiver URL (``…/v1/push/{feed}``) in one format."""

    def __init__(
        self,
        url: str,
        *,
        fmt: str = "ndjson",
        schema: Any = None,
        token: str | None = None,
        timeout: float = 60.0,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.url = url
        self.codec = get_codec(fmt)
        self.schema = schema
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session = session
        self._own_session = session is None
        self.bytes_sent = 0

    async def __aenter__(self) -> PushClient:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("PushClient is not open: use 'async with PushClient(...)'")
        return self._session

    async def handshake(self) -> tuple[int | None, int]:
        """The receiver's ``(frontier, epoch)``."""
        obj = await self._call("GET", None)
        return obj.get("frontier"), int(obj.get("epoch") or 0)

    async def push(self, messages: Sequence[Message], *, epoch: int) -> Ack:
        """Send one body; return the receiver's ACK."""
        return await self.post(await asyncio.to_thread(self.encode, messages), epoch=epoch)

    async def post(self, body: bytes, *, epoch: int) -> Ack:
        """Send one encoded body (see :meth:`encode`); return the receiver's ACK."""
        obj = await self._call("POST", body, epoch=epoch)
        return Ack(frontier=obj.get("frontier"), pending=int(obj.get("pending") or 0))

    def encode(self, messages: Sequence[Message]) -> bytes:
        """One body in this client's format (blocking: call it from a worker thread)."""
        buf = io.BytesIO()
        enc = self.codec.encoder(buf, schema=self.schema)
        enc.write_all(messages)
        enc.close()
        return buf.getvalue()

    async def _call(
        self, method: str, body: bytes | None, epoch: int | None = None
    ) -> dict[str, Any]:
        headers = dict(self._headers)
        if body is not None:
            headers["Content-Type"] = self.codec.content_type
            headers[EPOCH_HEADER] = str(epoch)
        try:
            # a file-like body is streamed in chunks; bytes would be written in one go
            data = io.BytesIO(body) if body is not None else None
            async with self.session.request(method, self.url, data=data, headers=headers) as r:
                raw = await r.read()
                if body is not None:
                    self.bytes_sent += len(body)
                if r.status == 200:
                    obj = orjson.loads(raw)
                    if not isinstance(obj, dict):
                        raise PushRejected(f"{self.url}: answer is not a JSON object", retry=True)
                    return obj
                raise _rejection(self.url, r.status, raw, r.headers.get("Retry-After"))
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise PushRejected(f"{self.url}: {type(e).__name__}: {e}", retry=True) from e
        except orjson.JSONDecodeError as e:
            raise PushRejected(f"{self.url}: answer is not JSON: {e}", retry=True) from e


def _rejection(url: str, status: int, raw: bytes, retry_after: str | None) -> PushRejected:
    try:
        obj = orjson.loads(raw)
        code, detail = str(obj.get("error", "")), str(obj.get("detail", ""))
    except (orjson.JSONDecodeError, AttributeError):
        code, detail = "", raw[:200].decode(errors="replace")
    msg = f"{url}: {status} {code}: {detail}"
    after = None
    if retry_after:
        try:
            after = float(retry_after)
        except ValueError:
            after = None
    if status == 409:
        return PushRejected(msg, status=status, code=code)
    if status == 413:
        # the body was too large for the receiver: smaller bodies go through
        return PushRejected(msg, status=status, code=code or "too_large", retry=True)
    if status in (429, 503) or status >= 500:
        return PushRejected(msg, status=status, code=code, retry=True, retry_after=after)
    return PushRejected(msg, status=status, code=code, fatal=True)
