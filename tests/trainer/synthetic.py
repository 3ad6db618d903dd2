"""Synthetic click data with a planted signal, written as block TFRecords like the Spark job writes them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from components.block_codec import encode_blocks, frame_records
from components.schema import CATEGORICAL_FEATURES, NUM_CATEGORICAL, NUM_DENSE, NUM_RESERVED_ROWS


@dataclass(frozen=True)
class Rows:
    labels: np.ndarray  # float32 [n]
    dense: np.ndarray  # float32 [n, DENSE_INPUT_DIM]: standardized values, then missing indicators
    categorical: np.ndarray  # int64 [n, NUM_CATEGORICAL]

    def __len__(self) -> int:
        return len(self.labels)

    def slice(self, start: int, stop: int) -> Rows:
        return Rows(self.labels[start:stop], self.dense[start:stop], self.categorical[start:stop])


def table_sizes(num_values: int) -> dict[str, int]:
    return {name: NUM_RESERVED_ROWS + num_values for name in CATEGORICAL_FEATURES}


def random_rows(num_rows: int, num_values: int, seed: int) -> Rows:
    """Rows whose labels follow a planted signal: a dense weight, per-value effects of C1 and C2, and an
    interaction of C3 with I2, so a model that learns beats chance by a wide margin."""
    rng = np.random.default_rng(seed)
    standardized = rng.standard_normal((num_rows, NUM_DENSE))
    missing = rng.random((num_rows, NUM_DENSE)) < 0.1
    standardized[missing] = 0.0
    dense = np.concatenate([standardized, missing], axis=1).astype(np.float32)
    categorical = rng.integers(0, num_values, (num_rows, NUM_CATEGORICAL)) + NUM_RESERVED_ROWS
    # Fixed effects: every seed draws rows from the same world, so train and eval sets agree.
    effects = np.random.default_rng(12345).standard_normal((2, NUM_RESERVED_ROWS + num_values)) * 1.5
    logit = (
        -1.0
        + 1.2 * standardized[:, 0]
        + effects[0][categorical[:, 0]]
        + effects[1][categorical[:, 1]]
        + 1.5 * np.where(categorical[:, 2] % 2 == 0, 1.0, -1.0) * np.sign(standardized[:, 1])
    )
    labels = (rng.random(num_rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return Rows(labels, dense, categorical.astype(np.int64))


def write_block_files(rows: Rows, directory: Path, num_files: int, block_rows: int) -> list[str]:
    """Splits `rows` into `num_files` consecutive parts, one block TFRecord file each; returns the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, len(rows), num_files + 1).astype(int)
    paths = []
    for index, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        part = rows.slice(start, stop)
        path = directory / f"part-{index:05d}.tfrecord"
        path.write_bytes(frame_records(encode_blocks(part.labels, part.dense, part.categorical, block_rows)))
        paths.append(str(path))
    return paths



def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve, from scikit-learn: a reference independent of components.evaluation's."""
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(np.asarray(labels).ravel(), np.asarray(scores).ravel()))
