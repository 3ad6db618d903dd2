"""Feature generation: vocabularies with min-count admission and dense transforms -> a feature state.

extract (raw minute partitions) -> pure transforms (counts, vocabulary, dense statistics) -> load
(feature-state directory with manifest, committed atomically). Runnable with spark-submit:

    spark-submit spark_jobs/features.py --start 2026-01-01T00:00 --end 2026-01-01T01:00
"""

from __future__ import annotations

from pathlib import Path

from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

from components.feature_state import FEATURE_STATE_KIND, DenseTransform, FeatureState, save_feature_state
from components.manifest import commit_dir, staging_dir, write_manifest
from components.schema import CATEGORICAL_FEATURES, DENSE_FEATURES, NUM_RESERVED_ROWS

CLIP_QUANTILES = (0.001, 0.999)
QUANTILE_RELATIVE_ERROR = 1e-4


def categorical_counts(frame: DataFrame) -> DataFrame:
    """(feature, value, count) over all categorical columns; missing values are not counted."""
    pairs = F.explode(F.array(*[
        F.struct(F.lit(name).alias("feature"), F.col(name).alias("value")) for name in CATEGORICAL_FEATURES
    ]))
    return (
        frame.select(pairs.alias("pair"))
        .select("pair.feature", "pair.value")
        .where(F.col("value").isNotNull())
        .groupBy("feature", "value")
        .agg(F.count(F.lit(1)).alias("count"))
    )


def build_vocabulary(counts: DataFrame, min_count: int) -> DataFrame:
    """Admits values seen at least `min_count` times; rows ordered by count desc then value, from the first
    free row after the reserved ones. Ties are broken by value so the result is deterministic."""
    order = Window.partitionBy("feature").orderBy(F.col("count").desc(), F.col("value").asc())
    return (
        counts.where(F.col("count") >= min_count)
        .withColumn("row", (F.row_number().over(order) + (NUM_RESERVED_ROWS - 1)).cast("long"))
        .select("feature", "value", "row", "count")
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


def to_feature_state(vocabulary_rows: list, dense: tuple[DenseTransform, ...], version: str,
                     min_count: int) -> FeatureState:
    by_feature: dict[str, list[tuple[int, str, int]]] = {name: [] for name in CATEGORICAL_FEATURES}
    for row in vocabulary_rows:
        by_feature[row["feature"]].append((row["row"], row["value"], row["count"]))
    vocabularies, counts = {}, {}
    for name, entries in by_feature.items():
        entries.sort()
        vocabularies[name] = tuple(value for _, value, _ in entries)
        counts[name] = tuple(count for _, _, count in entries)
    return FeatureState(version=version, min_count=min_count, vocabularies=vocabularies, counts=counts, dense=dense)


def build_feature_state(frame: DataFrame, min_count: int, version: str) -> FeatureState:
    """The whole feature-state computation on parsed training rows."""
    vocabulary = build_vocabulary(categorical_counts(frame), min_count).collect()
    return to_feature_state(vocabulary, dense_statistics(frame), version, min_count)


def write_feature_state(state: FeatureState, directory: Path, inputs: dict, num_rows: int) -> dict:
    staging = staging_dir(directory)
    files = save_feature_state(state, staging)
    manifest = write_manifest(
        staging, kind=FEATURE_STATE_KIND, version=state.version, files=files, inputs=inputs,
        row_counts={"training_rows": num_rows},
        extra={"min_count": state.min_count, "table_sizes": state.table_sizes(),
               "vocabulary_sizes": {k: len(v) for k, v in state.vocabularies.items()}},
    )
    commit_dir(staging, directory)
    return manifest
