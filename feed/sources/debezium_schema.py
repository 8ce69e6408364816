"""What Debezium events say about their table, read on the driver from the first events
or by one small Spark job: the table's name (:func:`debezium_table`), its record schema
for a new feed (:func:`debezium_schema`), and the shape of its columns (:func:`shape_of`,
a hash :mod:`feed.sources.debezium` gives every event; :func:`shape_sample`, the columns
of one shape, for :mod:`feed.sources.shapes`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import orjson
from pyspark.sql import Column, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from feed.sources.connect import connect_to_avro
from feed.sources.events import debezium_event
from feed.sources.file_text import input_lines
from feed.sources.rows import PARSE_OPTIONS, ordered_fields, read_text
from protocol import SourceError

__all__ = [
    "WRAPPER_SCHEMA",
    "columns_text",
    "debezium_schema",
    "debezium_table",
    "shape_of",
    "shape_sample",
    "table_of",
]

#: how far schema inference looks for a Debezium event of the feed's table
_SAMPLE_LINES = 100_000


def _debezium_events(files: Sequence[str]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(wrapper, payload) of the first Debezium data events of ``files`` (tombstones,
    transaction metadata and heartbeats left out), within the first lines."""
    seen = 0
    for path in files:
        for line in input_lines(path):
            seen += 1
            if seen > _SAMPLE_LINES:
                return
            found = debezium_event(line)
            if found is not None:
                yield found


def table_of(payload: dict[str, Any]) -> str | None:
    """The ``schema.table`` (or ``table``) an event's ``source`` block names, if any."""
    src = payload.get("source")
    if not isinstance(src, dict) or not src.get("table"):
        return None
    return f"{src['schema']}.{src['table']}" if src.get("schema") else str(src["table"])


def debezium_table(files: Sequence[str]) -> str | None:
    """The ``schema.table`` of the first Debezium data event in ``files``, if any (not the
    capture's own column-number table: feed/sources/capture.py)."""
    from feed.sources.capture import COLUMNS_TABLE

    for _, payload in _debezium_events(files):
        table = table_of(payload)
        if table != COLUMNS_TABLE:
            return table
    return None


def debezium_schema(
    spark: Callable[[], SparkSession], files: Sequence[str], table: str | None
) -> dict[str, Any]:
    """The record schema of ``table``'s first events in ``files``: the Connect schema of a
    wrapped event, without Spark; else the images typed by Spark (``spark`` is called
    then only)."""
    from pyspark.sql.pandas.types import to_arrow_type

    from protocol import arrow_to_avro

    images: list[str] = []
    first_image: dict[str, Any] | None = None
    for wrapper, payload in _debezium_events(files):
        if table is not None and table_of(payload) not in (table, None):
            continue
        schema = wrapper.get("schema")
        if isinstance(schema, dict):
            for fld in schema.get("fields", []):
                if fld.get("field") in ("after", "before") and fld.get("fields"):
                    return connect_to_avro(fld["fields"], "record")
        image = payload.get("after") or payload.get("before")
        if isinstance(image, dict):
            first_image = first_image or image
            images.append(orjson.dumps(image).decode())
            if len(images) >= 1000:  # enough for Spark to type the columns
                break
    if first_image is None:
        where = f" of table {table}" if table else ""
        raise SourceError(
            f"cannot infer a record schema: no Debezium change event{where} in the first "
            f"input files ({files[0]} …); give --schema FILE (an Avro record schema)"
        )
    # no Connect schema: let Spark type the images, then restore the table's column order
    session = spark()
    inferred = session.read.json(session.sparkContext.parallelize(images))
    fields = ordered_fields(list(inferred.schema.fields), list(first_image))
    return dict(arrow_to_avro(to_arrow_type(T.StructType(fields), timezone="UTC"), name="record"))


WRAPPER_SCHEMA = T.StructType(
    [
        T.StructField(
            "fields",
            T.ArrayType(
                T.StructType(
                    [
                        T.StructField("field", T.StringType()),
                        T.StructField("fields", T.StringType()),
                    ]
                )
            ),
        )
    ]
)


def columns_text(schema: Column) -> Column:
    """The JSON text of the table's columns in a parsed :data:`WRAPPER_SCHEMA` (null for
    a bare event)."""
    image = F.filter(schema["fields"], lambda f: f["field"].isin("after", "before"))
    return F.try_element_at(image, F.lit(1))["fields"]


def shape_of(schema: Column) -> Column:
    """A 64-bit hash of :func:`columns_text`: events of one shape share it."""
    text = columns_text(schema)
    return F.when(text.isNotNull(), F.xxhash64(text))


def shape_sample(spark: SparkSession, files: Sequence[str], shape: int) -> list[dict[str, Any]]:
    """The Connect fields (the table's columns) of the first event in ``files`` whose
    shape hash is ``shape``; [] when none is found."""
    wrapper = T.StructType([T.StructField("schema", WRAPPER_SCHEMA)])
    parsed = F.from_json("_raw", wrapper, PARSE_OPTIONS)["schema"]
    found = (
        read_text(spark, files)
        .select(columns_text(parsed).alias("t"), shape_of(parsed).alias("h"))
        .where(F.col("h") == F.lit(shape))
        .limit(1)
        .collect()
    )
    if not found:
        return []
    fields = orjson.loads(found[0]["t"])
    return fields if isinstance(fields, list) else []
