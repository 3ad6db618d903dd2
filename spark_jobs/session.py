"""The Spark session every job uses: a Spark Connect client when a remote URL is configured, else local."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from components.config import SparkConfig

log = logging.getLogger(__name__)


# Reads name their files (a minute per partition directory): the driver stats them itself instead of running
# a listing job once a read names more than Spark's default of 32 paths (an hour of lookback names 60; each
# such job cost about 0.16 s of a minute run through Spark Connect).
LISTING_THRESHOLD_KEY = "spark.sql.sources.parallelPartitionDiscovery.threshold"
LISTING_THRESHOLD = "100000"

# Compiled classes kept by the session (Spark's default is 100). A minute run through Spark Connect compiled
# about 70 classes; with 100 kept, each minute run found the last one's evicted and compiled them again (about
# 1 s of a 7-8 s minute, counted in the server's log). With more kept, a minute run compiles only what its
# own values change (spark_jobs.events.ms_at_least). A static setting: it is given when the session starts.
CODEGEN_CACHE_KEY = "spark.sql.codegen.cache.maxEntries"
CODEGEN_CACHE_ENTRIES = "2000"

# The checkout this module belongs to: Python workers import the project from here, like the driver.
PROJECT_ROOT = Path(__file__).resolve().parents[1]


def with_project_path(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` with this checkout first on PYTHONPATH. Python workers (a local session's, a Spark Connect
    server's) otherwise import the project from wherever the interpreter's installed copy points: an editable
    install shared by two checkouts points at the one that installed it last, so the driver and its workers
    could run different code (or the workers none, once that checkout is gone)."""
    paths = [part for part in environ.get("PYTHONPATH", "").split(os.pathsep) if part]
    if str(PROJECT_ROOT) not in paths:
        paths.insert(0, str(PROJECT_ROOT))
    return {**environ, "PYTHONPATH": os.pathsep.join(paths)}


def get_spark(config: SparkConfig, app_name: str = "ctr"):
    from pyspark.sql import SparkSession

    if config.remote:
        log.info("connecting to Spark Connect at %s", config.remote)
        return SparkSession.builder.remote(config.remote).getOrCreate()
    log.info("starting a local Spark session (%s)", config.master)
    # Local Python workers must run this interpreter (its environment has pyarrow, tfx-bsl, ...). PySpark reads
    # the worker's interpreter from this variable only, not from the session config.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ["PYTHONPATH"] = with_project_path(os.environ)["PYTHONPATH"]
    return (
        SparkSession.builder.master(config.master)
        .appName(app_name)
        .config("spark.driver.memory", config.driver_memory)
        .config("spark.sql.shuffle.partitions", str(config.shuffle_partitions))
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config(LISTING_THRESHOLD_KEY, LISTING_THRESHOLD)
        .config(CODEGEN_CACHE_KEY, CODEGEN_CACHE_ENTRIES)
        .getOrCreate()
    )


# What a minute's rows are kept in Spark's memory as: uncompressed column batches. For 60 K rows, compressing the
# batches cost more than reading the rows again; the daily run's large persisted frames keep Spark's default.
MINUTE_CACHE_CONF = {"spark.sql.inMemoryColumnarStorage.compressed": "false"}


@contextmanager
def session_conf(spark, settings: Mapping[str, str]) -> Iterator[None]:
    """Sets SQL settings of `spark`'s session for the block, then puts back what was there (or unsets)."""
    before = {key: spark.conf.get(key, None) for key in settings}
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)
