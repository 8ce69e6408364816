"""feed.sources.cached: a cached DataFrame whose plan begins at the cache gives the rows of
the DataFrame it was made from, mixes with DataFrames built on that one, and releases the
cache when released."""

from __future__ import annotations

from pyspark.sql import functions as F

from feed.sources.cached import cached


def _leaves(df) -> list[str]:
    """The kinds of the leaves of ``df``'s analyzed logical plan."""
    leaves = df._jdf.queryExecution().analyzed().collectLeaves()
    return [leaves.apply(i).getClass().getSimpleName() for i in range(leaves.size())]


def _is_cached(spark, df) -> bool:
    manager = spark._jsparkSession.sharedState().cacheManager()
    return not manager.lookupCachedData(df._jdf).isEmpty()


def test_a_cached_frame_plans_on_the_cache_alone_and_gives_the_same_rows(spark, tmp_path):
    lines = [f'{{"k": {i % 7}, "v": {i}}}' for i in range(200)]
    (tmp_path / "in.json").write_text("\n".join(lines) + "\n")
    source = spark.read.schema("k long, v long").json(str(tmp_path))
    shaped = source.where(F.col("v") % 3 != 0).withColumn("w", F.col("v") * 2)
    expected = sorted(tuple(r) for r in shaped.collect())

    frame = cached(shaped)
    try:
        # the plan begins at the cached relation, not at the files read
        assert _leaves(frame.select("k", "w")) == ["InMemoryRelation"]
        assert _leaves(shaped.persist()) == ["LogicalRelation"]  # (what it is without)
        assert sorted(tuple(r) for r in frame.collect()) == expected
        # built on, and joined with a DataFrame of the original's lineage
        sums = frame.groupBy("k").agg(F.sum("w").alias("s"))
        joined = sums.join(shaped.groupBy("k").count(), "k").collect()
        truth: dict[int, list[int]] = {}
        for k, _v, w in expected:
            truth.setdefault(k, []).append(w)
        assert sorted((r["k"], r["s"], r["count"]) for r in joined) == sorted(
            (k, sum(ws), len(ws)) for k, ws in truth.items()
        )
        assert _is_cached(spark, shaped)
    finally:
        frame.unpersist()
    # released: the original's cache is gone, and the frame still reads (from its lineage)
    assert not _is_cached(spark, shaped)
    assert sorted(tuple(r) for r in frame.collect()) == expected


def test_a_cached_frame_holds_the_rows_it_first_read(spark, tmp_path):
    """Read once: a file changed after the first job does not change what the frame gives,
    as with ``persist`` itself."""
    (tmp_path / "a.json").write_text('{"k": 1}\n{"k": 2}\n')
    frame = cached(spark.read.schema("k long").json(str(tmp_path)))
    try:
        assert sorted(r["k"] for r in frame.collect()) == [1, 2]
        (tmp_path / "a.json").write_text('{"k": 9}\n')
        assert sorted(r["k"] for r in frame.where(F.col("k") > 0).collect()) == [1, 2]
    finally:
        frame.unpersist()


def test_a_session_without_a_jvm_side_gets_the_persisted_frame_itself():
    """Spark Connect's DataFrames, say: no cached relation to plan on, the same data."""

    class Frame:
        level = None
        sparkSession = object()  # (no ``_jsparkSession``)

        def persist(self, level=None):
            self.level = level or "default"
            return self

    frame = Frame()
    assert cached(frame, "MEMORY_AND_DISK") is frame and frame.level == "MEMORY_AND_DISK"
    other = Frame()
    assert cached(other) is other and other.level == "default"
