import re

import keras
import numpy as np
import pytest

from trainer.layers.target_attention import TargetAttention

pytestmark = pytest.mark.unit

to_numpy = keras.ops.convert_to_numpy
TARGET = np.array([[1.0]], dtype="float32")
BEHAVIOURS = np.array([[[1.0], [2.0], [3.0]]], dtype="float32")
FIRST_TWO = np.array([[True, True, False]])


def hand_layer(use_softmax: bool) -> TargetAttention:
    # One hidden unit that reads target * behaviour only, and an output that copies it: score_t = b_t.
    layer = TargetAttention(hidden_units=[1], use_softmax=use_softmax)
    layer.build((None, 1), (None, 3, 1))
    layer.set_weights(
        [np.array([[0.0], [0.0], [0.0], [1.0]], "float32"), np.zeros(1, "float32"),
         np.ones((1, 1), "float32"), np.zeros(1, "float32")]
    )
    return layer


def test_raw_scores_weight_the_sum():
    pooled, weights = hand_layer(use_softmax=False)(TARGET, BEHAVIOURS, return_attention_scores=True)
    np.testing.assert_allclose(to_numpy(weights), [[1.0, 2.0, 3.0]])
    np.testing.assert_allclose(to_numpy(pooled), [[14.0]])  # 1 * 1 + 2 * 2 + 3 * 3


def test_padding_gets_no_weight():
    pooled, weights = hand_layer(use_softmax=False)(TARGET, BEHAVIOURS, mask=FIRST_TWO, return_attention_scores=True)
    np.testing.assert_allclose(to_numpy(weights), [[1.0, 2.0, 0.0]])
    np.testing.assert_allclose(to_numpy(pooled), [[5.0]])


def test_softmax_normalizes_over_valid_steps():
    pooled, weights = hand_layer(use_softmax=True)(TARGET, BEHAVIOURS, mask=FIRST_TWO, return_attention_scores=True)
    # softmax([1, 2]) = [0.26894, 0.73106]; pooled = 0.26894 * 1 + 0.73106 * 2
    np.testing.assert_allclose(to_numpy(weights), [[0.268941, 0.731059, 0.0]], rtol=1e-5)
    np.testing.assert_allclose(to_numpy(pooled), [[1.731059]], rtol=1e-5)


def test_softmax_over_padding_only_pools_zeros():
    pooled = hand_layer(use_softmax=True)(TARGET, BEHAVIOURS, mask=np.zeros((1, 3), dtype=bool))
    np.testing.assert_array_equal(to_numpy(pooled), [[0.0]])


def test_weight_shapes():
    layer = TargetAttention(hidden_units=[8, 4])
    layer.build((None, 5), (None, 7, 5))
    assert [tuple(w.shape) for w in layer.weights] == [(20, 8), (8,), (8, 4), (4,), (4, 1), (1,)]


@pytest.mark.parametrize("hidden_units", [[], [0], [4, -1], "8", 3])
def test_invalid_hidden_units(hidden_units):
    with pytest.raises(ValueError, match=re.escape(f"hidden_units={hidden_units!r}")):
        TargetAttention(hidden_units=hidden_units)


def test_invalid_use_softmax():
    with pytest.raises(ValueError, match=re.escape("use_softmax='yes'")):
        TargetAttention(use_softmax="yes")


def test_target_and_behaviours_must_share_a_dim():
    with pytest.raises(ValueError, match=re.escape("target_shape=(None, 4), behaviours_shape=(None, 7, 5)")):
        TargetAttention().build((None, 4), (None, 7, 5))


def test_config_round_trip():
    layer = TargetAttention(
        hidden_units=[6, 3], activation="sigmoid", use_softmax=True, kernel_initializer="he_normal",
        kernel_regularizer="l2", name="attention",
    )
    config = layer.get_config()
    arguments = {"hidden_units", "activation", "use_softmax", "kernel_initializer", "kernel_regularizer"}
    assert arguments <= set(config)
    restored = TargetAttention.from_config(config)
    assert restored.get_config() == config and restored.use_softmax is True


def test_save_and_load_round_trip(tmp_path):
    target, behaviours = keras.Input((2,)), keras.Input((4, 2))
    model = keras.Model([target, behaviours], TargetAttention(hidden_units=[3])(target, behaviours))
    rng = np.random.default_rng(0)
    data = [rng.standard_normal((3, 2)).astype("float32"), rng.standard_normal((3, 4, 2)).astype("float32")]
    model.save(tmp_path / "attention.keras")
    loaded = keras.saving.load_model(tmp_path / "attention.keras")
    np.testing.assert_array_equal(loaded.predict(data, verbose=0), model.predict(data, verbose=0))
