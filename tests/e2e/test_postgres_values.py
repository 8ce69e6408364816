"""Values as stored: every PostgreSQL type docs/sources.md lists, with NULL, with its
extreme values and with its DEFAULT, through a real capture and emitter.

Kafka Connect's JSON converter writes a column's DEFAULT where the value is NULL unless
told not to; ``tidefeed capture postgres`` tells it. The feed must equal ``SELECT *`` after
every PostgreSQL transaction: a NULL in a column with a DEFAULT (``DEFAULT now()`` too)
stays NULL, and the smallest and largest values of each type arrive exact.
"""

from __future__ import annotations

import decimal
import math
import struct
from collections import Counter

import pytest

from feed.demo.pgtemp import feed_multiset, normalize, table_multiset
from feed.log.reader import FeedReader
from protocol import check_messages

from .test_postgres import cluster_and_capture

pytestmark = [pytest.mark.slow, pytest.mark.realsource, pytest.mark.timeout(600)]

SCHEMA_SQL = """
CREATE TABLE vals (
    id int PRIMARY KEY,
    i2 smallint DEFAULT 2,
    i4 integer DEFAULT 4,
    i8 bigint DEFAULT 8,
    r4 real DEFAULT 1.5,
    r8 double precision DEFAULT 2.5,
    n numeric(12, 2) DEFAULT 1.25,
    nv numeric DEFAULT 3.5,
    nw numeric(50, 10) DEFAULT 1,
    b boolean DEFAULT true,
    t text DEFAULT 'd',
    vc varchar(10) DEFAULT 'v',
    ts timestamp DEFAULT now(),
    tz timestamptz DEFAULT now(),
    d date DEFAULT current_date,
    tm time DEFAULT '12:00',
    u uuid DEFAULT gen_random_uuid(),
    j json DEFAULT '{"k": 1}',
    jb jsonb DEFAULT '[1]',
    by bytea DEFAULT '\\x01'
);
ALTER TABLE vals REPLICA IDENTITY FULL;
"""
COLUMNS = "id, i2, i4, i8, r4, r8, n, nv, nw, b, t, vc, ts, tz, d, tm, u, j, jb, by"
SMALLEST = (
    "(2, -32768, -2147483648, -9223372036854775808, -3.4e38, -1.7e308, -9999999999.99, "
    "-99999999999999999999.999999999999999999, "
    "-1234567890123456789012345678901234567890.0123456789, false, '', '', "
    "'0001-01-01 00:00:00', '0001-01-01 00:00:00+00', '0001-01-01', '00:00:00', "
    "'00000000-0000-0000-0000-000000000000', 'null', '{}', '\\x')"
)
LARGEST = (
    "(3, 32767, 2147483647, 9223372036854775807, 3.4e38, 1.7e308, 9999999999.99, "
    "99999999999999999999.999999999999999999, "
    "1234567890123456789012345678901234567890.0123456789, true, 'Zoë 😀', 'ÿ€😀abcdefg', "
    "'9999-12-31 23:59:59.999999', '9999-12-31 23:59:59.999999+00', '9999-12-31', "
    "'23:59:59.999999', 'ffffffff-ffff-ffff-ffff-ffffffffffff', "
    '\'{"a": [1, {"b": null}]}\', \'{"x": "\\u00e9"}\', \'\\xff00ff\')'
)
ALL_NULL = "(1, " + ", ".join(["NULL"] * 19) + ")"
# each entry is one PostgreSQL transaction, streamed after the snapshot
WORKLOAD = [
    # a row of every column's DEFAULT, and one of NULLs inserted while streaming
    [
        "INSERT INTO vals (id) VALUES (10)",
        f"INSERT INTO vals ({COLUMNS}) VALUES " + ALL_NULL.replace("(1,", "(11,"),
    ],
    # a value set to NULL, and NULLs set to values
    [
        "UPDATE vals SET i4 = NULL, tz = NULL, ts = NULL, nv = NULL, u = NULL WHERE id = 10",
        "UPDATE vals SET i4 = 0, tz = '2024-02-29 12:00:00+05', t = 'was null' WHERE id = 1",
    ],
    # the special floating-point values
    ["INSERT INTO vals (id, r4, r8) VALUES (12, 'Infinity', '-Infinity'), (13, 'NaN', 'NaN')"],
    # the extremes swapped, and the smallest row deleted
    [
        "UPDATE vals SET i8 = -9223372036854775808, d = '0001-01-01' WHERE id = 3",
        "DELETE FROM vals WHERE id = 2",
    ],
]
JSON_COLS = {"j", "jb"}


def _normal(rows: Counter) -> Counter:
    """bytea as bytes on both sides (psycopg2 gives memoryview); ``numeric(50, 10)``, which
    the feed holds as its exact text, as a normalized decimal."""

    def one(c: str, v: object) -> object:
        if isinstance(v, memoryview):
            return bytes(v)
        if c == "nw" and isinstance(v, str):
            return normalize(decimal.Decimal(v))
        if isinstance(v, float) and math.isnan(v):
            return "NaN"  # NaN != NaN: compared by name
        if c == "r4" and isinstance(v, float):  # a real holds a float32
            return struct.unpack("f", struct.pack("f", v))[0]
        return v

    out: Counter = Counter()
    for row, n in rows.items():
        out[tuple((c, one(c, v)) for c, v in row)] += n
    return out


def _differences(got: Counter, truth: Counter, when: str) -> str:
    """The columns in which the feed's rows differ from the table's, row by row."""
    lines = [when]
    mine = {dict(r)["id"]: dict(r) for r in got}
    theirs = {dict(r)["id"]: dict(r) for r in truth}
    for k in sorted(mine.keys() | theirs.keys()):
        a, b = mine.get(k, {}), theirs.get(k, {})
        diff = {c: (a.get(c), b.get(c)) for c in a.keys() | b.keys() if a.get(c) != b.get(c)}
        if diff:
            lines.append(f"id {k}: (feed, table) {diff}")
    return "\n".join(lines)


def test_values_as_stored(spark, tmp_path):
    from tests.feed.model import run_emitter

    with cluster_and_capture(tmp_path / "src", tmp_path, "public.vals") as (capture, cur):
        cur.execute(SCHEMA_SQL)
        cur.execute(f"INSERT INTO vals ({COLUMNS}) VALUES {ALL_NULL}, {SMALLEST}, {LARGEST}")
        truths = [_normal(table_multiset(cur, "vals"))]
        capture.start()
        capture.wait_for('"snapshot":"last"')
        conn = cur.connection
        for txn in WORKLOAD:
            conn.autocommit = False
            for sql in txn:
                cur.execute(sql)
            conn.commit()
            conn.autocommit = True
            truths.append(_normal(table_multiset(cur, "vals")))
        capture.finish(ends=len(WORKLOAD))

    e, reports = run_emitter(
        spark,
        source_kind="debezium",
        source_path=str(capture.out),
        feed="vals",
        log=str(tmp_path / "log"),
        key=("id",),
        granularity="transaction",
        clock="logical",
    )
    e.close()
    assert sum(r.bad_rows for r in reports) == 0, [r.line() for r in reports]
    reader = FeedReader(str(tmp_path / "log"), "vals")
    assert check_messages(reader.messages(), non_negative=True, key=["id"]) == []
    assert reader.frontier == 1 + len(truths), "one time per PostgreSQL transaction"
    for i, truth in enumerate(truths):
        got = _normal(feed_multiset(reader, 1 + i, JSON_COLS))
        assert got == truth, _differences(got, truth, f"after PostgreSQL transaction {i}")
