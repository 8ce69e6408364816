"""A downstream consumer in ~40 lines: pull a tidefeed feed over HTTP and keep it durable.

Needs only the `protocol` package (from a checkout: pip install /path/to/tidefeed, no
Spark). It streams the feed from where it left off (its durable frontier), applies every
message through the same consumer state machine as the reference receiver, keeps the
result in SQLite, and prints the table in key order.

    python docs/examples/pull_consumer.py http://127.0.0.1:8080 accounts consumer.db \
        [KEY (default id)] [--follow]
"""

import sys
import urllib.request

from protocol import Consumer, get_codec
from protocol.sqlite_store import SqliteDatabase


def main(base: str, feed: str, db_path: str, follow: bool, key: str) -> None:
    store = SqliteDatabase(db_path).store(feed)
    consumer = Consumer(store, feed=feed)
    after = consumer.frontier or 0  # resume exactly where the last run stopped
    url = f"{base}/v1/feeds/{feed}/changes?after={after}&format=ndjson&follow={str(follow).lower()}"
    decoder = get_codec("ndjson")
    with urllib.request.urlopen(url) as stream:
        for line in stream:  # one message per line: apply it as it arrives
            result = consumer.apply(decoder.decode(line))
            if result.committed:  # one Arrow table or more per completed time
                n = sum(t.num_rows for t in result.committed)
                print(f"committed {n} updates, frontier {result.frontier}")
    rows = sorted(store.collection(), key=lambda rc: (rc[0].get(key) is None, rc[0].get(key)))
    print(f"{feed} at frontier {consumer.frontier}: {len(rows)} rows")
    for record, count in rows[:10]:
        print(f"  {count:+d}  {record}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--follow"]
    main(*args[:3], follow="--follow" in sys.argv, key=args[3] if len(args) > 3 else "id")
