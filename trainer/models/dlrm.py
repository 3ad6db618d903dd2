"""DLRM (Naumov et al. 2019): a bottom MLP maps the dense input into the embedding space, every pair of
feature vectors meets in a dot product, a top MLP reads the dense vector and the dot products.

    dense [B, 26] --dense arch (bottom MLP)--> [B, dim] --------+------------------------------+
                                                                +--> dot interaction --+       |
    categorical [B, 26] --sparse arch (embedding)--> [B, 26, dim]   [B, 27 * 26 / 2]   +--> over arch (top MLP)
                                                                                                 --> head --> p [B, 1]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import keras
from keras import ops

from components.config import TrainConfig
from trainer.arguments import require_integer, require_integer_list
from trainer.layers.categorical_embedding import CategoricalEmbedding
from trainer.layers.dot_interaction import DotInteraction
from trainer.model_inputs import CATEGORICAL_INPUT, CRITEO_INPUTS, DENSE_INPUT, ModelInputs
from trainer.models.blocks import embed_fields, embedding_options, mlp, num_fields, probability_head


@keras.saving.register_keras_serializable(package="ctr")
class DLRM(keras.Model):
    """Inputs: {"dense": float32 [B, DENSE_INPUT_DIM], "categorical": int [B, len(table_sizes)]}.
    Output: click probability, float32 [B, 1].

    `bottom_mlp_units` are the dense arch's hidden widths; its last layer always has `embedding_dim` units so
    its output can meet the embeddings. `top_mlp_units` are the over arch's widths, before the head.
    `embedding_options`: further CategoricalEmbedding arguments (multi-hash compression)."""

    def __init__(
        self,
        table_sizes: Sequence[int],
        embedding_dim: int = 16,
        bottom_mlp_units: Sequence[int] = (64,),
        top_mlp_units: Sequence[int] = (512, 256, 128),
        embedding_options: Mapping[str, Any] | None = None,
        bags: Sequence[Mapping[str, Any]] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        require_integer("embedding_dim", embedding_dim)
        if isinstance(bottom_mlp_units, str | bytes) or not hasattr(bottom_mlp_units, "__len__") or bottom_mlp_units:
            require_integer_list("bottom_mlp_units", bottom_mlp_units)  # empty: one layer of embedding_dim
        require_integer_list("top_mlp_units", top_mlp_units)
        self.table_sizes = list(table_sizes)
        self.embedding_dim = embedding_dim
        self.bottom_mlp_units = list(bottom_mlp_units)
        self.top_mlp_units = list(top_mlp_units)
        self.embedding_options = dict(embedding_options or {})
        self.bags = [dict(bag) for bag in bags]

        self.dense_arch = mlp([*self.bottom_mlp_units, embedding_dim], "dense_arch")
        self.embedding = CategoricalEmbedding(
            self.table_sizes, embedding_dim, **self.embedding_options, name="embedding"
        )
        self.num_fields = num_fields(self.embedding, self.bags)
        self.interaction = DotInteraction(name="interaction")
        self.over_arch = mlp(self.top_mlp_units, "over_arch")
        self.head = probability_head()

    def call(self, inputs: dict[str, Any]) -> Any:
        dense = self.dense_arch(inputs[DENSE_INPUT])
        embedded = embed_fields(self.embedding, inputs, self.bags)
        interactions = self.interaction(ops.concatenate([ops.expand_dims(dense, 1), embedded], axis=1))
        return self.head(self.over_arch(ops.concatenate([dense, interactions], axis=-1)))

    def build(self, input_shape: dict[str, tuple[int | None, ...]]) -> None:
        # Explicit so a loaded .keras model gets its weights before they are restored.
        num_vectors = self.num_fields + 1
        self.dense_arch.build(tuple(input_shape[DENSE_INPUT]))
        self.embedding.build(tuple(input_shape[CATEGORICAL_INPUT]))
        self.interaction.build((None, num_vectors, self.embedding_dim))
        self.over_arch.build((None, self.embedding_dim + num_vectors * (num_vectors - 1) // 2))
        self.head.build((None, self.top_mlp_units[-1]))

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            {
                "table_sizes": list(self.table_sizes),
                "embedding_dim": self.embedding_dim,
                "bottom_mlp_units": list(self.bottom_mlp_units),
                "top_mlp_units": list(self.top_mlp_units),
                "embedding_options": dict(self.embedding_options),
                "bags": [dict(bag) for bag in self.bags],
            }
        )
        return config


def build_dlrm(config: TrainConfig, table_sizes: Sequence[int], inputs: ModelInputs = CRITEO_INPUTS,
             spec_options: Mapping[str, Any] | None = None) -> DLRM:
    return DLRM(
        table_sizes,
        embedding_dim=config.embedding_dim,
        bottom_mlp_units=config.bottom_mlp_units,
        top_mlp_units=config.mlp_units,
        embedding_options=embedding_options(config, inputs, dict(spec_options or {})),
        bags=inputs.bags(attended=False),
        name="dlrm",
    )
