"""A real model chain for serving tests: a full export of a small DCNv2 and deltas from training it further.

Each step trains the Keras model for real (row-sparse Adagrad) on rows whose categorical values come from a
small set, admits one new vocabulary value into a row the table already had, and writes the delta between the
weights before and after, exactly as the incremental pipeline does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from components.config import TrainConfig
from components.delta import delta_arrays, write_delta
from components.feature_state import DenseTransform, FeatureState, Vocabulary, categorical_rows, transform_dense
from components.manifest import write_manifest
from components.schema import CATEGORICAL_FEATURES, DENSE_FEATURES, NUM_RESERVED_ROWS
from trainer.export import export_serving_model, weight_specs
from trainer.models import build_model
from trainer.train import compile_model

MODEL_NAME = "ctr"
FULL_VERSION = "202601020000"
TABLE_ROWS = 64  # per feature: admitted values use the first rows, the rest is room for minute admissions
CONFIG = TrainConfig(model="dcnv2", embedding_dim=4, num_cross_layers=1, mlp_units=(8,), batch_size=32,
                     learning_rate=0.05, embedding_learning_rate=0.5)


@dataclass
class ChainStep:
    version: str
    state: FeatureState
    weights: list[np.ndarray]
    directory: Path


def initial_state() -> FeatureState:
    vocabularies = {
        name: Vocabulary(tuple(f"{name}-v{i}" for i in range(8)),
                         tuple(range(NUM_RESERVED_ROWS, NUM_RESERVED_ROWS + 8)), (50,) * 8, (0,) * 8, TABLE_ROWS, ())
        for name in CATEGORICAL_FEATURES
    }
    dense = tuple(DenseTransform(name, low=-3.0, high=8.0, mean=0.5, std=1.5) for name in DENSE_FEATURES)
    return FeatureState(version="fs-0", min_count=2, vocabularies=vocabularies, dense=dense)


def admit(state: FeatureState, feature: str, value: str, version: str) -> FeatureState:
    """The state with `value` admitted into the next unused row of `feature`'s table."""
    vocabulary = state.vocabularies[feature]
    row = max(vocabulary.rows) + 1
    grown = replace(vocabulary, values=(*vocabulary.values, value), rows=(*vocabulary.rows, row),
                    counts=(*vocabulary.counts, 5), last_seen=(*vocabulary.last_seen, 0))
    return replace(state, version=version, vocabularies={**state.vocabularies, feature: grown})


def raw_rows(state: FeatureState, num_rows: int, seed: int) -> dict[str, list[Any]]:
    """Raw request columns: admitted, unknown and missing categorical values, dense values with NaNs."""
    rng = np.random.default_rng(seed)
    columns: dict[str, list[Any]] = {}
    for name in DENSE_FEATURES:
        values = rng.lognormal(1.0, 1.5, num_rows).astype(np.float32)
        values[rng.random(num_rows) < 0.2] = np.nan
        columns[name] = [float(v) for v in values]
    for name in CATEGORICAL_FEATURES:
        choices = [*state.vocabularies[name].values, "never-seen", ""]
        columns[name] = [choices[i] for i in rng.integers(0, len(choices), num_rows)]
    return columns


def model_inputs(state: FeatureState, columns: dict[str, list[Any]]) -> dict[str, np.ndarray]:
    """What the samples job writes for these raw rows: the trainer's view of them."""
    dense = np.array([columns[name] for name in DENSE_FEATURES], dtype=np.float32).T
    rows = [categorical_rows(pa.array(columns[name], pa.string()), *state.lookup(name))
            for name in CATEGORICAL_FEATURES]
    return {"dense": transform_dense(dense, state).astype(np.float32), "categorical": np.stack(rows, axis=1)}


def predictions(model: Any, state: FeatureState, columns: dict[str, list[Any]]) -> np.ndarray:
    return np.asarray(model(model_inputs(state, columns), training=False)).reshape(-1)


def export_full(model: Any, state: FeatureState, directory: Path, version: str) -> Path:
    files = export_serving_model(model, state, directory)
    write_manifest(directory, kind="full_model", version=version, files=files,
                   extra={"parent": None, "chain_root": version, "weight_specs": weight_specs(model),
                          "data_end": "2026-01-02T00:00:00+00:00"})
    return directory


def train_step(model: Any, state: FeatureState, seed: int, num_rows: int = 256) -> None:
    columns = raw_rows(state, num_rows, seed)
    labels = (np.random.default_rng(seed + 1).random(num_rows) < 0.3).astype(np.float32)
    model.fit(model_inputs(state, columns), labels, batch_size=CONFIG.batch_size, epochs=1, verbose=0, shuffle=False)


def build_chain(root: Path, num_deltas: int) -> tuple[Any, list[ChainStep]]:
    """A trained model, its full export and `num_deltas` deltas, each one minute later than its parent."""
    import keras

    keras.utils.set_random_seed(11)
    state = initial_state()
    model = build_model(CONFIG, state.table_sizes())
    compile_model(model, CONFIG)
    train_step(model, state, seed=0)
    steps = [ChainStep(FULL_VERSION, state, [np.array(v) for v in model.weights],
                       export_full(model, state, root / FULL_VERSION, FULL_VERSION))]
    for index in range(1, num_deltas + 1):
        parent = steps[-1]
        version = str(int(FULL_VERSION) + index)
        state = admit(parent.state, CATEGORICAL_FEATURES[index % 26], f"new-{index}", f"fs-{index}")
        train_step(model, state, seed=index)
        weights = [np.array(v) for v in model.weights]
        directory = root / version
        write_delta(directory, delta_arrays(parent.weights, weights, parent.state, state), version=version,
                    parent=parent.version, chain_root=FULL_VERSION, weight_specs=weight_specs(model),
                    extra={"data_end": f"2026-01-02T00:{index:02d}:00+00:00"})
        steps.append(ChainStep(version, state, weights, directory))
    return model, steps


def load_weights(model: Any, step: ChainStep) -> None:
    for variable, value in zip(model.weights, step.weights, strict=True):
        variable.assign(value)
