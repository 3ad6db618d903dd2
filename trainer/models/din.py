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
from trainer.model_inputs import CATEGORICAL_INPUT, CRITEO_INPUTS, DENSE_INPUT, HISTORY_INPUT, ModelInputs
from trainer.models.blocks import (
    behaviour_sequence,
    embed_fields,
    embedding_options,
    flatten_features,
    mlp,
    num_fields,
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
        bags: Sequence[Mapping[str, Any]] = (),
        sequence_key: str = HISTORY_INPUT,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        require_integer("embedding_dim", embedding_dim)
        require_integer_list("mlp_units", mlp_units)
        self.table_sizes = list(table_sizes)
        self.item_feature = int(item_feature)
        self.embedding_dim = embedding_dim
        self.attention_units = list(attention_units)
        self.mlp_units = list(mlp_units)
        self.embedding_options = dict(embedding_options or {})
        self.bags = [dict(bag) for bag in bags]
        self.sequence_key = sequence_key

        self.embedding = CategoricalEmbedding(
            self.table_sizes, embedding_dim, **self.embedding_options, name="embedding"
        )
        self.num_fields = num_fields(self.embedding, self.bags)
        require_item_feature(item_feature, range(self.embedding.num_features))
        self.attention = TargetAttention(self.attention_units, name="attention")
        self.deep_network = mlp(self.mlp_units, "deep_network")
        self.head = probability_head()

    def call(self, inputs: dict[str, Any]) -> Any:
        embedded = embed_fields(self.embedding, inputs, self.bags)
        target = ops.take(embedded, self.item_feature, axis=1)
        behaviours, valid = behaviour_sequence(self.embedding, inputs, self.item_feature, self.sequence_key)
        interest = self.attention(target, behaviours, mask=valid)
        features = ops.concatenate([flatten_features(embedded, inputs[DENSE_INPUT]), interest], axis=-1)
        return self.head(self.deep_network(features))

    def build(self, input_shape: dict[str, tuple[int | None, ...]]) -> None:
        # Explicit so a loaded .keras model gets its weights before they are restored.
        self.embedding.build(tuple(input_shape[CATEGORICAL_INPUT]))
        length = input_shape[self.sequence_key][-1]
        self.attention.build((None, self.embedding_dim), (None, length, self.embedding_dim))
        width = (self.num_fields + 1) * self.embedding_dim + input_shape[DENSE_INPUT][-1]
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
                "bags": [dict(bag) for bag in self.bags],
                "sequence_key": self.sequence_key,
            }
        )
        return config


def build_din(config: TrainConfig, table_sizes: Sequence[int], inputs: ModelInputs = CRITEO_INPUTS,
             spec_options: Mapping[str, Any] | None = None) -> DIN:
    model = DIN(
        table_sizes,
        item_feature=sequence_feature_index(config, inputs),
        sequence_key=inputs.sequence or HISTORY_INPUT,
        embedding_dim=config.embedding_dim,
        attention_units=config.attention_units,
        mlp_units=config.mlp_units,
        embedding_options=embedding_options(config, inputs, dict(spec_options or {})),
        bags=inputs.bags(attended=True),
        name="din",
    )
    model.build(inputs.shapes if inputs.sequence else
                {**inputs.shapes, HISTORY_INPUT: (None, config.sequence_length)})
    return model
