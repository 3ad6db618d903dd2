"""The linear part of Wide & Deep and DeepFM: one weight per dense input and per categorical value."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import keras
from keras import ops

from trainer.layers.categorical_embedding import CategoricalEmbedding


@keras.saving.register_keras_serializable(package="ctr")
class LinearLogit(keras.layers.Layer):
    """`layer(dense, categorical)` -> w . dense + sum over features f of v_f[categorical_f] + b: [batch, 1].

    dense: float [batch, dense_dim]; categorical: int [batch, len(table_sizes)] row ids, as CategoricalEmbedding
    reads them. The per-value weights v are a CategoricalEmbedding of width 1 (sparse updates, embedding
    learning rate), built with `embedding_options` (its other arguments, e.g. multi-hash compression; a width
    of 1 cannot be split between hash tables, so hashed features always sum them). All weights start at zero.
    """

    def __init__(
        self,
        table_sizes: Sequence[int],
        embedding_options: Mapping[str, Any] | None = None,
        kernel_regularizer: str | keras.regularizers.Regularizer | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.table_sizes = list(table_sizes)
        self.embedding_options = dict(embedding_options or {})
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        options = {"embeddings_initializer": "zeros", **self.embedding_options}
        if options.get("hashed_features"):
            options["hash_combiner"] = "sum"
        self.value_weights = CategoricalEmbedding(
            self.table_sizes, 1, **options, dtype=self.dtype_policy, name="value_weights"
        )

    def build(self, dense_shape: tuple[int | None, ...], categorical_shape: tuple[int | None, ...]) -> None:
        if dense_shape[-1] is None:
            raise ValueError(f"LinearLogit needs a known dense width. Received: dense_shape={dense_shape}")
        self.value_weights.build(tuple(categorical_shape))
        self.kernel = self.add_weight(
            name="kernel", shape=(dense_shape[-1], 1), initializer="zeros", regularizer=self.kernel_regularizer
        )
        self.bias = self.add_weight(name="bias", shape=(1,), initializer="zeros")

    def call(self, dense: Any, categorical: Any) -> Any:
        categorical_part = ops.sum(self.value_weights(categorical), axis=1)  # [batch, features, 1] -> [batch, 1]
        return ops.add(ops.add(ops.matmul(dense, self.kernel), categorical_part), self.bias)

    def compute_output_shape(
        self, dense_shape: tuple[int | None, ...], categorical_shape: tuple[int | None, ...]
    ) -> tuple[int | None, ...]:
        return (dense_shape[0], 1)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            {
                "table_sizes": list(self.table_sizes),
                "embedding_options": dict(self.embedding_options),
                "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
            }
        )
        return config
