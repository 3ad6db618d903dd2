"""Tiny SavedModels with the serving contract's 39 raw inputs, whose outputs are easy to compute by hand.

probability = sigmoid(dense_weight * (sum of the non-missing I1..I13) + c1_weight * (C1 == "abc"))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tensorflow as tf

from components.manifest import write_manifest
from components.schema import CATEGORICAL_FEATURES, DENSE_FEATURES

MODEL_NAME = "ctr"
OLD_VERSION = "202601010000"
NEW_VERSION = "202601010100"
# (dense_weight, c1_weight) of each fixture version: the two score every test instance differently.
WEIGHTS = {OLD_VERSION: (0.1, 0.5), NEW_VERSION: (-0.3, 2.0)}

INPUT_SIGNATURE = {
    **{name: tf.TensorSpec([None], tf.float32, name=name) for name in DENSE_FEATURES},
    **{name: tf.TensorSpec([None], tf.string, name=name) for name in CATEGORICAL_FEATURES},
}


class FixtureModel(tf.Module):
    def __init__(self, dense_weight: float, c1_weight: float) -> None:
        super().__init__()
        self.dense_weight = tf.Variable(dense_weight, dtype=tf.float32)
        self.c1_weight = tf.Variable(c1_weight, dtype=tf.float32)

    @tf.function(input_signature=[INPUT_SIGNATURE])
    def serve(self, features: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        dense = tf.stack([features[name] for name in DENSE_FEATURES], axis=1)
        dense_sum = tf.reduce_sum(tf.where(tf.math.is_nan(dense), tf.zeros_like(dense), dense), axis=1)
        c1_hit = tf.cast(tf.equal(features["C1"], "abc"), tf.float32)
        return {"probability": tf.sigmoid(self.dense_weight * dense_sum + self.c1_weight * c1_hit)}


def export_fixture_model(directory: Path, version: str) -> Path:
    """Writes <directory>/saved_model and a full_model manifest naming every file in it."""
    module = FixtureModel(*WEIGHTS[version])
    tf.saved_model.save(
        module,
        str(directory / "saved_model"),
        signatures={"serving_default": module.serve.get_concrete_function()},
    )
    files = [
        str(path.relative_to(directory)) for path in (directory / "saved_model").rglob("*") if path.is_file()
    ]
    write_manifest(directory, kind="full_model", version=version, files=files)
    return directory


class FixedSource:
    """A model source that never changes, for tests of the HTTP layer alone."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def current(self) -> Any:
        return self.model

    def models(self) -> list[Any]:
        return [] if self.model is None else [self.model]

    def labels(self) -> dict[str, str]:
        return {}


def corrupt(directory: Path) -> None:
    """Flips the content of the model's variables after it was published, keeping its size."""
    (path,) = (directory / "saved_model" / "variables").glob("variables.data-*")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
