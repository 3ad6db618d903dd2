import re

import keras
import numpy as np
import pytest

from trainer.layers.simple_recurrent_unit import SimpleRecurrentUnit

pytestmark = pytest.mark.unit

to_numpy = keras.ops.convert_to_numpy
SEQUENCE = np.array([[[2.0], [4.0]]], dtype="float32")
KERNEL = np.array([[1.0, 0.0, 0.0]], dtype="float32")  # blocks [x~, forget, reset]


def hand_layer() -> SimpleRecurrentUnit:
    # x~ = x, and gates sigmoid(0) = 0.5: c_t = (c_{t-1} + x_t) / 2, h_t = (c_t + x_t) / 2.
    layer = SimpleRecurrentUnit(units=1)
    layer.build((None, 2, 1))
    layer.set_weights([KERNEL, np.zeros((2, 1), "float32"), np.zeros((2, 1), "float32")])
    return layer


def test_matches_hand_computation():
    # c1 = 1, h1 = 1.5; c2 = 2.5, h2 = 3.25
    np.testing.assert_allclose(to_numpy(hand_layer()(SEQUENCE)), [[[1.5], [3.25]]])


def test_recurrent_weights_reach_the_gates():
    layer = hand_layer()
    layer.set_weights([KERNEL, np.array([[2.0], [0.0]], "float32"), np.zeros((2, 1), "float32")])
    # Step 2's forget gate is sigmoid(2 * c1) = sigmoid(2) = 0.880797: c2 = 0.880797 + 0.119203 * 4
    c2 = 0.880797 * 1.0 + 0.119203 * 4.0
    np.testing.assert_allclose(to_numpy(layer(SEQUENCE))[0, 1, 0], 0.5 * c2 + 0.5 * 4.0, rtol=1e-5)


def test_masked_steps_keep_the_state_and_output_zeros():
    layer = hand_layer()
    np.testing.assert_allclose(to_numpy(layer(SEQUENCE, mask=np.array([[True, False]]))), [[[1.5], [0.0]]])
    # Front padding: step 2 starts from c = 0, as if the sequence began there: c = 2, h = 3.
    np.testing.assert_allclose(to_numpy(layer(SEQUENCE, mask=np.array([[False, True]]))), [[[0.0], [3.0]]])


def test_front_padding_gives_the_outputs_of_the_shorter_sequence():
    layer = SimpleRecurrentUnit(units=3)
    rng = np.random.default_rng(0)
    sequence = rng.standard_normal((2, 4, 3)).astype("float32")
    padded = np.concatenate([rng.standard_normal((2, 2, 3)).astype("float32"), sequence], axis=1)
    mask = np.array([[False, False] + [True] * 4] * 2)
    np.testing.assert_allclose(
        to_numpy(layer(padded, mask=mask))[:, 2:], to_numpy(layer(sequence)), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(("dim", "kernel_shape"), [(4, (4, 12)), (6, (6, 16))])
def test_weight_shapes(dim, kernel_shape):
    # A dim other than units needs a projection of the highway input: a fourth block of the kernel.
    layer = SimpleRecurrentUnit(units=4)
    out = layer(np.zeros((2, 5, dim), dtype="float32"))
    assert [tuple(w.shape) for w in layer.weights] == [kernel_shape, (2, 4), (2, 4)]
    assert tuple(out.shape) == (2, 5, 4)


@pytest.mark.parametrize("units", [0, -1, 2.5, None])
def test_invalid_units(units):
    with pytest.raises(ValueError, match=re.escape(f"units={units!r}")):
        SimpleRecurrentUnit(units)


def test_needs_a_sequence():
    with pytest.raises(ValueError, match=re.escape("with a known dim. Received: inputs_shape=(None, 4)")):
        SimpleRecurrentUnit(4).build((None, 4))


def test_config_round_trip():
    layer = SimpleRecurrentUnit(5, kernel_initializer="ones", kernel_regularizer="l2", name="sru")
    config = layer.get_config()
    assert {"units", "kernel_initializer", "kernel_regularizer"} <= set(config)
    assert SimpleRecurrentUnit.from_config(config).get_config() == config


def test_save_and_load_round_trip(tmp_path):
    sequence = keras.Input((3, 2))
    model = keras.Model(sequence, SimpleRecurrentUnit(4)(sequence))
    data = np.random.default_rng(0).standard_normal((2, 3, 2)).astype("float32")
    model.save(tmp_path / "sru.keras")
    loaded = keras.saving.load_model(tmp_path / "sru.keras")
    np.testing.assert_array_equal(loaded.predict(data, verbose=0), model.predict(data, verbose=0))
