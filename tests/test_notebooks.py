"""The notebooks run top to bottom (nbclient) against a feed this test makes, and are kept
in git without outputs."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from feed.demo.data import generate_bank

from .feed.model import emit_bank

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))
#: what each notebook's last cell prints when its checks pass, and how many plots it shows
EXPECTED = {
    "explore_feed.ipynb": ("counts match, feed valid", 3),  # per time, one record, progress
    "spark_aggregate.ipynb": ("aggregate matches the collection at 6 times", 1),
}


def test_every_notebook_is_checked():
    assert sorted(EXPECTED) == [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, path.name


@pytest.mark.parametrize("compacted", [False, True], ids=["fresh", "compacted"])
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_against_a_fresh_and_a_compacted_feed(
    path, compacted, spark, tmp_path, monkeypatch
):
    bank = generate_bank(transactions=30, seed=61)
    src = tmp_path / "in"
    src.mkdir()
    (src / "part-0000.json").write_bytes(b"".join(e + b"\n" for e in bank.events))
    emit_bank(spark, src, tmp_path / "log")
    if compacted:
        from feed.log.compaction import compact
        from feed.log.reader import FeedReader

        times = FeedReader(str(tmp_path / "log"), "accounts").times()
        compact(str(tmp_path / "log"), "accounts", times[len(times) // 3])
    monkeypatch.setenv("TIDEFEED_LOG", str(tmp_path / "log"))
    monkeypatch.setenv("TIDEFEED_FEED", "accounts")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    marker, plots = EXPECTED[path.name]
    assert marker in text
    pngs = [o["data"]["image/png"] for o in outputs if "image/png" in o.get("data", {})]
    assert len(pngs) == plots
    shots = os.environ.get("TIDEFEED_NOTEBOOK_PNGS")  # to look at the plots
    if shots:
        import base64

        for i, png in enumerate(pngs):
            name = f"{path.stem}-{'compacted' if compacted else 'fresh'}-{i}.png"
            (Path(shots) / name).write_bytes(base64.b64decode(png))
