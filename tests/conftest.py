"""Shared test settings: hypothesis profiles (CI runs more examples than a laptop), the
shared SparkSession, and the markers ``make test-fast`` leaves out: ``spark`` (a test that
uses the SparkSession) and ``process`` (a test that runs ``tidefeed`` processes)."""

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example],
)
settings.register_profile(
    "ci",
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example],
)
settings.load_profile("ci" if os.environ.get("CI") else "default")

# The JVM of every `tidefeed` process a test starts (they inherit this) lives seconds:
# HotSpot's optimising compiler (C2) costs it CPU it never earns back, and the suite is
# CPU-bound on 2 cores. With C1 alone a short `tidefeed emit` needs about half the CPU
# (27 s -> 14 s measured). The shared session below is the opposite case, one JVM running
# thousands of jobs, where C1 alone made its tests twice as slow: it keeps the default.
# What the tests check does not depend on the JIT; users' JVMs keep the JVM's default.
# A PYSPARK_SUBMIT_ARGS of one's own wins.
SHORT_JVM = "--driver-java-options -XX:TieredStopAtLevel=1 pyspark-shell"
os.environ.setdefault("PYSPARK_SUBMIT_ARGS", SHORT_JVM)


@pytest.fixture(scope="session")
def spark():
    """One SparkSession for the whole test session (starting one takes 6-15 s)."""
    from feed.emit.session import get_spark

    given = os.environ.pop("PYSPARK_SUBMIT_ARGS")
    try:
        if given != SHORT_JVM:
            os.environ["PYSPARK_SUBMIT_ARGS"] = given
        session = get_spark("local[2]", app="tidefeed-tests")
    finally:
        os.environ["PYSPARK_SUBMIT_ARGS"] = given
    yield session
    session.stop()


def pytest_collection_modifyitems(config, items):
    from tests.e2e import helpers

    runs_processes = (helpers.start, helpers.tidefeed)
    for item in items:
        if "spark" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.spark)
        module = getattr(item, "module", None)
        if module is not None and any(
            v is f for v in vars(module).values() for f in runs_processes
        ):
            item.add_marker(pytest.mark.process)
