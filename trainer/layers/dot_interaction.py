"""The pairwise dot-product interaction of DLRM (Naumov et al. 2019)."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops


@keras.saving.register_keras_serializable(package="ctr")
class DotInteraction(keras.layers.Layer):
    """Dot products of every pair of feature vectors: [batch, N, dim] -> [batch, N (N - 1) / 2].

    Pairs are in row-major order of the strictly lower triangle: (1, 0), (2, 0), (2, 1), (3, 0), ...
    With `self_interaction`, each vector's dot with itself is kept too (the diagonal): N (N + 1) / 2 outputs.
    """

    def __init__(self, self_interaction: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(self_interaction, bool):
            raise ValueError(
                f"`self_interaction` must be True or False. Received: self_interaction={self_interaction!r}"
            )
        self.self_interaction = self_interaction

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        if len(input_shape) != 3 or input_shape[1] is None:
            raise ValueError(
                "DotInteraction needs [batch, features, dim] with a known number of features. "
                f"Received: input_shape={input_shape}"
            )
        num_features = input_shape[1]
        rows, columns = np.tril_indices(num_features, k=0 if self.self_interaction else -1)
        # Flat positions in the [N, N] matrix of dot products: one static gather picks the pairs.
        self._pair_positions = (rows * num_features + columns).astype(np.int64)

    def call(self, inputs: Any) -> Any:
        num_features = inputs.shape[1]
        products = ops.einsum("bnd,bmd->bnm", inputs, inputs)
        flat = ops.reshape(products, (-1, num_features * num_features))
        return ops.take(flat, self._pair_positions, axis=1)

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        num_features = input_shape[1]
        diagonal = num_features if self.self_interaction else 0
        return (input_shape[0], (num_features * (num_features - 1)) // 2 + diagonal)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config["self_interaction"] = self.self_interaction
        return config
