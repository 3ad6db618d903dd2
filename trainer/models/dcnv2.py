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
from trainer.layers.feature_cross import FeatureCross
from trainer.model_inputs import CRITEO_INPUTS, DENSE_INPUT, ModelInputs
from trainer.models.base import CTRModel, model_arguments
from trainer.models.blocks import probability_head


@keras.saving.register_keras_serializable(package="ctr")
class DCNv2(CTRModel):
    """Inputs and output: CTRModel's. `projection_dim`: the cross layers' low-rank projection (None: full)."""

    CONFIG_KEYS = ("num_cross_layers", "projection_dim", "mlp_units")

    def __init__(
        self,
        table_sizes: Sequence[int],
        num_cross_layers: int = 3,
        projection_dim: int | None = None,
        mlp_units: Sequence[int] = (512, 256, 128),
        **kwargs: Any,
    ) -> None:
        super().__init__(table_sizes, **kwargs)
        require_integer("num_cross_layers", num_cross_layers, minimum=0)
        require_integer_list("mlp_units", mlp_units)
        self.num_cross_layers = num_cross_layers
        self.projection_dim = projection_dim
        self.mlp_units = list(mlp_units)
        self.cross_layers = [
            FeatureCross(projection_dim=projection_dim, name=f"cross_{i}") for i in range(num_cross_layers)
        ]
        # Dense layers named deep_<i>, as checkpoints name them.
        self.deep_network = self.mlp(self.mlp_units, "deep_network", layer_name="deep")
        self.head = probability_head()

    def call(self, inputs: dict[str, Any], training: bool | None = None) -> Any:
        x0 = self.feature_input(inputs, training)
        crossed = self.cross_network(x0)
        hidden = self.deep_network(crossed, training=training)
        return self.head(hidden)

    def feature_input(self, inputs: dict[str, Any], training: bool | None = None) -> Any:
        """Flattened embeddings of the categorical features, then the dense features: [B, width]."""
        flat = ops.reshape(self.embed(inputs, training), (-1, self.num_fields * self.embedding_dim))
        dense = ops.cast(inputs[DENSE_INPUT], flat.dtype)
        return ops.concatenate([flat, dense], axis=-1)

    def cross_network(self, x0: Any) -> Any:
        x = x0
        for cross in self.cross_layers:
            x = cross(x0, x)
        return x

    def build_layers(self, input_shape: dict[str, tuple[int | None, ...]]) -> None:
        width = self.num_fields * self.embedding_dim + input_shape[DENSE_INPUT][-1]
        for cross in self.cross_layers:
            cross.build((None, width))
        self.deep_network.build((None, width))
        self.head.build((None, self.mlp_units[-1]))


def build_dcnv2(config: TrainConfig, table_sizes: Sequence[int], inputs: ModelInputs = CRITEO_INPUTS,
                spec_options: Mapping[str, Any] | None = None) -> DCNv2:
    if not isinstance(config.cross_projection_dim, int) or config.cross_projection_dim < 0:
        raise ValueError(f"train.cross_projection_dim must be 0 (full-rank cross layers) or a positive rank, got "
                         f"{config.cross_projection_dim!r}")
    return DCNv2(table_sizes, num_cross_layers=config.num_cross_layers,
                 projection_dim=config.cross_projection_dim or None, mlp_units=config.mlp_units,
                 **model_arguments(config, inputs, spec_options, attended=False), name="dcnv2")
