"""The notebooks run top to bottom (nbclient) against a feed this test makes, and are kept
in git without outputs."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import KernelManager
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


@pytest.fixture(scope="module")
def kernels():
    """One kernel per notebook for this module's runs of it: the second run of
    spark_aggregate finds the SparkSession its first run started (~15 s a start)."""
    started: dict[str, KernelManager] = {}

    def kernel(name: str) -> KernelManager:
        if name not in started:
            started[name] = KernelManager(kernel_name="python3")
        return started[name]

    yield kernel
    for km in started.values():
        if km.has_kernel:
            km.shutdown_kernel(now=True)


@pytest.mark.parametrize("compacted", [False, True], ids=["fresh", "compacted"])
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_against_a_fresh_and_a_compacted_feed(
    path, compacted, spark, tmp_path, kernels
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
    nb = nbformat.read(path, as_version=4)
    # the feed the notebook reads, as a user names it: in the kernel's environment (set in
    # a first cell, the kernel being shared by the runs of this module)
    chosen = {"TIDEFEED_LOG": str(tmp_path / "log"), "TIDEFEED_FEED": "accounts"}
    nb.cells.insert(0, nbformat.v4.new_code_cell(f"import os\nos.environ.update({chosen!r})"))
    client = NotebookClient(
        nb, timeout=180, km=kernels(path.name), resources={"metadata": {"path": str(path.parent)}}
    )
    try:
        client.execute()
    finally:
        if client.kc is not None:  # (the kernel stays; this run's connection to it goes)
            client.kc.stop_channels()
    del nb.cells[0]
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
