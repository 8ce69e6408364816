"""Which table shapes fit a feed's record schema (feed/shapes.py), without Spark."""

from __future__ import annotations

import pytest

from feed.connect import DECIMAL, connect_to_avro
from feed.shapes import evolve, first_unfit, shape_change

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


def _fields(schema: dict) -> dict:
    return {f["name"]: f["type"] for f in schema["fields"]}


def test_the_next_version_keeps_every_column_and_takes_the_new_ones_nullable():
    added = [*COLUMNS, {"field": "qty", "type": "int32", "optional": False, "default": 7}]
    schema, defaults, widened = evolve(FEED, frozenset(), shape_change(FEED, added))
    assert list(_fields(schema)) == ["id", "name", "amount", "qty"]
    assert _fields(schema)["qty"] == ["null", "int"]
    assert defaults == {"qty": 7} and widened == ()
    # dropped: kept, nullable, and a later event without it is no change at all
    schema, defaults, _ = evolve(FEED, frozenset(), shape_change(FEED, _with("id")[1:]))
    assert _fields(schema)["id"] == ["null", "int"] and defaults == {}
    assert not shape_change(schema, COLUMNS[1:], gone={"id"})
    # back again (with a default): added once more, its default to fill in
    back = shape_change(schema, _with("id", default=3), gone={"id"})
    assert back.added == ("id",)
    again, defaults, _ = evolve(schema, frozenset({"id"}), back)
    assert _fields(again)["id"] == ["null", "int"] and defaults == {"id": 3}


def test_widening_takes_the_wider_type_where_every_old_value_reads_the_same():
    wide = _with("id", type="int64")
    schema, _, widened = evolve(FEED, frozenset(), shape_change(FEED, wide))
    assert _fields(schema)["id"] == "long" and widened == ("id",)
    grown = _with("amount", parameters={"scale": "2", "connect.decimal.precision": "12"})
    schema, _, widened = evolve(FEED, frozenset(), shape_change(FEED, grown))
    assert _fields(schema)["amount"][1]["precision"] == 12 and widened == ("amount",)


@pytest.mark.parametrize(
    ("columns", "says"),
    [
        (_with("id", type="float64"), "id from int to double"),  # 5 would read as 5.0
        (
            _with("amount", parameters={"scale": "3", "connect.decimal.precision": "10"}),
            "amount from decimal(10, 2) to decimal(10, 3)",
        ),
        (_with("name", type="int32"), "name from string to int"),
        (_with("name", field="title"), "RENAME COLUMN"),
    ],
)
def test_changes_no_version_holds_say_why(columns, says):
    found = evolve(FEED, frozenset(), shape_change(FEED, columns))
    assert isinstance(found, str) and says in found
