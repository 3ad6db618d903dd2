"""The Spark session every job uses: a Spark Connect client when a remote URL is configured, else local."""

from __future__ import annotations

import logging
import os
import sys

from components.config import SparkConfig

log = logging.getLogger(__name__)


def get_spark(config: SparkConfig, app_name: str = "ctr"):
    from pyspark.sql import SparkSession

    if config.remote:
        log.info("connecting to Spark Connect at %s", config.remote)
        return SparkSession.builder.remote(config.remote).getOrCreate()
    log.info("starting a local Spark session (%s)", config.master)
    # Local Python workers must run this interpreter (its environment has pyarrow, tfx-bsl, ...). PySpark reads
    # the worker's interpreter from this variable only, not from the session config.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    return (
        SparkSession.builder.master(config.master)
        .appName(app_name)
        .config("spark.driver.memory", config.driver_memory)
        .config("spark.sql.shuffle.partitions", str(config.shuffle_partitions))
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
