"""Schema changes while captured (real PostgreSQL, real Debezium): never a column dropped
silently. The feed's record schema does not evolve yet (docs/sources.md): the emitter
commits every PostgreSQL transaction before the change, each one time equal to the table,
then stops with an error naming the change and commits nothing of the new shape. A change
whose values still read as the feed's types (varchar(n) to text, a new default) goes on.
"""

from __future__ import annotations

from collections import Counter

import pytest

from feed.pgtemp import feed_multiset, table_multiset
from feed.reader import FeedReader
from protocol import SourceError, check_messages

from .test_postgres import cluster_and_capture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# per table: its DDL, then the ALTER; each table also gets a change before and after it
TABLES = {
    "add_col": ("id int PRIMARY KEY, name text", "ADD COLUMN qty integer NOT NULL DEFAULT 0"),
    "drop_col": ("id int PRIMARY KEY, name text, note text", "DROP COLUMN note"),
    "widen": ("id int PRIMARY KEY, name varchar(5), n integer", "ALTER COLUMN n TYPE bigint"),
    "renamed": ("id int PRIMARY KEY, name text", "RENAME COLUMN name TO title"),
}
#: what the error says for each table's change
SAYS = {
    "add_col": "added qty",
    "drop_col": "dropped note",
    "widen": "n changed from int to long",
    "renamed": "added title; dropped name",
}


def _row(table: str, i: int) -> str:
    more = {"drop_col": ", 'x'", "widen": ", 7"}.get(table, "")
    return f"({i}, 'r{i}'{more})"


@pytest.fixture(scope="module")
def altered(tmp_path_factory):
    """Capture four tables through a change of each one's shape; the truths of each table
    after each PostgreSQL transaction before its change."""
    tmp = tmp_path_factory.mktemp("pgschema")
    truths: dict[str, list[Counter]] = {t: [] for t in TABLES}
    tables = ",".join(f"public.{t}" for t in TABLES)
    with cluster_and_capture(tmp / "src", tmp, tables) as (capture, cur):
        for t, (ddl, _) in TABLES.items():
            cur.execute(f"CREATE TABLE {t} ({ddl})")
            cur.execute(f"INSERT INTO {t} VALUES {_row(t, 1)}, {_row(t, 2)}")
            truths[t].append(table_multiset(cur, t))
        capture.start()
        capture.wait_for('"snapshot":"last"')
        for t in TABLES:
            cur.execute(f"UPDATE {t} SET id = 3 WHERE id = 2")  # a change before
            truths[t].append(table_multiset(cur, t))
        # varchar(5) -> text keeps the feed's type: the widen feed goes on through it
        cur.execute("ALTER TABLE widen ALTER COLUMN name TYPE text")
        cur.execute("INSERT INTO widen VALUES (4, 'longer than five', 8)")
        truths["widen"].append(table_multiset(cur, "widen"))
        for t, (_, alter) in TABLES.items():
            cur.execute(f"ALTER TABLE {t} {alter}")
        cur.execute("INSERT INTO add_col VALUES (5, 'new', 3)")
        cur.execute("INSERT INTO drop_col VALUES (5, 'new')")
        cur.execute("INSERT INTO widen VALUES (5, 'big', 1099511627776)")
        cur.execute("INSERT INTO renamed VALUES (5, 'new')")
        capture.wait_for('"id":5', times=4)
        capture.finish(ends=4 + 1 + 4)
    return {"src": capture.out, "tmp": tmp, "truths": truths}


@pytest.mark.parametrize("table", list(TABLES))
def test_a_change_of_shape_stops_the_feed_after_everything_before_it(spark, altered, table):
    from tests.feed.model import run_emitter

    log = altered["tmp"] / f"log-{table}"
    with pytest.raises(SourceError, match="changed shape") as err:
        run_emitter(
            spark,
            source_kind="debezium",
            source_path=str(altered["src"]),
            feed=table,
            log=str(log),
            key=("id",),
            table=f"public.{table}",
            granularity="transaction",
            clock="logical",
        )
    assert SAYS[table] in str(err.value)
    assert "nothing after it" in str(err.value)
    reader = FeedReader(str(log), table)
    truths = altered["truths"][table]
    assert check_messages(reader.messages(), non_negative=True, key=["id"]) == []
    assert reader.frontier == 1 + len(truths), "every transaction before the change"
    for i, truth in enumerate(truths):
        assert feed_multiset(reader, 1 + i) == truth, f"{table}: transaction {i}"
