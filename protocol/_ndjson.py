"""NDJSON codec: one CDCv2-shaped JSON message per line.

Streams decode line by line with orjson; for a caller that takes updates as Arrow tables
(``decoder(…, tables=True)``), a long line of updates (a feed server writes 2 000 per
line) with pyarrow's JSON reader, straight into Arrow. A whole body in
memory (what a receiver holds) first goes through pyarrow's multi-threaded JSON reader
whole. Any line or body that reader does not take cleanly (a malformed line, an unexpected
shape, a string it would read as a timestamp) is decoded again by orjson line by line,
which names what is wrong and where. Through pyarrow, a column that some records of a
line or body lack reads as null in them (a feed's records all carry every column).

The reader infers the types of every body, which takes about half its time. A body is
first read with the record type of the body before it, when that type is one inference
cannot read differently (structs of integers, strings and booleans; no float, which
inference makes an integer when a body has no fraction): the read fails at the first value
of another type, and a field that is missing from every record of the body (inference
would leave it out of the record type) sends it to inference too.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from typing import IO, Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from ._text_checks import longest_line, nesting_check, number_check, utf8_check
from .codecs import Codec, Decoder, Encoder, check_field_names
from .errors import CodecError, Compacted
from .jsontext import joined, json_pieces, span
from .messages import (
    Message,
    Progress,
    Updates,
    _json_default,
    wire_rows_problem,
)

__all__ = ["NdjsonCodec"]

_DUMP_OPTS = orjson.OPT_NON_STR_KEYS


#: Updates per line: lines of ~100-200 kB let pyarrow's reader parse a body in parallel.
MAX_UPDATES_PER_LINE = 2_000
#: updates whose text an encoder builds at once (bounded: a string array holds < 2 GiB)
_TEXT_ROWS = 65_536


class NdjsonEncoder(Encoder):
    def _write(self, message: Message) -> None:
        if not (isinstance(message, Updates) and len(message) > self._max and message.has_table()):
            super()._write(message)
            return
        # the text of many updates at once, then cut into lines: the kernels' cost per
        # call is paid once per batch of lines, not once per line
        table = message.table()
        step = self._max * max(1, _TEXT_ROWS // self._max)
        for at in range(0, len(message), step):
            rows = _row_texts(Updates.from_arrow(table.slice(at, step)))
            if rows is None:
                # left to orjson, from here on: a record type (or a value, such as a string
                # with a control character) the column-wise text does not take
                super()._write(Updates.from_arrow(table.slice(at)))
                return
            for start in range(0, len(rows), self._max):
                self._write_line(span(rows, start, min(len(rows), start + self._max)))
                self.written += 1

    def _write_updates(self, updates: Updates) -> None:
        rows = _row_texts(updates) if updates.has_table() else None
        if rows is None:  # wire rows, or a record type left to orjson
            line = orjson.dumps(
                {"updates": updates.rows()}, option=_DUMP_OPTS, default=_json_default
            )
            self._out.write(line)
            self._out.write(b"\n")
        else:
            self._write_line(span(rows, 0, len(rows)))

    def _write_line(self, rows: memoryview) -> None:
        """One ``{"updates": [...]}`` line of update texts that each end with a comma."""
        self._out.write(b'{"updates":[')
        self._out.write(rows[:-1])
        self._out.write(b"]}\n")

    def _write_progress(self, p: Progress) -> None:
        self._out.write(orjson.dumps({"progress": p.to_wire()}))
        self._out.write(b"\n")


def _row_texts(updates: Updates) -> pa.Array | None:
    """The text of every update of an Arrow-held batch, ``{"data":…,"time":…,"diff":…},``
    each, built column-wise (see :mod:`.jsontext`); None when its record type is left to
    orjson."""
    table = updates.table()
    data = json_pieces(table.column("data"))
    if data is None:
        return None
    pieces: list[Any] = ['{"data":', *data]
    text = ""  # (the literal text since the last column piece)
    for name in ("time", "diff"):
        column = table.column(name)
        low, high = pc.min_max(column).values()
        text += f',"{name}":'
        if low.is_valid and low == high:  # one value (one time, inserts alone): its text once
            text += str(low.as_py())
        else:
            pieces += [text, pc.cast(column, pa.string())]
            text = ""
    rows = joined([*pieces, text + "},"], table.num_rows)
    if isinstance(rows, pa.ChunkedArray):
        rows = rows.combine_chunks()
    return rows


#: the longest line a stream decoder reads: a feed's lines hold at most
#: :data:`MAX_UPDATES_PER_LINE` updates, so a longer line is a broken or hostile stream,
#: refused before it fills the reader's memory
MAX_LINE_BYTES = 64 << 20


class NdjsonDecoder(Decoder):
    fmt = "ndjson"
    max_line_bytes = MAX_LINE_BYTES

    def __init__(self, stream: IO[bytes], *, schema: Any = None, tables: bool = False) -> None:
        super().__init__(stream, schema=schema)
        #: long lines of updates go to pyarrow's reader (the caller wants Arrow tables, and
        #: gave no record schema: it types the rows)
        self.tables = tables and schema is None

    def _lines(self) -> Iterator[bytes]:
        """The stream's lines, each read up to :attr:`max_line_bytes` and no further."""
        limit, lineno = self.max_line_bytes, 0
        while line := self._stream.readline(limit + 1):
            lineno += 1
            self.position = f"line {lineno}"
            if len(line) > limit and not line.endswith(b"\n"):
                raise CodecError(
                    f"a line longer than {limit} bytes (a feed's lines are far shorter)",
                    fmt="ndjson",
                    position=self.position,
                )
            yield line

    def _messages(self) -> Iterator[Message]:
        record: pa.DataType | None = None  # the record type of the last line read columnar
        for line in self._lines():
            if self.tables and len(line) >= _COLUMNAR_LINE and line.startswith(b'{"updates":'):
                decoded = _columnar_updates(line, record)
                if decoded is not None:
                    messages, record = decoded
                    yield from messages
                    continue
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                raise CodecError(f"invalid JSON: {e}", fmt="ndjson", position=self.position) from e
            if (
                type(obj) is dict
                and obj.get("error") == "compacted"
                and type(obj.get("since")) is int
            ):
                # a feed server's last line when compaction overtook the stream
                raise Compacted(str(obj.get("detail", "compacted")), since=obj["since"])
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
                why = wire_rows_problem(rows)
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


#: with ``tables``, a stream's ``updates`` line at least this long is read by pyarrow's JSON
#: reader, straight into Arrow (1 M updates in lines of 2 000: 1.4 s against 2.5 s through
#: Python rows; but 7.4 s against 1.4 s for a caller that then wants the rows); shorter
#: lines, and any line that reader does not take cleanly, by orjson
_COLUMNAR_LINE = 16 << 10


def _columnar_updates(
    line: bytes, record: pa.DataType | None
) -> tuple[list[Message], pa.DataType | None] | None:
    """One stream line of updates decoded as a whole body is (:func:`_decode_columnar`,
    after the same checks): its messages and the record type to read the next line with;
    None for the line decoder to read it (and name what is wrong), as for any line that
    fails a check here."""
    try:
        nesting_check(line)
        utf8_check(line)
        decoded = _decode_columnar(line, record)
    except Exception:  # (CodecError too: the line decoder gives a stream's own error)
        return None
    if decoded is None:
        return None
    messages, seen = decoded
    if len(messages) != 1 or not isinstance(messages[0], Updates):
        return None
    return messages, seen if seen is not None and _hintable(seen) else None


#: the smallest block pyarrow's JSON reader parses at once (blocks are parsed in parallel)
_MIN_BLOCK = 256 << 10

#: a progress line's value as the JSON reader types it
_PROGRESS = pa.struct(
    [
        ("lower", pa.list_(pa.int64())),
        ("upper", pa.list_(pa.int64())),
        ("counts", pa.list_(pa.struct([("time", pa.int64()), ("count", pa.int64())]))),
    ]
)
_KNOWN_LEAVES = (pa.int64(), pa.string(), pa.bool_())


def _hintable(t: pa.DataType) -> bool:
    """Whether reading with record type ``t`` gives what inference would: a struct of
    int64, string, bool and such structs (values of any other JSON type fail the read)."""
    return pa.types.is_struct(t) and all(
        _hintable(f.type) if pa.types.is_struct(f.type) else f.type in _KNOWN_LEAVES for f in t
    )


def _unseen_field(data: pa.Array) -> bool:
    """Whether some field of the records (at any depth) is null in every one of them."""
    for child in data.flatten():
        if len(child) and child.null_count == len(child):
            return True
        if pa.types.is_struct(child.type) and _unseen_field(child):
            return True
    return False


def _read_hinted(body: bytes, options: pa_json.ReadOptions, record: pa.DataType) -> pa.Table | None:
    """The body read with the record type ``record``, or ``None`` where inference is needed."""
    update = pa.struct([("data", record), ("time", pa.int64()), ("diff", pa.int64())])
    schema = pa.schema([("updates", pa.list_(update)), ("progress", _PROGRESS)])
    parse = pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="error")
    try:
        table = pa_json.read_json(pa.BufferReader(body), read_options=options, parse_options=parse)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, ValueError):
        return None
    for chunk in table.column("updates").chunks:
        # (a null record goes to the line decoder from _update_batches, read either way)
        if _unseen_field(chunk.flatten().field("data")):
            return None
    return table


def _has_timestamp(t: pa.DataType) -> bool:
    return _holds(
        t,
        lambda leaf: (
            pa.types.is_timestamp(leaf) or pa.types.is_date(leaf) or pa.types.is_time(leaf)
        ),
    )


def _holds(t: pa.DataType, leaf: Callable[[pa.DataType], bool]) -> bool:
    """Whether ``t`` is, or nests in its structs and lists, a type ``leaf`` picks."""
    if pa.types.is_struct(t):
        return any(_holds(f.type, leaf) for f in t)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _holds(t.value_type, leaf)
    return leaf(t)


def _imprecise(data: pa.Array) -> bool:
    """Whether a record column holds a float too large to be exact (pyarrow's JSON reader
    turns an integer beyond 64 bits into one; the line decoder refuses it instead)."""
    for child in data.flatten():
        if pa.types.is_struct(child.type):
            if _imprecise(child):
                return True
        elif pa.types.is_floating(child.type) and len(child) > child.null_count:
            top = pc.max(pc.abs(child)).as_py()
            if top is not None and top >= 2.0**53:
                return True
    return False


def _update_batches(column: pa.ChunkedArray) -> list[pa.Table | None] | None:
    """The update table of every line (``None`` for other lines), or ``None`` when the
    column is not a clean list of ``{data: object, time: int, diff: int}``."""
    t = column.type
    if pa.types.is_null(t):
        return [None] * len(column)
    if not pa.types.is_list(t) or not pa.types.is_struct(t.value_type):
        return None
    item = t.value_type
    names = [f.name for f in item]
    if (
        any(n not in names for n in ("data", "time", "diff"))
        or not pa.types.is_struct(item.field("data").type)
        or item.field("time").type != pa.int64()
        or item.field("diff").type != pa.int64()
        or _has_timestamp(item.field("data").type)
    ):
        return None
    out: list[pa.Table | None] = []
    for chunk in column.chunks:
        items = chunk.flatten()
        if any(items.field(n).null_count for n in ("data", "time", "diff")):
            return None
        if _imprecise(items.field("data")):
            return None
        lowest = pc.min(items.field("time")).as_py()
        if lowest is not None and lowest < 0:
            return None
        offsets = chunk.offsets.to_numpy()
        valid = np.asarray(chunk.is_valid().to_numpy(zero_copy_only=False))
        table = pa.Table.from_arrays(
            [items.field("data"), items.field("time"), items.field("diff")],
            names=["data", "time", "diff"],
        )
        for i in range(len(chunk)):
            if valid[i]:
                out.append(table.slice(offsets[i], offsets[i + 1] - offsets[i]))
            else:
                out.append(None)
    return out


def _decode_columnar(
    body: bytes, record: pa.DataType | None = None
) -> tuple[list[Message], pa.DataType | None] | None:
    """Decode a whole body with pyarrow's JSON reader (with the record type ``record`` if
    it reads the body as inference would): its messages and its record type, or ``None``
    to use the line decoder. Raises :class:`CodecError` for a number no reader may take
    (:func:`number_check`), when a read with inferred types found a float (a typed read,
    or one that found none, rules them out)."""
    longest = longest_line(body)
    options = pa_json.ReadOptions(block_size=max(longest + 1, _MIN_BLOCK), use_threads=True)
    table = None if record is None else _read_hinted(body, options, record)
    inferred = table is None
    try:
        if table is None:
            table = pa_json.read_json(pa.BufferReader(body), read_options=options)
        check_field_names(table.schema)  # pyarrow takes keys that are not UTF-8
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, ValueError):
        return None  # the line decoder says exactly what is wrong
    if inferred and any(_holds(f.type, pa.types.is_floating) for f in table.schema):
        # inference makes floats of NaN, Infinity and integers beyond 64 bits (and a
        # typed read of integers, strings and booleans fails on them): a body read
        # without a float anywhere holds none of them, else the scan says where
        number_check(body)
    if not set(table.column_names) <= {"updates", "progress"} or not table.num_rows:
        return None
    n = table.num_rows
    updates: list[pa.Table | None] = [None] * n
    if "updates" in table.column_names:
        found = _update_batches(table.column("updates"))
        if found is None:
            return None
        updates = found
    progress = (
        table.column("progress").to_pylist() if "progress" in table.column_names else [None] * n
    )
    seen = None
    if "updates" in table.column_names:
        seen = table.column("updates").type.value_type.field("data").type
    messages: list[Message] = []
    for ups, prog in zip(updates, progress, strict=True):
        if (ups is None) == (prog is None):
            return None  # both or neither on one line
        if ups is not None:
            if ups.num_rows:
                messages.append(Updates.from_arrow(ups))
        else:
            try:
                messages.append(Progress.from_wire(prog, fmt="ndjson"))
            except CodecError:
                return None  # the line decoder names the line
    return messages, seen


class NdjsonCodec(Codec):
    name = "ndjson"
    content_type = "application/x-ndjson"

    def __init__(self) -> None:
        #: the record type of the last body read, when it can be read with (no lock: a
        #: stale one costs a failed read, never a wrong one)
        self._record: pa.DataType | None = None

    def encoder(
        self, out: IO[bytes], *, schema: Any = None, max_updates: int = MAX_UPDATES_PER_LINE
    ) -> Encoder:
        return NdjsonEncoder(out, schema=schema, max_updates=max_updates)

    def decoder(self, stream: IO[bytes], *, schema: Any = None, tables: bool = False) -> Decoder:
        return NdjsonDecoder(stream, schema=schema, tables=tables)

    def decode(self, body: bytes, *, schema: Any = None) -> list[Message]:
        nesting_check(body)
        utf8_check(body)
        if schema is None and body:
            try:
                decoded = _decode_columnar(body, self._record)
            except CodecError:
                raise
            except Exception:  # e.g. invalid UTF-8 in a key: the line decoder says what
                decoded = None
            if decoded is not None:
                messages, record = decoded
                if record is not None:
                    self._record = record if _hintable(record) else None
                return messages
        number_check(body)  # (before the line decoder, whatever the columnar read did)
        return list(NdjsonDecoder(io.BytesIO(body), schema=schema))
