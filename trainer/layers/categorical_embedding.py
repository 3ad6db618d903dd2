"""Embeddings of many categorical features kept in one concatenated table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from trainer.arguments import require_integer, require_integer_list


@keras.saving.register_keras_serializable(package="ctr")
class CategoricalEmbedding(keras.layers.Layer):
    """Looks up F categorical features in one table of sum(table_sizes) rows.

    Input: integers [batch, F], column f holding row ids of feature f in [0, table_sizes[f]).
    Output: [batch, F, embedding_dim]. Feature f owns rows offset[f] .. offset[f] + table_sizes[f] - 1.

    One table means one gather per batch and one variable for the optimizer. The lookup is `ops.take`, whose
    gradient on the TensorFlow backend is a `tf.IndexedSlices`, so a sparse-aware optimizer (Adagrad)
    updates only the rows a batch touched. The table is never cast under mixed precision (only the looked-up
    rows are), since casting would copy the whole table on every step.

    Row ids are not range-checked: an id past its feature's table reads the next feature's rows.
    """

    def __init__(
        self,
        table_sizes: Sequence[int],
        embedding_dim: int,
        embeddings_initializer: str | keras.initializers.Initializer = "uniform",
        embeddings_regularizer: str | keras.regularizers.Regularizer | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        require_integer_list("table_sizes", table_sizes)
        require_integer("embedding_dim", embedding_dim)
        self.table_sizes = [int(s) for s in table_sizes]
        self.embedding_dim = embedding_dim
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.embeddings_regularizer = keras.regularizers.get(embeddings_regularizer)
        self.offsets = np.concatenate([[0], np.cumsum(self.table_sizes)[:-1]]).astype(np.int64)
        self.num_rows = int(sum(self.table_sizes))

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        if input_shape[-1] != len(self.table_sizes):
            raise ValueError(
                f"CategoricalEmbedding has {len(self.table_sizes)} tables, so its input must be "
                f"[batch, {len(self.table_sizes)}]. Received: input_shape={input_shape}"
            )
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(self.num_rows, self.embedding_dim),
            initializer=self.embeddings_initializer,
            regularizer=self.embeddings_regularizer,
            autocast=False,
        )

    def call(self, inputs: Any) -> Any:
        if not keras.backend.is_int_dtype(inputs.dtype):
            inputs = ops.cast(inputs, "int64")
        rows = ops.add(inputs, ops.convert_to_tensor(self.offsets, dtype=inputs.dtype))
        return ops.cast(ops.take(self.embeddings, rows, axis=0), self.compute_dtype)

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        return (*input_shape, self.embedding_dim)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            {
                "table_sizes": list(self.table_sizes),
                "embedding_dim": self.embedding_dim,
                "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer),
                "embeddings_regularizer": keras.regularizers.serialize(self.embeddings_regularizer),
            }
        )
        return config
