"""The optimizer: Adagrad everywhere, with its own learning rate for embedding tables.

Why Adagrad for every weight: on the TensorFlow backend Keras 3's Adagrad applies a `tf.IndexedSlices`
gradient with scatter updates, so an embedding row that a step did not touch keeps its exact value (cheap
steps on big tables, and small model deltas). Adam's moments are dense: every row moves every step and a
big table makes steps 4-10x slower. One optimizer (not one per variable group) keeps `fit`, gradient
accumulation, XLA and saving stock Keras on every backend.
"""

from __future__ import annotations

from typing import Any

import keras

# Variables with this name get `embedding_learning_rate` (CategoricalEmbedding's and keras Embedding's tables).
EMBEDDING_VARIABLE_NAME = "embeddings"


@keras.saving.register_keras_serializable(package="ctr")
class EmbeddingAdagrad(keras.optimizers.Adagrad):
    """Adagrad whose variables named "embeddings" use `embedding_learning_rate`, the rest `learning_rate`."""

    def __init__(
        self,
        learning_rate: float = 0.05,
        embedding_learning_rate: float = 0.05,
        initial_accumulator_value: float = 0.1,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate=learning_rate, initial_accumulator_value=initial_accumulator_value, **kwargs)
        if isinstance(embedding_learning_rate, bool) or not isinstance(embedding_learning_rate, int | float) or not (
            embedding_learning_rate > 0
        ):
            raise ValueError(
                "`embedding_learning_rate` must be a positive number. "
                f"Received: embedding_learning_rate={embedding_learning_rate!r}"
            )
        self.embedding_learning_rate = float(embedding_learning_rate)

    def build(self, var_list: list[Any]) -> None:
        if self.built:
            return
        super().build(var_list)
        # By index: update_step may receive the backend's variable (a tf.Variable named "embeddings:0").
        self._embedding_indices = {
            self._get_variable_index(v) for v in var_list if v.name == EMBEDDING_VARIABLE_NAME
        }

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        if self._get_variable_index(variable) in self._embedding_indices:
            learning_rate = self.embedding_learning_rate
        super().update_step(gradient, variable, learning_rate)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config["embedding_learning_rate"] = self.embedding_learning_rate
        return config
