"""What both tidefeed HTTP servers share: the error table, JSON errors, bearer tokens.

Every error answer is ``{"error": "<code>", "detail": "<sentence>"}`` with one status per
error class (DESIGN §7). The table below is the only place that maps errors to statuses.
"""

from __future__ import annotations

import ctypes
import gc
import hmac
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
from aiohttp import web

from . import rowhash
from .defaults import IDLE_TIMEOUT
from .errors import (
    CheckpointError,
    CodecError,
    Compacted,
    Conflict,
    CountMismatch,
    Gap,
    ProtocolError,
    StaleEpoch,
    TidefeedError,
)

__all__ = [
    "IDLE_TIMEOUT",
    "HttpError",
    "encoding_middleware",
    "error_middleware",
    "json_response",
    "keep_freed_memory",
    "outcome_of",
    "read_body",
    "token_middleware",
]


class HttpError(TidefeedError):
    """An HTTP-level refusal: carries its own status and code (401, 404, 410, 413, 415, 429)."""

    def __init__(
        self,
        status: int,
        code: str,
        detail: str,
        *,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.headers = headers or {}
        self.extra = extra or {}


#: error class -> (status, code); the most specific class is looked up first
ERROR_TABLE: list[tuple[type[BaseException], int, str]] = [
    (CodecError, 400, "malformed_body"),
    (StaleEpoch, 409, "stale_epoch"),
    (Conflict, 409, "conflict"),
    (Gap, 409, "gap"),
    (CountMismatch, 409, "count_mismatch"),
    (ProtocolError, 409, "protocol_violation"),
    (Compacted, 410, "compacted"),  # an NDJSON body ending in a server's "compacted" line
    (CheckpointError, 503, "storage_unavailable"),
]


def json_response(
    obj: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(obj), status=status, headers=headers, content_type="application/json"
    )


def _error(
    status: int,
    code: str,
    detail: str,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> web.Response:
    return json_response({"error": code, "detail": detail, **(extra or {})}, status, headers)


log = logging.getLogger("tidefeed.http")

#: a refused malformed request is logged in one line, at most one line per client address
#: in this many seconds (the ones held back are counted into its next line)
REFUSAL_LOG_SECONDS = 10.0
#: the statuses of a request that is malformed or not allowed (protocol answers such as
#: 409 and 404 are part of normal work and not logged)
_LOGGED = frozenset({400, 401, 403, 413, 415})


class RefusalLog:
    """One WARNING line per refused request, rate-limited per client address: a client
    sending garbage in a loop costs a line every :data:`REFUSAL_LOG_SECONDS`."""

    def __init__(
        self, every: float = REFUSAL_LOG_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.every = every
        self.clock = clock
        self.last: dict[str, float] = {}
        self.held: Counter[str] = Counter()

    def note(self, peer: str, line: str) -> bool:
        """Log ``line`` for ``peer`` unless it had a line less than ``every`` ago (then
        it is counted); return whether it was logged."""
        now = self.clock()
        if now - self.last.get(peer, -self.every) < self.every:
            self.held[peer] += 1
            return False
        if len(self.last) > 10_000:  # forget addresses quiet for a while
            self.last = {p: t for p, t in self.last.items() if now - t < self.every}
        self.last[peer] = now
        held = self.held.pop(peer, 0)
        log.warning("%s%s", line, f" ({held} more refused from it since)" if held else "")
        return True


REFUSALS = RefusalLog()


def _refused(request: web.Request, response: web.Response, detail: str) -> web.Response:
    if response.status in _LOGGED:
        peer = request.remote or "?"
        REFUSALS.note(
            peer,
            f"refused {request.method} {request.path[:200]} from {peer}: {response.status} "
            f"{detail[:200]}",
        )
    return response


def _reason_code(e: web.HTTPException) -> str:
    """aiohttp's own refusals (405, 413, …) as an error code: their reason, snake-cased."""
    return e.reason.lower().replace(" ", "_")


def outcome_of(e: BaseException) -> str:
    """How a request that raised ``e`` is answered, as ``<status>_<code>`` (for metrics)."""
    if isinstance(e, HttpError):
        return f"{e.status}_{e.code}"
    if isinstance(e, web.HTTPException):
        return f"{e.status}_{_reason_code(e)}"
    for cls, status, code in ERROR_TABLE:
        if isinstance(e, cls):
            return f"{status}_{code}"
    return "500_internal_error"


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        declared = request.content_length
        if declared is not None and declared > request.client_max_size:
            # refused before a byte of the body is read: a client declaring 1 TB would
            # otherwise hold the connection until the idle timeout
            raise HttpError(
                413,
                "body_too_large",
                f"the body is too large: {declared} bytes declared, at most "
                f"{request.client_max_size} accepted",
            )
        return await handler(request)
    except HttpError as e:
        return _refused(request, _error(e.status, e.code, str(e), e.headers, e.extra), str(e))
    except web.HTTPRequestEntityTooLarge as e:
        return _refused(
            request, _error(413, "body_too_large", f"the body is too large: {e.text}"), e.text or ""
        )
    except web.HTTPException as e:
        if e.status >= 400:
            detail = e.text or e.reason
            code = _reason_code(e)
            return _refused(request, _error(e.status, code, detail), detail)
        raise
    except TidefeedError as e:
        for cls, status, code in ERROR_TABLE:
            if isinstance(e, cls):
                retry = {"Retry-After": "1"} if status == 503 else None
                return _refused(request, _error(status, code, str(e), retry), str(e))
        return _error(500, "internal_error", str(e))


async def read_body(request: web.Request) -> bytes:
    """The whole request body, under the same bound as aiohttp's ``request.read()`` (the
    app's ``client_max_size``; over it, the same 413, raised as soon as the bytes read
    pass it). ``read()`` grows a bytearray chunk by chunk and then copies it into bytes:
    a 10 MB body took 13-18 ms against 4-6 ms for the chunks kept as they come and joined
    once at the end (``benchmarks/bench_push.py``'s bodies, measured on loopback)."""
    limit = request.client_max_size
    chunks: list[bytes] = []
    size = 0
    try:
        while chunk := await request.content.readany():
            size += len(chunk)
            if limit and size > limit:
                raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
            chunks.append(chunk)
    except ConnectionResetError:
        # the client went away before its declared length arrived: a refusal like any
        # other (one rate-limited line), not aiohttp's traceback of a server error
        raise HttpError(
            400, "body_cut_short", f"the connection closed after {size} bytes of the body"
        ) from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


@web.middleware
async def encoding_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Refuse a compressed request body (``Content-Encoding`` other than ``identity``)
    before any of it is read: a few hundred KB of gzip can inflate to gigabytes, and the
    formats compress themselves where it pays (Avro deflate blocks, Arrow IPC buffers)."""
    given = request.headers.get("Content-Encoding", "")
    codings = [c.strip().lower() for c in given.split(",") if c.strip()]
    if any(c != "identity" for c in codings):
        raise HttpError(
            415,
            "unsupported_content_encoding",
            f"Content-Encoding {given[:40]!r} is not accepted: send the body uncompressed",
        )
    return await handler(request)


def token_middleware(token: str | None) -> Callable[..., Any]:
    """Require ``Authorization: Bearer <token>`` on every path but ``/healthz``."""
    expected = token.encode() if token else None

    @web.middleware
    async def check(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if expected is not None and request.path != "/healthz":
            # the scheme is case-insensitive (RFC 9110); a header that is not UTF-8 text
            # is a wrong token, never a server error
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            try:
                got = given.strip().encode()
            except UnicodeEncodeError:
                got = b""
            if scheme.lower() != "bearer" or not hmac.compare_digest(got, expected):
                raise HttpError(
                    401,
                    "unauthorized",
                    "missing or wrong bearer token",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        return await handler(request)

    return check


#: freed memory a server keeps at the top of its heap for the next bodies
KEPT_FREE_BYTES = 64 << 20
#: blocks from this size up are mapped apart and unmapped when freed (glibc's ceiling)
_MMAP_FROM_BYTES = 32 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory() -> bool:
    """Tell glibc's allocator to keep freed memory for reuse. By default it maps a large
    block (a body, its decoded columns) apart and unmaps it when freed, and it gives the
    top of the heap back to the kernel: the next body of the same size then pays a page
    fault for each 4 KiB page again (20 MB: 10 000 faults, every time). Kept, the pages
    are reused: a server's first 1M-update push was 9-12% faster in alternating runs
    (benchmarks/bench_push.py's feeds). Returns False where the C library is not glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no mallopt (macOS): nothing to tell
        return False
    return bool(
        mallopt(_M_MMAP_THRESHOLD, _MMAP_FROM_BYTES) and mallopt(_M_TRIM_THRESHOLD, KEPT_FREE_BYTES)
    )


async def settle(_app: web.Application) -> None:
    """An ``on_startup`` hook of the feed server and the receiver. pyarrow imports pandas
    the first time it converts a numpy array (~0.2 s here): do it now, not inside the
    first request. Then the heap: decoding a body allocates Python objects by the hundred
    thousand (fastavro makes a dict per record), and each full collection would walk every
    object the imports left behind. Those live for the whole process: move them out of
    the collector's sight. The record hash's tables are built here too
    (:func:`protocol.rowhash.warm`), not in the first large body, and freed memory is kept
    for the next bodies (:func:`keep_freed_memory`)."""
    keep_freed_memory()
    pa.array(np.zeros(1, dtype=np.int64))
    rowhash.warm()
    gc.collect()
    gc.freeze()
