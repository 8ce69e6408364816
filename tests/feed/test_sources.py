"""cdf, upsert and snapshot sources against the same truth as the Debezium one."""

from __future__ import annotations

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from feed.demo.data import ACCOUNTS_SCHEMA, generate_bank
from feed.log.reader import FeedReader
from protocol import check_messages

from .model import as_multiset, collection_of, debezium_truth, run_emitter

BANK = generate_bank(transactions=30, seed=31)


def run(spark, tmp_path, kind, src, **kw):
    e, reports = run_emitter(
        spark,
        source_kind=kind,
        source_path=str(src),
        feed="t",
        log=str(tmp_path / "log"),
        clock="logical",
        **kw,
    )
    e.close()
    cfg = e.config
    reader = FeedReader(str(tmp_path / "log"), "t")
    key = list(cfg.key) or None
    assert check_messages(reader.messages(), non_negative=bool(key), key=key) == []
    return reader, reports


def events():
    for line in BANK.events:
        e = orjson.loads(line)
        yield e.get("payload", e)


def cdf_rows():
    versions = {}
    for p in events():
        v = versions.setdefault(p["source"]["txId"], len(versions) + 1)
        if p["op"] == "c":
            yield dict(p["after"], _change_type="insert", _commit_version=v)
        elif p["op"] == "d":
            yield dict(p["before"], _change_type="delete", _commit_version=v)
        else:
            yield dict(p["before"], _change_type="update_preimage", _commit_version=v)
            yield dict(p["after"], _change_type="update_postimage", _commit_version=v)


@pytest.mark.parametrize(
    ("key", "numbered"),
    [(("id",), "inline"), ((), "inline"), (("id",), "joined"), (("id",), "ranked")],
    ids=["keyed", "unkeyed", "joined", "ranked"],
)
def test_cdf_per_version_equals_the_table_after_each_transaction(
    spark, tmp_path, key, numbered, monkeypatch
):
    if numbered == "joined":  # numbered by a join with their list, not inline
        monkeypatch.setattr("feed.txn.times.INLINE_TXNS", 0)
    if numbered == "ranked":  # the numbering of batches with too many transactions to list
        monkeypatch.setattr("feed.txn.times.LISTED_TXNS", 3)
    src = tmp_path / "in"
    src.mkdir()
    rows = list(cdf_rows())
    half = len(rows) // 2
    # files named against version order: the version, not the file, orders the feed
    (src / "b.json").write_bytes(b"\n".join(orjson.dumps(r) for r in rows[:half]))
    (src / "a.json").write_bytes(b"\n".join(orjson.dumps(r) for r in rows[half:]))
    reader, _ = run(
        spark, tmp_path, "cdf", src, key=key, schema=ACCOUNTS_SCHEMA, granularity="transaction"
    )
    _, states = debezium_truth(BANK.events)
    for i, state in enumerate(states):
        assert collection_of(reader, at=1 + i) == as_multiset(state.values()), i


def test_transactions_are_numbered_alike_inline_and_by_a_join(spark):
    """Source transactions take their place in the list as ``unit`` whether the list is a
    literal of the plan or a broadcast join; a name holding the literal's separator, and
    a null one, take the join; a row of no listed transaction is left out either way."""
    from feed.txn import times

    df = spark.createDataFrame(
        [("b", 1), ("a", 2), ("x\x00y", 3), (None, 4), ("gone", 5), ("a", 6)], "txn string, v int"
    )

    def numbered(txns):
        return sorted(tuple(r) for r in times._listed(df, txns).collect())

    want = [("a", 2, 1), ("a", 6, 1), ("b", 1, 0), ("x\x00y", 3, 2)]
    assert times._listed(df, ["b", "a"]).columns == ["txn", "v", "unit"]
    assert numbered(["b", "a", "x\x00y"]) == want  # (the join: the separator)
    assert numbered(["b", "a"]) == want[:3]  # inline
    assert numbered(["b", None, "a"]) == [("a", 2, 2), ("a", 6, 2), ("b", 1, 0)]


@pytest.mark.parametrize("listed_out", [256, 0], ids=["filter", "join"])
def test_held_transactions_are_left_out_and_rows_of_none_stay(spark, monkeypatch, listed_out):
    """The rows of held source transactions are left out, by a filter naming them or by a
    join with their list; rows of no transaction stay either way, a null among the held
    names included (in ``NOT IN`` it would leave out every other row)."""
    from feed.sources import holdback

    monkeypatch.setattr(holdback, "LISTED_OUT", listed_out)
    df = spark.createDataFrame(
        [("a", 1), ("b", 2), (None, 3), ("c", 4), ("a", 5)], "txn string, v int"
    )

    def kept(txns):
        return sorted(r["v"] for r in holdback._without(df, txns).collect())

    assert kept({"a", "c"}) == [2, 3]
    assert kept({"a", None}) == [2, 3, 4]
    assert kept({None}) == [1, 2, 3, 4, 5]
    assert kept(set()) == [1, 2, 3, 4, 5]


def test_upsert_with_order_and_delete_flag(spark, tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    lines = []
    for p in events():
        row = p["before"] if p["op"] == "d" else p["after"]
        lines.append(orjson.dumps(dict(row, lsn=p["source"]["lsn"], gone=p["op"] == "d")))
    lines.append(b'{"id": 5, "owner": "x", "balance": 1}')  # no order value
    # shuffled across two files: the order column decides, not the file order
    (src / "1.json").write_bytes(b"\n".join(lines[1::2]))
    (src / "2.json").write_bytes(b"\n".join(lines[0::2]))
    reader, reports = run(spark, tmp_path, "upsert", src, key=("id",), order="lsn", deleted="gone")
    assert collection_of(reader) == as_multiset(BANK.final.values())
    assert sum(r.bad_rows for r in reports) == 1
    assert set(reader.info.schema and [f["name"] for f in reader.info.schema["fields"]]) == {
        "id",
        "owner",
        "balance",
        "active",
        "note",
    }


@pytest.mark.parametrize("key", [("id",), ()])
@pytest.mark.parametrize("granularity", ["transaction", "batch"])
def test_snapshots_are_diffed(spark, tmp_path, key, granularity):
    _, states = debezium_truth(BANK.events)
    picks = states[3::6]
    src = tmp_path / "in"
    src.mkdir()
    schema = pa.schema(
        [
            ("id", pa.int64()),
            ("owner", pa.string()),
            ("balance", pa.int64()),
            ("active", pa.bool_()),
            ("note", pa.string()),
        ]
    )
    first = picks[: len(picks) // 2]
    for i, st in enumerate(first):
        pq.write_table(
            pa.Table.from_pylist(list(st.values()), schema=schema), src / f"snap-{i:03d}.parquet"
        )
    reader, _ = run(spark, tmp_path, "snapshot", src, key=key, granularity=granularity)
    if granularity == "transaction":
        for i, st in enumerate(first):
            assert collection_of(reader, at=1 + i) == as_multiset(st.values())
    assert collection_of(reader) == as_multiset(first[-1].values())
    # a later run diffs against the last snapshot it kept (the state)
    for i, st in enumerate(picks[len(first) :], start=len(first)):
        pq.write_table(
            pa.Table.from_pylist(list(st.values()), schema=schema), src / f"snap-{i:03d}.parquet"
        )
    reader, _ = run(spark, tmp_path, "snapshot", src, key=key, granularity=granularity)
    assert collection_of(reader) == as_multiset(picks[-1].values())


def test_keyed_snapshot_with_a_repeated_key_keeps_the_first_and_reports_the_rest(spark, tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    (src / "s1.json").write_bytes(
        b'{"id": 1, "v": "a"}\n{"id": 1, "v": "b"}\n{"id": 2, "v": "c"}\n'
    )
    reader, reports = run(spark, tmp_path, "snapshot", src, key=("id",))
    assert reports[0].bad_rows == 1
    assert sorted((r["id"], r["v"]) for r in reader.snapshot().to_pylist()) == [(1, "a"), (2, "c")]


def upsert_lines() -> list[bytes]:
    lines = []
    for p in events():
        row = p["before"] if p["op"] == "d" else p["after"]
        lines.append(orjson.dumps(dict(row, lsn=p["source"]["lsn"], gone=p["op"] == "d")))
    return lines


def test_upsert_older_or_redelivered_rows_in_later_transactions_change_nothing(spark, tmp_path):
    """One file per emitter transaction, the rows dealt round-robin (so a later file holds
    rows older than an earlier one's), then a file that redelivers a third of everything:
    per key, only a row newer than the state's changes it, deletes included."""
    src = tmp_path / "in"
    src.mkdir()
    lines = upsert_lines()
    for i in range(3):
        (src / f"{i}.json").write_bytes(b"\n".join(lines[i::3]))
    (src / "3.json").write_bytes(b"\n".join(lines[::3]))
    reader, reports = run(
        spark,
        tmp_path,
        "upsert",
        src,
        key=("id",),
        order="lsn",
        deleted="gone",
        max_files_per_txn=1,
    )
    assert len(reports) == 4
    assert collection_of(reader) == as_multiset(BANK.final.values())
    assert reports[-1].updates == 0  # the redelivered file changed nothing


def test_cdf_versions_already_committed_are_dropped_when_delivered_again(spark, tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    rows = list(cdf_rows())
    versions = sorted({r["_commit_version"] for r in rows})
    cut = versions[len(versions) // 2]
    first = [r for r in rows if r["_commit_version"] <= cut]
    again = [r for r in rows if cut - 3 < r["_commit_version"]]  # 3 versions redelivered
    (src / "0.json").write_bytes(b"\n".join(orjson.dumps(r) for r in first))
    (src / "1.json").write_bytes(b"\n".join(orjson.dumps(r) for r in again))
    for key in [("id",), ()]:
        reader, reports = run(
            spark,
            tmp_path / "-".join(key or ("nokey",)),
            "cdf",
            src,
            key=key,
            schema=ACCOUNTS_SCHEMA,
            max_files_per_txn=1,
        )
        assert len(reports) == 2
        assert reports[1].redelivered == sum(1 for r in again if r["_commit_version"] <= cut)
        assert collection_of(reader) == as_multiset(BANK.final.values()), key


EVENT = {"before": None, "after": {"id": 1}, "op": "c", "source": {"lsn": 1}}


@pytest.mark.parametrize(
    "lines,refused",
    [
        ([EVENT], "Debezium change events (columns after, before, op, source)"),
        ([{"schema": {"type": "struct"}, "payload": EVENT}], "Kafka Connect's wrapped events"),
        ([{"id": 1, "op": "x", "source": "web"}], None),  # (a table's own columns)
    ],
    ids=["events", "wrapped", "rows"],
)
def test_a_table_kind_refuses_change_events_for_rows_of_a_new_feed(spark, tmp_path, lines, refused):
    """Debezium's events read by a table-shaped kind (upsert, snapshot, cdf) would each
    become a row: the new feed's schema is refused, naming the kind to read them with."""
    from feed.sources.kinds import infer_record_schema
    from protocol import SourceError

    f = tmp_path / "part-0000.json"
    f.write_bytes(b"\n".join(orjson.dumps(line) for line in lines))
    if refused is None:
        schema = infer_record_schema(lambda: spark, "snapshot", [str(f)])
        assert [c["name"] for c in schema["fields"]] == ["id", "op", "source"]
        return
    with pytest.raises(SourceError, match="--source debezium:PATH") as e:
        infer_record_schema(lambda: spark, "upsert", [str(f)])
    assert refused in str(e.value) and str(f) in str(e.value)
