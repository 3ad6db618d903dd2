import re

import keras
import numpy as np
import pytest

from trainer.layers.feature_cross import FeatureCross

pytestmark = pytest.mark.unit

X0 = np.array([[1.0, 2.0]], dtype="float32")
X = np.array([[3.0, -1.0]], dtype="float32")
BIAS = np.array([0.5, -0.5], dtype="float32")


def test_full_rank_matches_hand_computation():
    layer = FeatureCross()
    layer.build(X0.shape)
    layer.set_weights([np.array([[1.0, 2.0], [3.0, 4.0]], dtype="float32"), BIAS])
    # x @ W = [3 - 3, 6 - 4] = [0, 2]; + b = [0.5, 1.5]; x0 * that = [0.5, 3]; + x = [3.5, 2]
    np.testing.assert_allclose(keras.ops.convert_to_numpy(layer(X0, X)), [[3.5, 2.0]])


def test_low_rank_matches_hand_computation():
    layer = FeatureCross(projection_dim=1)
    layer.build(X0.shape)
    down, up = np.array([[1.0], [2.0]], dtype="float32"), np.array([[1.0, -1.0]], dtype="float32")
    layer.set_weights([down, up, BIAS])
    # x @ U = 3 - 2 = 1; @ V = [1, -1]; + b = [1.5, -1.5]; x0 * that = [1.5, -3]; + x = [4.5, -4]
    np.testing.assert_allclose(keras.ops.convert_to_numpy(layer(X0, X)), [[4.5, -4.0]])


def test_without_previous_layer_output_crosses_x0_with_itself():
    layer = FeatureCross(use_bias=False, kernel_initializer="ones")
    # x0 @ ones = [3, 3]; x0 * 3 + x0 = [4, 8]
    np.testing.assert_allclose(keras.ops.convert_to_numpy(layer(X0)), [[4.0, 8.0]])


@pytest.mark.parametrize(
    ("kwargs", "expected_shapes"),
    [
        ({}, [(5, 5), (5,)]),
        ({"projection_dim": 2}, [(5, 2), (2, 5), (5,)]),
        ({"use_bias": False}, [(5, 5)]),
    ],
)
def test_weight_shapes(kwargs, expected_shapes):
    layer = FeatureCross(**kwargs)
    layer.build((None, 5))
    assert [tuple(w.shape) for w in layer.weights] == expected_shapes


@pytest.mark.parametrize("projection_dim", [0, -3, 2.5, True, "4"])
def test_invalid_projection_dim(projection_dim):
    with pytest.raises(ValueError, match=re.escape(f"projection_dim={projection_dim!r}")):
        FeatureCross(projection_dim=projection_dim)


def test_unknown_width_is_rejected():
    with pytest.raises(ValueError, match=r"known last input dimension.*\(None, None\)"):
        FeatureCross().build((None, None))


def test_config_round_trip():
    layer = FeatureCross(
        projection_dim=3, use_bias=False, kernel_initializer="he_normal", bias_initializer="ones",
        kernel_regularizer="l2", name="cross",
    )
    config = layer.get_config()
    arguments = {"projection_dim", "use_bias", "kernel_initializer", "bias_initializer", "kernel_regularizer"}
    assert arguments <= set(config)
    restored = FeatureCross.from_config(config)
    assert restored.get_config() == config
    assert restored.projection_dim == 3 and restored.use_bias is False


def test_save_and_load_round_trip(tmp_path):
    x0 = keras.Input((4,))
    x = FeatureCross(projection_dim=2)(x0)
    model = keras.Model(x0, FeatureCross()(x0, x))
    data = np.random.default_rng(0).standard_normal((3, 4)).astype("float32")
    model.save(tmp_path / "cross.keras")
    loaded = keras.saving.load_model(tmp_path / "cross.keras")
    np.testing.assert_array_equal(loaded.predict(data, verbose=0), model.predict(data, verbose=0))
