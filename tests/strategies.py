"""Hypothesis strategies for records, updates and feed streams."""

from __future__ import annotations

import datetime as dt
import decimal

from hypothesis import strategies as st

from protocol import Progress, Update, Updates, consolidate

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
TEXT = st.text(max_size=12)

#: JSON-native records (what NDJSON carries without a schema).
json_records = st.fixed_dictionaries(
    {
        "id": INT64,
        "name": TEXT,
        "score": st.none() | st.floats(allow_nan=False, allow_infinity=False, width=64),
        "ok": st.none() | st.booleans(),
        "tags": st.lists(TEXT, max_size=3),
        "address": st.none()
        | st.fixed_dictionaries({"city": st.none() | TEXT, "zip": st.integers(0, 99999)}),
    }
)

#: The same kind of record with logical types (Avro and Arrow carry them).
RICH_SCHEMA = {
    "type": "record",
    "name": "rich",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "name", "type": "string"},
        {"name": "score", "type": ["null", "double"], "default": None},
        {"name": "ok", "type": ["null", "boolean"], "default": None},
        {"name": "tags", "type": {"type": "array", "items": "string"}},
        {
            "name": "address",
            "type": [
                "null",
                {
                    "type": "record",
                    "name": "address",
                    "fields": [
                        {"name": "city", "type": ["null", "string"], "default": None},
                        {"name": "zip", "type": "long"},
                    ],
                },
            ],
            "default": None,
        },
        {"name": "at", "type": ["null", {"type": "long", "logicalType": "timestamp-micros"}]},
        {"name": "day", "type": {"type": "int", "logicalType": "date"}},
        {
            "name": "amount",
            "type": {"type": "bytes", "logicalType": "decimal", "precision": 18, "scale": 4},
        },
    ],
}

rich_records = st.builds(
    lambda base, at, day, amount: base | {"at": at, "day": day, "amount": amount},
    json_records,
    st.none()
    | st.datetimes(min_value=dt.datetime(1900, 1, 1), max_value=dt.datetime(2200, 1, 1)).map(
        lambda d: d.replace(tzinfo=dt.UTC)
    ),
    st.dates(min_value=dt.date(1, 1, 1), max_value=dt.date(9999, 12, 31)),
    st.decimals(
        min_value=decimal.Decimal("-99999999999999.9999"),
        max_value=decimal.Decimal("99999999999999.9999"),
        places=4,
        allow_nan=False,
        allow_infinity=False,
    ),
)

TIMES = st.integers(min_value=0, max_value=2**63 - 2)
DIFFS = INT64.filter(lambda d: d != 0)


def updates_of(records: st.SearchStrategy) -> st.SearchStrategy[list[Update]]:
    return st.lists(st.builds(Update, records, TIMES, DIFFS), min_size=1, max_size=20)


@st.composite
def valid_feeds(draw, records=None, max_times: int = 6):
    """A valid feed: chained progress, consolidated updates, exact counts.

    Returns (messages, truth) where truth maps each time to its consolidated updates.
    """
    records = records or st.fixed_dictionaries({"k": st.integers(0, 5), "v": TEXT})
    n_times = draw(st.integers(1, max_times))
    times = sorted(draw(st.sets(st.integers(1, 1000), min_size=n_times, max_size=n_times)))
    messages = [Progress(0, 0, ())]
    frontier = 0
    truth = {}
    for t in times:
        raw = draw(
            st.lists(
                st.builds(Update, records, st.just(t), st.sampled_from([-2, -1, 1, 3])), max_size=8
            )
        )
        batch = consolidate(raw)
        truth[t] = batch.rows()
        if len(batch):
            messages.append(batch)
        upper = t + 1
        messages.append(Progress(frontier, upper, ((t, len(batch)),) if len(batch) else ()))
        frontier = upper
    return messages, truth


def updates_batch(ups: list[Update]) -> Updates:
    return Updates.of(ups)
