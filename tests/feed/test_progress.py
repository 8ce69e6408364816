"""Progress off a terminal: a long transaction is never silent, a short one is one line."""

import io
import logging
import time

from feed.emit.progress import TxnProgress


def test_a_transaction_under_way_is_logged_every_few_seconds_and_stops_when_done(caplog):
    caplog.set_level(logging.INFO, logger="tidefeed.emit")
    p = TxnProgress("bank", stream=io.StringIO(), every=0.05)  # a pipe: not a terminal
    p.start(3, files=2)
    p.stage("computing diffs", rows_read=1_000)
    time.sleep(0.3)
    p.done()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(lines) >= 2
    assert all(x.startswith("feed bank: txn 3: ") and x.endswith("(under way)") for x in lines)
    assert any("computing diffs… 2 files, 1,000 rows read" in x for x in lines)
    after = len(caplog.records)
    time.sleep(0.2)
    assert len(caplog.records) == after  # nothing once the transaction is over


def test_a_short_transaction_gets_no_progress_line(caplog):
    caplog.set_level(logging.INFO, logger="tidefeed.emit")
    p = TxnProgress("bank", stream=io.StringIO(), every=5.0)
    p.start(1, files=1)
    p.stage("writing")
    p.done()
    assert [r for r in caplog.records if r.levelno >= logging.INFO] == []
    assert p._ticker is None
