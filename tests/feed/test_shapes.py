"""Which table shapes fit a feed's record schema (feed/shapes.py), without Spark."""

from __future__ import annotations

import pytest

from feed.connect import DECIMAL, connect_to_avro
from feed.shapes import first_unfit, shape_change

COLUMNS = [
    {"field": "id", "type": "int32", "optional": False},
    {"field": "name", "type": "string", "optional": True},
    {
        "field": "amount",
        "type": "bytes",
        "name": DECIMAL,
        "parameters": {"scale": "2", "connect.decimal.precision": "10"},
        "optional": True,
    },
]
FEED = connect_to_avro(COLUMNS, "record")


def _with(name: str, **changes) -> list[dict]:
    return [dict(c, **changes) if c["field"] == name else c for c in COLUMNS]


@pytest.mark.parametrize(
    "columns",
    [
        COLUMNS,
        _with("name", optional=False),  # NOT NULL added
        _with("name", default="x"),  # a default
        _with("id", type="int16"),  # smallint -> integer and back: both int
        _with("amount", parameters={"scale": "2", "connect.decimal.precision": "8"}),
    ],
)
def test_shapes_that_fit(columns):
    assert not shape_change(FEED, columns)


@pytest.mark.parametrize(
    ("columns", "says"),
    [
        ([*COLUMNS, {"field": "qty", "type": "int32", "optional": True}], "added qty"),
        (COLUMNS[:2], "dropped amount"),
        (_with("id", type="int64"), "id changed from int to long"),
        (
            _with("amount", parameters={"scale": "3", "connect.decimal.precision": "10"}),
            "amount changed from decimal(10, 2) to decimal(10, 3)",
        ),
        (
            _with("amount", parameters={"scale": "2", "connect.decimal.precision": "12"}),
            "amount changed from decimal(10, 2) to decimal(12, 2)",
        ),
        (_with("name", field="title"), "added title; dropped name"),
        (_with("name", type="int32"), "name changed from string to int"),
    ],
)
def test_shapes_that_do_not_fit_say_how(columns, says):
    change = shape_change(FEED, columns)
    assert change and change.describe() == says


def test_a_feed_with_wider_types_takes_narrower_columns():
    wide = {
        "type": "record",
        "name": "record",
        "fields": [
            {"name": "id", "type": "long"},
            {"name": "name", "type": ["null", "string"]},
            {"name": "amount", "type": ["null", FEED["fields"][2]["type"][1]]},
        ],
    }
    assert not shape_change(wide, COLUMNS)
    assert shape_change(wide, _with("name", type="int32"))


def test_first_unfit_learns_the_shapes_that_fit_and_samples_each_once():
    samples = {1: COLUMNS, 2: _with("name", optional=False), 3: COLUMNS[:1]}
    asked: list[int] = []

    def sample(h):
        asked.append(h)
        return samples[h]

    known: set[int] = set()
    assert first_unfit(feed_schema=FEED, shapes=[1, 2, None], known=known, sample=sample) is None
    assert known == {1, 2}
    found = first_unfit(feed_schema=FEED, shapes=[1, 2, 3], known=known, sample=sample)
    assert found is not None and found[0] == 3
    assert found[1].describe() == "dropped name, amount"
    assert asked == [1, 2, 3] and known == {1, 2}
