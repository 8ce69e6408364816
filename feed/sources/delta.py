"""``--source delta:TABLE_URI``: a Delta table's change data feed, read by commit version.

The table must have ``delta.enableChangeDataFeed = true`` from the first version the feed
reads. Each emitter transaction reads the versions after the committed one
(``source.version``) through ``deltalake`` (delta-rs, no Spark connector needed), stages
their change rows as one Parquet file in the feed log (``_staging/``), and hands that to
the ``cdf`` source: one Delta version is one source transaction, so with
``--granularity transaction`` each version becomes one time. In ``--follow`` new versions
are picked up as they are committed.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from protocol import SourceError, arrow_to_avro

__all__ = ["DeltaSource", "plain_types"]

_CDF_COLUMNS = ("_change_type", "_commit_version", "_commit_timestamp")
#: versions per emitter transaction at most
MAX_VERSIONS = 1000


def plain_types(t: pa.DataType) -> pa.DataType:
    """``t`` with the Arrow types Spark cannot read (string and binary views, large
    variants, unsigned integers) replaced by their plain counterparts."""
    if pa.types.is_string_view(t) or pa.types.is_large_string(t):
        return pa.string()
    if pa.types.is_binary_view(t) or pa.types.is_large_binary(t):
        return pa.binary()
    if pa.types.is_unsigned_integer(t):
        return pa.int64()
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(plain_types(f.type)) for f in t])
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t):
        return pa.list_(t.value_field.with_type(plain_types(t.value_type)))
    if pa.types.is_map(t):
        return pa.map_(plain_types(t.key_type), t.item_field.with_type(plain_types(t.item_type)))
    return t


def _plain(schema: pa.Schema) -> pa.Schema:
    return pa.schema([f.with_type(plain_types(f.type)) for f in schema])


class DeltaSource:
    """One Delta table's change data feed."""

    def __init__(self, uri: str) -> None:
        try:
            from deltalake import DeltaTable
        except ImportError as e:
            raise SourceError(
                "--source delta: needs the delta extra: pip install 'tidefeed[delta]'"
            ) from e
        self.uri = uri
        try:
            self.table = DeltaTable(uri)
        except Exception as e:  # delta-rs raises its own TableNotFoundError, OSError, …
            raise SourceError(f"cannot open Delta table {uri!r}: {e}") from e
        config = self.table.metadata().configuration or {}
        if str(config.get("delta.enableChangeDataFeed", "")).lower() != "true":
            raise SourceError(
                f"Delta table {uri!r} has no change data feed: set its property "
                "delta.enableChangeDataFeed = true (from the first version the feed reads)"
            )

    def latest(self) -> int:
        self.table.update_incremental()
        return int(self.table.version())

    def record_schema(self) -> dict[str, Any]:
        arrow = pa.schema(self.table.schema().to_arrow())
        fields = [f for f in _plain(arrow) if f.name not in _CDF_COLUMNS]
        schema: dict[str, Any] = arrow_to_avro(pa.struct(fields), name="record")
        return schema

    def stage_next(self, done: int, feedlog: Any) -> tuple[str, int] | None:
        """Stage the change rows of the versions after ``done`` (at most
        :data:`MAX_VERSIONS` of them) in the log's ``_staging`` folder: the staged file
        and the last version in it, or ``None`` when there is no newer version."""
        latest = self.latest()
        if latest <= done:
            return None
        last = min(latest, done + MAX_VERSIONS)
        staged = feedlog.path("_staging", f"delta-v{done + 1}-v{last}.parquet")
        feedlog.fs.create_dir(feedlog.path("_staging"), recursive=True)
        self.stage(done + 1, last, staged, feedlog.fs)
        return staged, last

    def stage(self, first: int, last: int, path: str, fs: Any) -> int:
        """Write the change rows of versions ``first..last`` to ``path`` (Parquet on the
        log's filesystem ``fs``); return how many there are."""
        try:
            reader = self.table.load_cdf(starting_version=first, ending_version=last)
            table = pa.RecordBatchReader.from_stream(reader).read_all()
        except Exception as e:
            raise SourceError(
                f"cannot read the change data feed of {self.uri!r}, versions {first}..{last}: {e}"
            ) from e
        table = table.cast(_plain(table.schema))
        with fs.open_output_stream(path) as out:
            pq.write_table(table, out)
        return int(table.num_rows)
