"""The pairwise interaction term of a factorization machine (Rendle 2010), the FM half of DeepFM."""

from __future__ import annotations

from typing import Any

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="ctr")
class FactorizationMachine(keras.layers.Layer):
    """sum over feature pairs i < j of <v_i, v_j>, computed in O(F * dim) as
    0.5 * sum_d((sum_i v_id) ** 2 - sum_i v_id ** 2) (Rendle 2010, lemma 3.1).

    Input: field embeddings [batch, F, dim]. Output: [batch, 1]. No weights: the embeddings are the factors.
    """

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        if len(input_shape) != 3:
            raise ValueError(
                f"FactorizationMachine needs field embeddings [batch, fields, dim]. Received: input_shape={input_shape}"
            )

    def call(self, inputs: Any) -> Any:
        square_of_sum = ops.square(ops.sum(inputs, axis=1))
        sum_of_squares = ops.sum(ops.square(inputs), axis=1)
        return ops.multiply(0.5, ops.sum(ops.subtract(square_of_sum, sum_of_squares), axis=-1, keepdims=True))

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        return (input_shape[0], 1)
