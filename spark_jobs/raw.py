"""Extract and parse raw click-log minute partitions (Criteo TSV layout)."""

from __future__ import annotations

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StringType, StructField, StructType

from components.schema import CATEGORICAL_FEATURES, DENSE_FEATURES, LABEL, RAW_COLUMNS

RAW_SCHEMA = StructType([StructField(name, StringType(), True) for name in RAW_COLUMNS])
MINUTE_COLUMN = "minute"


def extract_raw(spark: SparkSession, paths: list[str]) -> DataFrame:
    """Raw columns as strings plus the partition's minute ('YYYY-MM-DD HH:MM') taken from the path."""
    frame = spark.read.csv(paths, sep="\t", schema=RAW_SCHEMA, header=False, mode="PERMISSIVE", emptyValue=None)
    path = F.col("_metadata.file_path")
    minute = F.concat(
        F.regexp_extract(path, r"date=(\d{4}-\d{2}-\d{2})", 1), F.lit(" "),
        F.regexp_extract(path, r"minute=(\d{2})(\d{2})", 1), F.lit(":"),
        F.regexp_extract(path, r"minute=(\d{2})(\d{2})", 2),
    )
    return frame.select(*RAW_COLUMNS, minute.alias(MINUTE_COLUMN))


def parse_raw(frame: DataFrame) -> DataFrame:
    """Typed columns: label int, dense doubles (null = missing), categorical strings (null = missing)."""
    return frame.select(
        F.col(LABEL).cast("int").alias(LABEL),
        *[F.col(name).cast("double").alias(name) for name in DENSE_FEATURES],
        *[F.when(F.col(name) == "", None).otherwise(F.col(name)).alias(name) for name in CATEGORICAL_FEATURES],
        F.col(MINUTE_COLUMN),
    )
