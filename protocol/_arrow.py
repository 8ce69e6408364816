"""Arrow codec: an IPC stream of update batches; progress rides in batch metadata.

Update batches have the columns ``data`` (struct), ``time`` and ``diff`` (int64). A progress
statement is a batch with no rows whose custom metadata holds ``tidefeed.progress`` (the
progress' wire JSON), so the stream keeps one schema from start to end.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import IO, Any

import orjson
import pyarrow as pa

from .codecs import MAX_UPDATES_PER_MESSAGE, Codec, Decoder, Encoder, check_field_names
from .errors import CodecError
from .messages import Message, Progress, Updates, columns_problem, update_schema
from .schema import arrow_to_avro, avro_to_arrow

__all__ = ["PROGRESS_KEY", "ArrowCodec"]

PROGRESS_KEY = b"tidefeed.progress"


class ArrowEncoder(Encoder):
    _writer: pa.ipc.RecordBatchStreamWriter

    @property
    def needs_schema(self) -> bool:
        return True

    def _start(self) -> None:
        assert self._data_type is not None
        self._arrow_schema = update_schema(self._data_type)
        self._empty = self._arrow_schema.empty_table().to_batches()
        if not self._empty:
            self._empty = [pa.RecordBatch.from_pylist([], schema=self._arrow_schema)]
        self._writer = pa.ipc.new_stream(self._out, self._arrow_schema)

    def _write_updates(self, updates: Updates) -> None:
        table = updates.table(self._data_type)
        try:
            self._writer.write_table(table, max_chunksize=self._max)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise CodecError(f"cannot write update batch: {e}", fmt="arrow") from e

    def _write_progress(self, p: Progress) -> None:
        self._writer.write_batch(
            self._empty[0], custom_metadata={PROGRESS_KEY: orjson.dumps(p.to_wire())}
        )

    def _finish(self) -> None:
        self._writer.close()


class ArrowDecoder(Decoder):
    fmt = "arrow"

    _data_type: pa.DataType | None = None

    @property
    def record_schema(self) -> Any:
        # derived on demand: most readers never ask, and the derivation is not free
        if self._schema is None and self._data_type is not None:
            self._schema = arrow_to_avro(self._data_type)
        return self._schema

    def _messages(self) -> Iterator[Message]:
        self.position = "schema"
        try:
            reader = pa.ipc.open_stream(self._stream)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise CodecError(
                f"not an Arrow IPC stream: {e}", fmt="arrow", position=self.position
            ) from e
        schema = reader.schema
        check_field_names(schema)
        names = schema.names
        if (
            "data" not in names
            or not pa.types.is_struct(schema.field("data").type)
            or any(
                n not in names or not pa.types.is_integer(schema.field(n).type)
                for n in ("time", "diff")
            )
        ):
            raise CodecError(
                f"stream schema must have data (struct), time and diff (integers), got {schema}",
                fmt="arrow",
                position=self.position,
            )
        sent = schema.field("data").type
        try:
            # the record type every reader of the feed will use (an Arrow type each Avro
            # type reads back as): a large_string column becomes string, a timestamp in
            # any zone an instant in UTC. Kept as sent, parts of two pushes would not
            # concatenate, and the receiver's collection read failed from then on. (A
            # type with no such round trip, an all-null column, is kept as sent.)
            self._data_type = avro_to_arrow(arrow_to_avro(sent))
        except CodecError:
            self._data_type = sent
        cast = None if self._data_type == sent else self._data_type
        maps = [f.name for f in self._data_type if pa.types.is_map(f.type)]
        columns = [(name, names.index(name)) for name in ("data", "time", "diff")]
        index = 0
        while True:
            self.position = f"batch {index}"
            try:
                batch, meta = reader.read_next_batch_with_custom_metadata()
            except StopIteration:
                return
            except (pa.ArrowException, OSError, ValueError) as e:
                raise CodecError(
                    f"cannot read batch: {e}", fmt="arrow", position=self.position
                ) from e
            index += 1
            try:
                # row counts, offsets and buffers as the batch claims them, checked before
                # anything reads it (a patched count made reads run past the body)
                batch.validate(full=True)
            except (pa.ArrowException, ValueError) as e:
                raise CodecError(f"invalid batch: {e}", fmt="arrow", position=self.position) from e
            if batch.num_rows:
                why = columns_problem(batch)
                if why is not None:
                    raise CodecError(why, fmt="arrow", position=self.position)
                if cast is not None:
                    batch = _with_data(batch, columns[0][1], cast, self.position)
                for name in maps:
                    _unique_keys(batch.column(columns[0][1]).field(name), name, self.position)
                for name, i in columns:
                    if batch.column(i).null_count:
                        raise CodecError(
                            f"null '{name}' in an update batch", fmt="arrow", position=self.position
                        )
                yield Updates(_table=batch)  # columns were checked with the schema
            raw = meta.get(PROGRESS_KEY) if meta is not None else None
            if raw is not None:
                try:
                    obj = orjson.loads(raw)
                except orjson.JSONDecodeError as e:
                    raise CodecError(
                        f"progress metadata is not JSON: {e}", fmt="arrow", position=self.position
                    ) from e
                yield Progress.from_wire(obj, fmt="arrow", position=self.position)


def _with_data(batch: pa.RecordBatch, at: int, to: pa.DataType, position: str) -> pa.RecordBatch:
    """``batch`` with its ``data`` column cast to ``to``."""
    try:
        data = batch.column(at).cast(to)
    except (pa.ArrowException, ValueError) as e:
        raise CodecError(f"data does not read as {to}: {e}", fmt="arrow", position=position) from e
    arrays = list(batch.columns)
    arrays[at] = data
    return pa.RecordBatch.from_arrays(arrays, names=batch.schema.names)


def _unique_keys(col: pa.MapArray, name: str, position: str) -> None:
    """Refuse a map column with a key twice in one value (no record can hold that: JSON
    and Avro readers keep one of them, so two readers would see two records)."""
    import numpy as np
    import pyarrow.compute as pc

    keys = pa.ListArray.from_arrays(col.offsets, col.keys)  # (a slice's own maps)
    lengths = pc.list_value_length(keys).to_numpy(zero_copy_only=False)
    if not lengths.sum():
        return
    rows = pa.array(np.repeat(np.arange(len(col)), lengths))
    pairs = pa.table({"row": rows, "key": pc.list_flatten(keys)})
    if pairs.group_by(["row", "key"]).aggregate([]).num_rows != len(pairs):
        raise CodecError(
            f"map '{name}' holds a key twice in one record", fmt="arrow", position=position
        )


class ArrowCodec(Codec):
    name = "arrow"
    content_type = "application/vnd.apache.arrow.stream"

    def encoder(
        self, out: IO[bytes], *, schema: Any = None, max_updates: int = MAX_UPDATES_PER_MESSAGE
    ) -> Encoder:
        return ArrowEncoder(out, schema=schema, max_updates=max_updates)

    def decoder(self, stream: IO[bytes], *, schema: Any = None, tables: bool = False) -> Decoder:
        return ArrowDecoder(stream, schema=schema)  # (its batches are Arrow either way)

    def decode(self, body: bytes, *, schema: Any = None) -> list[Message]:
        # a whole body in memory: Arrow reads it in place, with no copy through Python
        return list(ArrowDecoder(pa.BufferReader(body), schema=schema))
