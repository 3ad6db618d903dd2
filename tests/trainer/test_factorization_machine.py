import re

import keras
import numpy as np
import pytest

from trainer.layers.factorization_machine import FactorizationMachine

pytestmark = pytest.mark.unit

FIELDS = np.array([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]], dtype="float32")


def test_sums_the_dot_products_of_every_pair():
    # <v0, v1> + <v0, v2> + <v1, v2> = 11 + 17 + 39
    np.testing.assert_allclose(keras.ops.convert_to_numpy(FactorizationMachine()(FIELDS)), [[67.0]])


def test_equals_the_explicit_pair_sum():
    fields = np.random.default_rng(0).standard_normal((4, 6, 3)).astype("float32")
    explicit = sum(
        (fields[:, i] * fields[:, j]).sum(axis=-1) for i in range(6) for j in range(i + 1, 6)
    )
    np.testing.assert_allclose(keras.ops.convert_to_numpy(FactorizationMachine()(fields))[:, 0], explicit, rtol=1e-5)


def test_has_no_weights():
    layer = FactorizationMachine()
    layer.build((None, 3, 2))
    assert layer.weights == []


def test_rejects_inputs_that_are_not_field_embeddings():
    with pytest.raises(ValueError, match=re.escape("[batch, fields, dim]. Received: input_shape=(None, 6)")):
        FactorizationMachine().build((None, 6))


def test_config_round_trip():
    layer = FactorizationMachine(name="fm", dtype="float32")
    config = layer.get_config()
    assert FactorizationMachine.from_config(config).get_config() == config


def test_save_and_load_round_trip(tmp_path):
    fields = keras.Input((3, 2))
    model = keras.Model(fields, FactorizationMachine()(fields))
    model.save(tmp_path / "fm.keras")
    loaded = keras.saving.load_model(tmp_path / "fm.keras")
    np.testing.assert_array_equal(loaded.predict(FIELDS, verbose=0), model.predict(FIELDS, verbose=0))
