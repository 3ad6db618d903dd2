import re

import keras
import numpy as np
import pytest

from trainer.layers.attentional_update_gru import AttentionalUpdateGRU

pytestmark = pytest.mark.unit

to_numpy = keras.ops.convert_to_numpy
SEQUENCE = np.array([[[1.0], [2.0]]], dtype="float32")


def hand_layer() -> AttentionalUpdateGRU:
    # Kernel blocks [update, reset, candidate]: update gate sigmoid(0) = 0.5, candidate tanh(x_t).
    layer = AttentionalUpdateGRU(units=1)
    layer.build((None, 2, 1), (None, 2))
    zeros = np.zeros(3, "float32")
    layer.set_weights([np.array([[0.0, 0.0, 1.0]], "float32"), np.zeros((1, 3), "float32"), zeros, zeros])
    return layer


def test_attention_scales_the_update_gate():
    state = hand_layer()(SEQUENCE, np.array([[1.0, 0.5]], "float32"))
    # u1 = 0.5: h1 = 0.5 tanh(1) = 0.380797; u2 = 0.25: h2 = h1 + 0.25 (tanh(2) - h1) = 0.526605
    np.testing.assert_allclose(to_numpy(state), [[0.526605]], rtol=1e-5)


def test_zero_attention_and_masked_steps_leave_the_state():
    layer = hand_layer()
    np.testing.assert_array_equal(to_numpy(layer(SEQUENCE, np.zeros((1, 2), "float32"))), [[0.0]])
    state = layer(SEQUENCE, np.ones((1, 2), "float32"), mask=np.array([[True, False]]))
    np.testing.assert_allclose(to_numpy(state), [[0.380797]], rtol=1e-5)


def test_with_attention_one_it_is_a_gru():
    rng = np.random.default_rng(0)
    layer = AttentionalUpdateGRU(units=3)
    layer.build((None, 4, 2), (None, 4))
    kernel, recurrent_kernel, bias, recurrent_bias = (
        rng.standard_normal(shape).astype("float32") for shape in [(2, 9), (3, 9), (9,), (9,)]
    )
    layer.set_weights([kernel, recurrent_kernel, bias, recurrent_bias])
    # Keras' GRU keeps z h_{t-1} + (1 - z) h~ where this layer keeps (1 - u) h_{t-1} + u h~: u = 1 - z,
    # which negated update-gate weights give (sigmoid(-x) = 1 - sigmoid(x)).
    flip = np.concatenate([-np.ones(3), np.ones(6)]).astype("float32")
    gru = keras.layers.GRU(3, reset_after=True)
    gru.build((None, 4, 2))
    gru.set_weights([kernel * flip, recurrent_kernel * flip, np.stack([bias * flip, recurrent_bias * flip])])
    sequence = rng.standard_normal((5, 4, 2)).astype("float32")
    np.testing.assert_allclose(
        to_numpy(layer(sequence, np.ones((5, 4), "float32"))), to_numpy(gru(sequence)), rtol=1e-5, atol=1e-6
    )


def test_weight_shapes():
    layer = AttentionalUpdateGRU(units=4)
    layer.build((None, 6, 5), (None, 6))
    assert [tuple(w.shape) for w in layer.weights] == [(5, 12), (4, 12), (12,), (12,)]


@pytest.mark.parametrize("units", [0, -1, 2.5, None])
def test_invalid_units(units):
    with pytest.raises(ValueError, match=re.escape(f"units={units!r}")):
        AttentionalUpdateGRU(units)


def test_attention_must_have_one_weight_per_step():
    with pytest.raises(ValueError, match=re.escape("inputs_shape=(None, 6, 5), attention_shape=(None, 5)")):
        AttentionalUpdateGRU(4).build((None, 6, 5), (None, 5))


def test_config_round_trip():
    layer = AttentionalUpdateGRU(
        5, kernel_initializer="ones", recurrent_initializer="zeros", kernel_regularizer="l2", name="augru"
    )
    config = layer.get_config()
    assert {"units", "kernel_initializer", "recurrent_initializer", "kernel_regularizer"} <= set(config)
    assert AttentionalUpdateGRU.from_config(config).get_config() == config


def test_save_and_load_round_trip(tmp_path):
    sequence, attention = keras.Input((3, 2)), keras.Input((3,))
    model = keras.Model([sequence, attention], AttentionalUpdateGRU(4)(sequence, attention))
    rng = np.random.default_rng(0)
    data = [rng.standard_normal((2, 3, 2)).astype("float32"), rng.random((2, 3)).astype("float32")]
    model.save(tmp_path / "augru.keras")
    loaded = keras.saving.load_model(tmp_path / "augru.keras")
    np.testing.assert_array_equal(loaded.predict(data, verbose=0), model.predict(data, verbose=0))
