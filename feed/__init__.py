"""The tidefeed producer: sources, diffs, clock, consolidation, feed log, checkpoints, CLI.

Importing :mod:`feed` does not start or import Spark; the modules that need it import it
when they are used.
"""

from typing import Any

__all__ = ["register_spark"]


def register_spark(spark: Any) -> None:
    """Make ``spark.read.format("tidefeed")`` and ``spark.readStream.format("tidefeed")``
    read committed feeds on this SparkSession (:mod:`feed.spark_source`)."""
    from feed.spark_source import register_spark as register

    register(spark)
