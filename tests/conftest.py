"""Shared test settings: hypothesis profiles (CI runs more examples than a laptop), the
shared SparkSession, and the markers ``make test-fast`` leaves out: ``spark`` (a test that
uses the SparkSession) and ``process`` (a test that runs ``tidefeed`` processes)."""

import os
from pathlib import Path

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
# When the session runs processes, they also map the classes they load from a
# class-data-sharing archive (tests/jvm_archive.py, built once per environment).
# What the tests check does not depend on the JIT or the archive; users' JVMs keep the
# JVM's defaults. A PYSPARK_SUBMIT_ARGS of one's own wins.
SHORT_JVM_OPTIONS = "-XX:TieredStopAtLevel=1"
# The same holds for the executor JVMs a standalone cluster starts for those processes
# (tests/e2e/test_cluster.py): one per emit, living seconds (46 of the file's ~150 core-seconds
# with C2). In local mode the executor is the driver's JVM and this setting is unused.
SHORT_EXECUTORS = f"--conf spark.executor.extraJavaOptions={SHORT_JVM_OPTIONS}"
SHORT_JVM = f"--driver-java-options {SHORT_JVM_OPTIONS} {SHORT_EXECUTORS} pyspark-shell"
_OWN_SUBMIT_ARGS = "PYSPARK_SUBMIT_ARGS" in os.environ
os.environ.setdefault("PYSPARK_SUBMIT_ARGS", SHORT_JVM)


@pytest.fixture(scope="session")
def spark():
    """One SparkSession for the whole test session (starting one takes 6-15 s)."""
    from feed.emit.session import get_spark

    given = os.environ.pop("PYSPARK_SUBMIT_ARGS")
    try:
        if _OWN_SUBMIT_ARGS:
            os.environ["PYSPARK_SUBMIT_ARGS"] = given
        session = get_spark("local[2]", app="tidefeed-tests")
    finally:
        os.environ["PYSPARK_SUBMIT_ARGS"] = given
    yield session
    session.stop()


def pytest_collection_finish(session):
    """With processes to run, their JVMs map a class-data-sharing archive: make's
    (``TIDEFEED_JVM_ARCHIVE``), else one built here the first time (one short emit)."""
    if _OWN_SUBMIT_ARGS or not any(i.get_closest_marker("process") for i in session.items):
        return
    from feed.emit.jvm_archive import ENV
    from tests import jvm_archive

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    made = os.environ.get(ENV)
    if made and os.path.isfile(made):
        # make's archive (make test names it): the test JVMs map it as well, and cannot
        # dump one of their own over it (a JVM dumps a dynamic archive only over the
        # JDK's base one)
        archive: Path | None = Path(made)
        if reporter is not None:
            reporter.write_line(f"tests: the test JVMs map ${ENV} ({made})")
    else:
        built = jvm_archive.archive_path()
        if built is not None and not built.exists() and reporter is not None:
            reporter.write_line(f"tests: building the test JVMs' class archive {built} (once)")
        archive = jvm_archive.ensure(SHORT_JVM_OPTIONS)
    if archive is None:
        if reporter is not None:
            reporter.write_line("tests: no class archive for the test JVMs; they load classes")
        return
    options = f"{SHORT_JVM_OPTIONS} -XX:SharedArchiveFile={archive} {jvm_archive.QUIET}"
    os.environ["PYSPARK_SUBMIT_ARGS"] = (
        f"--driver-java-options '{options}' {SHORT_EXECUTORS} pyspark-shell"
    )


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
