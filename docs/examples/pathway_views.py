"""Views of a feed in Pathway, kept exact through restarts, and one written back as a feed.

Needs the `pathway` extra in an environment of its own (Pathway 0.33 needs pyarrow<26):

    python -m venv .venv-pathway && .venv-pathway/bin/pip install -e '.[pathway]'
    .venv-pathway/bin/python docs/examples/pathway_views.py http://127.0.0.1:8080 bank \
        --regions regions.json --state pathway-state --changes views.jsonl --write-back by_owner

It reads the feed (a bank's accounts: id, owner, balance, ...) as a Pathway table, one
Pathway commit per complete time, and keeps three views: the accounts, the balance per
owner, and the balance per region through a join with a static table (``--regions``, a
JSON object owner -> region). Every change of a view goes to ``--changes`` as a JSON line
``[view, pathway_time, is_addition, row]``. With ``--state`` Pathway persists its state:
stopped (SIGTERM) and started again, the program goes on after the last time it
persisted. ``--write-back DIR`` writes the per-owner view as a feed's input; then

    tidefeed emit --source weighted:by_owner --schema by_owner.avsc --feed owners \
        --log /data/feeds --clock logical --max-files-per-txn 1

makes it a feed of its own. tests/e2e/test_pathway.py runs this program.
"""

import argparse

import orjson
import pathway as pw

from feed.pathway import read, write


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("server")
    p.add_argument("feed")
    p.add_argument("--regions", required=True, help="JSON file: owner -> region")
    p.add_argument("--changes", required=True, help="JSON lines of every view's changes")
    p.add_argument("--state", help="Pathway's persistence folder (resume after a restart)")
    p.add_argument("--until", type=int, help="stop at this frontier (default: follow)")
    p.add_argument("--write-back", help="folder for the per-owner view as a feed's input")
    args = p.parse_args()

    accounts = read(args.server, args.feed, until=args.until, name="pathway-views")
    by_owner = accounts.groupby(accounts.owner).reduce(
        accounts.owner, total=pw.reducers.sum(accounts.balance), n=pw.reducers.count()
    )
    with open(args.regions, "rb") as f:
        regions = orjson.loads(f.read())
    static = pw.debug.table_from_rows(
        pw.schema_from_types(owner=str, region=str), list(regions.items())
    )
    joined = accounts.join(static, accounts.owner == static.owner).select(
        static.region, accounts.balance
    )
    by_region = joined.groupby(joined.region).reduce(
        joined.region, total=pw.reducers.sum(joined.balance)
    )

    if args.write_back:
        write(by_owner, args.write_back)
    persistence = None
    if args.state:
        persistence = pw.persistence.Config(pw.persistence.Backend.filesystem(args.state))
    with open(args.changes, "ab") as out:

        def sink(view: str):
            def on_change(key, row, time, is_addition) -> None:
                out.write(orjson.dumps([view, time, is_addition, row]) + b"\n")
                out.flush()

            return on_change

        views = (("accounts", accounts), ("by_owner", by_owner), ("by_region", by_region))
        for view, table in views:
            pw.io.subscribe(table, on_change=sink(view))
        pw.run(monitoring_level=pw.MonitoringLevel.NONE, persistence_config=persistence)


if __name__ == "__main__":
    main()
