"""seed_random: the seeds of keras.utils.set_random_seed, without clearing TensorFlow's caches every minute."""

from __future__ import annotations

import random

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer.incremental import seed_random


def draws() -> tuple[float, float, list[int]]:
    """Python's and numpy's next numbers, and the order of a tf.data shuffle with an op seed (as the minute's
    training data is shuffled), which also depends on TensorFlow's global seed."""
    order = tf.data.Dataset.range(20).shuffle(20, seed=3).as_numpy_iterator()
    return random.random(), float(np.random.rand()), [int(value) for value in order]


@pytest.mark.parametrize("seed_before", [5, 7, None], ids=["the same seed", "another seed", "no global seed"])
def test_seed_random_draws_as_keras_set_random_seed_does(seed_before):
    keras.utils.set_random_seed(seed_before or 1)
    if seed_before is None:
        tf.random.set_seed(None)
    random.random(), np.random.rand()  # the generators moved on since
    seed_random(5)
    got = draws()
    assert tf.compat.v1.random.get_seed(0)[0] == 5
    keras.utils.set_random_seed(5)
    assert got == draws()
    keras.utils.set_random_seed(7)
    assert got[2] != draws()[2]  # the global seed decides the order, so the comparison above says something


def test_reset_random_draws_gives_a_loaded_copy_the_draws_of_the_model_in_memory():
    """A minute's parent comes from memory (its seed generators moved on by the minutes before) or from its
    checkpoint (a saved model keeps no generator state): after reset_random_draws both draw the same dropout
    and rare-row masks."""
    import dataclasses

    from components.config import TrainConfig
    from tests.trainer.synthetic import random_rows, table_sizes
    from trainer.incremental import reset_random_draws
    from trainer.models import build_model

    config = dataclasses.replace(TrainConfig(), embedding_dim=4, mlp_units=(16, 8), dropout=0.5, rare_row_rate=0.3)
    rows = random_rows(64, 10, seed=1)
    batch = {"dense": rows.dense, "categorical": rows.categorical}
    in_memory = build_model(config, table_sizes(10))
    for _ in range(3):  # earlier minutes' draws
        in_memory(batch, training=True)
    loaded = type(in_memory).from_config(in_memory.get_config())
    loaded(batch)
    loaded.set_weights(in_memory.get_weights())
    assert reset_random_draws(in_memory, 5) == reset_random_draws(loaded, 5) == 3  # two dropouts, the rare row
    np.testing.assert_array_equal(np.asarray(in_memory(batch, training=True)), np.asarray(loaded(batch, training=True)))
    reset_random_draws(in_memory, 5), reset_random_draws(loaded, 6)  # the seed decides the draws
    assert np.abs(np.asarray(in_memory(batch, training=True)) - np.asarray(loaded(batch, training=True))).max() > 1e-3
