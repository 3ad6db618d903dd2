"""The feature state: per categorical feature a vocabulary (value -> embedding row), per dense feature its
transform. Spark builds it, the sample writer and the exported serving model apply it, so the same raw value
maps to the same row everywhere.

Files in a feature-state directory: vocabulary.parquet (feature, value, row, count), dense.json, manifest.json.
The functions `categorical_rows` and `transform_dense` are the reference transforms; the SavedModel's
TensorFlow version is tested against them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from components.schema import (
    CATEGORICAL_FEATURES,
    DENSE_FEATURES,
    MISSING_ROW,
    NUM_DENSE,
    NUM_RESERVED_ROWS,
    RARE_ROW,
)

VOCABULARY_FILE = "vocabulary.parquet"
DENSE_FILE = "dense.json"
FEATURE_STATE_KIND = "feature_state"


@dataclass(frozen=True)
class DenseTransform:
    """x -> standardize(clip(sign(x) * log1p(|x|), low, high)); missing -> 0 with an indicator of 1."""

    name: str
    low: float
    high: float
    mean: float
    std: float


@dataclass(frozen=True)
class FeatureState:
    version: str
    min_count: int
    # Admitted values of each categorical feature in row order: value i has row NUM_RESERVED_ROWS + i.
    vocabularies: dict[str, tuple[str, ...]]
    counts: dict[str, tuple[int, ...]]
    dense: tuple[DenseTransform, ...]

    def table_size(self, feature: str) -> int:
        return NUM_RESERVED_ROWS + len(self.vocabularies[feature])

    def table_sizes(self) -> dict[str, int]:
        return {name: self.table_size(name) for name in CATEGORICAL_FEATURES}

    def dense_arrays(self) -> dict[str, np.ndarray]:
        return {
            key: np.array([getattr(d, key) for d in self.dense], dtype=np.float64)
            for key in ("low", "high", "mean", "std")
        }


def save_feature_state(state: FeatureState, directory: str | Path) -> list[str]:
    """Writes the state's files into `directory` (a staging dir) and returns their names for the manifest."""
    directory = Path(directory)
    features, values, rows, counts = [], [], [], []
    for name in CATEGORICAL_FEATURES:
        vocab = state.vocabularies[name]
        features.extend([name] * len(vocab))
        values.extend(vocab)
        rows.extend(range(NUM_RESERVED_ROWS, NUM_RESERVED_ROWS + len(vocab)))
        counts.extend(state.counts[name])
    table = pa.table(
        {
            "feature": pa.array(features, pa.string()),
            "value": pa.array(values, pa.string()),
            "row": pa.array(rows, pa.int64()),
            "count": pa.array(counts, pa.int64()),
        }
    )
    pq.write_table(table, directory / VOCABULARY_FILE)
    (directory / DENSE_FILE).write_text(
        json.dumps(
            {"version": state.version, "min_count": state.min_count, "dense": [asdict(d) for d in state.dense]},
            indent=2,
        )
    )
    return [VOCABULARY_FILE, DENSE_FILE]


def load_feature_state(directory: str | Path, verify: bool = True) -> FeatureState:
    from components.manifest import read_manifest

    directory = Path(directory)
    read_manifest(directory, kind=FEATURE_STATE_KIND, verify=verify)
    dense_doc = json.loads((directory / DENSE_FILE).read_text())
    table = pq.read_table(directory / VOCABULARY_FILE).sort_by([("feature", "ascending"), ("row", "ascending")])
    by_feature: dict[str, tuple[list[str], list[int]]] = {name: ([], []) for name in CATEGORICAL_FEATURES}
    for feature, value, row, count in zip(
        table["feature"].to_pylist(), table["value"].to_pylist(), table["row"].to_pylist(),
        table["count"].to_pylist(), strict=True,
    ):
        values, counts = by_feature[feature]
        if row != NUM_RESERVED_ROWS + len(values):
            raise ValueError(f"{directory}: vocabulary of {feature} has a gap at row {row}")
        values.append(value)
        counts.append(count)
    dense = tuple(DenseTransform(**d) for d in dense_doc["dense"])
    if [d.name for d in dense] != list(DENSE_FEATURES):
        raise ValueError(f"{directory}: dense transforms {[d.name for d in dense]} do not match {DENSE_FEATURES}")
    return FeatureState(
        version=dense_doc["version"],
        min_count=dense_doc["min_count"],
        vocabularies={k: tuple(v[0]) for k, v in by_feature.items()},
        counts={k: tuple(v[1]) for k, v in by_feature.items()},
        dense=dense,
    )


def categorical_rows(values: pa.Array, vocabulary: pa.Array) -> np.ndarray:
    """Row ids of raw string values: missing (null or empty) -> MISSING_ROW, unknown or rare -> RARE_ROW."""
    index = pc.index_in(values, value_set=vocabulary)
    rows = pc.fill_null(pc.add(index, NUM_RESERVED_ROWS), RARE_ROW)
    missing = pc.or_kleene(pc.is_null(values), pc.equal(values, "")).fill_null(True)
    return pc.if_else(missing, MISSING_ROW, rows).to_numpy(zero_copy_only=False).astype(np.int64)


def signed_log1p(values: np.ndarray) -> np.ndarray:
    return np.sign(values) * np.log1p(np.abs(values))


def transform_dense(values: np.ndarray, state: FeatureState) -> np.ndarray:
    """[n, 13] raw dense values (NaN = missing) -> [n, 26] float32: standardized values, then indicators."""
    values = np.asarray(values, dtype=np.float64).reshape(-1, NUM_DENSE)
    stats = state.dense_arrays()
    missing = np.isnan(values)
    clipped = np.clip(signed_log1p(np.where(missing, 0.0, values)), stats["low"], stats["high"])
    standardized = np.where(missing, 0.0, (clipped - stats["mean"]) / stats["std"])
    return np.concatenate([standardized, missing.astype(np.float64)], axis=1).astype(np.float32)
