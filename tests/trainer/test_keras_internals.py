"""trainer/keras_internals.py: the private names of Keras the trainer reads. These fail loudly when a Keras
upgrade drops or changes one, before warm start, minute runs or the export do."""

import keras
import pytest

from trainer.keras_internals import flatten_layers, micro_steps

pytestmark = pytest.mark.unit


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(3, name="inner")
        self.outer = keras.layers.Dense(1, name="outer")

    def call(self, x):
        return self.outer(self.inner(x))


def test_keras_still_has_the_private_recursive_walk_the_adapter_calls():
    assert callable(getattr(keras.layers.Layer, "_flatten_layers", None)), (
        "keras.layers.Layer._flatten_layers is gone: rewrite trainer/keras_internals.flatten_layers")


def test_flatten_layers_reaches_layers_made_inside_other_layers_once_each():
    inputs = keras.Input((4,))
    block = Block(name="block")
    model = keras.Model(inputs, block(inputs))
    names = [layer.name for layer in flatten_layers(model, include_self=False)]
    assert sorted(n for n in names if n in ("block", "inner", "outer")) == ["block", "inner", "outer"]
    assert names == [layer.name for layer in flatten_layers(model, include_self=False)]  # the same order again
    assert "inner" not in [layer.name for layer in model.layers]  # what the public `layers` does not reach
    assert flatten_layers(model)[0] is model and flatten_layers(model, include_self=False)[0] is not model


def test_flatten_layers_finds_the_embedding_table_of_a_model_of_the_zoo():
    from components.config import TrainConfig
    from tests.trainer.test_export import feature_state
    from trainer.layers.categorical_embedding import CategoricalEmbedding
    from trainer.models import build_model

    model = build_model(TrainConfig(model="dcnv2", embedding_dim=4, mlp_units=(8,)), feature_state().table_sizes())
    tables = [layer for layer in flatten_layers(model) if isinstance(layer, CategoricalEmbedding)]
    assert len(tables) == 1 and tables[0].num_rows == sum(feature_state().table_sizes().values())


def test_micro_steps_counts_micro_batches_and_fit_counts_one_more_at_an_epochs_end():
    """`micro_steps` reads `BaseOptimizer._iterations`. Keras' fit over a generator (unknown length) counts one
    more when it finds the input exhausted: 4 micro-batches, 5 counted. If a Keras upgrade stops doing that,
    this test fails, and trainer/keras_internals.py's text (and docs/tiers.md) should say so."""
    import numpy as np

    assert hasattr(keras.optimizers.SGD(), "_iterations"), (
        "keras.optimizers.Optimizer._iterations is gone: rewrite trainer/keras_internals.micro_steps")
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), loss="mse")
    x, y = np.ones((8, 2), np.float32), np.ones((8, 1), np.float32)
    for _ in range(3):
        model.train_on_batch(x, y)
    assert micro_steps(model.optimizer) == 3 and int(model.optimizer.iterations.numpy()) == 1

    def batches():
        for _ in range(4):
            yield x, y

    model.fit(batches(), epochs=1, verbose=0)
    assert micro_steps(model.optimizer) == 3 + 4 + 1  # the tests' backend, TensorFlow
