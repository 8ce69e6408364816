"""PySpark looks for top-level modules named ``pyspark_*`` holding a ``DefaultSource`` and
registers them on every session: with tidefeed installed, ``format("tidefeed")`` works
without ``feed.register_spark(spark)``."""

from feed.spark_source import TidefeedDataSource as DefaultSource

__all__ = ["DefaultSource"]
