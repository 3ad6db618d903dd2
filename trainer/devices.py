"""Several devices of one host for the JAX train step (`train.devices`, `train.shard_table_rows`).

The Keras 3 distribution API over JAX, on a one-axis mesh of the devices: every batch is split across them along
its rows (data parallel: the dense weights are replicated, each device computes its share of the batch and
XLA sums the gradients), and the embedding table, when it holds more than `shard_table_rows` rows, is sharded
row-wise across the same devices (a LayoutMap entry of `("devices", None)`), its optimizer state with it.
XLA inserts the collectives a lookup into the sharded table needs. The table gets a multiple of the device
count as its rows (CategoricalEmbedding's `row_multiple`), so that it splits evenly.

A batch that is split must hold a multiple of the device count of rows: training batches are cut down to one
(at most devices - 1 rows of a batch are left out of that step), and the held-out slice is scored by calling
the model directly, which takes any number of rows (`held_out_metrics`), so no held-out row is left out.

Tiered tables (storage: tiered) train the same way: their hot slots (one HotTable variable each, rows on disk
behind it, and one more of width 1 in a model with a linear part) are sharded row-wise like the table when a
tier holds more than `shard_table_rows` slots, else replicated; the hot tier's plans stay one per table in this
process (the host decides which row goes into which slot of the whole variable, and a slot write lands on the
device that holds that slot).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from components.config import TrainConfig
from components.evaluation import log_loss, roc_auc

DEVICE_AXIS = "devices"
# The path of CategoricalEmbedding's table variable in every model of the zoo.
TABLE_PATH = r"(.*/)?embedding/embeddings"
# The paths of its tiered tables' hot slots (HotTable's variable, one per tiered table), and of the linear part's
# hot slots of the same tables (LinearLogit's `value_weights`, in DeepFM and Wide & Deep).
HOT_TABLE_PATH = r"(.*/)?(embedding|value_weights)/tiered_table_\d+/embeddings"


def resolve_devices(requested: int) -> int:
    """`train.devices` -> how many devices the step uses: 0 is all this host shows."""
    import jax

    available = jax.device_count()
    if not isinstance(requested, int) or requested < 0:
        raise ValueError(f"train.devices={requested!r} must be 0 (all visible) or a number of devices")
    if requested > available:
        raise ValueError(
            f"train.devices={requested}, but this host shows {available} {jax.default_backend()} device(s): "
            f"{[str(d) for d in jax.devices()]}. Set train.devices to at most {available}, or 0 for all of them"
        )
    return requested or available


def table_rows(config: TrainConfig, table_sizes: Mapping[str, int], tables: Sequence[str],
               hashed: Sequence[str] = ()) -> int:
    """Rows of the embedding table variable the model will have: the tables multi-hashed neither by the config
    nor by the spec (`hashed`), rounded up to a multiple of `config.devices`."""
    rows = sum(int(table_sizes[name]) for name in tables
               if name not in config.multi_hash_features and name not in hashed)
    multiple = max(1, config.devices)
    return -(-rows // multiple) * multiple


def distribution(devices: int, shard_table: bool, shard_hot_tables: bool = False) -> Any:
    """keras.distribution.ModelParallel over the first `devices` devices: batches split along their rows, the
    embedding table split along its rows when `shard_table`, the hot slots of its tiered tables when
    `shard_hot_tables`, every other weight replicated."""
    from keras import distribution as keras_distribution

    mesh = keras_distribution.DeviceMesh((devices,), (DEVICE_AXIS,), keras_distribution.list_devices()[:devices])
    layout_map = keras_distribution.LayoutMap(mesh)
    if shard_table:
        layout_map[TABLE_PATH] = (DEVICE_AXIS, None)
    if shard_hot_tables:
        layout_map[HOT_TABLE_PATH] = (DEVICE_AXIS, None)
    # The data is never a tf.data dataset for Keras to shard: with several processes each feeds its own share
    # (trainer/processes.py).
    return keras_distribution.ModelParallel(layout_map=layout_map, batch_dim_name=DEVICE_AXIS,
                                            auto_shard_dataset=False)


def whole_batches(batches: Iterable[tuple[Any, Any]], devices: int) -> Iterator[tuple[Any, Any]]:
    """Each (features, labels) batch cut down to a multiple of `devices` rows (the rest left out); a batch of
    fewer rows than that is skipped."""
    for features, labels in batches:
        rows = len(labels) // devices * devices
        if rows == len(labels):
            yield features, labels
        elif rows:
            yield {name: values[:rows] for name, values in features.items()}, labels[:rows]


def held_out_metrics(model: Any, batches: Iterable[tuple[Any, Any]]) -> dict[str, float]:
    """The held-out metrics Keras' validation gives (`val_auc`, `val_loss`, `val_prediction_mean`,
    `val_label_mean`, `val_num_examples`), from a direct call of the model on every held-out row: the AUC exact
    rather than Keras' 1,000-threshold estimate."""
    from trainer.calibration import predictions_of

    labels, predictions = predictions_of(model, batches)
    return {"val_auc": roc_auc(labels, predictions), "val_loss": log_loss(labels, predictions),
            "val_prediction_mean": float(predictions.mean()), "val_label_mean": float(labels.mean()),
            "val_num_examples": float(len(labels))}


def host_copy(batch: Any) -> Any:
    """A batch of the readers' shared memory as numpy arrays of its own (the reader reuses the slot as soon as
    this returns); Keras splits it across the devices."""
    import jax

    return jax.tree.map(np.array, batch)


def shard_rows(model: Any) -> dict[str, Any]:
    """Rows of the embedding table (`table`) and of the optimizer state of its shape (`optimizer`) that each
    device holds, read from the live variables: [rows] on one device, [rows / n] * n when sharded. With tiered
    tables, the same for each one's hot slots and their Adagrad accumulator (`hot_tables`, `hot_optimizer`:
    table index -> rows per device), and for the linear part's hot slots where the model has one
    (`linear_hot_tables`, `linear_hot_optimizer`)."""
    from trainer.tiered_training import accumulator_of, linear_part

    def rows(variable: Any) -> list[int]:
        return [int(shard.data.shape[0]) for shard in variable.value.addressable_shards]

    def per_device(prefix: str, hot: dict[str, Any]) -> dict[str, Any]:
        return {f"{prefix}hot_tables": {table: rows(variable) for table, variable in hot.items()},
                f"{prefix}hot_optimizer": {table: rows(accumulator_of(model.optimizer, variable))
                                           for table, variable in hot.items()}} if hot else {}

    layer, linear = model.embedding, linear_part(model)
    hot = {str(table): layer.hot_table(table).embeddings for table in getattr(layer, "tiered_tables", {})}
    linear_hot = {str(table): linear.hot_table(table).embeddings
                  for table in getattr(linear, "tiered_tables", {})} if linear is not None else {}
    tiered = {**per_device("", hot), **per_device("linear_", linear_hot)}
    table = getattr(layer, "embeddings", None)
    if table is None:  # every feature multi-hashed or tiered: no table
        return {"table": [], "optimizer": [], **tiered}
    state = [v for v in model.optimizer.variables if tuple(v.shape) == tuple(table.shape)]
    return {"table": rows(table), "optimizer": [n for v in state for n in rows(v)], **tiered}
