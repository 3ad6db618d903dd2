from __future__ import annotations

import os

import pytest

# Quiet TensorFlow's C++ start-up banner in test output.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture(scope="session")
def spark():
    from components.config import SparkConfig
    from spark_jobs.session import get_spark

    session = get_spark(SparkConfig(master="local[2]", shuffle_partitions=2, driver_memory="2g"), "ctr-tests")
    yield session
    session.stop()
