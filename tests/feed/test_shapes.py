"""Which table shapes fit a feed's record schema (feed/sources/shapes.py), without Spark."""

from __future__ import annotations

import orjson
import pytest

from feed.sources.capture import COLUMNS_TABLE
from feed.sources.connect import DECIMAL, connect_to_avro
from feed.sources.shapes import evolve, shape_change, unfit_shapes, with_renames
from protocol import SourceError

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


def test_unfit_shapes_learns_the_shapes_that_fit_and_samples_each_once():
    samples = {1: COLUMNS, 2: _with("name", optional=False), 3: COLUMNS[:1], 4: COLUMNS[1:]}
    asked: list[int] = []

    def sample(h):
        asked.append(h)
        return samples[h]

    known: set[int] = set()
    assert unfit_shapes(feed_schema=FEED, shapes=[1, 2, None], known=known, sample=sample) == []
    assert known == {1, 2}
    found = unfit_shapes(feed_schema=FEED, shapes=[4, 1, 2, 3], known=known, sample=sample)
    # every unfit shape, for the caller to cut at the one delivered first
    assert [(h, c.describe()) for h, c in found] == [
        (3, "dropped name, amount"),
        (4, "dropped id"),
    ]
    assert asked == [1, 2, 3, 4] and known == {1, 2}


def test_a_shape_not_found_again_is_an_error_not_a_fit():
    """The input changed under the read: nothing is taken as fitting."""

    def gone(h):
        raise FileNotFoundError("/in/part-9.json")

    for sample in (lambda h: [], gone):
        known: set[int] = set()
        with pytest.raises(SourceError, match=r"feed 'f': the input changed .* part-9\.json"):
            unfit_shapes(
                feed_schema=FEED,
                shapes=[5],
                known=known,
                sample=sample,
                feed="f",
                files=["/in/part-9.json"],
            )
        assert known == set()


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


def _event(table: str, columns: list[dict], after: dict) -> str:
    schema = {"fields": [{"field": "after", "fields": columns}]}
    schema_name, _, name = table.rpartition(".")
    src = {"schema": schema_name, "table": name, "lsn": 1}
    return orjson.dumps(
        {"schema": schema, "payload": {"op": "c", "source": src, "after": after}}
    ).decode()


def _numbers(table: str, columns: dict[str, int]) -> str:
    row = {"id": 1, "tbl": table, "columns": orjson.dumps(columns).decode()}
    return _event(COLUMNS_TABLE, [], row)


def _folder(tmp_path, *files: list[str]) -> list[str]:
    tmp_path.mkdir(exist_ok=True)
    paths = []
    for i, lines in enumerate(files, 1):
        p = tmp_path / f"events-{i:012d}.json"
        p.write_text("\n".join(lines) + "\n")
        paths.append(str(p))
    return paths


RENAMED = _with("name", field="title")


def test_column_numbers_tell_a_rename_from_a_drop_and_an_add(tmp_path):
    t = "public.items"
    change = shape_change(FEED, RENAMED)
    files = _folder(
        tmp_path,
        [_numbers(t, {"id": 1, "name": 2, "amount": 3}), _event(t, COLUMNS, {"id": 1})],
        # the ALTER's own row, then the first event of the new shape, then a later ALTER
        # (not the catalog that event was written under)
        [
            _numbers(t, {"id": 1, "title": 2, "amount": 3}),
            _event(t, RENAMED, {"id": 2}),
            _numbers(t, {"id": 1, "title": 4, "amount": 3}),
        ],
    )
    found = with_renames(change, files, t, "events-000000000002.json")
    assert found.renamed == (("name", "title"),) and found.numbered
    assert found.describe() == "renamed name to title"
    schema, defaults, _ = evolve(FEED, frozenset(), found)
    assert list(_fields(schema)) == ["id", "name", "amount", "title"]
    assert _fields(schema)["name"] == ["null", "string"] and defaults == {}
    # another number under the new name: a drop and an add, which a version holds too
    files = _folder(
        tmp_path / "b",
        [_numbers(t, {"id": 1, "name": 2, "amount": 3})],
        [_numbers(t, {"id": 1, "amount": 3, "title": 4}), _event(t, RENAMED, {"id": 2})],
    )
    dropped = with_renames(change, files, t, "events-000000000002.json")
    assert dropped.renamed == () and dropped.numbered
    assert not isinstance(evolve(FEED, frozenset(), dropped), str)


def test_without_the_numbers_of_both_shapes_a_drop_and_an_add_stay_refused(tmp_path):
    t = "public.items"
    change = shape_change(FEED, RENAMED)
    only_new = _folder(tmp_path, [_numbers(t, {"id": 1, "title": 2, "amount": 3})])
    other_table = _folder(
        tmp_path / "b",
        [_numbers("public.other", {"id": 1, "name": 2, "amount": 3})],
        [_numbers(t, {"id": 1, "title": 2, "amount": 3})],
    )
    for files in (only_new, other_table, []):
        found = with_renames(change, files, t, "events-000000000002.json")
        assert not found.numbered
        assert "RENAME COLUMN" in evolve(FEED, frozenset(), found)
