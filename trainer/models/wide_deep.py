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
from trainer.arguments import require_integer, require_integer_list
from trainer.layers.categorical_embedding import CategoricalEmbedding
from trainer.layers.linear_logit import LinearLogit
from trainer.model_inputs import CATEGORICAL_INPUT, CRITEO_INPUTS, DENSE_INPUT, ModelInputs
from trainer.models.blocks import embed_fields, embedding_options, flatten_features, mlp, num_fields


@keras.saving.register_keras_serializable(package="ctr")
class WideDeep(keras.Model):
    """Inputs: {"dense": float32 [B, DENSE_INPUT_DIM], "categorical": int [B, len(table_sizes)]}.
    Output: click probability, float32 [B, 1]. `embedding_options`: further CategoricalEmbedding arguments
    (multi-hash compression), for the deep embeddings and the wide per-value weights alike."""

    def __init__(
        self,
        table_sizes: Sequence[int],
        embedding_dim: int = 16,
        mlp_units: Sequence[int] = (512, 256, 128),
        embedding_options: Mapping[str, Any] | None = None,
        bags: Sequence[Mapping[str, Any]] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        require_integer("embedding_dim", embedding_dim)
        require_integer_list("mlp_units", mlp_units)
        self.table_sizes = list(table_sizes)
        self.embedding_dim = embedding_dim
        self.mlp_units = list(mlp_units)
        self.embedding_options = dict(embedding_options or {})
        self.bags = [dict(bag) for bag in bags]

        # The logits are summed in float32, where the sigmoid and the loss run.
        self.wide = LinearLogit(self.table_sizes, self.embedding_options, dtype="float32", name="wide")
        self.embedding = CategoricalEmbedding(
            self.table_sizes, embedding_dim, **self.embedding_options, name="embedding"
        )
        self.num_fields = num_fields(self.embedding, self.bags)
        self.deep_network = mlp(self.mlp_units, "deep_network")
        self.deep_logit = keras.layers.Dense(1, dtype="float32", name="deep_logit")
        self.head = keras.layers.Activation("sigmoid", dtype="float32", name="head")

    def call(self, inputs: dict[str, Any]) -> Any:
        wide = self.wide(inputs[DENSE_INPUT], inputs[CATEGORICAL_INPUT])
        embedded = embed_fields(self.embedding, inputs, self.bags)
        deep = self.deep_logit(self.deep_network(flatten_features(embedded, inputs[DENSE_INPUT])))
        return self.head(ops.add(wide, deep))

    def build(self, input_shape: dict[str, tuple[int | None, ...]]) -> None:
        # Explicit so a loaded .keras model gets its weights before they are restored.
        dense_shape, categorical_shape = tuple(input_shape[DENSE_INPUT]), tuple(input_shape[CATEGORICAL_INPUT])
        self.wide.build(dense_shape, categorical_shape)
        self.embedding.build(categorical_shape)
        self.deep_network.build((None, self.num_fields * self.embedding_dim + dense_shape[-1]))
        self.deep_logit.build((None, self.mlp_units[-1]))

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            {
                "table_sizes": list(self.table_sizes),
                "embedding_dim": self.embedding_dim,
                "mlp_units": list(self.mlp_units),
                "embedding_options": dict(self.embedding_options),
                "bags": [dict(bag) for bag in self.bags],
            }
        )
        return config


def build_wide_deep(config: TrainConfig, table_sizes: Sequence[int], inputs: ModelInputs = CRITEO_INPUTS,
             spec_options: Mapping[str, Any] | None = None) -> WideDeep:
    return WideDeep(
        table_sizes,
        embedding_dim=config.embedding_dim,
        mlp_units=config.mlp_units,
        embedding_options=embedding_options(config, inputs, dict(spec_options or {})),
        bags=inputs.bags(attended=False),
        name="wide_deep",
    )
