"""A downstream consumer in ~30 lines: pull a tidefeed feed over HTTP and keep it durable.

Needs only the `protocol` package (from a checkout: pip install /path/to/tidefeed, no
Spark). `FeedClient` hands over the feed's complete times, checked by the consumer state
machine; each one goes into SQLite in one transaction with its frontier, the token this
consumer resumes from at its next run. At the end it prints the table in key order.

    python docs/examples/pull_consumer.py http://127.0.0.1:8080 accounts consumer.db \
        [KEY (default id)] [--follow]
"""

import sys

from protocol import FeedClient
from protocol.sqlite_store import SqliteDatabase


def main(base: str, feed: str, db_path: str, follow: bool, key: str) -> None:
    store = SqliteDatabase(db_path).store(feed)
    start = store.load()  # resume exactly where the last run stopped
    for t in FeedClient(base, feed).times(after=start.frontier, follow=follow):
        # the time's updates and the new frontier commit together: a crash loses neither
        store.commit(updates=[t.updates], frontier=t.frontier, epoch=start.epoch)
        print(f"committed {t.updates.num_rows} updates, frontier {t.frontier}")
    rows = sorted(store.collection(), key=lambda rc: (rc[0].get(key) is None, rc[0].get(key)))
    print(f"{feed} at frontier {store.load().frontier}: {len(rows)} rows")
    for record, count in rows[:10]:
        print(f"  {count:+d}  {record}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--follow"]
    main(*args[:3], follow="--follow" in sys.argv, key=args[3] if len(args) > 3 else "id")
