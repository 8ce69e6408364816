"""The input position: a high-water file name plus the few files consumed past it."""

from __future__ import annotations

import pytest

from feed.sources.inputs import FilePosition, InputWindow


def test_the_high_water_passes_every_consumed_name_up_to_the_first_pending_one():
    listed = ["a", "b", "c", "d", "e"]
    p = FilePosition()
    assert p.pending(listed) == listed
    # a, b consumed; c held back (an incomplete transaction); d consumed past it
    p = p.advance(listed, ["a", "b", "d"])
    assert (p.last, p.beyond) == ("b", frozenset({"d"}))
    assert p.pending(listed) == ["c", "e"]
    # c completes: the high-water jumps over d, and nothing is listed beyond it
    p = p.advance(listed, ["c"])
    assert (p.last, p.beyond) == ("d", frozenset())
    assert p.pending([*listed, "f"]) == ["e", "f"]
    # the checkpoint holds two keys whatever the history: no list of every file
    assert p.to_source() == {"file": "d", "file_beyond": []}


def test_a_checkpoint_with_the_whole_list_folds_into_a_high_water():
    legacy = {"files": ["x1", "x2", "x4"], "tx_files": ["t1"]}
    p = FilePosition.from_source(legacy)
    assert p.pending(["x1", "x2", "x3", "x4", "x5"]) == ["x3", "x5"]
    p = p.advance(["x1", "x2", "x3", "x4", "x5"], ["x3"])
    assert (p.last, p.beyond) == ("x4", frozenset())
    tx = FilePosition.from_source(legacy, "tx_file")
    assert tx.pending(["t1", "t2"]) == ["t2"]
    assert tx.advance(["t1", "t2"], ["t2"]).to_source("tx_file") == {
        "tx_file": "t2",
        "tx_beyond": [],
    }


def test_files_deleted_after_they_were_consumed_do_not_matter():
    p = FilePosition().advance(["a", "b"], ["a", "b"])
    assert p.pending(["c"]) == ["c"]  # a and b were deleted by the connector's retention
    assert p.advance(["c"], ["c"]).last == "c"


def test_a_tx_metadata_folder_not_made_yet_has_no_files_until_it_appears(tmp_path):
    """emit --follow may start before the capture writes its first transaction (which
    makes the --tx-metadata folder): nothing pending until then, then its files."""
    window = InputWindow(str(tmp_path / "in"), str(tmp_path / "tx"))
    assert window.pending_tx({}) == []
    (tmp_path / "tx").mkdir()
    (tmp_path / "tx" / "tx-1.json").write_text("{}\n")
    assert [p.rsplit("/", 1)[-1] for p in window.pending_tx({})] == ["tx-1.json"]


def test_a_window_never_ends_between_two_files_of_one_source_transaction(tmp_path):
    """Each kind says how its lines name their source transaction (SourceKind.line_txn):
    a Debezium event's txId, a change row's _commit_version; kinds whose files may end
    anywhere (upserts) say nothing, and their windows end at the file limit."""
    from feed.sources.registry import KINDS

    def dbz(tx):
        return f'{{"op":"c","after":{{"id":1}},"source":{{"txId":{tx},"lsn":{tx}}}}}'

    def cdf(v):
        return f'{{"id":1,"_change_type":"insert","_commit_version":{v}}}'

    for kind, line in (("debezium", dbz), ("cdf", cdf)):
        d = tmp_path / kind
        d.mkdir()
        bodies = [[line(1), line(2)], [line(2), line(3)], [line(4)]]
        files = []
        for i, body in enumerate(bodies):
            f = d / f"p{i}.json"
            f.write_text("\n".join(["", *body, ""]))  # blank lines are passed over
            files.append(str(f))
        k = KINDS[kind]
        # version 2 goes on into p1, which ends with 3: p2 (4) starts a new one
        assert InputWindow.first(files, 1, kind=k, whole_txns=True) == files[:2]
        assert InputWindow.first(files, 1, kind=k, whole_txns=False) == files[:1]
    # an upsert file's rows name no transaction: the limit alone decides
    assert KINDS["upsert"].line_txn is None
    assert InputWindow.first(files, 1, kind=KINDS["upsert"], whole_txns=True) == files[:1]


def test_a_file_named_as_compressed_must_hold_that_codecs_data(tmp_path):
    """Spark picks a codec by the name's ending and fails the whole transaction on data
    of another kind, naming no file; the check names it before Spark reads."""
    import bz2
    import gzip

    from feed.sources.file_text import check_compressed
    from protocol import SourceError

    good = [tmp_path / "a.json.gz", tmp_path / "b.json.bz2", tmp_path / "c.json"]
    good[0].write_bytes(gzip.compress(b'{"x": 1}\n'))
    good[1].write_bytes(bz2.compress(b'{"x": 1}\n'))
    good[2].write_bytes(b'{"x": 1}\n')
    check_compressed([str(p) for p in good])  # (no error)
    for name, codec in (("d.json.gz", "gzip"), ("e.json.bz2", "bzip2"), ("f.json.zst", "zstd")):
        bad = tmp_path / name
        bad.write_bytes(b'{"x": 1}\n')
        with pytest.raises(SourceError, match=rf"{bad} is named \.\w+ but does not hold {codec}"):
            check_compressed([*map(str, good), str(bad)])


def test_store_lines_break_as_sparks_text_reader_does():
    """Lines read by the tasks from a store (feed/sources/store_lines.py) break where
    Spark's text reader breaks them (\\n, \\r\\n, a lone \\r; no empty line after the last
    break), whatever the blocks; a byte that is not UTF-8 reads as U+FFFD."""
    import random

    from feed.sources.store_lines import split_lines

    def spark_like(data: bytes) -> list[str]:
        lines = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        if lines[-1] == b"":
            lines.pop()
        return [x.decode("utf-8", errors="replace") for x in lines]

    rng = random.Random(7)
    for _ in range(500):
        data = bytes(rng.choice(b'a{"\r\n\xff\xc3\xa9') for _ in range(rng.randint(0, 40)))
        cuts = sorted(rng.sample(range(len(data) + 1), k=min(len(data) + 1, rng.randint(0, 5))))
        blocks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        assert list(split_lines(b for b in blocks if b)) == spark_like(data), (data, blocks)
    assert list(split_lines([b"a\r", b"\nb\r\r", b"c"])) == ["a", "b", "", "c"]
    assert list(split_lines([b"\xc3", b"\xa9t\xff\n"])) == ["ét\ufffd"]


def test_store_lines_stop_at_a_line_past_the_bound(monkeypatch):
    """A line with no break is not gathered without end in a task's memory (a small
    compressed file in a store may decompress to one huge line)."""
    import feed.sources.file_text as file_text
    from feed.sources.store_lines import split_lines
    from protocol import SourceError

    monkeypatch.setattr(file_text, "MAX_LINE", 100)
    assert list(split_lines([b"x" * 60 + b"\n", b"y" * 90 + b"\n"])) == ["x" * 60, "y" * 90]
    with pytest.raises(SourceError, match="a line longer than 100 bytes"):
        list(split_lines([b"a\n", *[b"z" * 40] * 5]))


def test_compressed_input_is_read_as_its_text_without_spark(tmp_path):
    """Spark reads a ``.gz``, ``.bz2`` or ``.zst`` input file as its text; what tidefeed
    reads of a file itself (its lines, the source transaction at its edges, the
    Connect schema of its first event) does the same, and a Hadoop-only codec is refused
    by name where it used to read the compressed bytes as lines."""
    import shutil

    import pyarrow as pa

    from feed.demo.data import generate_bank
    from feed.sources.debezium_schema import debezium_schema
    from feed.sources.file_text import input_lines
    from feed.sources.inputs import edge_txn
    from feed.sources.registry import KINDS
    from protocol import SourceError

    text = b"\n".join(generate_bank(transactions=40, seed=3, wrapped_every=1).events) + b"\n"
    plain = tmp_path / "plain.json"
    plain.write_bytes(text)
    expected = list(input_lines(str(plain)))
    assert len(expected) > 10 and expected[0].startswith(b"{")
    schema = debezium_schema(lambda: pytest.fail("Spark is not needed"), [str(plain)], None)
    edges = [edge_txn(KINDS["debezium"], str(plain), last=last) for last in (False, True)]
    assert all(edges), edges
    for ending, codec in (("gz", "gzip"), ("bz2", "bz2"), ("zst", "zstd")):
        f = tmp_path / f"in.json.{ending}"
        with pa.CompressedOutputStream(str(f), codec) as out:
            out.write(text)
        assert list(input_lines(str(f))) == expected, ending
        assert [edge_txn(KINDS["debezium"], str(f), last=last) for last in (False, True)] == edges
        assert debezium_schema(lambda: pytest.fail("Spark"), [str(f)], None) == schema
    hadoop = tmp_path / "in.json.lz4"
    shutil.copy(plain, hadoop)
    with pytest.raises(SourceError, match=rf"{hadoop}: a Hadoop codec only Spark reads"):
        list(input_lines(str(hadoop)))
    broken = tmp_path / "broken.json.gz"
    whole = (tmp_path / "in.json.gz").read_bytes()
    broken.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(SourceError, match=rf"{broken} could not be decompressed \(gzip\)"):
        list(input_lines(str(broken)))


def test_a_small_compressed_file_cannot_make_the_driver_read_without_bound(tmp_path, monkeypatch):
    """A few kilobytes of gzip can hold gigabytes of text. The driver reads a line up to
    MAX_LINE bytes and a file up to the limit it is given, then says which file went past;
    the driver parse declines text past its budget (Spark reads it instead)."""
    import gzip

    import pyarrow as pa

    import feed.sources.file_text as file_text
    from feed.demo.data import generate_bank
    from feed.sources.debezium_lines import Declined, parse_lines
    from feed.sources.file_text import input_lines
    from protocol import SourceError

    monkeypatch.setattr(file_text, "MAX_LINE", 1 << 20)
    bomb = tmp_path / "bomb.json.gz"
    bomb.write_bytes(gzip.compress(b"x" * (8 << 20)))
    assert bomb.stat().st_size < 64 << 10
    with pytest.raises(SourceError, match=rf"{bomb}: a line longer than {1 << 20} bytes"):
        list(input_lines(str(bomb)))
    text = b"\n".join(generate_bank(transactions=40, seed=3).events) + b"\n"
    events = tmp_path / "events.json.gz"
    events.write_bytes(gzip.compress(text))
    assert b"\n".join(input_lines(str(events))) + b"\n" == text
    with pytest.raises(SourceError, match=rf"{events}: more than 1000 bytes of text"):
        list(input_lines(str(events), limit=1000))
    record = pa.struct([("id", pa.int64()), ("owner", pa.string())])
    args = ([str(events)], record, {}, ["id"], None)
    assert parse_lines(*args, budget=len(text) + (1 << 20)).num_rows == text.count(b"\n")
    with pytest.raises(Declined, match="bytes of text"):
        parse_lines(*args, budget=len(text) // 2)
