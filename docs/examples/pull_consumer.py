"""A downstream consumer in ~40 lines: pull a tidefeed feed over HTTP and keep it durable.

Needs only the `protocol` package (pip install tidefeed, no Spark). It streams the feed from
where it left off (its durable frontier), applies every message through the same DESIGN §3
state machine as the reference receiver, keeps the result in SQLite, and prints the table.

    python docs/examples/pull_consumer.py http://127.0.0.1:8080 accounts consumer.db [--follow]
"""

import sys
import urllib.request

from protocol import Consumer, get_codec
from protocol.sqlite_store import SqliteDatabase


def main(base: str, feed: str, db_path: str, follow: bool) -> None:
    store = SqliteDatabase(db_path).store(feed)
    consumer = Consumer(store, feed=feed)
    after = consumer.frontier or 0  # resume exactly where the last run stopped
    url = f"{base}/v1/feeds/{feed}/changes?after={after}&format=ndjson&follow={str(follow).lower()}"
    decoder = get_codec("ndjson")
    with urllib.request.urlopen(url) as stream:
        for line in stream:  # one message per line: apply it as it arrives
            result = consumer.apply(decoder.decode(line))
            if result.committed:
                print(f"committed {len(result.committed)} updates, frontier {result.frontier}")
    rows = sorted(store.collection(), key=lambda rc: str(rc[0]))
    print(f"{feed} at frontier {consumer.frontier}: {len(rows)} rows")
    for record, count in rows[:10]:
        print(f"  {count:+d}  {record}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], "--follow" in sys.argv[4:])
