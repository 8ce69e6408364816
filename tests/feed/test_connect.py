"""Kafka Connect encodings read exactly at the edges of their types (feed/sources/connect.py)."""

from __future__ import annotations

import base64
import decimal

import pytest
from pyspark.sql import functions as F
from pyspark.sql import types as T

from feed.sources.connect import (
    DECIMAL,
    connect_names,
    connect_scales,
    connect_to_avro,
    typed_record,
)


def _b64(unscaled: int) -> str:
    n = (unscaled.bit_length() + 8) // 8
    return base64.b64encode(unscaled.to_bytes(n, "big", signed=True)).decode()


def test_float_and_double_fields_are_numbers_not_text():
    # the JSON converter names float32/float64 "float" and "double"
    avro = connect_to_avro(
        [{"field": "r", "type": "float"}, {"field": "d", "type": "double", "optional": True}],
        "record",
    )
    assert avro["fields"][0]["type"] == "float"
    assert avro["fields"][1]["type"] == ["null", "double"]


@pytest.mark.parametrize(
    "unscaled",
    [10**38 - 1, -(10**38 - 1), -(10**38 - 2), 1, -1, -128, -129, 255, -(10**37), 0],
)
def test_decimal38_at_its_limits(spark, unscaled):
    record = T.StructType([T.StructField("v", T.DecimalType(38, 4))])
    raw = spark.createDataFrame([(_b64(unscaled),)], "v string")
    typed, mism = typed_record(F.struct("v"), record, "", {"v": DECIMAL})
    row = raw.select(typed.alias("t"), F.concat_ws(",", *mism).alias("m")).first()
    assert row["m"] == ""
    assert row["t"]["v"] == decimal.Decimal(unscaled).scaleb(-4, decimal.Context(prec=100))


@pytest.mark.parametrize("unscaled", [10**38, -(10**38)])
def test_decimal38_past_its_limits_is_a_mismatch(spark, unscaled):
    record = T.StructType([T.StructField("v", T.DecimalType(38, 0))])
    raw = spark.createDataFrame([(_b64(unscaled),)], "v string")
    typed, mism = typed_record(F.struct("v"), record, "after.", {"v": DECIMAL})
    row = raw.select(typed.alias("t"), F.concat_ws(",", *mism).alias("m")).first()
    assert row["t"]["v"] is None and row["m"] == "after.v"


def test_wide_decimal_is_exact_text_at_its_scale(spark):
    schema = connect_to_avro(
        [
            {
                "field": "w",
                "type": "bytes",
                "name": DECIMAL,
                "parameters": {"scale": "10", "connect.decimal.precision": "50"},
                "optional": True,
            }
        ],
        "record",
    )
    assert connect_scales(schema) == {"w": 10} and connect_names(schema) == {"w": DECIMAL}
    values = [
        -12345678901234567890123456789012345678900123456789,
        10**49 - 1,
        5,
        -5,
        0,
    ]
    want = [
        "-1234567890123456789012345678901234567890.0123456789",
        "999999999999999999999999999999999999999.9999999999",
        "0.0000000005",
        "-0.0000000005",
        "0.0000000000",
    ]
    record = T.StructType([T.StructField("w", T.StringType())])
    raw = spark.createDataFrame([(_b64(v),) for v in values] + [(None,)], "w string")
    typed, _ = typed_record(
        F.struct("w"), record, "", connect_names(schema), connect_scales(schema)
    )
    got = [r["t"]["w"] for r in raw.select(typed.alias("t")).collect()]
    assert got == [*want, None]
