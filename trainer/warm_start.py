"""Warm start: a new model begins from a previous run's weights although the vocabularies changed since.

The feature state keeps an admitted value's row for as long as it stays admitted, so a previous model's row r
of feature f is still value v's row, with three exceptions the state lists: tables grew (rows past the old
size are new), rows were evicted (their values are gone), and freed rows were handed to newly admitted values.
Kept rows are copied, every other row keeps the new model's fresh initialisation, and every other weight is
copied as is. The optimizer starts afresh (its accumulators belong to the previous run's schedule).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

import keras
import numpy as np

from trainer.keras_internals import flatten_layers
from trainer.layers.categorical_embedding import CategoricalEmbedding


class WarmStartError(ValueError):
    """The previous model cannot seed the new one (another model or other layer sizes)."""


def warm_start_weights(
    model: keras.Model, previous: keras.Model, reset_rows: Mapping[int, Iterable[int]] | None = None,
    skip: Collection[str] = (),
) -> dict[str, int]:
    """Copies `previous`'s weights into the built `model`. Embedding tables of CategoricalEmbedding layers
    are copied feature by feature up to the smaller of the two sizes, leaving the rows in `reset_rows`
    (feature index -> row ids, e.g. evicted and newly assigned rows) at `model`'s initial values.

    Weights whose path is in `skip` keep their initial values (a tiered table's hot slots: its rows come from
    its store). Returns counts: weights copied, embedding rows kept, rows reset, rows new (past the old tables).
    """
    reset = {int(f): np.asarray(sorted(set(rows)), dtype=np.int64) for f, rows in (reset_rows or {}).items()}
    previous_weights = {v.path: v for v in previous.weights}
    tables = _embedding_tables(model)
    previous_tables = _embedding_tables(previous)
    summary = {"weights_copied": 0, "rows_kept": 0, "rows_reset": 0, "rows_new": 0}
    for variable in model.weights:
        if variable.path in skip:
            continue
        old = previous_weights.get(variable.path)
        if old is None:
            raise WarmStartError(
                f"the previous model has no weight {variable.path!r} (it has {sorted(previous_weights)[:8]}...); "
                "warm start needs the same model: set train.warm_start=false to train from scratch"
            )
        if variable.path in tables:
            layer, old_layer = tables[variable.path], previous_tables.get(variable.path)
            if old_layer is None:
                raise WarmStartError(f"{variable.path!r} is not an embedding table in the previous model")
            values, counts = _merged_table(layer, old_layer, np.asarray(variable), np.asarray(old), reset)
            variable.assign(values)
            for key, count in counts.items():
                summary[key] += count
        elif tuple(variable.shape) == tuple(old.shape):
            variable.assign(np.asarray(old))
        else:
            raise WarmStartError(
                f"weight {variable.path!r} has shape {tuple(variable.shape)} here and {tuple(old.shape)} in the "
                "previous model (a changed layer size); set train.warm_start=false to train from scratch"
            )
        summary["weights_copied"] += 1
    return summary


def _embedding_tables(model: keras.Model) -> dict[str, CategoricalEmbedding]:
    layers = [layer for layer in flatten_layers(model) if isinstance(layer, CategoricalEmbedding)]
    return {layer.embeddings.path: layer for layer in layers if layer.num_rows}


def _merged_table(
    layer: CategoricalEmbedding, old_layer: CategoricalEmbedding, fresh: np.ndarray, old: np.ndarray,
    reset: Mapping[int, np.ndarray],
) -> tuple[np.ndarray, dict[str, int]]:
    if layer.hashed_features != old_layer.hashed_features or fresh.shape[1] != old.shape[1]:
        raise WarmStartError(
            f"embedding {layer.embeddings.path!r}: hashed features {old_layer.hashed_features} -> "
            f"{layer.hashed_features}, dim {old.shape[1]} -> {fresh.shape[1]}; warm start needs the same "
            "embedding layout: set train.warm_start=false to train from scratch"
        )
    values = fresh.copy()
    counts = {"rows_kept": 0, "rows_reset": 0, "rows_new": 0}
    for feature in layer.tabled_features:
        size, old_size = layer.table_sizes[feature], old_layer.table_sizes[feature]
        kept = np.ones(min(size, old_size), dtype=bool)
        rows = reset.get(feature, np.empty(0, np.int64))
        kept[rows[rows < len(kept)]] = False
        new_offset, old_offset = int(layer.offsets[feature]), int(old_layer.offsets[feature])
        kept_rows = np.flatnonzero(kept)
        values[new_offset + kept_rows] = old[old_offset + kept_rows]
        counts["rows_kept"] += len(kept_rows)
        counts["rows_reset"] += len(kept) - len(kept_rows)
        counts["rows_new"] += max(0, size - old_size)
    return values, counts


def reset_rows_by_feature(evicted: Mapping[str, Iterable[int]], added: Mapping[str, Iterable[int]],
                          features: list[str]) -> dict[int, list[int]]:
    """FeatureState.evicted_rows and .new_rows (by feature name) -> rows to reset by feature index."""
    out: dict[int, list[int]] = {}
    for source in (evicted, added):
        for name, rows in source.items():
            out.setdefault(features.index(name), []).extend(int(r) for r in rows)
    return out
