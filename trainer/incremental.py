"""Minute-level training: a parent checkpoint trained on a little more data, scored before and after.

The parent's checkpoint holds its weights and its optimizer state (Adagrad accumulators, step count), so a
chain of minute runs trains like one long run cut into minutes. Rows that the minute's feature state handed
to newly admitted values start from a fresh draw of the table's initializer, as in the daily warm start.
"""

from __future__ import annotations

import random
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import keras
import numpy as np

from components.block_codec import BLOCK_LAYOUT
from components.delta import save_weights, saved_weights, weight_specs
from components.feature_spec import FeatureSpec, load_spec
from trainer.arguments import even_batch_size
from trainer.keras_internals import flatten_layers
from trainer.layers.categorical_embedding import CategoricalEmbedding
from trainer.train import CHECKPOINT_KIND, ThroughputMeter, load_checkpoint, save_checkpoint


@dataclass
class _WarmModel:
    """The model a minute run just saved, kept in memory by a long-running process (the step worker): the next
    minute's parent is usually that checkpoint, and the kept model has its weights, optimizer state and
    compiled train and test functions already."""

    directory: Path
    files: dict[str, Any]  # the checkpoint manifest's files (sha256, bytes) when it was saved
    model: keras.Model


# A minute's rows are one finite pass of unknown length: Keras warns at its end, in every minute run's log.
warnings.filterwarnings("ignore", message="Your input ran out of data", category=UserWarning)

_warm: _WarmModel | None = None
_warm_lock = threading.Lock()
_MAX_TF_SEED = 2**31 - 1  # TensorFlow keeps a global seed modulo this


def seed_random(seed: int) -> None:
    """keras.utils.set_random_seed(seed), except that TensorFlow's global seed is left alone when it is `seed`
    already: setting it clears TensorFlow's kernel caches (TFE_ContextClearCaches), after which the kept
    model's compiled test and train steps are instantiated and their graphs optimized again, in every minute.
    Python's and numpy's generators are reset either way. What is not reset then, TensorFlow's sequence of op
    seeds and Keras' global seed generator, a minute does not draw from: its shuffles take explicit seeds, its
    initializers stateless ones, and its dropout and rare-row draws are set by reset_random_draws. On the JAX
    backend (no TensorFlow, no kernel caches) it is keras.utils.set_random_seed."""
    if keras.backend.backend() != "tensorflow":
        keras.utils.set_random_seed(seed)
        return
    import tensorflow as tf

    global_seed, _ = tf.compat.v1.random.get_seed(0)  # (the global seed or a default, the op seed given)
    if tf.executing_eagerly() and global_seed == seed % _MAX_TF_SEED:
        random.seed(seed)
        np.random.seed(seed)
        return
    keras.utils.set_random_seed(seed)


def reset_random_draws(model: keras.Model, seed: int) -> int:
    """Sets the state of every seed generator in `model` (dropout's, the rare row's draws) from `seed`, so that
    a minute's random draws are the same whether its parent came from memory or from its checkpoint (a saved
    model does not keep them). Returns how many it set."""
    states = [variable for variable in model.variables if variable.path.endswith("seed_generator_state")]
    for i, state in enumerate(states):
        state.assign(np.asarray([seed + i, 0], dtype=state.dtype))
    return len(states)


def _parent_model(parent_checkpoint: Path) -> tuple[keras.Model, bool]:
    """(the parent's model, whether it came from memory). The kept model is used only for the checkpoint it
    was saved as, while that checkpoint's manifest still names the same files; it is taken out while in use,
    so a run that fails half-way never leaves a half-trained model behind."""
    from components.manifest import read_manifest

    global _warm
    with _warm_lock:
        warm, _warm = _warm, None
    if warm is not None and warm.directory == Path(parent_checkpoint).resolve():
        manifest = read_manifest(parent_checkpoint, kind=CHECKPOINT_KIND, verify=False)
        if manifest.get("files") == warm.files:
            return warm.model, True
    return load_checkpoint(parent_checkpoint), False


def forget_kept_model() -> None:
    """Drops the model a minute run keeps in memory, so that the next one loads its parent's checkpoint."""
    global _warm
    with _warm_lock:
        _warm = None


def _keep_warm(model: keras.Model, checkpoint_dir: Path, manifest: Mapping[str, Any]) -> None:
    global _warm
    with _warm_lock:
        _warm = _WarmModel(Path(checkpoint_dir).resolve(), manifest["files"], model)


def checkpoint_weights(checkpoint_dir: Path) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    """The weight list of a checkpoint (trainer.export.weight_specs) and the weights as numpy arrays: from the
    plain weights.npz that minute runs write beside model.keras (no model to rebuild), else from model.keras."""
    saved = saved_weights(checkpoint_dir)
    if saved is not None:
        return saved
    model = load_checkpoint(checkpoint_dir)
    return weight_specs(model), [np.array(v) for v in model.weights]


def reset_rows(model: keras.Model, new_rows: Mapping[str, Sequence[int]], table_names: Sequence[str]) -> int:
    """Re-draws the embedding rows of newly admitted values (by table name; `table_names` in the model's table
    order, FeatureState.vocabularies') from the table's initializer; returns how many."""
    num_reset = 0
    for layer in flatten_layers(model):
        if not isinstance(layer, CategoricalEmbedding) or not layer.num_rows:
            continue
        table = np.array(layer.embeddings)
        for name, rows in new_rows.items():
            feature = list(table_names).index(name)
            if layer.offsets[feature] < 0 or not rows:
                continue
            global_rows = layer.offsets[feature] + np.asarray(rows, dtype=np.int64)
            fresh = layer.embeddings_initializer((len(global_rows), layer.embedding_dim), dtype="float32")
            table[global_rows] = np.asarray(fresh)
            num_reset += len(global_rows)
        layer.embeddings.assign(table)
    return num_reset


def train_increment(
    parent_checkpoint: Path, train_files: Sequence[str], holdout_files: Sequence[str], checkpoint_dir: Path, *,
    new_rows: Mapping[str, Sequence[int]], batch_size: int, epochs: int, seed: int, version: str,
    layout: str = BLOCK_LAYOUT, num_rows: int | None = None, spec: FeatureSpec | None = None,
    span_max_bytes: int | None = None,
) -> dict[str, Any]:
    """Trains the parent checkpoint on `train_files` and writes `checkpoint_dir`. Returns the numbers the gate
    and the run's log need: rows, speed, holdout logloss of parent and child, the global step. `span_max_bytes`:
    the records a tiered table's span may gather (trainer/tiered_tables.py, `write_span`; None: its default,
    0: no spans).

    On TensorFlow the rows come through tf.data (trainer.input); on JAX (trainer.jax_train runs this in a child
    process with KERAS_BACKEND=jax) through the TensorFlow-free block reader, with the same seeds."""
    from trainer.model_inputs import CRITEO_INPUTS, model_inputs

    inputs = model_inputs(spec) if spec is not None else CRITEO_INPUTS

    def batches(files: Sequence[str], size: int, shuffle: bool, shuffle_seed: int) -> Any:
        if keras.backend.backend() == "tensorflow":
            from trainer.input import samples_dataset
            from trainer.row_layout import row_columns

            return samples_dataset(files, size, shuffle=shuffle, seed=shuffle_seed, layout=layout, inputs=inputs,
                                   columns=row_columns(spec, layout))
        if layout != BLOCK_LAYOUT:
            raise ValueError(f"train.backend=jax reads block samples ({BLOCK_LAYOUT!r}) only; these are {layout!r}: "
                             "write them with features.samples_layout=block or train with train.backend=tensorflow")
        from trainer.block_reader import block_batches

        return block_batches(files, size, shuffle=shuffle, seed=shuffle_seed, inputs=inputs)

    started = time.monotonic()
    seconds: dict[str, float] = {}

    def lap(name: str) -> None:  # where the step's time goes, returned with its numbers
        seconds[name] = round(time.monotonic() - started - sum(seconds.values()), 3)

    seed_random(seed)
    train_batch_size = even_batch_size(num_rows, batch_size) if num_rows else batch_size
    model, from_memory = _parent_model(parent_checkpoint)
    if model.optimizer is None:
        raise ValueError(f"the checkpoint in {parent_checkpoint} has no optimizer state; it cannot be trained on")
    lap("load_parent")
    num_reset = reset_rows(model, new_rows, list(inputs.tables))
    reset_random_draws(model, seed)
    tiered = _tiered_tables(model, parent_checkpoint, list(inputs.tables))
    live_reused = tiered.open_live(Path(parent_checkpoint)) if tiered is not None else False
    try:
        if tiered is not None:  # the new values' rows drawn afresh in the live stores
            num_reset += tiered.reset_rows({list(inputs.tables).index(name): rows for name, rows in new_rows.items()},
                                           seed)
        lap("reset_rows")

        def holdout() -> Any:
            return batches(holdout_files, batch_size, False, seed)

        def score() -> float:
            if tiered is not None:
                return tiered.evaluate(model, holdout())["val_loss"]
            return float(model.evaluate(holdout(), verbose=0, return_dict=True)["loss"])

        parent_logloss = score()
        lap("score_parent")
        meter = ThroughputMeter()
        for epoch in range(epochs):
            rows = batches(train_files, train_batch_size, True, seed + epoch)
            callbacks: list[keras.callbacks.Callback] = [meter]
            if tiered is not None:  # through the hot tiers (trainer/tiered_tables.py)
                rows, tier_callback = tiered.training(rows)
                callbacks.insert(0, tier_callback)
            model.fit(rows, epochs=1, callbacks=callbacks, shuffle=False, verbose=0)
        lap("fit")
        logloss = score()
        lap("score_child")
        global_step = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
        train_rows = meter.num_examples_by_epoch[-1] if meter.num_examples_by_epoch else 0
        holdout_rows = int(sum(int(label.shape[0]) for _, label in holdout()))
        lap("count_holdout")
        checkpoint_dir = Path(checkpoint_dir)
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        weights_file = save_weights(checkpoint_dir, [np.asarray(v) for v in model.weights])  # for the delta export
        table_files, touched, tier_counters, chain_inputs, chain_extra, span_rows = [], {}, None, {}, {}, {}
        if tiered is not None:  # per tiered table, the rows the minute's batches read (and reset) with their values
            touched = tiered.touched()
            chain = tiered.write_overlays(checkpoint_dir, parent_checkpoint, span_max_bytes)
            table_files, span_rows = chain.files, chain.span_rows
            chain_inputs, chain_extra = chain.manifest()
        lap("save_weights")
        saved = save_checkpoint(
            model, checkpoint_dir, version=version, extra_files=[weights_file, *table_files],
            spec_hash=(spec or load_spec("criteo")).hash(),
            inputs={"parent_checkpoint": str(parent_checkpoint), "train_files": list(train_files),
                    "holdout_files": list(holdout_files), **chain_inputs},
            row_counts={"train": train_rows, "holdout": holdout_rows},
            extra={"global_step": global_step, "rows_reset": num_reset, "weight_specs": weight_specs(model),
                   **chain_extra,
                   **({"tiered_tables": {name: table.hot_rows for name, table in spec.tables().items()
                                         if table.tiered}} if tiered is not None and spec is not None else {})})
        if tiered is not None:  # the live stores now hold this checkpoint's tables: the next minute trains them
            tier_counters = tiered.counters()
            tiered.release_live(checkpoint_dir)
        lap("save_checkpoint")
        _keep_warm(model, checkpoint_dir, saved)
        return {"train_rows": train_rows, "batch_size": train_batch_size, "holdout_rows": holdout_rows,
                "parent_from_memory": from_memory, "rows_reset": num_reset,
                "examples_per_second": meter.examples_per_second(), "holdout_logloss": logloss,
                "parent_holdout_logloss": parent_logloss, "global_step": global_step, "seconds": seconds,
                **({"tiered_tables": tier_counters, "tiered_live_reused": live_reused,
                    "tiered_rows_touched": {name: int(len(rows)) for name, rows in touched.items()},
                    "tiered_span_rows": span_rows}
                   if tiered is not None else {})}
    finally:
        if tiered is not None:  # after release_live, nothing to do; after a failure the next minute rebuilds them
            tiered.unlock_live()


def _tiered_tables(model: keras.Model, parent_checkpoint: Path, table_names: list[str]) -> Any:
    """The minute's tiered tables (trainer/tiered_tables.py), on the chain's live stores (beside its daily
    checkpoint: `live_directory`), not opened yet; None when the model has none."""
    from trainer.tiered_tables import TieredTables, live_directory, tiered_layer

    layer = tiered_layer(model)
    if layer is None:
        return None
    first = table_names[next(iter(layer.tiered_tables))]
    return TieredTables(model, layer, table_names, live_directory(Path(parent_checkpoint), first))
