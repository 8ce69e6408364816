"""Grouped Parquet files written by Spark's tasks with pyarrow (feed/txn/grouped.py)."""

from __future__ import annotations

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from feed.txn.grouped import by_group as group_totals
from feed.txn.grouped import strays, write_groups


def test_each_group_gets_files_holding_exactly_its_rows_with_their_counts(spark, tmp_path):
    rows = [(t % 7, i, f"r{i}") for i, t in enumerate(range(0, 5000, 3))]
    df = spark.createDataFrame(rows, "t long, id long, name string").repartition(3)
    written = write_groups(df, "t", None, str(tmp_path / "out"), "time=")
    by_group: dict[int, list[tuple[int, str]]] = {}
    for g, path, n in written:
        assert path.startswith(f"{tmp_path}/out/time={g}/") and path.endswith(".parquet")
        table = pq.read_table(path)
        assert table.column_names == ["id", "name"]  # the group column stays out
        assert table.num_rows == n
        by_group.setdefault(g, []).extend(zip(*table.to_pydict().values(), strict=True))
    expect: dict[int, list[tuple[int, str]]] = {}
    for t, i, name in rows:
        expect.setdefault(t, []).append((i, name))
    assert {g: sorted(v) for g, v in by_group.items()} == expect
    assert {g: n for g, (_, n) in group_totals(written).items()} == {
        g: len(v) for g, v in expect.items()
    }
    # nothing else was written, so nothing is a stray; a left-over file is one
    fs = pafs.LocalFileSystem()
    assert strays(fs, str(tmp_path / "out"), written) == []
    left = tmp_path / "out" / "time=3" / "part-failed-attempt.parquet"
    left.write_bytes(b"PAR1")
    assert strays(fs, str(tmp_path / "out"), written) == [str(left)]


def test_an_empty_frame_writes_nothing(spark, tmp_path):
    df = spark.createDataFrame([], "t long, id long")
    assert write_groups(df, "t", None, str(tmp_path / "out"), "g=") == []
    assert not (tmp_path / "out").exists()
