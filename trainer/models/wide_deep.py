"""Wide & Deep (Cheng et al. 2016): a linear model and an MLP trained jointly, their logits added.

    dense, categorical ----------------> wide: linear logit ---------------------+
                                                                                  +--> sigmoid --> p [B, 1]
    categorical --embedding--> [B, 26 * dim] --+--> deep MLP --> deep logit ------+
    dense [B, 26] -----------------------------+

The paper's wide part also takes hand-picked cross-product features; here it sees the raw features only and
the deep part learns the interactions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import keras
from keras import ops

from components.config import TrainConfig
from trainer.arguments import require_integer_list
from trainer.layers.linear_logit import LinearLogit
from trainer.model_inputs import CATEGORICAL_INPUT, CRITEO_INPUTS, DENSE_INPUT, ModelInputs
from trainer.models.base import CTRModel, model_arguments
from trainer.models.blocks import flatten_features


@keras.saving.register_keras_serializable(package="ctr")
class WideDeep(CTRModel):
    """Inputs and output: CTRModel's. The embedding options (multi-hash compression) apply to the deep
    embeddings and the wide per-value weights alike."""

    CONFIG_KEYS = ("mlp_units",)

    def __init__(self, table_sizes: Sequence[int], mlp_units: Sequence[int] = (512, 256, 128), **kwargs: Any) -> None:
        super().__init__(table_sizes, **kwargs)
        require_integer_list("mlp_units", mlp_units)
        self.mlp_units = list(mlp_units)
        # The logits are summed in float32, where the sigmoid and the loss run.
        self.wide = LinearLogit(self.table_sizes, self.embedding_options, dtype="float32", name="wide")
        self.deep_network = self.mlp(self.mlp_units, "deep_network")
        self.deep_logit = keras.layers.Dense(1, dtype="float32", name="deep_logit")
        self.head = keras.layers.Activation("sigmoid", dtype="float32", name="head")

    def call(self, inputs: dict[str, Any], training: bool | None = None) -> Any:
        wide = self.wide(inputs[DENSE_INPUT], inputs[CATEGORICAL_INPUT])
        deep = self.deep_logit(self.deep_network(flatten_features(self.embed(inputs, training), inputs[DENSE_INPUT]),
                                                   training=training))
        return self.head(ops.add(wide, deep))

    def build_layers(self, input_shape: dict[str, tuple[int | None, ...]]) -> None:
        dense_shape, categorical_shape = tuple(input_shape[DENSE_INPUT]), tuple(input_shape[CATEGORICAL_INPUT])
        self.wide.build(dense_shape, categorical_shape)
        self.deep_network.build((None, self.num_fields * self.embedding_dim + dense_shape[-1]))
        self.deep_logit.build((None, self.mlp_units[-1]))


def build_wide_deep(config: TrainConfig, table_sizes: Sequence[int], inputs: ModelInputs = CRITEO_INPUTS,
                    spec_options: Mapping[str, Any] | None = None) -> WideDeep:
    return WideDeep(table_sizes, mlp_units=config.mlp_units,
                    **model_arguments(config, inputs, spec_options, attended=False), name="wide_deep")
