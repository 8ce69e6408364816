"""Cached DataFrames whose plans begin at the cache.

``DataFrame.persist`` keeps a DataFrame's whole lineage as its logical plan, and so does
every DataFrame built on it: Spark swaps the cached relation in only when it plans a job.
Until then each step of a transaction (a ``select``, a join, a union) has the lineage
analyzed again, from the input's text scan and JSON parse down (Spark's
``DeduplicateRelations`` walks all of it at every step), and each action prints it whole
into the SQL execution's start event. For a transaction of a few events that planning costs
more than its jobs: a keyed transaction with TOAST placeholders spent half its time building
DataFrames (docs/operations.md, "Plans that begin at the cache").

:func:`cached` persists a DataFrame and gives one whose plan is the cached relation alone:
the same cache, the same columns (with the same attribute ids, so it mixes with DataFrames
of the original), read the same way by every job. Releasing it (``unpersist``) releases the
cache. Where the session cannot give its cached relation (a session other than PySpark's
own JVM one), the persisted DataFrame itself is given: slower to plan on, the same data.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["cached", "released"]


def cached(df: Any, level: Any = None) -> Any:
    """``df`` persisted (at ``level``, else Spark's default), as a DataFrame whose plan is
    the cached relation; nothing is computed until a job reads it."""
    from py4j.protocol import Py4JError

    kept = df.persist() if level is None else df.persist(level)
    try:
        session = kept.sparkSession
        jsession = session._jsparkSession
        found = jsession.sharedState().cacheManager().lookupCachedData(kept._jdf)
        if found.isEmpty():
            return kept
        relation = found.get().cachedRepresentation()
        jdf = session._jvm.org.apache.spark.sql.classic.Dataset.ofRows(jsession, relation)
    except (AttributeError, Py4JError):  # (a session without that JVM side)
        return kept
    return _cache_frame()(jdf, session, kept)


def released(*frames: Any) -> None:
    """Unpersist every one of ``frames`` (what a transaction cached, when it stops)."""
    for df in frames:
        df.unpersist()


@functools.cache
def _cache_frame() -> Any:
    """The DataFrame class :func:`cached` gives (made on first use: importing this module
    does not import PySpark)."""
    from pyspark.sql.classic.dataframe import DataFrame

    class CacheFrame(DataFrame):
        """A DataFrame over a cached relation that releases the cache of the DataFrame it
        was made from (Spark finds a cache by the plan it was made for, not by this one)."""

        def __init__(self, jdf: Any, session: Any, kept: Any) -> None:
            super().__init__(jdf, session)
            self._kept = kept
            self.is_cached = True

        def unpersist(self, blocking: bool = False) -> Any:
            self._kept.unpersist(blocking)
            self.is_cached = False
            return self

    return CacheFrame
