"""DIN, the deep interest network (Zhou et al. 2018): the user's behaviours are pooled with weights given by
their relevance to the target item, so the interest vector changes with the item being scored.

    categorical [B, 26] --embedding--> [B, 26, dim] --> target = the item feature's vector [B, dim] --+
    history [B, K] --embedding (the item feature's rows)--> behaviours [B, K, dim] -------------------+
                                                                                                       |
                                        target attention (weighted sum pooling) --> interest [B, dim] <+
    flatten(embeddings), dense, interest[, target * interest] --> deep MLP --> head --> p [B, 1]

In training, `history_aux_weight` adds co_occurrence_loss over the behaviours: each one against the mean of
its row's others, and against the next row's behaviour at the same place, so items one user clicks together
get vectors that point the same way. Left out from the paper: the Dice activation (ReLU here) and mini-batch
aware regularization.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import keras
from keras import ops

from components.config import TrainConfig
from trainer.arguments import require_integer_list
from trainer.layers.target_attention import TargetAttention
from trainer.model_inputs import CRITEO_INPUTS, DENSE_INPUT, HISTORY_INPUT, ModelInputs
from trainer.models.base import CTRModel, model_arguments
from trainer.models.blocks import (
    behaviour_sequence,
    flatten_features,
    paired_logistic_loss,
    probability_head,
    require_aux_weight,
    require_item_feature,
    sequence_feature_index,
)


@keras.saving.register_keras_serializable(package="ctr")
class DIN(CTRModel):
    """Inputs: CTRModel's and `sequence_key`: int [B, K] row ids of feature `item_feature`'s table, padding 1
    or negative. Output: click probability, float32 [B, 1].

    The target item is column `item_feature` of "categorical"; the history is read from the same rows. With
    `interest_product` the deep network also reads target * interest, element by element (the authors' code
    feeds it beside the interest); off by default, so models saved without it load as they were built.
    `history_aux_weight`: the weight of co_occurrence_loss in training (0, the default here, leaves it out)."""

    CONFIG_KEYS = ("item_feature", "attention_units", "mlp_units", "sequence_key", "interest_product",
                   "history_aux_weight")

    def __init__(
        self,
        table_sizes: Sequence[int],
        item_feature: int = 0,
        attention_units: Sequence[int] = (80, 40),
        mlp_units: Sequence[int] = (512, 256, 128),
        sequence_key: str = HISTORY_INPUT,
        interest_product: bool = False,
        history_aux_weight: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(table_sizes, **kwargs)
        require_integer_list("mlp_units", mlp_units)
        require_item_feature(item_feature, range(self.embedding.num_features))
        if not isinstance(interest_product, bool):
            raise ValueError(f"interest_product must be True or False. Received: {interest_product!r}")
        self.interest_product = interest_product
        self.history_aux_weight = require_aux_weight(history_aux_weight)
        self.item_feature = int(item_feature)
        self.attention_units = list(attention_units)
        self.mlp_units = list(mlp_units)
        self.sequence_key = sequence_key
        self.attention = TargetAttention(self.attention_units, name="attention")
        self.deep_network = self.mlp(self.mlp_units, "deep_network")
        self.head = probability_head()

    def call(self, inputs: dict[str, Any], training: bool | None = None) -> Any:
        embedded = self.embed(inputs, training)
        target = ops.take(embedded, self.item_feature, axis=1)
        behaviours, valid = behaviour_sequence(self.embedding, inputs, self.item_feature, self.sequence_key)
        interest = self.attention(target, behaviours, mask=valid)
        if training and self.history_aux_weight:
            self.add_loss(self.history_aux_weight * co_occurrence_loss(behaviours, valid))
        parts = [flatten_features(embedded, inputs[DENSE_INPUT]), interest]
        if self.interest_product:
            parts.append(ops.multiply(target, ops.cast(interest, target.dtype)))
        features = ops.concatenate(parts, axis=-1)
        return self.head(self.deep_network(features, training=training))

    def build_layers(self, input_shape: dict[str, tuple[int | None, ...]]) -> None:
        length = input_shape[self.sequence_key][-1]
        self.attention.build((None, self.embedding_dim), (None, length, self.embedding_dim))
        width = (self.num_fields + 1 + self.interest_product) * self.embedding_dim + input_shape[DENSE_INPUT][-1]
        self.deep_network.build((None, width))
        self.head.build((None, self.mlp_units[-1]))


def co_occurrence_loss(behaviours: Any, valid: Any) -> Any:
    """Mean logistic loss of behaviours [B, K, dim] (mask `valid` [B, K]) against their rows' other behaviours.

    Position k of row b is a positive: its vector dotted with the mean of row b's other valid behaviours. The
    same position of the next row of the batch (rolled by one; another user's click, so mostly unrelated) is a
    negative against the same mean. A row with fewer than two behaviours adds nothing."""
    dtype = "float32"
    behaviours = ops.cast(behaviours, dtype)
    mask = ops.cast(valid, dtype)
    kept = ops.multiply(behaviours, ops.expand_dims(mask, -1))
    count = ops.sum(mask, axis=1, keepdims=True)  # [B, 1]
    others = ops.divide(ops.subtract(ops.sum(kept, axis=1, keepdims=True), kept),
                        ops.expand_dims(ops.maximum(ops.subtract(count, 1.0), 1.0), -1))
    weight = ops.multiply(mask, ops.cast(ops.greater(count, 1.0), dtype))  # [B, K]
    positive = ops.sum(ops.multiply(kept, others), axis=-1)
    negative = ops.sum(ops.multiply(ops.roll(kept, 1, axis=0), others), axis=-1)
    return paired_logistic_loss(positive, negative, weight, ops.multiply(weight, ops.roll(mask, 1, axis=0)))


def build_din(config: TrainConfig, table_sizes: Sequence[int], inputs: ModelInputs = CRITEO_INPUTS,
              spec_options: Mapping[str, Any] | None = None) -> DIN:
    model = DIN(table_sizes, item_feature=sequence_feature_index(config, inputs),
                sequence_key=inputs.sequence or HISTORY_INPUT, attention_units=config.attention_units,
                mlp_units=config.mlp_units, interest_product=config.interest_product,
                history_aux_weight=config.history_aux_weight,
                **model_arguments(config, inputs, spec_options, attended=True), name="din")
    model.build(inputs.shapes if inputs.sequence else
                {**inputs.shapes, HISTORY_INPUT: (None, config.sequence_length)})
    return model
