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
from trainer.arguments import require_integer_list
from trainer.layers.dot_interaction import DotInteraction
from trainer.model_inputs import CRITEO_INPUTS, DENSE_INPUT, ModelInputs
from trainer.models.base import CTRModel, model_arguments
from trainer.models.blocks import mlp, probability_head


@keras.saving.register_keras_serializable(package="ctr")
class DLRM(CTRModel):
    """Inputs and output: CTRModel's.

    `bottom_mlp_units` are the dense arch's hidden widths; its last layer always has `embedding_dim` units so
    its output can meet the embeddings. `top_mlp_units` are the over arch's widths, before the head."""

    CONFIG_KEYS = ("bottom_mlp_units", "top_mlp_units")

    def __init__(
        self,
        table_sizes: Sequence[int],
        bottom_mlp_units: Sequence[int] = (64,),
        top_mlp_units: Sequence[int] = (512, 256, 128),
        **kwargs: Any,
    ) -> None:
        super().__init__(table_sizes, **kwargs)
        if isinstance(bottom_mlp_units, str | bytes) or not hasattr(bottom_mlp_units, "__len__") or bottom_mlp_units:
            require_integer_list("bottom_mlp_units", bottom_mlp_units)  # empty: one layer of embedding_dim
        require_integer_list("top_mlp_units", top_mlp_units)
        self.bottom_mlp_units = list(bottom_mlp_units)
        self.top_mlp_units = list(top_mlp_units)
        self.dense_arch = mlp([*self.bottom_mlp_units, self.embedding_dim], "dense_arch")
        self.interaction = DotInteraction(name="interaction")
        self.over_arch = self.mlp(self.top_mlp_units, "over_arch")
        self.head = probability_head()

    def call(self, inputs: dict[str, Any], training: bool | None = None) -> Any:
        dense = self.dense_arch(inputs[DENSE_INPUT])
        embedded = self.embed(inputs, training)
        interactions = self.interaction(ops.concatenate([ops.expand_dims(dense, 1), embedded], axis=1))
        return self.head(self.over_arch(ops.concatenate([dense, interactions], axis=-1), training=training))

    def build_layers(self, input_shape: dict[str, tuple[int | None, ...]]) -> None:
        num_vectors = self.num_fields + 1
        self.dense_arch.build(tuple(input_shape[DENSE_INPUT]))
        self.interaction.build((None, num_vectors, self.embedding_dim))
        self.over_arch.build((None, self.embedding_dim + num_vectors * (num_vectors - 1) // 2))
        self.head.build((None, self.top_mlp_units[-1]))


def build_dlrm(config: TrainConfig, table_sizes: Sequence[int], inputs: ModelInputs = CRITEO_INPUTS,
               spec_options: Mapping[str, Any] | None = None) -> DLRM:
    return DLRM(table_sizes, bottom_mlp_units=config.bottom_mlp_units, top_mlp_units=config.mlp_units,
                **model_arguments(config, inputs, spec_options, attended=False), name="dlrm")
