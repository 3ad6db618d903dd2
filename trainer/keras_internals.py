"""The private names of Keras the trainer reads, in one place, each with a test that fails if Keras drops or
changes it (tests/trainer/test_keras_internals.py).

Keras 3 has no public recursive walk over a model's layers: `Model.layers` lists the direct children only, and
a layer made inside another (a block's Dense, a model's CategoricalEmbedding) is reached through
`Layer._flatten_layers`, which Keras itself uses to collect weights and losses. Nor does an optimizer with
`gradient_accumulation_steps` say how many micro-batches it has taken (`micro_steps`).
"""

from __future__ import annotations

from typing import Any


def flatten_layers(layer: Any, include_self: bool = True) -> list[Any]:
    """Every layer under `layer` (and `layer` itself first, with include_self), each once, in Keras' order: the
    same for two models built alike (the export pairs a model's layers with its twin's by it)."""
    return list(layer._flatten_layers(include_self=include_self, recursive=True))


def micro_steps(optimizer: Any) -> int:
    """The batches the optimizer has taken, micro-batches included: `BaseOptimizer._iterations`, which
    `gradient_accumulation_steps` counts in (the public `iterations` is it divided by those steps). An optimizer
    step applies when (micro_steps + 1) is a multiple of the steps. Keras' TensorFlow `fit` over an input of
    unknown length counts one more at each epoch's end, when it finds the input exhausted, so the optimizer
    steps do not start where an epoch does: the tiered tables' plans (trainer/tiered_tables.py) follow this
    count instead."""
    import keras

    return int(keras.ops.convert_to_numpy(optimizer._iterations))
