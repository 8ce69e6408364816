"""``tidefeed demo``: the main job end to end on the embedded default, with a readable report.

A small bank's Debezium change events (inserts, updates, deletes, reopened accounts,
multi-row transactions, no-op updates, changes undone inside a transaction) land in three
files. The reference receiver starts on 127.0.0.1 (SQLite). The Spark emitter (local Spark,
local feed log) turns the events into a keyed feed with one time per database transaction,
committing once per file and pushing every commit to the receiver, which ACKs it; after
each commit the demo shows the consolidated deltas and progress statements of the new
times. At the end it checks the feed, converts it to Materialize's CDCv2 Avro (read back
with plain fastavro) and compares the receiver's collection with the bank's final table.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fastavro

from feed.demo.data import ACCOUNTS_SCHEMA, generate_bank
from feed.log.checkpoint import Checkpoint
from feed.log.inspection import format_table
from feed.serve.publisher import deliver_log
from protocol import Updates, cdcv2_schema, check_messages, get_codec, record_key

__all__ = ["run_demo"]

SHOWN_TIMES = 4  # how many times to print in full per commit


def run_demo(*, workdir: str | None = None, transactions: int = 60, out: Any = None) -> int:
    """Run the demo; 0 when the feed equals the bank's final table."""
    with narrated():
        return _demo(workdir, transactions, out)


@contextlib.contextmanager
def narrated() -> Iterator[None]:
    """The emitter's and the receiver's log lines held back while a demo says what they
    would, and their levels as they were after it (a demo run inside another program
    leaves that program's logging as it found it)."""
    loggers = [logging.getLogger(n) for n in ("tidefeed.emit", "tidefeed.receive")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _demo(workdir: str | None, transactions: int, out: Any) -> int:
    from feed.emit.emitter import Emitter, EmitterConfig

    def say(s: str = "") -> None:
        print(s, file=out, flush=True)

    started = time.monotonic()
    work = new_run_dir(workdir, "tidefeed-demo-")
    src = work / "bank-events"
    src.mkdir(parents=True, exist_ok=True)
    bank = generate_bank(transactions=transactions)
    third = -(-len(bank.events) // 3)
    for i in range(3):
        chunk = bank.events[i * third : (i + 1) * third]
        (src / f"part-{i:04d}.json").write_bytes(b"".join(e + b"\n" for e in chunk))
    say(
        f"1. generated {len(bank.events)} Debezium events ({bank.transactions} database "
        f"transactions on an accounts table) in 3 files under {src}"
    )
    log = work / "log"
    say(
        f"2. tidefeed emit --source debezium:{src} --feed accounts --log {log} --key id "
        "--granularity transaction --clock logical --driver-txn-bytes 0   (local Spark; "
        "starting…)"
    )

    show = _commit_printer(log, say)

    config = EmitterConfig(
        source_kind="debezium",
        source_path=str(src),
        feed="accounts",
        log=str(log),
        key=("id",),
        schema=ACCOUNTS_SCHEMA,
        clock="logical",
        granularity="transaction",
        max_files_per_txn=1,
        # the demo shows the Spark job: input this small would otherwise be computed on
        # the driver without starting Spark (docs/emitter.md, "Small Debezium transactions")
        driver_txn_bytes=0,
    )
    receiver = _Receiver(str(work / "receiver.db"))
    push_url = f"{receiver.url}/v1/push/accounts"
    say(f"   reference receiver: {push_url} (SQLite {work / 'receiver.db'})")

    def show_and_push(cp: Checkpoint) -> None:
        show(cp)
        acked = deliver_log(str(log), "accounts", push_url, epoch=cp.epoch, give_up_after=60)
        say(f"   pushed to the receiver: ACK frontier {acked}")

    emitter = Emitter(config, on_commit=show_and_push)
    try:
        emitter.open()
        emitter.run()
        emitter.close()
        received = receiver.collection()
    finally:
        receiver.stop()

    return _verify(work, log, bank, received, say, started)


def _commit_printer(log: Path, say: Callable[..., None]) -> Callable[[Checkpoint], None]:
    """What the demo prints at each commit: its progress, and the first times' updates."""
    from feed.log.reader import FeedReader

    reader_box: list[Any] = []

    def show(cp: Checkpoint) -> None:
        if not reader_box:
            reader_box.append(FeedReader(str(log), "accounts"))
        reader = reader_box[0]
        reader.refresh()
        times = [t for t, _ in cp.progress.counts]
        span = cp.progress.upper - cp.progress.lower
        say(
            f"\n-- commit {cp.seq} (epoch {cp.epoch}): progress lower=[{cp.progress.lower}] "
            f"upper=[{cp.progress.upper}], {sum(n for _, n in cp.progress.counts)} updates "
            f"at {len(times)} of {span} times"
        )
        for t in times[:SHOWN_TIMES]:
            table = reader.table(t)
            cols = ["diff", *[c for c in table.column_names if c != "diff"]]
            say(f"   time {t}: {table.num_rows} consolidated update(s)")
            say("     " + format_table(table.select(cols)).replace("\n", "\n     "))
        if len(times) > SHOWN_TIMES:
            say(f"   … {len(times) - SHOWN_TIMES} more times with updates")

    return show


def _verify(
    work: Path,
    log: Path,
    bank: Any,
    received: Counter[bytes],
    say: Callable[..., None],
    started: float,
) -> int:
    """Steps 3 to 5: the feed checked, written as CDCv2 Avro and read back, and the
    receiver's and the log's collections compared with the bank's table."""
    from feed.log.reader import FeedReader

    reader = FeedReader(str(log), "accounts")
    messages = list(reader.messages())
    problems = check_messages(messages, non_negative=True, key=["id"])
    n_updates = sum(len(m) for m in messages if isinstance(m, Updates))
    say(
        f"\n3. tidefeed check: {len(messages)} messages, {n_updates} updates, frontier "
        f"{reader.frontier}: {'valid' if not problems else 'INVALID'}"
    )
    for v in problems:
        say(f"   {v}")
    avro = get_codec("avro").encode(messages, schema=ACCOUNTS_SCHEMA)
    (work / "accounts.cdcv2.avro").write_bytes(avro)
    datums = list(fastavro.reader(io.BytesIO(avro), reader_schema=cdcv2_schema(ACCOUNTS_SCHEMA)))
    say(
        f"4. CDCv2 Avro: {len(avro)} bytes, read back by plain fastavro as {len(datums)} "
        f"messages -> {work / 'accounts.cdcv2.avro'}"
    )
    got: Counter[bytes] = Counter()
    for row in reader.snapshot().to_pylist():
        n = row.pop("count")
        got[record_key(row)] += n
    truth = Counter(record_key(r) for r in bank.final.values())
    elapsed = time.monotonic() - started
    say(
        f"5. the receiver holds {sum(received.values())} rows at frontier {reader.frontier}; "
        f"the feed log accumulates to {sum(got.values())}; the bank has {len(truth)} accounts"
    )
    if got == truth and received == truth and not problems:
        say(
            f"OK: the receiver's collection equals the bank's final table ({len(truth)} "
            f"accounts) [{elapsed:.0f}s]"
        )
        return 0
    say("MISMATCH: the receiver's collection differs from the bank's final table")
    return 1


def new_run_dir(workdir: str | None, prefix: str) -> Path:
    """This run's own folder: ``<workdir>/run-<n>`` (earlier runs are kept; ``latest``
    links to the newest), or a fresh temporary folder without ``workdir``."""
    if workdir is None:
        return Path(tempfile.mkdtemp(prefix=prefix))
    base = Path(workdir)
    base.mkdir(parents=True, exist_ok=True)
    taken = [int(p.name[4:]) for p in base.glob("run-*") if p.name[4:].isdigit()]
    n = max(taken, default=0) + 1
    while True:
        work = base / f"run-{n:03d}"
        try:
            work.mkdir()  # two demos at once each get their own
            break
        except FileExistsError:
            n += 1
    link = base / f".latest-{n}"
    link.unlink(missing_ok=True)
    link.symlink_to(work.name)
    os.replace(link, base / "latest")
    return work


class _Receiver:
    """``tidefeed receive`` in a background thread of this process, on 127.0.0.1."""

    def __init__(self, db: str) -> None:
        import asyncio
        import threading

        from aiohttp import web

        from protocol.receiver import ReceiverConfig, make_receiver_app

        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(make_receiver_app(ReceiverConfig(db=db)))
        ready = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            self._loop.run_until_complete(site.start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="demo-receiver", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the demo's receiver did not start")
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    def collection(self) -> Counter[bytes]:
        import urllib.request

        import orjson

        with urllib.request.urlopen(f"{self.url}/v1/collections/accounts") as r:
            rows = [orjson.loads(x) for x in r.read().splitlines()]
        return Counter({record_key(x["data"]): x["count"] for x in rows})

    def stop(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
