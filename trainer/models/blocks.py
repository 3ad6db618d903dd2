"""Pieces the models share: MLPs, the probability head, the config's embedding arguments and the
behaviour-sequence input of DIN and DIEN."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
from keras import ops

from components.config import TrainConfig
from components.schema import CATEGORICAL_FEATURES
from trainer.arguments import is_integer
from trainer.layers.categorical_embedding import CategoricalEmbedding
from trainer.model_inputs import CATEGORICAL_INPUT, DENSE_INPUT, HISTORY_INPUT


def mlp(units: Sequence[int], name: str) -> keras.Sequential:
    """ReLU layers of `units` widths."""
    return keras.Sequential(
        [keras.layers.Dense(width, activation="relu", name=f"{name}_{i}") for i, width in enumerate(units)],
        name=name,
    )


def probability_head() -> keras.layers.Dense:
    # float32 keeps the sigmoid and the loss out of bfloat16 under mixed precision.
    return keras.layers.Dense(1, activation="sigmoid", dtype="float32", name="head")


def flatten_features(embedded: Any, dense: Any) -> Any:
    """[B, F, dim] embeddings and [B, dense_dim] dense inputs -> [B, F * dim + dense_dim], embeddings first."""
    flat = ops.reshape(embedded, (-1, embedded.shape[1] * embedded.shape[2]))
    return ops.concatenate([flat, ops.cast(dense, flat.dtype)], axis=-1)


def behaviour_sequence(embedding: CategoricalEmbedding, inputs: dict[str, Any], item_feature: int) -> Any:
    """The history's embeddings [B, length, dim], read from the item feature's rows, and its mask [B, length]
    (False at padding)."""
    if HISTORY_INPUT not in inputs:
        raise ValueError(
            f"this model reads the behaviour sequence input {HISTORY_INPUT!r} (int [batch, sequence_length] row "
            f"ids of the item feature, padding -1) beside {DENSE_INPUT!r} and {CATEGORICAL_INPUT!r}; "
            f"received inputs {sorted(inputs)}. Feed a history, or train a model without one."
        )
    history = inputs[HISTORY_INPUT]
    valid = ops.greater_equal(history, 0)
    # Padding reads row 0, then the mask drops it.
    return embedding.embed_feature(ops.maximum(history, 0), item_feature), valid


def embedding_options(config: TrainConfig) -> dict[str, Any]:
    """CategoricalEmbedding arguments beyond table_sizes and embedding_dim that the config asks for:
    multi-hash compression of `multi_hash_features`."""
    names = config.multi_hash_features
    if not names:
        return {}
    unknown = [name for name in names if name not in CATEGORICAL_FEATURES]
    if unknown or len(set(names)) != len(names):
        raise ValueError(
            f"train.multi_hash_features={names!r} must name distinct categorical features "
            f"({CATEGORICAL_FEATURES[0]}..{CATEGORICAL_FEATURES[-1]}); not categorical: {unknown}"
        )
    if config.multi_hash_buckets < 1:
        raise ValueError(
            f"train.multi_hash_buckets={config.multi_hash_buckets!r} must be a positive number of rows per hash "
            "table when train.multi_hash_features is set"
        )
    return {
        "hashed_features": [CATEGORICAL_FEATURES.index(name) for name in names],
        "num_hash_buckets": config.multi_hash_buckets,
        "num_hash_functions": config.multi_hash_functions,
        "hash_combiner": config.multi_hash_combiner,
    }


def sequence_feature_index(config: TrainConfig) -> int:
    if config.sequence_feature not in CATEGORICAL_FEATURES:
        raise ValueError(
            f"train.sequence_feature={config.sequence_feature!r} must name the categorical feature whose table "
            f"the history shares, one of {CATEGORICAL_FEATURES[0]}..{CATEGORICAL_FEATURES[-1]}"
        )
    return CATEGORICAL_FEATURES.index(config.sequence_feature)


def require_item_feature(item_feature: Any, table_sizes: Sequence[int]) -> None:
    if not is_integer(item_feature) or not 0 <= item_feature < len(table_sizes):
        raise ValueError(
            f"`item_feature` must be the index of the target item's feature in `table_sizes`, in "
            f"[0, {len(table_sizes)}). Received: item_feature={item_feature!r}"
        )
