"""One codec interface, three wire formats: ``ndjson``, ``avro`` and ``arrow`` (DESIGN §7).

Both directions stream: an :class:`Encoder` writes messages to a binary stream as they come
(splitting large update batches into bounded messages), and a :class:`Decoder` reads
messages from a binary stream one at a time, never holding the whole body. Each decoded
message's place in the stream is in :attr:`Decoder.position` (a line for NDJSON, a datum
for Avro, a batch for Arrow), which errors and the checker name.

A record schema (Avro JSON) may be given to both ends. Without one, an encoder that needs
it (Avro, Arrow) derives it from the first update batch it is asked to write, holding any
progress messages that come before it.
"""

from __future__ import annotations

import io
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import IO, Any, ClassVar

import pyarrow as pa

from .errors import CodecError, Compacted
from .messages import Message, Progress, Updates
from .schema import arrow_to_avro, avro_to_arrow

__all__ = [
    "CODECS",
    "Codec",
    "Decoder",
    "Encoder",
    "codec_for_content_type",
    "get_codec",
]

#: Update batches are split into messages of at most this many updates.
MAX_UPDATES_PER_MESSAGE = 10_000


class Encoder(ABC):
    """Writes messages to a binary stream. Call :meth:`close` to finish the stream."""

    def __init__(
        self,
        out: IO[bytes],
        *,
        schema: Any = None,
        max_updates: int = MAX_UPDATES_PER_MESSAGE,
    ) -> None:
        self._out = out
        self._schema = schema
        self._data_type: pa.DataType | None = avro_to_arrow(schema) if schema else None
        self._max = max_updates
        self._held: list[Progress] = []
        self._started = False
        self._closed = False
        self.written = 0  # messages written

    @property
    def needs_schema(self) -> bool:
        return False

    def write(self, message: Message) -> None:
        if self._closed:
            raise ValueError("encoder is closed")
        if not self._started:
            if self.needs_schema and self._schema is None:
                if isinstance(message, Progress):
                    self._held.append(message)
                    return
                if len(message) == 0:
                    return
                self._data_type = message.table().schema.field("data").type
                self._schema = arrow_to_avro(self._data_type)
            self._start()
            self._started = True
            for held in self._held:
                self._write(held)
            self._held.clear()
        self._write(message)

    def write_all(self, messages: Iterable[Message]) -> None:
        for m in messages:
            self.write(m)

    def close(self) -> None:
        """Finish the stream (the underlying binary stream stays open)."""
        if self._closed:
            return
        if not self._started:
            if self._schema is None and self.needs_schema:
                self._schema = {"type": "record", "name": "data", "fields": []}
                self._data_type = pa.struct([])
            self._start()
            self._started = True
            for held in self._held:
                self._write(held)
        self._finish()
        self._closed = True

    def flush(self) -> None:
        """Push what was written so far to the stream (Avro otherwise buffers a block)."""
        if self._started and not self._closed:
            self._flush()

    def _flush(self) -> None:  # noqa: B027 - optional hook
        """Format-specific flush."""

    def _start(self) -> None:  # noqa: B027 - optional hook
        """Write the stream's header, if the format has one."""

    def _finish(self) -> None:  # noqa: B027 - optional hook
        """Write the stream's trailer, if the format has one."""

    def _write(self, message: Message) -> None:
        if isinstance(message, Progress):
            self._write_progress(message)
            self.written += 1
            return
        n = len(message)
        if n <= self._max:
            if n:
                self._write_updates(message)
                self.written += 1
            return
        if message.has_table():
            table = message.table()
            for start in range(0, n, self._max):
                self._write_updates(Updates.from_arrow(table.slice(start, self._max)))
                self.written += 1
        else:
            rows = message.rows()
            for start in range(0, n, self._max):
                self._write_updates(Updates.from_rows(rows[start : start + self._max]))
                self.written += 1

    @abstractmethod
    def _write_updates(self, updates: Updates) -> None: ...

    @abstractmethod
    def _write_progress(self, p: Progress) -> None: ...


def check_field_names(schema: pa.Schema) -> None:
    """Read every field name, nested ones too. One that is not UTF-8 (a decoder can be fed
    anything) raises here, inside the decoder, not later where the rows are hashed."""

    def walk(t: pa.DataType) -> None:
        for i in range(t.num_fields):
            f = t.field(i)
            _ = f.name
            walk(f.type)

    for f in schema:
        _ = f.name
        walk(f.type)


class Decoder(ABC):
    """Reads messages from a binary stream; iterate it. ``position`` names the last one."""

    def __init__(self, stream: IO[bytes], *, schema: Any = None) -> None:
        self._stream = stream
        self._schema = schema
        self.position = "start"

    #: the format's name, for errors
    fmt: ClassVar[str] = ""

    @property
    def record_schema(self) -> Any:
        """The record schema: given, or as found in the stream (``None`` if unknown yet)."""
        return self._schema

    def __iter__(self) -> Iterator[Message]:
        """The messages, in order. Whatever a bad body makes the underlying library raise
        comes out as :class:`CodecError` naming the format and the position."""
        try:
            yield from self._messages()
        except (CodecError, Compacted):  # Compacted: a feed server's NDJSON last line
            raise
        except Exception as e:
            raise CodecError(
                f"cannot decode: {type(e).__name__}: {e}", fmt=self.fmt, position=self.position
            ) from e

    @abstractmethod
    def _messages(self) -> Iterator[Message]: ...


class Codec(ABC):
    """A wire format: its name, content type, and how to encode and decode it."""

    name: ClassVar[str]
    content_type: ClassVar[str]

    @abstractmethod
    def encoder(self, out: IO[bytes], *, schema: Any = None, max_updates: int = ...) -> Encoder: ...

    @abstractmethod
    def decoder(self, stream: IO[bytes], *, schema: Any = None, tables: bool = False) -> Decoder:
        """A decoder of ``stream``. ``tables``: the caller takes each batch of updates as
        Arrow (:meth:`Updates.table`), so a text format may read them straight into Arrow
        (NDJSON: a long line through pyarrow's reader, not Python objects); a caller that
        wants Python rows leaves it False."""

    def encode(self, messages: Iterable[Message], *, schema: Any = None) -> bytes:
        """Encode ``messages`` into one complete body."""
        buf = io.BytesIO()
        enc = self.encoder(buf, schema=schema)
        enc.write_all(messages)
        enc.close()
        return buf.getvalue()

    def decode(self, body: bytes, *, schema: Any = None) -> list[Message]:
        """Decode one complete body."""
        return list(self.decoder(io.BytesIO(body), schema=schema))


# The registry is made on first use, not when this module loads: the codecs' own modules
# import their base classes from here, so any of them may be imported first.
CODECS: dict[str, Codec]  # name -> codec (made by _registry: see __getattr__)
_BY_CONTENT_TYPE: dict[str, Codec]
_MAKING = threading.Lock()  # (one registry, whichever thread asks first)


def _registry() -> dict[str, Codec]:
    global CODECS, _BY_CONTENT_TYPE
    if "CODECS" in globals():
        return CODECS
    with _MAKING:
        if "CODECS" not in globals():
            from ._arrow import ArrowCodec
            from ._avro import AvroCodec
            from ._ndjson import NdjsonCodec

            made: list[Codec] = [NdjsonCodec(), AvroCodec(), ArrowCodec()]
            codecs = {c.name: c for c in made}
            _BY_CONTENT_TYPE = {c.content_type: c for c in codecs.values()}
            CODECS = codecs
    return CODECS


def __getattr__(name: str) -> Any:
    if name == "CODECS":
        return _registry()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_codec(name: str) -> Codec:
    """The codec called ``name``; :class:`CodecError` names the known ones otherwise."""
    try:
        return _registry()[name]
    except KeyError:
        known = ", ".join(_registry())
        raise CodecError(f"unknown format {name!r}; known formats: {known}") from None


def codec_for_content_type(content_type: str) -> Codec | None:
    """The codec for a ``Content-Type`` value (parameters ignored), or ``None``."""
    _registry()
    return _BY_CONTENT_TYPE.get(content_type.split(";", 1)[0].strip().lower())
