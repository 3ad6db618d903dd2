"""DIN, the deep interest network (Zhou et al. 2018): the user's behaviours are pooled with weights given by
their relevance to the target item, so the interest vector changes with the item being scored.

    categorical [B, 26] --embedding--> [B, 26, dim] --> target = the item feature's vector [B, dim] --+
    history [B, K] --embedding (the item feature's rows)--> behaviours [B, K, dim] -------------------+
                                                                                                       |
                                        target attention (weighted sum pooling) --> interest [B, dim] <+
    flatten(embeddings), dense, interest --> deep MLP --> head --> p [B, 1]

Left out from the paper: the Dice activation (ReLU here) and mini-batch aware regularization.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import keras
from keras import ops

from components.config import TrainConfig
from trainer.arguments import require_integer, require_integer_list
from trainer.layers.categorical_embedding import CategoricalEmbedding
from trainer.layers.target_attention import TargetAttention
from trainer.model_inputs import CATEGORICAL_INPUT, DENSE_INPUT, HISTORY_INPUT, sequence_input_shapes
from trainer.models.blocks import (
    behaviour_sequence,
    embedding_options,
    flatten_features,
    mlp,
    probability_head,
    require_item_feature,
    sequence_feature_index,
)


@keras.saving.register_keras_serializable(package="ctr")
class DIN(keras.Model):
    """Inputs: {"dense": float32 [B, DENSE_INPUT_DIM], "categorical": int [B, len(table_sizes)],
    "history": int [B, K] row ids of feature `item_feature`, negative at padding}.
    Output: click probability, float32 [B, 1].

    The target item is column `item_feature` of "categorical"; the history is read from the same rows.
    `embedding_options`: further CategoricalEmbedding arguments (multi-hash compression)."""

    def __init__(
        self,
        table_sizes: Sequence[int],
        item_feature: int = 0,
        embedding_dim: int = 16,
        attention_units: Sequence[int] = (80, 40),
        mlp_units: Sequence[int] = (512, 256, 128),
        embedding_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        require_item_feature(item_feature, table_sizes)
        require_integer("embedding_dim", embedding_dim)
        require_integer_list("mlp_units", mlp_units)
        self.table_sizes = list(table_sizes)
        self.item_feature = int(item_feature)
        self.embedding_dim = embedding_dim
        self.attention_units = list(attention_units)
        self.mlp_units = list(mlp_units)
        self.embedding_options = dict(embedding_options or {})

        self.embedding = CategoricalEmbedding(
            self.table_sizes, embedding_dim, **self.embedding_options, name="embedding"
        )
        self.attention = TargetAttention(self.attention_units, name="attention")
        self.deep_network = mlp(self.mlp_units, "deep_network")
        self.head = probability_head()

    def call(self, inputs: dict[str, Any]) -> Any:
        embedded = self.embedding(inputs[CATEGORICAL_INPUT])
        target = ops.take(embedded, self.item_feature, axis=1)
        behaviours, valid = behaviour_sequence(self.embedding, inputs, self.item_feature)
        interest = self.attention(target, behaviours, mask=valid)
        features = ops.concatenate([flatten_features(embedded, inputs[DENSE_INPUT]), interest], axis=-1)
        return self.head(self.deep_network(features))

    def build(self, input_shape: dict[str, tuple[int | None, ...]]) -> None:
        # Explicit so a loaded .keras model gets its weights before they are restored.
        self.embedding.build(tuple(input_shape[CATEGORICAL_INPUT]))
        length = input_shape[HISTORY_INPUT][-1]
        self.attention.build((None, self.embedding_dim), (None, length, self.embedding_dim))
        width = (len(self.table_sizes) + 1) * self.embedding_dim + input_shape[DENSE_INPUT][-1]
        self.deep_network.build((None, width))
        self.head.build((None, self.mlp_units[-1]))

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            {
                "table_sizes": list(self.table_sizes),
                "item_feature": self.item_feature,
                "embedding_dim": self.embedding_dim,
                "attention_units": list(self.attention_units),
                "mlp_units": list(self.mlp_units),
                "embedding_options": dict(self.embedding_options),
            }
        )
        return config


def build_din(config: TrainConfig, table_sizes: Sequence[int]) -> DIN:
    model = DIN(
        table_sizes,
        item_feature=sequence_feature_index(config),
        embedding_dim=config.embedding_dim,
        attention_units=config.attention_units,
        mlp_units=config.mlp_units,
        embedding_options=embedding_options(config),
        name="din",
    )
    model.build(sequence_input_shapes(config.sequence_length))
    return model
