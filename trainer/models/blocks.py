"""Pieces the models share: MLPs, the probability head, the config's embedding arguments and the
behaviour-sequence input of DIN and DIEN."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
from keras import ops

from components.config import TrainConfig
from components.feature_spec import RARE_ROW
from trainer.arguments import is_integer
from trainer.layers.categorical_embedding import CategoricalEmbedding
from trainer.model_inputs import (
    CATEGORICAL_INPUT,
    CRITEO_INPUTS,
    DENSE_INPUT,
    HISTORY_INPUT,
    PADDING_ROW,
    ModelInputs,
)


def mlp(units: Sequence[int], name: str, dropout: float = 0.0, seed: int | None = None,
        layer_name: str | None = None) -> keras.Sequential:
    """ReLU layers of `units` widths, named `<layer_name or name>_<i>`, each followed in training by dropout
    of `dropout` (layer i's draws seeded with seed + i) when it is above 0. Call it with `training`."""
    layers: list[keras.layers.Layer] = []
    for i, width in enumerate(units):
        layers.append(keras.layers.Dense(width, activation="relu", name=f"{layer_name or name}_{i}"))
        if dropout > 0:
            layers.append(keras.layers.Dropout(dropout, seed=None if seed is None else seed + i,
                                               name=f"{layer_name or name}_dropout_{i}"))
    return keras.Sequential(layers, name=name)


def probability_head() -> keras.layers.Dense:
    # float32 keeps the sigmoid and the loss out of bfloat16 under mixed precision.
    return keras.layers.Dense(1, activation="sigmoid", dtype="float32", name="head")


def flatten_features(embedded: Any, dense: Any) -> Any:
    """[B, F, dim] embeddings and [B, dense_dim] dense inputs -> [B, F * dim + dense_dim], embeddings first."""
    flat = ops.reshape(embedded, (-1, embedded.shape[1] * embedded.shape[2]))
    return ops.concatenate([flat, ops.cast(dense, flat.dtype)], axis=-1)


def valid_ids(ids: Any) -> Any:
    """False at padding: MISSING_ROW (what the sample writer pads with) and negative ids."""
    return ops.logical_and(ops.greater_equal(ids, 0), ops.not_equal(ids, PADDING_ROW))


def list_mask(embedding: CategoricalEmbedding, ids: Any, table: int) -> Any:
    """False at padding of a list input reading `table`. A tiered table's list ids are slots of its hot tier,
    rewritten with padding as -1 (trainer/tiered_training.py in training, trainer/export.py RowSlots in serving),
    so there every id >= 0 is an item, slot 1 included; elsewhere `valid_ids`."""
    if table in embedding.tiered_tables:
        return ops.greater_equal(ids, 0)
    return valid_ids(ids)


def behaviour_sequence(embedding: CategoricalEmbedding, inputs: dict[str, Any], item_feature: int,
                       key: str = HISTORY_INPUT) -> Any:
    """The sequence's embeddings [B, length, dim], read from the item feature's table, and its mask
    [B, length] (False at padding)."""
    if key not in inputs:
        raise ValueError(
            f"this model reads the behaviour sequence input {key!r} (int [batch, sequence_length] row ids of the "
            f"item feature's table, padding 1 or -1) beside {DENSE_INPUT!r} and {CATEGORICAL_INPUT!r}; "
            f"received inputs {sorted(inputs)}. Declare a sequence feature in the feature spec, or train a "
            "model without one."
        )
    history = inputs[key]
    # Padding reads row 0, then the mask drops it.
    return (embedding.embed_feature(ops.maximum(history, 0), item_feature),
            list_mask(embedding, history, embedding.feature_tables[item_feature]))


def pooled_bags(embedding: CategoricalEmbedding, inputs: dict[str, Any], bags: Sequence[dict[str, Any]]) -> list:
    """One [B, 1, dim] vector per multi-valued or sequence input in `bags` (ModelInputs.bags): the sum or
    the mean of its values' embeddings, padding left out (an empty list gives zeros)."""
    out = []
    for bag in bags:
        ids = inputs[bag["key"]]
        vectors = embedding.embed_table(ops.maximum(ids, 0), bag["table"])
        mask = ops.expand_dims(ops.cast(list_mask(embedding, ids, bag["table"]), vectors.dtype), -1)
        total = ops.sum(ops.multiply(vectors, mask), axis=1)
        if bag.get("pooling", "mean") == "mean":
            total = ops.divide(total, ops.maximum(ops.sum(mask, axis=1), ops.cast(1, vectors.dtype)))
        out.append(ops.expand_dims(total, 1))
    return out


def embed_fields(embedding: CategoricalEmbedding, inputs: dict[str, Any], bags: Sequence[dict[str, Any]],
                 training: bool | None = None) -> Any:
    """[B, F + len(bags), dim]: the categorical columns' embeddings, then one pooled vector per bag."""
    embedded = embedding(inputs[CATEGORICAL_INPUT], training=training)
    if not bags:
        return embedded
    return ops.concatenate([embedded, *pooled_bags(embedding, inputs, bags)], axis=1)


def num_fields(embedding: CategoricalEmbedding, bags: Sequence[Any]) -> int:
    return embedding.num_features + len(bags)


def embedding_options(config: TrainConfig, inputs: ModelInputs = CRITEO_INPUTS,
                      spec_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """CategoricalEmbedding arguments beyond table_sizes and embedding_dim: the spec's (`spec_options`,
    ModelInputs.embedding_options: shared tables, multi-hash per table), or the config's multi-hash
    compression of the tables in `train.multi_hash_features`."""
    options = dict(spec_options or {})
    if config.devices > 1:  # the table may be sharded row-wise across them (trainer/devices.py)
        options["row_multiple"] = config.devices
    if config.embedding_l2:
        options["row_l2"] = config.embedding_l2
    rates = list(config.rare_row_rates) or config.rare_row_rate
    if any(rate > 0 for rate in (rates if isinstance(rates, list) else [rates])):
        options.update(rare_row_rate=rates, rare_row=RARE_ROW, missing_row=PADDING_ROW, seed=config.seed)
    names = config.multi_hash_features
    if not names:
        return options
    tables = list(inputs.tables)
    unknown = [name for name in names if name not in tables]
    if unknown or len(set(names)) != len(names):
        raise ValueError(
            f"train.multi_hash_features={names!r} must name distinct tables of the feature spec "
            f"({', '.join(tables)}); not tables: {unknown}"
        )
    if config.multi_hash_buckets < 1:
        raise ValueError(
            f"train.multi_hash_buckets={config.multi_hash_buckets!r} must be a positive number of rows per hash "
            "table when train.multi_hash_features is set"
        )
    return {
        **options,
        "hashed_features": [tables.index(name) for name in names],
        "num_hash_buckets": config.multi_hash_buckets,
        "num_hash_functions": config.multi_hash_functions,
        "hash_combiner": config.multi_hash_combiner,
    }


def sequence_feature_index(config: TrainConfig, inputs: ModelInputs = CRITEO_INPUTS) -> int:
    """The target item's categorical column: the one the spec's sequence shares a table with, else (no
    sequence in the spec: synthetic histories) `train.sequence_feature`."""
    if inputs.target_column is not None:
        return inputs.target_column
    names = list(inputs.categorical_names)
    if config.sequence_feature not in names:
        raise ValueError(
            f"train.sequence_feature={config.sequence_feature!r} must name the categorical feature whose table "
            f"the history shares, one of {', '.join(names)}"
        )
    return names.index(config.sequence_feature)


def require_item_feature(item_feature: Any, table_sizes: Sequence[int]) -> None:
    if not is_integer(item_feature) or not 0 <= item_feature < len(table_sizes):
        raise ValueError(
            f"`item_feature` must be the index of the target item's feature in `table_sizes`, in "
            f"[0, {len(table_sizes)}). Received: item_feature={item_feature!r}"
        )


def require_aux_weight(weight: Any) -> float:
    """`history_aux_weight` of DIN and DIEN as a float, refused unless a weight >= 0."""
    if not float(weight) >= 0.0:
        raise ValueError(f"history_aux_weight must be a weight >= 0. Received: {weight!r}")
    return float(weight)


def paired_logistic_loss(positive: Any, negative: Any, weight: Any, negative_weight: Any) -> Any:
    """The auxiliary losses' common form: softplus(-positive) where `weight`, plus softplus(negative) where
    `negative_weight` (scores and masks of one shape), over the positives counted; 0 with none."""
    total = ops.add(ops.sum(ops.multiply(ops.softplus(ops.negative(positive)), weight)),
                    ops.sum(ops.multiply(ops.softplus(negative), negative_weight)))
    return ops.divide(total, ops.maximum(ops.sum(weight), 1.0))
