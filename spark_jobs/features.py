"""Feature generation: vocabularies with min-count admission and dense transforms -> a feature state.

extract (raw minute partitions) -> pure transforms (counts, vocabulary, dense statistics) -> load
(feature-state directory with manifest, committed atomically). Runnable with spark-submit:

    spark-submit spark_jobs/features.py --start 2026-01-01T00:00 --end 2026-01-01T01:00
"""

from __future__ import annotations

from pathlib import Path

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from components.config import FeatureConfig
from components.feature_state import (
    FEATURE_STATE_KIND,
    DenseTransform,
    FeatureState,
    advance_feature_state,
    save_feature_state,
)
from components.manifest import commit_dir, staging_dir, write_manifest
from components.schema import CATEGORICAL_FEATURES, DENSE_FEATURES

CLIP_QUANTILES = (0.001, 0.999)
QUANTILE_RELATIVE_ERROR = 1e-4


def categorical_counts(frame: DataFrame, day: int) -> DataFrame:
    """(feature, value, count, last_seen=day) over all categorical columns; missing values are not counted.

    Values are grouped under the feature's index (a byte), not its name, and named after the aggregation:
    ~20 % faster on 2 M rows x 26 features here than grouping by the name string."""
    pairs = F.explode(F.array(*[
        F.struct(F.lit(index).cast("tinyint").alias("feature"), F.col(name).alias("value"))
        for index, name in enumerate(CATEGORICAL_FEATURES)
    ]))
    names = F.array(*[F.lit(name) for name in CATEGORICAL_FEATURES])
    return (
        frame.select(pairs.alias("pair"))
        .select("pair.feature", "pair.value")
        .where(F.col("value").isNotNull() & (F.col("value") != ""))
        .groupBy("feature", "value")
        .agg(F.count(F.lit(1)).alias("count"))
        .select(F.element_at(names, F.col("feature").cast("int") + 1).alias("feature"), "value", "count",
                F.lit(day).cast("int").alias("last_seen"))
    )


def signed_log1p(column):
    return F.signum(column) * F.log1p(F.abs(column))


def dense_statistics(frame: DataFrame) -> tuple[DenseTransform, ...]:
    transformed = frame.select(*[signed_log1p(F.col(name)).alias(name) for name in DENSE_FEATURES])
    quantiles = transformed.approxQuantile(list(DENSE_FEATURES), list(CLIP_QUANTILES), QUANTILE_RELATIVE_ERROR)
    # least/greatest skip nulls, so missing values are kept missing explicitly (not clipped to `low`).
    clipped = transformed.select(*[
        F.when(F.col(name).isNull(), None)
        .otherwise(F.least(F.greatest(F.col(name), F.lit(q[0] if q else 0.0)), F.lit(q[1] if q else 0.0)))
        .alias(name)
        for name, q in zip(DENSE_FEATURES, quantiles, strict=True)
    ])
    moments = clipped.agg(*[F.mean(name).alias(f"{name}_mean") for name in DENSE_FEATURES],
                          *[F.stddev_pop(name).alias(f"{name}_std") for name in DENSE_FEATURES]).first()
    out = []
    for name, q in zip(DENSE_FEATURES, quantiles, strict=True):
        low, high = (q[0], q[1]) if q else (0.0, 0.0)
        mean = moments[f"{name}_mean"] if moments[f"{name}_mean"] is not None else 0.0
        std = moments[f"{name}_std"] or 0.0
        out.append(DenseTransform(name, float(low), float(high), float(mean), float(std) if std > 1e-6 else 1.0))
    return tuple(out)


def build_feature_state(
    frame: DataFrame, previous: FeatureState | None, config: FeatureConfig, *, day: int, version: str,
    evict: bool,
) -> FeatureState:
    """The feature state after folding `frame` (parsed rows) into `previous` (None for the first run).

    Spark counts the values and computes the dense statistics; the driver merges the counts into the
    vocabularies (components.feature_state.advance_feature_state). `evict` says which run this is:
    - the daily run (True): eviction, room for `config.growth_rows` more values per table, and dense
      transforms recomputed from `frame`;
    - a minute run (False): no table grows past its previous size and the previous dense transforms are kept,
      so the minute's model has its parent's shape and inputs and its delta only changes rows.
    """
    counts = categorical_counts(frame, day).toArrow()
    dense = dense_statistics(frame) if evict or previous is None else previous.dense
    return advance_feature_state(
        previous, counts, day=day, min_count=config.min_count, dense=dense, version=version,
        evict_after_days=config.evict_after_days if evict else 0,
        max_rows_per_feature=config.max_rows_per_feature,
        growth_rows=config.growth_rows if evict else 0, fixed_tables=not evict,
    )


def write_feature_state(state: FeatureState, directory: Path, inputs: dict, num_rows: int) -> dict:
    staging = staging_dir(directory)
    files = save_feature_state(state, staging)
    manifest = write_manifest(
        staging, kind=FEATURE_STATE_KIND, version=state.version, files=files, inputs=inputs,
        row_counts={"training_rows": num_rows},
        extra={**state.summary(), "evicted_rows": {k: list(v) for k, v in state.evicted_rows.items() if v}},
    )
    commit_dir(staging, directory)
    return manifest
