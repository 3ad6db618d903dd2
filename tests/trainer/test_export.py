import subprocess
import sys
import textwrap
from typing import Any

import keras
import numpy as np
import pyarrow as pa
import pytest
import tensorflow as tf

from components.config import TrainConfig
from components.feature_state import DenseTransform, FeatureState, Vocabulary, categorical_rows, transform_dense
from components.schema import CATEGORICAL_FEATURES, DENSE_FEATURES, MISSING_ROW, NUM_RESERVED_ROWS, RARE_ROW
from trainer.export import RawFeaturePreprocessor, export_serving_model
from trainer.models import build_model
from trainer.train import compile_model

pytestmark = pytest.mark.integration

NAN = float("nan")

# Raw rows as a request would carry them: NaN / "" are missing values.
RAW_DENSE = np.array(
    [
        [NAN] * 13,
        [0.0] * 13,
        [-1, -3, -100, -2, -1, 0, -7, -1, -50, -1, -2, -3, -1e6],
        [1e9, 2.0**40, 3e12, 12345678, 1e15, 7, 99999, 1e7, 4.0e9, 1e20, 5, 1, 3e10],
        [1, 2, 3, 4, NAN, 6, 7, 8, 9, 10, 11, 12, NAN],
        [0.5, NAN, 250, 0, 1, NAN, 3, 2.0**31, -2.0**31, 64, 0, 18, 2],
    ],
    dtype=np.float32,
)


def feature_state() -> FeatureState:
    vocabularies = {name: (f"{name}-common", f"{name}-second", "9f3c2a71") for name in CATEGORICAL_FEATURES}
    vocabularies["C2"] = ("only-in-c2", "0", "é-unicode")
    vocabularies["C26"] = ()  # a feature with no admitted values: everything is rare or missing
    return FeatureState(
        version="fs-test",
        min_count=2,
        vocabularies={
            **{name: Vocabulary.of(values, [5] * len(values)) for name, values in vocabularies.items()},
            # After an eviction: rows out of value order, with freed rows between them.
            "C5": Vocabulary(("C5-common", "C5-second", "9f3c2a71"), (6, 2, 4), (5, 5, 5), (0, 0, 0), 8, (3, 5, 7)),
        },
        dense=tuple(
            DenseTransform(name, low=-2 - 0.1 * i, high=5 + 0.3 * i, mean=0.4 + 0.05 * i, std=1.2 + 0.1 * i)
            for i, name in enumerate(DENSE_FEATURES)
        ),
    )


def raw_categorical(state: FeatureState) -> np.ndarray:
    columns = []
    for name in CATEGORICAL_FEATURES:
        vocabulary = state.vocabularies[name].values or ("never-admitted",)
        columns.append(
            [
                "",  # missing
                vocabulary[0],  # admitted
                "zzz-unknown",  # never seen
                "only-in-c2",  # admitted in C2 only
                vocabulary[-1],
                "9f3c2a71" if name != "C2" else "",
            ]
        )
    return np.array(columns, dtype=object).T


def reference_inputs(state: FeatureState, dense: np.ndarray, categorical: np.ndarray) -> dict[str, Any]:
    """The model inputs the Spark job would write for these raw rows."""
    rows = [
        categorical_rows(pa.array(list(values), pa.string()), *state.lookup(name))
        for values, name in zip(categorical.T, CATEGORICAL_FEATURES, strict=True)
    ]
    return {"dense": transform_dense(dense, state), "categorical": np.stack(rows, axis=1)}


def raw_request(categorical: np.ndarray) -> dict[str, tf.Tensor]:
    request = {name: tf.constant(RAW_DENSE[:, j]) for j, name in enumerate(DENSE_FEATURES)}
    for values, name in zip(categorical.T, CATEGORICAL_FEATURES, strict=True):
        request[name] = tf.constant(list(values))
    return request


@pytest.fixture(scope="module")
def model_and_state():
    state = feature_state()
    keras.utils.set_random_seed(3)
    # rare_row_rate and dropout: a model that draws in training exports like any other (its draws' state is no
    # weight, and the packed endpoints' per-precision twin of it is built before any graph is traced).
    model = build_model(TrainConfig(embedding_dim=4, num_cross_layers=1, mlp_units=(8,), rare_row_rate=0.1,
                                    dropout=0.5), state.table_sizes())
    # Spread the embeddings so that a wrong row anywhere changes the probability visibly.
    embeddings = model.embedding.embeddings
    embeddings.assign(np.random.default_rng(0).normal(0, 0.8, embeddings.shape).astype("float32"))
    return model, state


def test_preprocessing_in_the_graph_equals_the_reference_transforms(model_and_state):
    _, state = model_and_state
    categorical = raw_categorical(state)
    expected = reference_inputs(state, RAW_DENSE, categorical)
    got = RawFeaturePreprocessor(state)(raw_request(categorical))
    np.testing.assert_array_equal(got["categorical"].numpy(), expected["categorical"])
    np.testing.assert_allclose(got["dense"].numpy(), expected["dense"], rtol=1e-6, atol=1e-7)
    # The cases the rows cover, spelled out for C1 and C2.
    assert expected["categorical"][:, 0].tolist() == [MISSING_ROW, 2, RARE_ROW, RARE_ROW, 4, 4]
    assert expected["categorical"][:, 1].tolist() == [MISSING_ROW, 2, RARE_ROW, 2, 4, MISSING_ROW]
    assert set(expected["categorical"][:, -1].tolist()) == {MISSING_ROW, RARE_ROW}
    # C5's vocabulary was left with holes by an eviction: values keep their own rows, not their positions.
    assert expected["categorical"][:, 4].tolist() == [MISSING_ROW, 6, RARE_ROW, RARE_ROW, 4, 4]
    assert np.delete(expected["categorical"], 4, axis=1).max() < NUM_RESERVED_ROWS + 3


def test_saved_model_serves_raw_features_like_the_model(model_and_state, tmp_path):
    model, state = model_and_state
    categorical = raw_categorical(state)
    expected = model.predict(reference_inputs(state, RAW_DENSE, categorical), verbose=0).reshape(-1)
    assert np.ptp(expected) > 1e-3  # rows differ, so a wrong mapping cannot hide

    files = export_serving_model(model, state, tmp_path)

    assert "saved_model/saved_model.pb" in files
    assert all((tmp_path / name).is_file() for name in files)
    signature = tf.saved_model.load(str(tmp_path / "saved_model")).signatures["serving_default"]
    _, inputs = signature.structured_input_signature
    assert set(inputs) == set(DENSE_FEATURES) | set(CATEGORICAL_FEATURES)
    assert inputs["I1"] == tf.TensorSpec([None], tf.float32, name="i1")
    assert inputs["C1"] == tf.TensorSpec([None], tf.string, name="c1")
    served = signature(**raw_request(categorical))
    assert list(served) == ["probability"] and served["probability"].dtype == tf.float32
    np.testing.assert_allclose(served["probability"].numpy(), expected, rtol=0, atol=1e-5)

    # A fresh interpreter that cannot import the project's code serves the same numbers.
    np.savez(tmp_path / "request.npz", dense=RAW_DENSE, categorical=categorical.astype(str))
    script = textwrap.dedent(
        f"""
        import sys

        class Blocked:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("trainer", "components"):
                    raise ImportError("blocked: " + name)

        sys.meta_path.insert(0, Blocked())
        import numpy as np
        import tensorflow as tf

        request = np.load({str(tmp_path / "request.npz")!r})
        dense_names = {list(DENSE_FEATURES)!r}
        categorical_names = {list(CATEGORICAL_FEATURES)!r}
        inputs = {{name: tf.constant(request["dense"][:, j]) for j, name in enumerate(dense_names)}}
        for j, name in enumerate(categorical_names):
            inputs[name] = tf.constant(request["categorical"][:, j])
        serve = tf.saved_model.load({str(tmp_path / "saved_model")!r}).signatures["serving_default"]
        np.save({str(tmp_path / "served.npy")!r}, serve(**inputs)["probability"].numpy())
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    np.testing.assert_allclose(np.load(tmp_path / "served.npy"), expected, rtol=0, atol=1e-5)


def test_a_checkpoint_loads_after_importing_the_export_module(model_and_state, tmp_path):
    model, _ = model_and_state
    compile_model(model, TrainConfig(micro_batches=2))
    model.save(tmp_path / "model.keras")
    script = textwrap.dedent(
        f"""
        import keras
        import trainer.export

        model = keras.saving.load_model({str(tmp_path / "model.keras")!r})
        optimizer = model.optimizer
        print(type(model).__name__, type(optimizer).__name__, optimizer.gradient_accumulation_steps)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["DCNv2", "EmbeddingAdagrad", "2"]


def test_export_replaces_an_older_saved_model(model_and_state, tmp_path):
    model, state = model_and_state
    stale = tmp_path / "saved_model" / "stale.txt"
    stale.parent.mkdir()
    stale.write_text("from an older export")
    files = export_serving_model(model, state, tmp_path)
    assert not stale.exists() and "saved_model/stale.txt" not in files
