"""The private names of Keras the trainer reads, in one place, each with a test that fails if Keras drops or
changes it (tests/trainer/test_keras_internals.py).

Keras 3 has no public recursive walk over a model's layers: `Model.layers` lists the direct children only, and
a layer made inside another (a block's Dense, a model's CategoricalEmbedding) is reached through
`Layer._flatten_layers`, which Keras itself uses to collect weights and losses.
"""

from __future__ import annotations

from typing import Any


def flatten_layers(layer: Any, include_self: bool = True) -> list[Any]:
    """Every layer under `layer` (and `layer` itself first, with include_self), each once, in Keras' order: the
    same for two models built alike (the export pairs a model's layers with its twin's by it)."""
    return list(layer._flatten_layers(include_self=include_self, recursive=True))
