"""Schema changes while captured (real PostgreSQL, real Debezium): the feed's record schema
grows with the table (docs/sources.md, "Schema changes"). Each table gets DML before its
ALTER, the ALTER, and DML after it (new rows and old rows changed); the feed holds one
time per PostgreSQL transaction, the ALTER's own included, and at every one of them the
collection equals the table (a null column counting as absent). A rename is told from a
drop and an add by the column numbers the capture records; in a folder without them (a
foreign Debezium folder) a column dropped and another added stop the feed after
everything before them.
"""

from __future__ import annotations

from collections import Counter

import pytest

from feed.demo.pgtemp import feed_multiset, table_multiset
from feed.log.read import open_feed
from feed.log.reader import FeedReader
from protocol import SourceError, Updates, check_messages, get_codec, record_key

from .test_postgres import cluster_and_capture

pytestmark = [pytest.mark.slow, pytest.mark.realsource, pytest.mark.timeout(600)]

# per table: its DDL, the ALTER, and the DML after it (old-shape rows and new ones)
TABLES = {
    "add_col": (
        "id int PRIMARY KEY, name text",
        "ADD COLUMN qty integer NOT NULL DEFAULT 7",
        ["INSERT INTO add_col VALUES (5, 'new', 3)", "UPDATE add_col SET qty = 9 WHERE id = 1"],
    ),
    "add_null": (
        "id int PRIMARY KEY, name text",
        "ADD COLUMN note text",
        ["INSERT INTO add_null VALUES (5, 'new', 'n')", "UPDATE add_null SET name = 'x'"],
    ),
    "drop_col": (
        "id int PRIMARY KEY, name text, note text",
        "DROP COLUMN note",
        ["INSERT INTO drop_col VALUES (5, 'new')", "DELETE FROM drop_col WHERE id = 1"],
    ),
    "widen": (
        "id int PRIMARY KEY, name varchar(5), n integer",
        "ALTER COLUMN n TYPE bigint",
        [
            "INSERT INTO widen VALUES (5, 'big', 1099511627776)",
            "UPDATE widen SET n = -1099511627776 WHERE id = 1",
        ],
    ),
    "amounts": (
        "id int PRIMARY KEY, name text, amount numeric(6, 2)",
        "ALTER COLUMN amount TYPE numeric(12, 2)",
        [
            "INSERT INTO amounts VALUES (5, 'big', 1234567890.12)",
            "UPDATE amounts SET amount = -9999.99 WHERE id = 1",
        ],
    ),
    "renamed": (
        "id int PRIMARY KEY, name text",
        "RENAME COLUMN name TO title",
        ["INSERT INTO renamed VALUES (5, 'new')", "UPDATE renamed SET title = 'x' WHERE id = 1"],
    ),
    "swapped": (
        "id int PRIMARY KEY, name text, note text",
        "DROP COLUMN note, ADD COLUMN memo text DEFAULT 'm'",
        ["INSERT INTO swapped VALUES (5, 'new', 'n')", "UPDATE swapped SET memo = 'y'"],
    ),
}
#: updates at the ALTER's time: the two rows then in the table, each -old +new, where
#: the ALTER changes them (a default filled in, a column gone, a column renamed); none
#: for the others
REWRITTEN = {
    "add_col": 4,
    "add_null": 0,
    "drop_col": 4,
    "widen": 0,
    "amounts": 0,
    "renamed": 4,
    "swapped": 4,
}


def _row(table: str, i: int) -> str:
    more = {"drop_col": ", 'x'", "widen": ", 7", "amounts": ", 12.5", "swapped": ", 'x'"}.get(
        table, ""
    )
    return f"({i}, 'r{i}'{more})"


def _as_records(rows: Counter) -> Counter:
    """Rows as records whose null columns are absent (the feed's record identity)."""
    return Counter(
        {tuple(sorted((c, v) for c, v in row if v is not None)): n for row, n in rows.items()}
    )


@pytest.fixture(scope="module")
def altered(tmp_path_factory):
    """Capture five tables through a change of each one's shape; the truth of each table
    after each of its PostgreSQL transactions (the ALTER's too)."""
    tmp = tmp_path_factory.mktemp("pgschema")
    truths: dict[str, list[Counter]] = {t: [] for t in TABLES}
    tables = ",".join(f"public.{t}" for t in TABLES)
    with cluster_and_capture(tmp / "src", tmp, tables) as (capture, cur):
        for t, (ddl, _, _) in TABLES.items():
            cur.execute(f"CREATE TABLE {t} ({ddl})")
            cur.execute(f"INSERT INTO {t} VALUES {_row(t, 1)}, {_row(t, 2)}")
            truths[t].append(table_multiset(cur, t))
        capture.start()
        capture.wait_for('"snapshot":"last"')
        for t in TABLES:
            cur.execute(f"UPDATE {t} SET id = 3 WHERE id = 2")  # a change before
            truths[t].append(table_multiset(cur, t))
        # varchar(5) -> text keeps the feed's type: no new version
        cur.execute("ALTER TABLE widen ALTER COLUMN name TYPE text")
        cur.execute("INSERT INTO widen VALUES (4, 'longer than five', 8)")
        truths["widen"].append(table_multiset(cur, "widen"))
        for t, (_, alter, after) in TABLES.items():
            cur.execute(f"ALTER TABLE {t} {alter}")
            truths[t].append(table_multiset(cur, t))
            for dml in after:
                cur.execute(dml)
                truths[t].append(table_multiset(cur, t))
        ends = sum(len(after) for _, _, after in TABLES.values())
        capture.wait_for('"id":5', times=len(TABLES))
        # the UPDATEs before, the ALTERs (each records its columns), the DML after
        capture.finish(ends=2 * (len(TABLES) + 1) + ends)
    return {"src": capture.out, "tmp": tmp, "truths": truths}


def _emit(spark, altered, table: str, src=None):
    from tests.feed.model import run_emitter

    log = altered["tmp"] / f"log-{table}"
    run_emitter(
        spark,
        source_kind="debezium",
        source_path=str(src or altered["src"]),
        feed=table,
        log=str(log),
        key=("id",),
        table=f"public.{table}",
        granularity="transaction",
        clock="logical",
    )
    return str(log)


@pytest.mark.parametrize("table", list(TABLES))
def test_the_feed_equals_the_table_at_every_time_across_a_change_of_shape(spark, altered, table):
    log = _emit(spark, altered, table)
    reader = FeedReader(log, table)
    truths = altered["truths"][table]
    assert check_messages(reader.messages(), non_negative=True, key=["id"]) == []
    assert reader.frontier == 1 + len(truths), "one time per PostgreSQL transaction"
    for i, truth in enumerate(truths):
        assert _as_records(feed_multiset(reader, 1 + i)) == _as_records(truth), (table, i)
    # one version more, from the ALTER's time, telling what changed
    history = reader.info.history()
    assert len(history) == 2
    alter_index = len(truths) - 1 - len(TABLES[table][2])
    assert history[1].start == 1 + alter_index
    # the ALTER's time rewrites the rows it changed: -old +new for each
    assert reader.counts().get(1 + alter_index, 0) == REWRITTEN[table]
    # every reader path reads the whole feed: feed.log.read, and each wire format
    feed = open_feed(log, table)
    last = feed.collection().to_pylist()
    want = Counter(record_key({k: v for k, v in r.items() if k != "count"}) for r in last)
    assert sum(want.values()) == sum(truths[-1].values())
    for fmt in ("ndjson", "avro", "arrow"):
        codec = get_codec(fmt)
        body = codec.encode(reader.messages(), schema=reader.info.schema)
        got: Counter = Counter()
        for m in codec.decode(body, schema=reader.info.schema):
            if isinstance(m, Updates):
                for u in m.rows():
                    got[record_key(u["data"])] += u["diff"]
        assert +got == want, fmt


def test_a_rename_is_told_apart_and_its_values_move_to_the_new_name(altered):
    reader = FeedReader(str(altered["tmp"] / "log-renamed"), "renamed")
    version = reader.info.history()[1]
    assert version.renamed == (("name", "title"),)
    assert "renamed name to title" in version.describe()
    # the ALTER's time moves each value: -{name: v} +{title: v}
    moved = feed_multiset(reader, version.start) - feed_multiset(reader, version.start - 1)
    assert sorted(dict(r)["title"] for r in moved.elements()) == ["r1", "r2"]


def test_a_drop_and_an_add_without_column_numbers_stop_the_feed_after_everything_before(
    spark, altered
):
    """A folder with no column numbers (a Debezium folder from elsewhere): a column
    dropped and another added may be a rename, and the feed stops before it."""
    foreign, logs = altered["tmp"] / "foreign-src", altered["tmp"] / "foreign"
    foreign.mkdir()
    logs.mkdir()
    for p in sorted(altered["src"].glob("events-*.json")):
        lines = p.read_text().splitlines(keepends=True)
        (foreign / p.name).write_text("".join(x for x in lines if "tidefeed_columns" not in x))
    table = "renamed"
    with pytest.raises(SourceError, match="RENAME") as err:
        _emit(spark, {**altered, "tmp": logs}, table, src=foreign)
    assert "added title; dropped name" in str(err.value)
    reader = FeedReader(str(logs / f"log-{table}"), table)
    truths = altered["truths"][table]
    before = len(truths) - 1 - len(TABLES[table][2])  # the times before the ALTER
    assert check_messages(reader.messages(), non_negative=True, key=["id"]) == []
    assert reader.frontier == 1 + before
    for i in range(before):
        assert feed_multiset(reader, 1 + i) == truths[i]
