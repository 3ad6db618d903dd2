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
