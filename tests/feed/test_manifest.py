"""The manifest-based feed log: what readers trust, how damage shows, how old feeds move on."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from feed.demo.data import ACCOUNTS_SCHEMA, generate_bank
from feed.emit.emitter import Emitter, EmitterConfig
from feed.log.checkpoint import CheckpointStore
from feed.log.compaction import compact
from feed.log.manifest import ManifestStore, Segment
from feed.log.reader import FeedReader
from feed.log.store import FeedLog
from protocol import CheckpointError, check_messages

from ..e2e.helpers import write_parts, write_parts_at_transactions
from .model import as_multiset, collection_of, debezium_truth
from .test_compaction import rows_of

BANK = generate_bank(transactions=30, seed=21)


def _txn_boundary(lines: list[bytes], at: int) -> int:
    def tx(line: bytes) -> object:
        e = orjson.loads(line)
        return e.get("payload", e)["source"]["txId"]

    while tx(lines[at]) == tx(lines[at - 1]):
        at += 1
    return at


CUT = _txn_boundary(BANK.events, len(BANK.events) * 2 // 3)
FIRST, REST = BANK.events[:CUT], BANK.events[CUT:]
FIRST_TRUTH = as_multiset(debezium_truth(FIRST)[0].values())
FINAL = as_multiset(BANK.final.values())


# ---- the manifest store alone (no Spark) ----------------------------------------------
def test_parts_merge_like_a_binary_counter_and_every_time_stays_listed(tmp_path):
    store = ManifestStore(FeedLog(str(tmp_path), "f"))
    m = None
    for t in range(1, 101):
        seg = Segment(t, 1, t % 7 + 1, (f"times/{t}/part-e1-00000.parquet",))
        m = store.write(seq=t, epoch=1, base=m, added=[seg])
        # the parts are powers of two, largest first: at most log2(t) + 1 of them
        sizes = [p.times for p in m.parts]
        assert sizes == sorted(sizes, reverse=True) and len(sizes) <= t.bit_length()
        assert sum(sizes) == t
    assert m is not None
    fresh = ManifestStore(FeedLog(str(tmp_path), "f"))  # from the files, no cache
    segs = fresh.segments(fresh.read(m.name))
    assert [s.time for s in segs] == list(range(1, 101))
    assert [s.count for s in segs] == [t % 7 + 1 for t in range(1, 101)]
    assert [s.time for s in fresh.segments(fresh.read(m.name), 40, 45)] == [40, 41, 42, 43, 44]
    # compaction drops the folded times and keeps the rest
    c = store.write(seq=101, epoch=1, base=m, since=50, compacted=(("compacted/50/p",), 9))
    assert [s.time for s in fresh.segments(fresh.read(c.name))] == list(range(50, 101))
    assert (c.since, c.compacted, c.records) == (50, ("compacted/50/p",), 9)
    # a time at or below the last listed one is refused: the log never rewrites a time
    with pytest.raises(CheckpointError, match="already in the log"):
        store.write(seq=102, epoch=1, base=c, added=[Segment(100, 1, 1, ("x",))])


def test_prune_keeps_what_kept_manifests_name_and_deletes_the_rest(tmp_path):
    flog = FeedLog(str(tmp_path), "f")
    store = ManifestStore(flog)
    names, m = [], None
    for t in range(1, 9):
        m = store.write(seq=t, epoch=1, base=m, added=[Segment(t, 1, 1, ("x",))])
        names.append(m.name)
    store.prune(names[-2:], written=store.written)
    left = sorted(os.listdir(tmp_path / "f" / "_manifests"))
    assert [n for n in left if n.endswith(".json")] == sorted(n.split("/")[-1] for n in names[-2:])
    fresh = ManifestStore(flog)
    for n in names[-2:]:  # both kept manifests are still whole
        assert len(fresh.segments(fresh.read(n))) == int(n.split("/")[-1][:20])
    # a missing part is an error that names it, never an empty feed
    part = fresh.read(names[-1]).parts[0].file
    os.unlink(tmp_path / "f" / part)
    with pytest.raises(CheckpointError, match=f"manifest part {part}.*missing"):
        ManifestStore(flog).segments(fresh.read(names[-1]))


# ---- with the emitter ------------------------------------------------------------------
def config(tmp_path, **kw) -> EmitterConfig:
    return EmitterConfig(
        source_kind="debezium",
        source_path=str(tmp_path / "in"),
        feed="bank",
        log=str(tmp_path / "log"),
        key=("id",),
        schema=ACCOUNTS_SCHEMA,
        clock="logical",
        granularity="transaction",
        max_files_per_txn=1,
        **kw,
    )


def run(spark, cfg) -> Emitter:
    e = Emitter(cfg, spark=spark)
    e.open()
    e.run()
    e.close()
    return e


@pytest.fixture(scope="module")
def fed(spark, tmp_path_factory):
    """A feed of BANK in three files (three transactions of the emitter)."""
    base = tmp_path_factory.mktemp("manifest")
    write_parts_at_transactions(base / "in", FIRST, 3)
    run(spark, config(base))
    return base


@pytest.fixture
def copy(fed, tmp_path):
    shutil.copytree(fed, tmp_path, dirs_exist_ok=True)
    return tmp_path


def test_a_missing_segment_is_an_error_naming_the_time_and_file(copy):
    reader = FeedReader(str(copy / "log"), "bank")
    t = reader.times()[3]
    segs = reader._manifests.segments(reader.manifest, t, t + 1)
    os.unlink(copy / "log" / "bank" / segs[0].files[0])
    with pytest.raises(CheckpointError, match=rf"time {t} is committed but its file .* missing"):
        list(FeedReader(str(copy / "log"), "bank").messages())
    # the counts still come from the manifest, not from what happens to be on disk
    assert FeedReader(str(copy / "log"), "bank").counts()[t] == segs[0].count


def test_a_segment_with_other_rows_than_counted_is_refused_before_any_batch(copy):
    reader = FeedReader(str(copy / "log"), "bank")
    t = max(reader.times(), key=lambda t: reader.counts()[t])
    whole = reader.table(t)
    # streamed in small batches, a time is the same updates as read at once
    streamed = list(reader.batches(t, rows=2))
    assert max(len(b) for b in streamed) <= 2
    assert sum(len(b) for b in streamed) == whole.num_rows == reader.counts()[t]
    assert [r for b in streamed for r in b.rows()] == reader.updates(t).rows()
    # one row less in the segment than the manifest counts: an error, and no batch at all
    seg = copy / "log" / "bank" / reader._manifests.segments(reader.manifest, t, t + 1)[0].files[0]
    pq.write_table(pq.read_table(seg).slice(1), seg)
    reread = FeedReader(str(copy / "log"), "bank")
    batches = reread.batches(t)
    with pytest.raises(CheckpointError, match=rf"time {t} holds \d+ update\(s\) in .*counts"):
        next(batches)
    with pytest.raises(CheckpointError, match=rf"time {t} holds"):
        reread.table(t)


def test_a_time_read_from_any_update_on_is_the_rest_of_it(copy):
    """``batches(skip=k)`` gives the updates after the first k, whole row groups skipped
    unread and the rest of one dropped: what a stream that let its files go reads."""
    reader = FeedReader(str(copy / "log"), "bank")
    t = max(reader.times(), key=lambda t: reader.counts()[t])
    seg = copy / "log" / "bank" / reader._manifests.segments(reader.manifest, t, t + 1)[0].files[0]
    pq.write_table(pq.read_table(seg), seg, row_group_size=1)  # the same rows, small groups
    assert pq.ParquetFile(seg).metadata.num_row_groups > 2
    rows = reader.updates(t).rows()
    for k in range(len(rows) + 1):
        rest = list(FeedReader(str(copy / "log"), "bank").batches(t, rows=2, skip=k))
        assert [r for b in rest for r in b.rows()] == rows[k:]
        assert all(0 < len(b) <= 2 for b in rest)


@pytest.mark.parametrize("damage", [b"", b'{"format": 1, "feed": "ba'])
def test_an_empty_or_cut_newest_commit_file_is_not_a_commit(spark, copy, damage):
    store = CheckpointStore(FeedLog(str(copy / "log"), "bank"))
    good = store.latest()
    assert good is not None
    broken = copy / "log" / "bank" / "_commits" / f"{good.seq + 1:020d}.json"
    broken.write_bytes(damage)
    # readers take the last whole commit; the emitter starts and goes on after it
    assert FeedReader(str(copy / "log"), "bank").frontier == good.frontier
    write_parts(copy / "in", REST, 1, start=3)
    e = run(spark, config(copy))
    assert e.cp.seq > good.seq + 1 and e.cp.frontier > good.frontier
    assert (broken.parent / f"{broken.name}.broken").exists()
    reader = FeedReader(str(copy / "log"), "bank")
    assert check_messages(reader.messages(), key=["id"]) == []
    assert collection_of(reader) == FINAL


def test_a_feed_without_manifests_is_read_and_then_migrated(spark, copy):
    flog = FeedLog(str(copy / "log"), "bank")
    before = collection_of(FeedReader(str(copy / "log"), "bank"))
    assert before == FIRST_TRUTH
    expected = rows_of(FeedReader(str(copy / "log"), "bank").messages())
    # make it look like an older tidefeed wrote it: no manifests, the epoch ranges instead
    commits = flog.path("_commits")
    for name in os.listdir(commits):
        path = Path(commits, name)
        d = orjson.loads(path.read_bytes())
        d.pop("manifest", None)
        d["writers"] = [[0, 1]]
        path.write_bytes(orjson.dumps(d))
    shutil.rmtree(flog.path("_manifests"))
    reader = FeedReader(str(copy / "log"), "bank")
    assert reader.manifest.name == "" and rows_of(reader.messages()) == expected
    e = run(spark, config(copy))  # nothing new to read: the start-up migrates
    assert e.cp.manifest and os.path.exists(flog.path(e.cp.manifest))
    reader = FeedReader(str(copy / "log"), "bank")
    assert reader.manifest.name == e.cp.manifest
    assert rows_of(reader.messages()) == expected and collection_of(reader) == before


def test_a_compaction_between_two_transactions_does_not_stop_the_emitter(spark, copy):
    e = Emitter(config(copy), spark=spark)
    e.open()
    reader = FeedReader(str(copy / "log"), "bank")
    cut = reader.times()[-3]
    res = compact(str(copy / "log"), "bank", cut)  # takes the next commit seq
    assert res.since == cut
    write_parts(copy / "in", REST, 2, start=3)
    e.run()  # its next commit finds the seq taken by the compaction, and commits on top
    e.close()
    reader = FeedReader(str(copy / "log"), "bank")
    assert reader.since == cut and reader.checkpoint.epoch == e.cp.epoch
    assert reader.frontier == e.cp.frontier and len(reader.times()) > 3
    assert check_messages(reader.messages(), key=["id"]) == []
    assert collection_of(reader) == FINAL
