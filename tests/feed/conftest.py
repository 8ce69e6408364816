"""Fixtures for the producer's tests: one SparkSession for the whole test session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def spark():
    from feed.session import get_spark

    session = get_spark("local[2]", app="tidefeed-tests")
    yield session
    session.stop()
