"""The ``packs`` layout (feed/txn/packs.py): a transaction's times in a few files, each time
in its own row groups, read back through the manifest exactly as a folder per time."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from feed.emit.emitter import Emitter
from feed.log.compaction import compact
from feed.log.manifest import PACKS, ManifestStore, Segment
from feed.log.reader import FeedReader
from feed.log.store import FeedLog
from feed.txn import packs
from protocol import CheckpointError, SourceError, check_messages

from ..e2e.helpers import write_parts, write_parts_at_transactions
from .model import collection_of
from .test_compaction import rows_of
from .test_manifest import FINAL, FIRST, FIRST_TRUTH, REST, config, run


def _updates(reader: FeedReader) -> dict[int, list]:
    """Each time's updates, in a stable order (the order within a time is free)."""
    return {t: sorted(map(repr, reader.updates(t).rows())) for t in reader.times()}


# ---- the writer and the manifest alone (no Spark) --------------------------------------
def test_a_pack_keeps_each_time_in_its_own_row_groups(tmp_path, monkeypatch):
    monkeypatch.setattr(packs, "ROW_GROUP", 2)  # a time of 5 rows takes 3 groups
    fl = FeedLog(str(tmp_path), "f")
    schema = pa.schema([("time", pa.int64()), ("id", pa.int64()), ("diff", pa.int64())])
    w = packs.PackWriter(fl.fs, fl.path(packs.pack_name(1, 1)), schema)
    rows = {7: [1, 2, 3], 9: [4], 12: [5, 6, 7, 8, 9]}
    for t, ids in rows.items():  # time 7 comes in two batches, as a task's batches may cut it
        for part in (ids[:1], ids[1:]):
            w.write(t, pa.table({"time": [t] * len(part), "id": part, "diff": [1] * len(part)}))
    written = w.close()
    assert [(t, n) for t, n, _, _ in written] == [(7, 3), (9, 1), (12, 5)]
    with pytest.raises(ValueError, match="time 3 after 12"):
        w.write(3, pa.table({"time": [3], "id": [0], "diff": [1]}))
    rel = w.path[len(fl.root) + 1 :]
    segs = packs.pack_segments([(t, rel, n, g, k) for t, n, g, k in written], epoch=1)
    f = pq.ParquetFile(w.path)
    for s in segs:
        (groups,) = s.groups
        assert f.read_row_groups(list(groups))["id"].to_pylist() == rows[s.time]
    # the manifest of a segment with row groups is format 2, and keeps them
    store = ManifestStore(fl)
    m = store.write(seq=1, epoch=1, base=None, added=segs)
    assert orjson.loads((tmp_path / "f" / m.name).read_bytes())["format"] == 2
    assert ManifestStore(fl).segments(ManifestStore(fl).read(m.name)) == segs
    assert store.packs(m) == {rel}
    # a feed without packs keeps format 1 and parts without the groups column
    plain = store.write(seq=2, epoch=1, base=None, added=[Segment(1, 1, 1, ("times/1/x",))])
    assert orjson.loads((tmp_path / "f" / plain.name).read_bytes())["format"] == 1
    assert "groups" not in pq.read_schema(tmp_path / "f" / plain.parts[0].file).names
    assert ManifestStore(fl).segments(plain)[0].groups == ()


def test_a_group_commit_keeps_the_row_groups_of_its_segments():
    from feed.emit.group_commits import commit_entry, from_entry
    from feed.emit.plans import Planned
    from protocol import Progress

    segs = [
        Segment(4, 2, 3, ("packs/a.parquet", "packs/b.parquet"), ((0,), (2, 3))),
        Segment(5, 2, 1, ("times/5/part-e2-00000.parquet",)),
    ]
    plan = Planned(progress=Progress(4, 6, ((4, 3), (5, 1))), next=6, source={}, state=None)
    entry = orjson.loads(orjson.dumps(commit_entry(plan, segs)))  # as the file keeps it
    assert from_entry(entry)[1] == segs


# ---- with the emitter ------------------------------------------------------------------
def _emit(spark, base: Path, **kw) -> Emitter:
    return run(spark, config(base, **kw))


@pytest.fixture(scope="module")
def fed(spark, tmp_path_factory):
    """BANK's first part in three files, emitted into a feed of packs (small
    transactions: computed and written on the driver) and into a feed of folders."""
    base = tmp_path_factory.mktemp("packs")
    write_parts_at_transactions(base / "in", FIRST, 3)
    _emit(spark, base, layout="packs")
    folders = tmp_path_factory.mktemp("folders")
    shutil.copytree(base / "in", folders / "in")
    _emit(spark, folders)
    return base, folders


@pytest.fixture
def copy(fed, tmp_path):
    shutil.copytree(fed[0], tmp_path, dirs_exist_ok=True)
    return tmp_path


def _files(log: Path) -> list[str]:
    return sorted(str(p.relative_to(log)) for p in log.rglob("*") if p.is_file())


def test_a_feed_of_packs_holds_the_same_updates_in_few_files(fed):
    packed, folders = fed
    reader = FeedReader(str(packed / "log"), "bank")
    plain = FeedReader(str(folders / "log"), "bank")
    assert reader.info.layout == "packs" and plain.info.layout == "times"
    assert reader.counts() == plain.counts() and len(reader.times()) > 6
    assert _updates(reader) == _updates(plain)
    assert check_messages(reader.messages(), key=["id"]) == []
    assert collection_of(reader) == FIRST_TRUTH
    files = _files(packed / "log" / "bank")
    assert not [f for f in files if f.startswith("times/")]
    in_packs = [f for f in files if f.startswith(f"{PACKS}/")]
    # a pack per writing task and transaction, every one named by the manifest
    assert 3 <= len(in_packs) <= 3 * 2
    assert {f.split("/", 1)[1] for f in in_packs} == {p.split("/", 1)[1] for p in reader.packs()}
    # read in batches from any update on, as a stream that let its files go does
    t = max(reader.times(), key=lambda t: reader.counts()[t])
    rows = reader.updates(t).rows()
    for k in range(len(rows) + 1):
        rest = list(FeedReader(str(packed / "log"), "bank").batches(t, rows=2, skip=k))
        assert [r for b in rest for r in b.rows()] == rows[k:]


def test_every_transaction_in_spark_writes_the_same_feed(spark, fed, tmp_path):
    packed, _ = fed
    shutil.copytree(packed / "in", tmp_path / "in")
    _emit(spark, tmp_path, layout="packs", driver_txn_bytes=0)
    reader = FeedReader(str(tmp_path / "log"), "bank")
    assert _updates(reader) == _updates(FeedReader(str(packed / "log"), "bank"))
    files = _files(tmp_path / "log" / "bank")
    assert not [f for f in files if f.startswith("times/")]
    assert {f for f in files if f.startswith(f"{PACKS}/")} == reader.packs()


@pytest.mark.parametrize("store", [None, "file:///"], ids=["spark reads", "pyarrow reads"])
def test_an_eager_push_of_packs_sends_each_update_at_its_time(spark, fed, store):
    """``--eager`` pushes a transaction's files from Spark's tasks: a pack's rows carry
    their time in its ``time`` column, not in a folder name. A log in a store is read
    by the tasks through pyarrow (here the local disk through its URI)."""
    import http.server
    import threading

    from feed.demo.data import ACCOUNTS_SCHEMA
    from feed.emit.eager import EagerPusher
    from protocol import Updates, get_codec

    got: list[Updates] = []

    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            got.extend(get_codec("ndjson").decode(body, schema=ACCOUNTS_SCHEMA))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reader = FeedReader(str(fed[0] / "log"), "bank")
        paths = [reader.log.path(p) for p in sorted(reader.packs())]
        url = f"http://127.0.0.1:{server.server_address[1]}/push"
        report = EagerPusher(url, "ndjson", ACCOUNTS_SCHEMA).push(spark, paths, 1, store)
    finally:
        server.shutdown()
        server.server_close()
    assert (report.pushed, report.failed) == (sum(reader.counts().values()), 0)
    pushed = sorted(repr(r) for u in got for r in u.rows())
    assert pushed == sorted(repr(r) for t in reader.times() for r in reader.updates(t).rows())


def test_a_layout_is_the_feeds_own(spark, copy):
    with pytest.raises(SourceError, match="created with --layout packs; this run gives times"):
        Emitter(config(copy, layout="times"), spark=spark).open()
    e = Emitter(config(copy), spark=spark)  # left out: the feed's
    e.open()
    assert e.config.layout == "packs"
    e.close()


def test_uncommitted_packs_go_at_the_next_start_and_the_feed_goes_on(spark, copy):
    bank = copy / "log" / "bank"
    named = set(FeedReader(str(copy / "log"), "bank").packs())
    stray = bank / PACKS / "00000000000000000099-e9-0123456789ab.parquet"
    shutil.copy(bank / sorted(named)[0], stray)  # a transaction that never committed
    write_parts(copy / "in", REST, 2, start=3)
    _emit(spark, copy)
    assert not stray.exists()
    reader = FeedReader(str(copy / "log"), "bank")
    assert {f"{PACKS}/{n}" for n in os.listdir(bank / PACKS)} == reader.packs()
    assert check_messages(reader.messages(), key=["id"]) == []
    assert collection_of(reader) == FINAL


def test_compaction_folds_whole_packs_away_and_keeps_the_collection(copy):
    log = str(copy / "log")
    before = FeedReader(log, "bank")
    times = before.times()
    cut = times[len(times) // 2]
    later = rows_of(before.messages(after=cut))
    folded = before.packs(hi=cut) - before.packs(lo=cut)
    assert folded  # the first transaction's packs hold only times below the cut
    compact(log, "bank", cut)
    after = FeedReader(log, "bank")
    assert after.since == cut and collection_of(after) == FIRST_TRUTH
    assert rows_of(after.messages(after=cut)) == later
    left = {f"{PACKS}/{n}" for n in os.listdir(copy / "log" / "bank" / PACKS)}
    assert left == after.packs() and not left & folded


def test_a_pack_without_the_named_row_groups_is_an_error_naming_it(copy):
    reader = FeedReader(str(copy / "log"), "bank")
    t = reader.times()[-1]
    (seg,) = reader._segments(t, t + 1)
    path = copy / "log" / "bank" / seg.files[0]
    table = pq.read_table(path)
    pq.write_table(table.slice(0, 0), path)  # no row group left
    with pytest.raises(CheckpointError, match=rf"time {t}'s row groups .* not all there"):
        FeedReader(str(copy / "log"), "bank").table(t)


def test_a_pack_cut_short_is_an_error_naming_it_not_a_crash(copy):
    reader = FeedReader(str(copy / "log"), "bank")
    t = reader.times()[-1]
    (seg,) = reader._segments(t, t + 1)
    path = copy / "log" / "bank" / seg.files[0]
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=rf"time {t}: its file {seg.files[0]} is not"):
        FeedReader(str(copy / "log"), "bank").table(t)


def test_a_reader_of_format_1_only_refuses_a_manifest_of_packs(copy, monkeypatch):
    from feed.log import manifest

    monkeypatch.setattr(manifest, "PACKS_FORMAT", 1)  # what an older tidefeed knows
    with pytest.raises(CheckpointError, match="unknown manifest format 2"):
        FeedReader(str(copy / "log"), "bank")
