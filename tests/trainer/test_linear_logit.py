import re

import keras
import numpy as np
import pytest

from trainer.layers.linear_logit import LinearLogit

pytestmark = pytest.mark.unit

to_numpy = keras.ops.convert_to_numpy
DENSE = np.array([[1.0, -2.0]], dtype="float32")
CATEGORICAL = np.array([[1, 2]], dtype="int64")


def test_adds_dense_weights_value_weights_and_bias():
    layer = LinearLogit([2, 3])
    layer.build((None, 2), (None, 2))
    value_weights = np.array([[0.1], [0.2], [0.3], [0.4], [0.5]], "float32")  # feature 0: rows 0-1, feature 1: 2-4
    layer.set_weights([np.array([[3.0], [1.0]], "float32"), np.array([0.25], "float32"), value_weights])
    # 3 * 1 + 1 * -2 + v[1] + v[2 + 2] + 0.25 = 1 + 0.2 + 0.5 + 0.25
    np.testing.assert_allclose(to_numpy(layer(DENSE, CATEGORICAL)), [[1.95]], rtol=1e-6)


def test_starts_at_zero():
    np.testing.assert_array_equal(to_numpy(LinearLogit([2, 3])(DENSE, CATEGORICAL)), [[0.0]])


def test_weight_shapes_and_hashed_features_always_sum():
    layer = LinearLogit(
        [2, 1000], {"hashed_features": [1], "num_hash_buckets": 7, "num_hash_functions": 2, "hash_combiner": "concat"}
    )
    layer.build((None, 4), (None, 2))
    assert layer.value_weights.hash_combiner == "sum"  # a width of 1 cannot be split between tables
    assert [tuple(w.shape) for w in layer.weights] == [(4, 1), (1,), (2, 1), (14, 1)]
    assert layer.value_weights.embeddings.name == "embeddings"  # the optimizer's embedding learning rate


def test_invalid_embedding_options_are_named():
    with pytest.raises(ValueError, match=re.escape("table_sizes=[0]")):
        LinearLogit([0])
    with pytest.raises(ValueError, match=re.escape("num_hash_buckets=None")):
        LinearLogit([4, 5], {"hashed_features": [0]})


def test_needs_a_known_dense_width():
    with pytest.raises(ValueError, match=re.escape("Received: dense_shape=(None, None)")):
        LinearLogit([2]).build((None, None), (None, 1))


def test_config_round_trip():
    layer = LinearLogit([2, 9], {"hashed_features": [1], "num_hash_buckets": 3}, kernel_regularizer="l2", name="wide")
    config = layer.get_config()
    assert {"table_sizes", "embedding_options", "kernel_regularizer"} <= set(config)
    restored = LinearLogit.from_config(config)
    assert restored.get_config() == config


def test_save_and_load_round_trip(tmp_path):
    dense, categorical = keras.Input((2,)), keras.Input((2,), dtype="int64")
    layer = LinearLogit([2, 3], kernel_regularizer=None)
    model = keras.Model([dense, categorical], layer(dense, categorical))
    layer.set_weights([w + np.arange(w.size).reshape(w.shape) for w in layer.get_weights()])
    model.save(tmp_path / "linear.keras")
    loaded = keras.saving.load_model(tmp_path / "linear.keras")
    data = [DENSE, CATEGORICAL]
    np.testing.assert_array_equal(loaded.predict(data, verbose=0), model.predict(data, verbose=0))
    assert model.predict(data, verbose=0)[0, 0] != 0
