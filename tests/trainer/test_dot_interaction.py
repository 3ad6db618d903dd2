import re

import keras
import numpy as np
import pytest

from trainer.layers.dot_interaction import DotInteraction

pytestmark = pytest.mark.unit

VECTORS = np.array([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]], dtype="float32")


def test_pairs_in_lower_triangle_order():
    # (1, 0) = 3 + 8, (2, 0) = 5 + 12, (2, 1) = 15 + 24
    np.testing.assert_allclose(keras.ops.convert_to_numpy(DotInteraction()(VECTORS)), [[11.0, 17.0, 39.0]])


def test_self_interaction_keeps_the_diagonal():
    # (0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2)
    out = keras.ops.convert_to_numpy(DotInteraction(self_interaction=True)(VECTORS))
    np.testing.assert_allclose(out, [[5.0, 11.0, 25.0, 17.0, 39.0, 61.0]])


@pytest.mark.parametrize(("self_interaction", "width"), [(False, 10), (True, 15)])
def test_output_width(self_interaction, width):
    layer = DotInteraction(self_interaction=self_interaction)
    out = layer(np.ones((2, 5, 3), dtype="float32"))
    assert tuple(out.shape) == (2, width) == layer.compute_output_shape((2, 5, 3))
    assert layer.weights == []


@pytest.mark.parametrize("self_interaction", ["yes", 1, None])
def test_invalid_self_interaction(self_interaction):
    with pytest.raises(ValueError, match=re.escape(f"self_interaction={self_interaction!r}")):
        DotInteraction(self_interaction=self_interaction)


def test_needs_a_known_number_of_features():
    with pytest.raises(ValueError, match=re.escape("known number of features. Received: input_shape=(None, None, 4)")):
        DotInteraction().build((None, None, 4))


def test_config_round_trip():
    layer = DotInteraction(self_interaction=True, name="interaction")
    config = layer.get_config()
    assert config["self_interaction"] is True
    restored = DotInteraction.from_config(config)
    assert restored.get_config() == config and restored.self_interaction is True


def test_save_and_load_round_trip(tmp_path):
    vectors = keras.Input((3, 2))
    model = keras.Model(vectors, DotInteraction()(vectors))
    model.save(tmp_path / "dot.keras")
    loaded = keras.saving.load_model(tmp_path / "dot.keras")
    np.testing.assert_array_equal(loaded.predict(VECTORS, verbose=0), model.predict(VECTORS, verbose=0))
