"""DCNv2 (Wang et al. 2021), stacked: features -> cross network -> deep network -> head.

    categorical [B, 26] --embedding--> [B, 26 * dim] --+
                                                       +--> x0 --cross x L--> deep MLP --> head --> p [B, 1]
    dense [B, 26] ---------------------------------------+
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import keras
from keras import ops

from components.config import TrainConfig
from trainer.arguments import require_integer, require_integer_list
from trainer.layers.categorical_embedding import CategoricalEmbedding
from trainer.layers.feature_cross import FeatureCross
from trainer.model_inputs import CATEGORICAL_INPUT, CRITEO_INPUTS, DENSE_INPUT, ModelInputs
from trainer.models.blocks import embed_fields, embedding_options, num_fields


@keras.saving.register_keras_serializable(package="ctr")
class DCNv2(keras.Model):
    """Inputs: {"dense": float32 [B, DENSE_INPUT_DIM], "categorical": int [B, len(table_sizes)]}.
    Output: click probability, float32 [B, 1] (float32 also under a mixed-precision policy).
    `embedding_options`: further CategoricalEmbedding arguments (multi-hash compression)."""

    def __init__(
        self,
        table_sizes: Sequence[int],
        embedding_dim: int = 16,
        num_cross_layers: int = 3,
        projection_dim: int | None = None,
        mlp_units: Sequence[int] = (512, 256, 128),
        embedding_options: Mapping[str, Any] | None = None,
        bags: Sequence[Mapping[str, Any]] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        require_integer("num_cross_layers", num_cross_layers, minimum=0)
        require_integer_list("mlp_units", mlp_units)
        self.table_sizes = list(table_sizes)
        self.embedding_dim = embedding_dim
        self.num_cross_layers = num_cross_layers
        self.projection_dim = projection_dim
        self.mlp_units = list(mlp_units)
        self.embedding_options = dict(embedding_options or {})
        self.bags = [dict(bag) for bag in bags]

        self.embedding = CategoricalEmbedding(
            self.table_sizes, embedding_dim, **self.embedding_options, name="embedding"
        )
        self.num_fields = num_fields(self.embedding, self.bags)
        self.cross_layers = [
            FeatureCross(projection_dim=projection_dim, name=f"cross_{i}") for i in range(num_cross_layers)
        ]
        self.deep_network = keras.Sequential(
            [
                keras.layers.Dense(units, activation="relu", name=f"deep_{i}")
                for i, units in enumerate(self.mlp_units)
            ],
            name="deep_network",
        )
        # A float32 head keeps the sigmoid and the loss out of bfloat16 under mixed precision.
        self.head = keras.layers.Dense(1, activation="sigmoid", dtype="float32", name="head")

    def call(self, inputs: dict[str, Any]) -> Any:
        x0 = self.feature_input(inputs)
        crossed = self.cross_network(x0)
        hidden = self.deep_network(crossed)
        return self.head(hidden)

    def feature_input(self, inputs: dict[str, Any]) -> Any:
        """Flattened embeddings of the categorical features, then the dense features: [B, width]."""
        embedded = embed_fields(self.embedding, inputs, self.bags)
        flat = ops.reshape(embedded, (-1, self.num_fields * self.embedding_dim))
        dense = ops.cast(inputs[DENSE_INPUT], flat.dtype)
        return ops.concatenate([flat, dense], axis=-1)

    def cross_network(self, x0: Any) -> Any:
        x = x0
        for cross in self.cross_layers:
            x = cross(x0, x)
        return x

    def build(self, input_shape: dict[str, tuple[int | None, ...]]) -> None:
        # Explicit so a loaded .keras model gets its weights before they are restored.
        self.embedding.build(tuple(input_shape[CATEGORICAL_INPUT]))
        width = self.num_fields * self.embedding_dim + input_shape[DENSE_INPUT][-1]
        for cross in self.cross_layers:
            cross.build((None, width))
        self.deep_network.build((None, width))
        self.head.build((None, self.mlp_units[-1]))

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            {
                "table_sizes": list(self.table_sizes),
                "embedding_dim": self.embedding_dim,
                "num_cross_layers": self.num_cross_layers,
                "projection_dim": self.projection_dim,
                "mlp_units": list(self.mlp_units),
                "embedding_options": dict(self.embedding_options),
                "bags": [dict(bag) for bag in self.bags],
            }
        )
        return config


def build_dcnv2(config: TrainConfig, table_sizes: Sequence[int], inputs: ModelInputs = CRITEO_INPUTS,
             spec_options: Mapping[str, Any] | None = None) -> DCNv2:
    return DCNv2(
        table_sizes,
        embedding_dim=config.embedding_dim,
        num_cross_layers=config.num_cross_layers,
        mlp_units=config.mlp_units,
        embedding_options=embedding_options(config, inputs, dict(spec_options or {})),
        bags=inputs.bags(attended=False),
        name="dcnv2",
    )
