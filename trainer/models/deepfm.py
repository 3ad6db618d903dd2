"""DeepFM (Guo et al. 2017): a factorization machine and an MLP share the embeddings; their logits add up.

    categorical --embedding--> [B, 26, dim] --+--> FM pairwise term ------------------------+
                                              |                                             |
    dense [B, 26] ----------------------------+--> flatten --> deep MLP --> deep logit -----+--> sigmoid --> p
                                                                                            |
    dense, categorical --> linear (first-order) term ---------------------------------------+

The FM's fields are the categorical features; the dense inputs enter through the linear term and the MLP.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import keras
from keras import ops

from components.config import TrainConfig
from trainer.arguments import require_integer_list
from trainer.layers.factorization_machine import FactorizationMachine
from trainer.layers.linear_logit import LinearLogit
from trainer.model_inputs import CATEGORICAL_INPUT, CRITEO_INPUTS, DENSE_INPUT, ModelInputs
from trainer.models.base import CTRModel, model_arguments
from trainer.models.blocks import flatten_features


@keras.saving.register_keras_serializable(package="ctr")
class DeepFM(CTRModel):
    """Inputs and output: CTRModel's. The embedding options (multi-hash compression) apply to the embeddings
    and the first-order weights alike."""

    CONFIG_KEYS = ("mlp_units",)

    def __init__(self, table_sizes: Sequence[int], mlp_units: Sequence[int] = (512, 256, 128), **kwargs: Any) -> None:
        super().__init__(table_sizes, **kwargs)
        require_integer_list("mlp_units", mlp_units)
        self.mlp_units = list(mlp_units)
        # The three logits are computed and summed in float32, where the sigmoid and the loss run.
        self.linear = LinearLogit(self.table_sizes, self.embedding_options, dtype="float32", name="linear")
        self.factorization_machine = FactorizationMachine(dtype="float32", name="factorization_machine")
        self.deep_network = self.mlp(self.mlp_units, "deep_network")
        self.deep_logit = keras.layers.Dense(1, dtype="float32", name="deep_logit")
        self.head = keras.layers.Activation("sigmoid", dtype="float32", name="head")

    def call(self, inputs: dict[str, Any], training: bool | None = None) -> Any:
        embedded = self.embed(inputs, training)
        linear = self.linear(inputs[DENSE_INPUT], inputs[CATEGORICAL_INPUT])
        pairwise = self.factorization_machine(embedded)
        deep = self.deep_logit(self.deep_network(flatten_features(embedded, inputs[DENSE_INPUT]), training=training))
        return self.head(ops.add(ops.add(linear, pairwise), deep))

    def build_layers(self, input_shape: dict[str, tuple[int | None, ...]]) -> None:
        dense_shape, categorical_shape = tuple(input_shape[DENSE_INPUT]), tuple(input_shape[CATEGORICAL_INPUT])
        self.linear.build(dense_shape, categorical_shape)
        self.factorization_machine.build((None, self.num_fields, self.embedding_dim))
        self.deep_network.build((None, self.num_fields * self.embedding_dim + dense_shape[-1]))
        self.deep_logit.build((None, self.mlp_units[-1]))


def build_deepfm(config: TrainConfig, table_sizes: Sequence[int], inputs: ModelInputs = CRITEO_INPUTS,
                 spec_options: Mapping[str, Any] | None = None) -> DeepFM:
    return DeepFM(table_sizes, mlp_units=config.mlp_units,
                  **model_arguments(config, inputs, spec_options, attended=False), name="deepfm")
