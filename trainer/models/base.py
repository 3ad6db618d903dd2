"""The base of the model zoo: what every model has, written once.

Every model embeds the spec's categorical columns with one CategoricalEmbedding (its tables, dim and options:
multi-hash compression, shared tables), pools the multi-valued and sequence inputs it does not attend over
(`bags`, ModelInputs.bags) into one vector each, and saves and loads through `get_config`. A model adds its own
layers, names its own arguments in `CONFIG_KEYS` (attributes of the same names), builds its layers in
`build_layers`, and gets a builder from `model_arguments`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import keras

from components.config import TrainConfig
from trainer.arguments import require_integer
from trainer.layers.categorical_embedding import CategoricalEmbedding
from trainer.model_inputs import CATEGORICAL_INPUT, ModelInputs
from trainer.models.blocks import embed_fields, embedding_options, mlp, num_fields


class CTRModel(keras.Model):
    """Inputs: {"dense": float32 [B, dense width], "categorical": int [B, len(table_sizes)], and one int
    [B, length] input per bag (and per attended sequence)}. Output: click probability, float32 [B, 1].

    `embedding_options`: further CategoricalEmbedding arguments; `bags`: ModelInputs.bags entries, each pooled
    into one more field after the categorical columns (`num_fields` counts both)."""

    CONFIG_KEYS: ClassVar[tuple[str, ...]] = ()  # the subclass's own arguments, saved by get_config

    def __init__(
        self,
        table_sizes: Sequence[int],
        embedding_dim: int = 16,
        embedding_options: Mapping[str, Any] | None = None,
        bags: Sequence[Mapping[str, Any]] = (),
        dropout: float = 0.0,
        dropout_seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        require_integer("embedding_dim", embedding_dim)
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"`dropout` must be a rate in [0, 1). Received: dropout={dropout!r}")
        self.dropout = float(dropout)
        self.dropout_seed = dropout_seed
        self.table_sizes = [int(size) for size in table_sizes]
        self.embedding_dim = embedding_dim
        self.embedding_options = dict(embedding_options or {})
        self.bags = [dict(bag) for bag in bags]
        self.embedding = CategoricalEmbedding(
            self.table_sizes, embedding_dim, **self.embedding_options, name="embedding"
        )
        self.num_fields = num_fields(self.embedding, self.bags)

    def mlp(self, units: Sequence[int], name: str, layer_name: str | None = None) -> keras.Sequential:
        """blocks.mlp with the model's dropout: the hidden layers of every model's deep part."""
        return mlp(units, name, dropout=self.dropout, seed=self.dropout_seed, layer_name=layer_name)

    def embed(self, inputs: dict[str, Any], training: bool | None = None) -> Any:
        """[B, num_fields, dim]: the categorical columns' embeddings, then one pooled vector per bag.

        `training` is passed down explicitly: the JAX trainer calls the model's `call` itself
        (`stateless_call`), so nothing sets the call context from which a layer would otherwise read it."""
        return embed_fields(self.embedding, inputs, self.bags, training)

    def build(self, input_shape: dict[str, tuple[int | None, ...]]) -> None:
        # Explicit so a loaded .keras model gets its weights before they are restored.
        self.embedding.build(tuple(input_shape[CATEGORICAL_INPUT]))
        self.build_layers(input_shape)

    def build_layers(self, input_shape: dict[str, tuple[int | None, ...]]) -> None:
        """Builds the subclass's layers (the embedding is built)."""
        raise NotImplementedError(f"{type(self).__name__} must build its layers in build_layers")

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update({
            "table_sizes": list(self.table_sizes),
            "embedding_dim": self.embedding_dim,
            "embedding_options": dict(self.embedding_options),
            "bags": [dict(bag) for bag in self.bags],
            "dropout": self.dropout,
            "dropout_seed": self.dropout_seed,
        })
        for key in self.CONFIG_KEYS:
            value = getattr(self, key)
            config[key] = list(value) if isinstance(value, tuple | list) else value
        return config


def model_arguments(config: TrainConfig, inputs: ModelInputs, spec_options: Mapping[str, Any] | None,
                    attended: bool) -> dict[str, Any]:
    """The base arguments every builder passes: the config's embedding dim, the spec's (and the config's)
    embedding options, and the bags (with `attended`, the attended sequence is not pooled)."""
    return {
        "embedding_dim": config.embedding_dim,
        "embedding_options": embedding_options(config, inputs, dict(spec_options or {})),
        "bags": inputs.bags(attended=attended),
        "dropout": config.dropout,
        "dropout_seed": config.seed,
    }
