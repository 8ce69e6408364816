"""``tidefeed demo``: the most complete real path, end to end, with a readable report.

Today: a bank's Debezium events become a consolidated feed (one time per database
transaction, progress after each), the feed is checked, converted to CDCv2 Avro and read
back with plain fastavro, and its accumulated collection is compared with the bank's final
table.
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path
from typing import Any

import fastavro
import orjson

from protocol import (
    FeedChecker,
    Progress,
    Update,
    Updates,
    announcement,
    cdcv2_schema,
    consolidate,
    get_codec,
    record_key,
)

from .demo_data import ACCOUNTS_SCHEMA, generate_bank

__all__ = ["run_demo"]


def _model_updates(events: list[bytes]) -> dict[int, list[Update]]:
    """A plain model: each database transaction's before/after images, at logical times."""
    by_tx: dict[int, list[Update]] = {}
    order: dict[int, int] = {}
    for line in events:
        e = orjson.loads(line)
        p = e.get("payload", e)
        tx = p["source"]["txId"]
        t = order.setdefault(tx, len(order) + 1)
        if p["before"] is not None:
            by_tx.setdefault(t, []).append(Update(p["before"], t, -1))
        if p["after"] is not None:
            by_tx.setdefault(t, []).append(Update(p["after"], t, +1))
    return by_tx


def _table(rows: list[dict[str, Any]], title: str) -> str:
    cols = ["time", "diff", "id", "owner", "balance", "active", "note"]
    lines = [title, "  " + " ".join(f"{c:>8}" for c in cols)]
    for r in rows:
        d = r["data"]
        vals = [
            r["time"],
            f"{r['diff']:+d}",
            d["id"],
            d["owner"],
            d["balance"],
            d["active"],
            repr(d["note"]),
        ]
        lines.append("  " + " ".join(f"{str(v)[:8]:>8}" for v in vals))
    return "\n".join(lines)


def run_demo(*, workdir: str | None = None, transactions: int = 40, out: Any = None) -> int:
    say = (lambda s: print(s, file=out)) if out is not None else print
    work = Path(workdir or tempfile.mkdtemp(prefix="tidefeed-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    bank = generate_bank(transactions=transactions)
    (work / "bank.debezium.json").write_bytes(bank.lines())
    say(
        f"generated {len(bank.events)} Debezium events in {bank.transactions} transactions "
        f"-> {work / 'bank.debezium.json'}"
    )

    messages: list[Any] = [announcement(0)]
    frontier = 0  # a new feed's since: the first progress starts there
    for t, ups in sorted(_model_updates(bank.events).items()):
        batch = consolidate(ups)
        if len(batch):
            messages.append(batch)
        counts = ((t, len(batch)),) if len(batch) else ()
        p = Progress(lower=frontier, upper=t + 1, counts=counts)
        messages.append(p)
        frontier = p.upper
        if t <= 4:
            say(
                _table(batch.rows(), f"time {t}: {len(batch)} consolidated update(s)")
                if len(batch)
                else f"time {t}: no net change"
            )
            say(f"  progress lower=[{p.lower}] upper=[{p.upper}] counts={list(p.counts)}")
    say("  …")
    ndjson = get_codec("ndjson").encode(messages)
    (work / "bank.feed.ndjson").write_bytes(ndjson)

    checker = FeedChecker(non_negative=True, key=["id"])
    for m in get_codec("ndjson").decode(ndjson):
        checker.check(m)
    problems = checker.finish()
    if problems:
        for v in problems:
            say(f"violation: {v}")
        return 1
    say(
        f"checked {checker.messages} messages ({checker.updates} updates): valid, "
        f"frontier {checker.frontier}"
    )

    avro = get_codec("avro").encode(get_codec("ndjson").decode(ndjson), schema=ACCOUNTS_SCHEMA)
    (work / "bank.feed.avro").write_bytes(avro)
    reader = fastavro.reader(io.BytesIO(avro), reader_schema=cdcv2_schema(ACCOUNTS_SCHEMA))
    datums = list(reader)
    say(f"converted to CDCv2 Avro ({len(avro)} bytes); plain fastavro reads {len(datums)} messages")

    acc: dict[bytes, list[Any]] = {}
    for d in datums:
        if isinstance(d, list):
            for u in Updates.from_rows(d).rows():
                slot = acc.setdefault(record_key(u["data"]), [u["data"], 0])
                slot[1] += u["diff"]
    collection = {k: v for k, v in acc.items() if v[1]}
    truth = {record_key(r): [r, 1] for r in bank.final.values()}
    if collection == truth:
        say(f"OK: the feed accumulates to the bank's final table ({len(truth)} accounts)")
        return 0
    say(f"MISMATCH: feed has {len(collection)} rows, the table has {len(truth)}")
    return 1
