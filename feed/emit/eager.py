"""Eager delivery (DESIGN §6): Spark executors push a transaction's updates before it commits.

With ``tidefeed emit --push URL --eager`` each transaction, once its updates are in the feed
log and before the checkpoint commit, runs a Spark job whose tasks read the new time
segments and push them to the receiver as update-only bodies (the subscription's format,
the emitter's epoch, bodies of at most one Arrow batch). After the commit the driver sends
only the progress; when its counts match what the receiver holds, the transaction is
delivered without the driver ever reading the updates.

Eager pushes are an optimisation, never the source of truth:

* a task whose push fails counts it and goes on; the progress then does not match the
  receiver's pending updates (409), and the driver falls back to a committed-delivery
  session (announcement, which drops the partial pending updates, then the log);
* a task run twice (a Spark retry) pushes duplicates, which the receiver ignores (§3);
* an emitter killed after the pushes and before the commit leaves pending updates at the
  receiver; its successor's announcement rolls them back and the transaction is redone.

So it needs a rollback-capable consumer (the reference receiver is one).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from protocol import Progress, avro_to_arrow, get_codec
from protocol.push import PushClient, PushRejected

__all__ = ["EagerPusher", "EagerReport"]

log = logging.getLogger("tidefeed.eager")

#: seconds an executor waits for one push to be answered
PUSH_TIMEOUT = 60.0


@dataclass(frozen=True, slots=True)
class EagerReport:
    pushed: int
    failed: int

    def log(self, logger: logging.Logger, feed: str) -> None:
        logger.info(
            "feed %s: eager: pushed %d update(s) before the commit (%d failed)",
            feed,
            self.pushed,
            self.failed,
        )


def _push_batches(
    url: str, fmt: str, token: str | None, schema: Any, epoch: int
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The function each Spark task runs over its Arrow batches (record columns, ``diff``,
    ``time``): one POST per batch; yields one row of counts."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import http.client
        import urllib.error
        import urllib.request

        from feed.log.reader import flat_updates

        codec = get_codec(fmt)
        record_type = avro_to_arrow(schema)
        headers = {"Content-Type": codec.content_type, "Tidefeed-Epoch": str(epoch)}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        pushed = failed = 0
        for batch in batches:
            n = batch.num_rows
            if not n:
                continue
            table = pa.Table.from_batches([batch])
            updates = flat_updates(table, record_type, table.column("time"))
            body = codec.encode([updates], schema=schema)
            request = urllib.request.Request(url, data=body, method="POST", headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=PUSH_TIMEOUT) as response:
                    response.read()
                pushed += n
            except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
                # an answer cut short is an HTTPException, not an OSError: it failed the
                # Spark task, and the emitter with it (found by the reliability harness)
                failed += n  # the progress will not match: the driver falls back
        yield pa.RecordBatch.from_pydict(
            {"pushed": pa.array([pushed], pa.int64()), "failed": pa.array([failed], pa.int64())}
        )

    return run


@dataclass(slots=True)
class EagerPusher:
    """Pushes a transaction's staged time segments from the executors, then closes them.

    ``ready()`` says whether the receiver is caught up with the log (the emitter's
    publisher is idle). While it is not, a transaction is not pushed eagerly (``skipped``):
    its updates would cross the publisher's session; the publisher delivers it instead."""

    url: str
    fmt: str
    schema: Any
    token: str | None = None
    ready: Callable[[], bool] | None = None
    skipped: bool = field(default=False, init=False)

    def push(
        self, spark: Any, paths: list[str], epoch: int, store: str | None = None
    ) -> EagerReport:
        """Push the update files ``paths`` (``…/times/<t>/part-….parquet``, or packs, whose
        ``time`` column says each row's) from Spark tasks. ``store``: the URI of the
        filesystem of packs not on a local disk, read by the tasks through pyarrow (Spark's
        own reader would need hadoop-aws for ``s3://``)."""
        self.skipped = self.ready is not None and not self.ready()
        if not paths or self.skipped:
            return EagerReport(0, 0)
        from pyspark.sql import functions as F

        df = _updates_frame(spark, paths, store)
        fn = _push_batches(self.url, self.fmt, self.token, self.schema, epoch)
        row = (
            df.mapInArrow(fn, "pushed long, failed long")
            .agg(F.sum("pushed").alias("pushed"), F.sum("failed").alias("failed"))
            .collect()[0]
        )
        return EagerReport(int(row["pushed"] or 0), int(row["failed"] or 0))

    def close(self, progress: Progress, epoch: int) -> int | None:
        """Send only the committed progress; the receiver's ACK, or ``None`` when it refused
        (counts that do not match what it holds) or could not be reached."""

        async def go() -> int | None:
            async with PushClient(
                self.url, fmt=self.fmt, schema=self.schema, token=self.token
            ) as c:
                ack = await c.push([progress], epoch=epoch)
                return ack.frontier

        try:
            return asyncio.run(go())
        except PushRejected as e:
            log.warning("eager: the receiver did not take the progress (%s); resending", e)
            return None


def _updates_frame(spark: Any, paths: list[str], store: str | None) -> Any:
    """The rows of the update files ``paths`` with their ``time``, as a DataFrame."""
    from pyspark.sql import functions as F

    if store is not None:
        import pyarrow.parquet as pq
        from pyspark.sql.pandas.types import from_arrow_schema

        from feed.txn.grouped import read_files, store_fs

        schema = pq.read_schema(paths[0], filesystem=store_fs(store))
        if "time" in schema.names:  # packs (a folder per time on a store goes below)
            return read_files(spark, store, paths, from_arrow_schema(schema))
    df = spark.read.parquet(*paths)
    if "time" not in df.columns:
        df = df.withColumn(
            "time",
            F.regexp_extract(F.input_file_name(), r"/times/(\d+)/[^/]*$", 1).cast("long"),
        )
    return df
