"""NDJSON codec: one CDCv2-shaped JSON message per line (orjson)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import IO, Any

import orjson

from .codecs import MAX_UPDATES_PER_MESSAGE, Codec, Decoder, Encoder
from .errors import CodecError
from .messages import INT64_MAX, INT64_MIN, Message, Progress, Updates, _json_default

__all__ = ["NdjsonCodec"]

_DUMP_OPTS = orjson.OPT_NON_STR_KEYS


class NdjsonEncoder(Encoder):
    def _write_updates(self, updates: Updates) -> None:
        self._out.write(
            orjson.dumps({"updates": updates.rows()}, option=_DUMP_OPTS, default=_json_default)
        )
        self._out.write(b"\n")

    def _write_progress(self, p: Progress) -> None:
        self._out.write(orjson.dumps({"progress": p.to_wire()}))
        self._out.write(b"\n")


def _bad_rows(rows: list[Any]) -> str | None:
    """Why a list of wire updates is malformed, or ``None``. One cheap pass, no allocation."""
    for i, r in enumerate(rows):
        if type(r) is not dict:
            return f"updates[{i}] is not an object"
        t, d = r.get("time"), r.get("diff")
        if type(t) is not int or type(d) is not int or type(r.get("data")) is not dict:
            return (
                f"updates[{i}] must have an object 'data' and integer 'time' and 'diff', "
                f"got {orjson.dumps(r)[:120].decode(errors='replace')}"
            )
        if not (0 <= t <= INT64_MAX and INT64_MIN <= d <= INT64_MAX):
            return f"updates[{i}] time {t} or diff {d} is outside the 64-bit range"
    return None


class NdjsonDecoder(Decoder):
    def __iter__(self) -> Iterator[Message]:
        for lineno, line in enumerate(self._stream, start=1):
            self.position = f"line {lineno}"
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                raise CodecError(f"invalid JSON: {e}", fmt="ndjson", position=self.position) from e
            if type(obj) is not dict or len(obj) != 1:
                raise CodecError(
                    "each line must be an object with exactly one of 'updates' or 'progress'",
                    fmt="ndjson",
                    position=self.position,
                )
            if "updates" in obj:
                rows = obj["updates"]
                if type(rows) is not list:
                    raise CodecError(
                        "'updates' must be a list", fmt="ndjson", position=self.position
                    )
                why = _bad_rows(rows)
                if why:
                    raise CodecError(why, fmt="ndjson", position=self.position)
                yield Updates.from_rows(rows)
            elif "progress" in obj:
                yield Progress.from_wire(obj["progress"], fmt="ndjson", position=self.position)
            else:
                raise CodecError(
                    f"unknown message kind {next(iter(obj))!r}; expected 'updates' or 'progress'",
                    fmt="ndjson",
                    position=self.position,
                )


class NdjsonCodec(Codec):
    name = "ndjson"
    content_type = "application/x-ndjson"

    def encoder(
        self, out: IO[bytes], *, schema: Any = None, max_updates: int = MAX_UPDATES_PER_MESSAGE
    ) -> Encoder:
        return NdjsonEncoder(out, schema=schema, max_updates=max_updates)

    def decoder(self, stream: IO[bytes], *, schema: Any = None) -> Decoder:
        return NdjsonDecoder(stream, schema=schema)
