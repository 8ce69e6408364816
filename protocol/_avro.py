"""Avro codec: an object container file with Materialize's CDCv2 message schema."""

from __future__ import annotations

import io
import os
import zlib
from collections.abc import Iterator
from typing import IO, Any

import fastavro
import orjson
import pyarrow as pa

from ._avro_columns import avro_long, avro_long_at, encode_update_array
from ._avro_read import decode_columns
from .codecs import MAX_UPDATES_PER_MESSAGE, Codec, Decoder, Encoder
from .errors import CodecError
from .messages import Message, Progress, Updates, rows_to_table, wire_rows_problem
from .schema import CDC_NAMESPACE, avro_to_arrow, cdcv2_schema, record_schema_of

__all__ = ["AvroCodec", "check_reader", "decode_rows"]


#: an open block is written out once it holds this many bytes
BLOCK_BYTES = 64 * 1024


class AvroEncoder(Encoder):
    """An Avro object container of CDCv2 datums. The container (header, blocks of datums,
    sync markers) is written here; an update batch held as Arrow is encoded column-wise
    (:mod:`protocol._avro_columns`), anything else by fastavro's schemaless writer."""

    _parsed: Any
    _block: io.BytesIO
    _count: int
    _sync: bytes

    @property
    def needs_schema(self) -> bool:
        return True

    def _start(self) -> None:
        schema = cdcv2_schema(self._schema)
        try:
            self._parsed = fastavro.parse_schema(schema)
        except (fastavro.schema.SchemaParseException, KeyError, TypeError, ValueError) as e:
            raise CodecError(f"invalid record schema: {e}", fmt="avro") from e
        self._record = record_schema_of(self._schema)
        self._sync = os.urandom(16)
        meta = {"avro.schema": orjson.dumps(schema), "avro.codec": b"null"}
        head = bytearray(b"Obj\x01")
        head += avro_long(len(meta))
        for k, v in meta.items():
            head += avro_long(len(k)) + k.encode() + avro_long(len(v)) + v
        head += avro_long(0)
        self._out.write(bytes(head) + self._sync)
        self._block, self._count = io.BytesIO(), 0

    def _datum(self, datum: Any) -> None:
        try:
            fastavro.schemaless_writer(self._block, self._parsed, datum)
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
            raise CodecError(
                f"message {self.written} does not fit the record schema: {e}", fmt="avro"
            ) from e
        self._added()

    def _added(self) -> None:
        self._count += 1
        if self._block.tell() >= BLOCK_BYTES:
            self._flush()

    def _write_updates(self, updates: Updates) -> None:
        if updates.has_table():
            encoded = encode_update_array(updates.table(), self._record)
            if encoded is not None:
                self._block.write(encoded)
                self._added()
                return
        self._datum(updates.rows())

    def _write_progress(self, p: Progress) -> None:
        self._datum(p.to_wire())

    def _flush(self) -> None:
        if not self._count:
            return
        data = self._block.getbuffer()
        self._out.write(avro_long(self._count) + avro_long(len(data)))
        self._out.write(data)
        self._out.write(self._sync)
        del data
        self._block, self._count = io.BytesIO(), 0

    def _finish(self) -> None:
        self._flush()


def _update_fields_ok(items: Any) -> bool:
    """Whether an update array's items are records with ``time`` and ``diff`` longs (so
    each item takes two bytes at least: a body cannot declare millions of empty items)."""
    if not isinstance(items, dict) or items.get("type") != "record":
        return False
    types = {f.get("name"): f.get("type") for f in items.get("fields") or () if isinstance(f, dict)}
    return types.get("time") == "long" and types.get("diff") == "long" and "data" in types


def _check_cdcv2(schema: Any) -> None:
    ok = (
        isinstance(schema, list)
        and len(schema) == 2
        and isinstance(schema[0], dict)
        and schema[0].get("type") == "array"
        and _update_fields_ok(schema[0].get("items"))
        and isinstance(schema[1], dict)
        and schema[1].get("name") in ("progress", f"{CDC_NAMESPACE}.progress")
    )
    if not ok:
        raise CodecError(
            "the container's writer schema is not the CDCv2 message schema "
            "(a union of an update array and a progress record)",
            fmt="avro",
            position="header",
        )


#: block codecs a body may use (others, bzip2 and xz among them, inflate to far more than
#: they weigh and cost more to undo than the body is worth)
ALLOWED_CODECS = ("null", "deflate")


def check_reader(reader: Any) -> None:
    """Refuse a container whose writer schema is not CDCv2's, refers to itself or names
    a block codec not accepted."""
    _check_cdcv2(reader.writer_schema)
    _check_safe(reader)


def _check_safe(reader: Any) -> None:
    """Refuse a writer schema that refers to itself (a record nested in itself can be as
    deep as the body is long, and decoding it recursed until the process died) and a block
    codec not in :data:`ALLOWED_CODECS`."""
    codec = str(getattr(reader, "codec", "null"))
    if codec not in ALLOWED_CODECS:
        raise CodecError(
            f"block codec {codec!r} is not accepted (use {' or '.join(ALLOWED_CODECS)})",
            fmt="avro",
            position="header",
        )
    name = _recursive(reader.writer_schema, ())
    if name is not None:
        raise CodecError(
            f"the writer schema's type {name!r} contains itself: recursive types are refused",
            fmt="avro",
            position="header",
        )


def _recursive(schema: Any, path: tuple[str, ...], namespace: str = "") -> str | None:
    """The first named type inside ``schema`` that refers to one it is nested in."""
    if isinstance(schema, str):
        full = schema if "." in schema or not namespace else f"{namespace}.{schema}"
        return schema if schema in path or full in path else None
    if isinstance(schema, list):
        for branch in schema:
            found = _recursive(branch, path, namespace)
            if found is not None:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if kind in ("record", "error", "enum", "fixed"):
        name = str(schema.get("name", ""))
        namespace = str(schema.get("namespace", namespace) or "")
        full = name if "." in name or not namespace else f"{namespace}.{name}"
        path = (*path, name, full)
    if kind in ("record", "error"):
        for f in schema.get("fields") or ():
            found = _recursive(f.get("type") if isinstance(f, dict) else None, path, namespace)
            if found is not None:
                return found
        return None
    if kind == "array":
        return _recursive(schema.get("items"), path, namespace)
    if kind == "map":
        return _recursive(schema.get("values"), path, namespace)
    if isinstance(kind, dict | list):
        return _recursive(kind, path, namespace)
    return None


#: a whole body's blocks may hold at most this many times its own size once inflated (a
#: deflate block of CDCv2 rows shrinks 3 to 10 times; a bomb, a thousand), plus this much
MAX_INFLATION = 32
INFLATION_SLACK = 1 << 20
_INFLATE_STEP = 1 << 20


def _inflated_size(data: memoryview, cap: int, where: str) -> int:
    """How many bytes a raw deflate block inflates to, counted without keeping them, and
    refused as soon as it passes ``cap``."""
    d = zlib.decompressobj(-15)
    total, pending = 0, bytes(data)
    try:
        while pending and not d.eof:
            # (after the stream's end, bytes left (fastavro writes three of its checksum)
            # stayed the unconsumed tail when the step ended there: the loop never ended)
            total += len(d.decompress(pending, _INFLATE_STEP))
            pending = d.unconsumed_tail
            if total > cap:
                break
    except zlib.error as e:
        raise CodecError(f"bad deflate data: {e}", fmt="avro", position=where) from e
    return total


def check_container(body: bytes, *, factor: int = MAX_INFLATION) -> None:
    """Walk an Avro object container's blocks before any is decoded: every number at most
    ten bytes, every block inside the body, at most one datum per byte of its data, and
    all blocks together no larger inflated than ``factor`` times the body (plus
    :data:`INFLATION_SLACK`). A body that is not a container is left to the decoder."""
    if body[:4] != b"Obj\x01":
        return
    cap = factor * len(body) + INFLATION_SLACK
    pos, codec = 4, b"null"
    while True:  # the metadata map
        n, pos = avro_long_at(body, pos, "header")
        if n == 0:
            break
        if n < 0:
            n = -n
            _, pos = avro_long_at(body, pos, "header")
        for _ in range(n):
            klen, pos = avro_long_at(body, pos, "header")
            key = body[pos : pos + max(klen, 0)]
            pos += max(klen, 0)
            vlen, pos = avro_long_at(body, pos, "header")
            if key == b"avro.codec":
                codec = body[pos : pos + max(vlen, 0)]
            pos += max(vlen, 0)
    pos += 16  # the sync marker
    view = memoryview(body)
    total, index = 0, 0
    while pos < len(body):
        where = f"block {index}"
        count, pos = avro_long_at(body, pos, where)
        size, pos = avro_long_at(body, pos, where)
        if count < 0 or size < 0 or pos + size > len(body):
            raise CodecError(
                f"a block of {count} datum(s) in {size} byte(s) does not fit the body",
                fmt="avro",
                position=where,
            )
        inflated = size
        if codec == b"deflate":
            inflated = _inflated_size(view[pos : pos + size], cap - total, where)
        total += inflated
        if total > cap:
            raise CodecError(
                f"the blocks inflate to more than {cap} bytes ({factor} times the "
                f"{len(body)}-byte body, plus {INFLATION_SLACK}): refused",
                fmt="avro",
                position=where,
            )
        if count > inflated:
            raise CodecError(
                f"a block of {inflated} byte(s) cannot hold {count} datums",
                fmt="avro",
                position=where,
            )
        pos += size + 16
        index += 1


class AvroDecoder(Decoder):
    fmt = "avro"

    def _messages(self) -> Iterator[Message]:
        self.position = "header"
        try:
            reader = fastavro.reader(self._stream)
        except Exception as e:  # fastavro raises many kinds on garbage: all are bad input
            raise CodecError(
                f"not an Avro object container: {e!r}", fmt="avro", position=self.position
            ) from e
        _check_cdcv2(reader.writer_schema)
        _check_safe(reader)
        self._schema = record_schema_of(reader.writer_schema)
        index = 0
        it = iter(reader)
        while True:
            self.position = f"datum {index}"
            try:
                datum = next(it)
            except StopIteration:
                return
            except Exception as e:  # as above: the body is bad, whatever fastavro says
                raise CodecError(
                    f"cannot read datum: {e!r}", fmt="avro", position=self.position
                ) from e
            if isinstance(datum, list):
                why = wire_rows_problem(datum)
                if why is not None:
                    raise CodecError(why, fmt="avro", position=self.position)
                yield Updates.from_rows(datum)
            else:
                yield Progress.from_wire(datum, fmt="avro", position=self.position)
            index += 1


class AvroCodec(Codec):
    name = "avro"
    content_type = "application/vnd.tidefeed.cdcv2+avro"

    def encoder(
        self, out: IO[bytes], *, schema: Any = None, max_updates: int = MAX_UPDATES_PER_MESSAGE
    ) -> Encoder:
        return AvroEncoder(out, schema=schema, max_updates=max_updates)

    def decoder(self, stream: IO[bytes], *, schema: Any = None, tables: bool = False) -> Decoder:
        return AvroDecoder(stream, schema=schema)

    def decode(self, body: bytes, *, schema: Any = None) -> list[Message]:
        # a whole body: column-wise when the record schema is flat (protocol._avro_read),
        # else by fastavro, each update array becoming Arrow as soon as it is read
        check_container(body)
        fast = decode_columns(body, check_reader)
        return fast if fast is not None else decode_rows(body, schema=schema)


def decode_rows(body: bytes, *, schema: Any = None) -> list[Message]:
    """A container read by fastavro, its update arrays typed by the writer schema (one C
    pass, no inference), so few Python rows are alive at a time."""
    decoder = AvroDecoder(io.BytesIO(body), schema=schema)
    data_type: pa.DataType | None = None
    typed = True
    messages: list[Message] = []
    for m in decoder:
        if isinstance(m, Updates) and typed:
            if data_type is None:
                try:
                    data_type = avro_to_arrow(decoder.record_schema)
                except CodecError:  # a schema Arrow cannot hold exactly: keep the rows
                    typed = False
                    messages.append(m)
                    continue
            m = Updates.from_arrow(rows_to_table(m.rows(), data_type))
        messages.append(m)
    return messages
