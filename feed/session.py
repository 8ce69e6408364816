"""The Spark session the emitter runs in: local by default, any master by flag."""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["DEFAULT_MASTER", "get_spark"]

DEFAULT_MASTER = "local[*]"
DEFAULT_DRIVER_MEMORY = "4g"


def get_spark(
    master: str | None = None, *, app: str = "tidefeed", conf: dict[str, Any] | None = None
) -> Any:
    """Get (or create) the SparkSession; an existing active session is reused as it is.

    Binds the driver to 127.0.0.1 unless ``SPARK_LOCAL_IP`` says otherwise, turns the UI off
    and uses a few shuffle partitions: tidefeed's transactions are many and small.
    """
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    host = os.environ.get("SPARK_LOCAL_IP", "127.0.0.1")
    # Python workers (eager pushes) must run this interpreter, which has tidefeed installed,
    # not whatever "python3" is first on the PATH
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.master(master or DEFAULT_MASTER)
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.driver.host", host)
        .config("spark.driver.bindAddress", host)
        .config("spark.sql.files.maxPartitionBytes", str(1 << 30))
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.pyspark.python", os.environ["PYSPARK_PYTHON"])
    )
    if (master or DEFAULT_MASTER).startswith("local"):
        # in local mode the driver does all the work: the JVM's 1 GiB default is too small
        builder = builder.config(
            "spark.driver.memory", os.environ.get("TIDEFEED_DRIVER_MEMORY", DEFAULT_DRIVER_MEMORY)
        )
    for k, v in (conf or {}).items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
