"""The training loop: stock `keras.Model.fit` over block TFRecords, then a checkpoint and its manifest."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import keras
import numpy as np

from components.block_codec import BLOCK_LAYOUT
from components.config import TrainConfig
from components.feature_spec import FeatureSpec, load_spec
from components.manifest import read_manifest, write_manifest
from trainer.arguments import even_batch_size, require_integer, resolve_batch_size
from trainer.calibration import calibrate, predictions_of
from trainer.early_stopping import BestEpoch
from trainer.metrics import ctr_metrics
from trainer.models import build_model
from trainer.optimizers import EMBEDDING_VARIABLE_NAME, EmbeddingAdagrad
from trainer.progress import ProgressCheckpoint, clear_progress, read_progress
from trainer.row_layout import row_columns
from trainer.warm_start import warm_start_weights

MODEL_FILE = "model.keras"
PROGRESS_DIR = "progress"
CHECKPOINT_KIND = "checkpoint"
MIXED_PRECISION_POLICY = "mixed_bfloat16"
# From this many embedding rows on, train_model warns that micro-batching reads and writes every row each
# micro-batch (dense_accumulation_warning).
DENSE_ACCUMULATION_WARN_ROWS = 100_000

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    model: keras.Model
    # Per-epoch values of the loss and metrics, training and "val_" (the eval files), as Keras names them.
    history: dict[str, list[float]]
    # Training rows in one epoch.
    num_train_examples: int
    # Training rows per second over the whole fit, without the first step (tracing and compilation)
    # and without validation.
    examples_per_second: float
    # Eval labels and predicted probabilities, both float32 [n] and in eval-file order.
    eval_labels: np.ndarray
    eval_predictions: np.ndarray
    # The speed settings in effect (see speed_flags_of), for the run's log.
    speed_flags: dict[str, Any]
    # Training batches applied in all (micro-batches when micro_batches > 1).
    global_step: int = 0
    # The step a killed run's saved progress resumed from, if it did.
    resumed_from_step: int | None = None
    # What warm_start_weights copied and reset, when the run was warm-started.
    warm_start: dict[str, int] | None = None
    # The level calibration applied after training (trainer.calibration.calibrate_level), if any.
    calibration: dict[str, float] | None = None
    # The epoch (0-based) whose weights were kept: the best held-out AUC (None with early stopping off).
    best_epoch: int | None = None
    # With train.average_epochs, the epochs (0-based) whose weights were averaged into the kept model: the best
    # one and the ones after it; empty when one epoch's weights were kept as they were.
    averaged_epochs: tuple[int, ...] = ()
    # Per tiered table (storage: tiered), what its hot tier and store did: TieredTables.counters().
    tiered_tables: dict[str, dict[str, int]] | None = None


class StepMetricsLogger(keras.callbacks.Callback):
    """Calls `log_fn(metrics, step)` every `every_n_steps` training steps, and with the epoch's metrics
    (training and validation) at the end of each epoch. `step` counts training batches from 1.

    Step metrics are Keras' running values over the epoch so far, plus `examples_per_second` over the steps
    since the previous log (from the "num_examples" metric). Tracking adapters (MLflow) pass their own
    `log_fn`; the trainer knows no tracking library.
    """

    def __init__(self, log_fn: Callable[[dict[str, float], int], None], every_n_steps: int) -> None:
        super().__init__()
        require_integer("every_n_steps", every_n_steps)
        self.log_fn = log_fn
        self.every_n_steps = every_n_steps
        self.step = 0
        self._last: tuple[float, float] | None = None  # (time, num_examples) at the previous log

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._last = (time.perf_counter(), 0.0)

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        self.step += 1
        if self.step % self.every_n_steps == 0:
            metrics = _floats(logs)
            now, examples = time.perf_counter(), metrics.get("num_examples")
            if examples is not None and self._last is not None and now > self._last[0]:
                metrics["examples_per_second"] = (examples - self._last[1]) / (now - self._last[0])
                self._last = (now, examples)
            self.log_fn(metrics, self.step)

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        self.log_fn(_floats(logs), self.step)


class ThroughputMeter(keras.callbacks.Callback):
    """Training rows and seconds per epoch, leaving out the first step and validation."""

    def __init__(self) -> None:
        super().__init__()
        self.num_examples_by_epoch: list[int] = []
        self.timed_examples = 0
        self.timed_seconds = 0.0
        self._epoch_start = 0.0
        self._last_batch_end = 0.0
        self._first_step: tuple[float, int] | None = None

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._epoch_start = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._last_batch_end = time.perf_counter()
        if self._first_step is None:
            self._first_step = (self._last_batch_end, int(_floats(logs)["num_examples"]))

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        num_examples = int(_floats(logs)["num_examples"])
        self.num_examples_by_epoch.append(num_examples)
        start, skipped = self._epoch_start, 0
        if len(self.num_examples_by_epoch) == 1 and self._first_step is not None:  # the first epoch timed
            start, skipped = self._first_step
        self.timed_examples += num_examples - skipped
        self.timed_seconds += self._last_batch_end - start

    def examples_per_second(self) -> float:
        return self.timed_examples / self.timed_seconds if self.timed_seconds > 0 else float("nan")


@dataclass(frozen=True)
class WarmStart:
    """Where a run starts from: a previous checkpoint, and the rows to re-initialise by feature index
    (trainer.warm_start.reset_rows_by_feature)."""

    checkpoint_dir: Path
    reset_rows: Mapping[int, Sequence[int]]


def train_model(
    config: TrainConfig,
    table_sizes: Mapping[str, int],
    train_files: Sequence[str],
    eval_files: Sequence[str],
    checkpoint_dir: Path,
    callbacks: Sequence[keras.callbacks.Callback] = (),
    *,
    version: str | None = None,
    warm_start: WarmStart | None = None,
    layout: str = BLOCK_LAYOUT,
    num_rows: int | None = None,
    spec: FeatureSpec | None = None,
) -> TrainResult:
    """Trains `config.model` on `train_files`, validates on `eval_files` after each epoch, and writes
    `checkpoint_dir/model.keras` and its manifest (kind "checkpoint", `version` or else a hash of the inputs).

    `config.batch_size` is the rows per optimizer step; with `micro_batches` = k > 1 each step accumulates
    k micro-batches of batch_size / k rows (Keras, and StepMetricsLogger, count micro-batches as steps; the
    accumulated gradients are dense, so each micro-batch costs O(table) on the embeddings). `mixed_precision`
    trains under "mixed_bfloat16"; the global dtype policy is restored afterwards.

    Progress is saved under `checkpoint_dir/progress` every `config.checkpoint_every_steps` steps and at each
    epoch's end. A run with the same inputs that finds progress there resumes from it: same weights, optimizer
    state, step count and data position (epoch e reads its files in the order of seed + e, and skips the
    batches already applied). After each epoch the held-out AUC is compared with the best so far
    (trainer/early_stopping.py): `early_stopping_patience` epochs without a gain end the run, and the best
    epoch's weights are the ones kept. Otherwise `warm_start`, when given, seeds the weights from a previous checkpoint.
    `spec`: the feature spec the samples were written under (the criteo spec when None).
    """
    # Imported here: the input pipeline is tf.data, and the rest of this module (compile_model,
    # load_checkpoint, StepMetricsLogger) must import on JAX hosts without TensorFlow.
    from trainer.input import samples_dataset
    from trainer.model_inputs import CRITEO_INPUTS, model_inputs
    from trainer.tiered_tables import TABLES_DIR, TieredTables, tiered_layer

    inputs = model_inputs(spec) if spec is not None else CRITEO_INPUTS
    columns = row_columns(spec, layout)

    # train.batch_size=0 is chosen from the rows; the checkpoint's manifest records the size used.
    config = dataclasses.replace(config, batch_size=resolve_batch_size(config.batch_size, num_rows))
    micro_batch_size = micro_batch_size_of(config)
    if num_rows and config.micro_batches == 1:
        # Equal batches: an epoch's last step is not taken on a handful of rows.
        micro_batch_size = even_batch_size(num_rows, micro_batch_size)
    checkpoint_dir = Path(checkpoint_dir)
    progress_dir = checkpoint_dir / PROGRESS_DIR
    identity = input_hash(config, table_sizes, train_files, eval_files)
    resumed = read_progress(progress_dir, identity)
    keras.utils.set_random_seed(config.seed)
    previous_policy = keras.config.dtype_policy()
    if config.mixed_precision:
        keras.config.set_dtype_policy(MIXED_PRECISION_POLICY)
    strategy = _distribution_strategy()
    warm_start_summary: dict[str, int] | None = None
    tiered: TieredTables | None = None
    try:
        with strategy.scope():
            model = build_model(config, table_sizes, spec)
            compile_model(model, config)
            warning = dense_accumulation_warning(config, embedding_shapes(model))
            if warning:
                logger.warning(warning)
            layer = tiered_layer(model)
            if layer is not None:  # tables on disk with a hot tier (trainer/tiered_tables.py)
                if config.average_epochs:
                    raise ValueError("train.average_epochs averages whole tables, which a tiered table (storage: "
                                     "tiered) never holds in memory; set train.average_epochs=false")
                tiered = TieredTables(model, layer, inputs.tables, progress_dir / TABLES_DIR)
            if resumed is not None:
                model.optimizer.build(model.trainable_variables)
                model.load_weights(progress_dir / resumed.weights)
                if tiered is not None:
                    tiered.restore(progress_dir / progress_tables(resumed.global_step))
            elif warm_start is not None:
                warm_start_summary = warm_start_model(model, warm_start, tiered, config.seed, inputs.tables)
            elif tiered is not None:
                tiered.create(config.seed)
        eval_data = samples_dataset(eval_files, config.batch_size, shuffle=False, seed=config.seed, layout=layout,
                                    inputs=inputs, columns=columns)
        meter = ThroughputMeter()
        saver = ProgressCheckpoint(progress_dir, identity, progress_every(config, tiered), start=resumed,
                                   save_weights=None if tiered is None else
                                   lambda model, path: save_tiered_progress(model, path, tiered, saver))
        best = BestEpoch(progress_dir, identity, config.early_stopping_patience, config.early_stopping_min_delta,
                         average=config.average_epochs)
        for callback in callbacks:
            if isinstance(callback, StepMetricsLogger) and resumed is not None:
                callback.step = resumed.global_step
        history: dict[str, list[float]] = {}
        first_epoch = resumed.epoch if resumed else 0
        with warnings.catch_warnings():
            # Keras warns whenever a dataset of unknown length ends, which ours do at every epoch's end.
            warnings.filterwarnings("ignore", message="Your input ran out of data")
            for epoch in range(first_epoch, config.epochs):
                train_data = samples_dataset(
                    train_files, micro_batch_size, shuffle=True, seed=config.seed + epoch, layout=layout,
                    shuffle_buffer_blocks=config.shuffle_buffer_blocks, inputs=inputs, columns=columns,
                )
                if resumed is not None and epoch == resumed.epoch and resumed.batches_done:
                    train_data = train_data.skip(resumed.batches_done)
                if tiered is None:
                    fitted = model.fit(
                        train_data,
                        validation_data=eval_data,
                        initial_epoch=epoch,
                        epochs=epoch + 1,
                        callbacks=[meter, saver, *callbacks],
                        shuffle=False,  # block_dataset shuffles
                        verbose=0,
                    ).history
                else:
                    fitted = fit_tiered_epoch(model, tiered, train_data, eval_data, epoch, [meter, saver, *callbacks])
                for name, values in fitted.items():
                    history.setdefault(name, []).extend(float(v) for v in values)
                logs = {name: values[-1] for name, values in fitted.items()}
                if update_best(best, epoch, logs, model, tiered, progress_dir):
                    break
            best_epoch = restore_best(best, model, tiered, progress_dir)
            averaged_epochs = tuple(best.averaged_epochs)
            calibration = None
            if config.calibrate:
                rows = samples_dataset(train_files, config.batch_size, shuffle=False, seed=config.seed, layout=layout,
                                       inputs=inputs, columns=columns
                                       ).take(-(-config.calibration_rows // config.batch_size))
                held_out = eval_data if config.calibrate_on == "held_out" else None
                if tiered is not None:
                    rows = tiered.applied(rows)
                    held_out = tiered.applied(held_out) if held_out is not None else None
                calibration = calibrate(model, rows, held_out, config.calibration_min_clicks)
            if tiered is None:
                eval_predictions = model.predict(eval_data.map(lambda features, label: features), verbose=0)
                eval_labels = np.concatenate([label.numpy() for _, label in eval_data]).astype(np.float32)
            else:
                labels, predictions = predictions_of(model, tiered.applied(eval_data))
                eval_labels, eval_predictions = labels.astype(np.float32), predictions.astype(np.float32)
    finally:
        keras.config.set_dtype_policy(previous_policy)
    num_train_examples = meter.num_examples_by_epoch[-1] if meter.num_examples_by_epoch else 0
    speed_flags = speed_flags_of(config, strategy.num_replicas_in_sync)
    kept = best_epoch - first_epoch if best_epoch is not None and best_epoch >= first_epoch else -1

    table_files = tiered.commit(checkpoint_dir) if tiered is not None else []
    write_training_checkpoint(
        model, checkpoint_dir, config=config, version=version or identity, spec=spec, table_sizes=table_sizes,
        train_files=train_files, eval_files=eval_files,
        warm_start=warm_start if warm_start_summary is not None else None, warm_start_summary=warm_start_summary,
        num_train_examples=num_train_examples, num_eval_examples=len(eval_labels), history=history, kept=kept,
        best_epoch=best_epoch, first_epoch=first_epoch, speed_flags=speed_flags, global_step=saver.global_step,
        resumed_from_step=resumed.global_step if resumed else None, calibration=calibration,
        table_files=table_files,
        extra={"averaged_epochs": list(averaged_epochs),
               "tiered_tables": {name: table.hot_rows for name, table in (spec.tables() if spec else {}).items()
                                 if table.tiered}})
    clear_progress(progress_dir)  # the checkpoint supersedes it
    return TrainResult(
        model=model,
        history=history,
        num_train_examples=num_train_examples,
        examples_per_second=meter.examples_per_second(),
        eval_labels=eval_labels,
        eval_predictions=eval_predictions.reshape(-1).astype(np.float32),
        speed_flags=speed_flags,
        global_step=saver.global_step,
        resumed_from_step=resumed.global_step if resumed else None,
        warm_start=warm_start_summary,
        calibration=calibration,
        best_epoch=best_epoch,
        averaged_epochs=averaged_epochs,
        tiered_tables=tiered.counters() if tiered is not None else None,
    )


def write_training_checkpoint(
    model: keras.Model, checkpoint_dir: Path, *, config: TrainConfig, version: str, spec: FeatureSpec | None,
    table_sizes: Mapping[str, int], train_files: Sequence[str], eval_files: Sequence[str],
    warm_start: WarmStart | None, warm_start_summary: dict[str, int] | None, num_train_examples: int,
    num_eval_examples: int, history: Mapping[str, list[float]], kept: int, best_epoch: int | None, first_epoch: int,
    speed_flags: Mapping[str, Any], global_step: int, resumed_from_step: int | None,
    calibration: dict[str, float] | None, extra: Mapping[str, Any] | None = None, table_files: Sequence[str] = (),
) -> dict[str, Any]:
    """model.keras, the weights file deltas diff against, and the checkpoint's manifest (kind "checkpoint"),
    written last: what a training run leaves, on either backend (train_model, trainer.jax_train). `kept` indexes
    `history`'s lists: the kept epoch's metrics (the last epoch's when early stopping is off or the best epoch
    ran before a resume). `table_files`: the tiered tables' stores, already in `checkpoint_dir`. Returns the
    manifest."""
    from components.delta import save_weights, weight_specs

    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    weights_file = save_weights(checkpoint_dir, [np.asarray(v) for v in model.weights])  # for delta exports
    return save_checkpoint(
        model,
        checkpoint_dir,
        version=version,
        extra_files=[weights_file, *table_files],
        spec_hash=(spec or load_spec("criteo")).hash(),
        inputs={"train_files": [str(f) for f in train_files], "eval_files": [str(f) for f in eval_files],
                "warm_start": str(warm_start.checkpoint_dir) if warm_start is not None else None},
        row_counts={"train": num_train_examples, "eval": num_eval_examples},
        extra={
            "train_config": dataclasses.asdict(config),
            "table_sizes": dict(table_sizes),
            "final_metrics": {name: values[kept] for name, values in history.items()},
            "best_epoch": best_epoch,
            "epochs_run": first_epoch + len(history.get("loss", [])),
            "speed_flags": dict(speed_flags),
            "global_step": global_step,
            "resumed_from_step": resumed_from_step,
            "warm_start": warm_start_summary,
            "calibration": calibration,
            "weight_specs": weight_specs(model),
            **(extra or {}),
        },
    )


def compile_model(model: keras.Model, config: TrainConfig, steps_per_execution: int = 1) -> None:
    """Optimizer, loss, metrics and XLA as `train_model` uses them. `steps_per_execution` > 1 runs that many
    steps per call into the compiled step (fewer host round trips; callbacks then see every k-th step)."""
    model.compile(
        optimizer=EmbeddingAdagrad(
            learning_rate=config.learning_rate,
            embedding_learning_rate=config.embedding_learning_rate,
            gradient_accumulation_steps=config.micro_batches if config.micro_batches > 1 else None,
            row_sparse_updates=config.row_sparse_updates,
            dense_optimizer=config.dense_optimizer,
        ),
        loss=keras.losses.BinaryCrossentropy(name="logloss"),
        metrics=ctr_metrics(),
        jit_compile=config.jit_compile,
        steps_per_execution=steps_per_execution,
    )


def load_checkpoint(checkpoint_dir: Path, verify: bool = True) -> keras.Model:
    """The model a `train_model` run saved, after checking the checkpoint's manifest. With tiered tables its
    CategoricalEmbedding holds hot slots, and the tables are the stores in `checkpoint_dir/tables`
    (`load_in_memory` reads them into a model that holds them)."""
    read_manifest(checkpoint_dir, kind=CHECKPOINT_KIND, verify=verify)
    return keras.saving.load_model(Path(checkpoint_dir) / MODEL_FILE)


def load_in_memory(checkpoint_dir: Path, table_names: Sequence[str], verify: bool = True) -> keras.Model:
    """The checkpoint's model with every table in memory: as saved, or, with tiered tables, the same model with
    their rows read from the checkpoint's stores (trainer/tiered_tables.py in_memory_model). `table_names`: the
    spec's tables in model order (ModelInputs.tables)."""
    from trainer.tiered_tables import in_memory_model

    model = load_checkpoint(checkpoint_dir, verify=verify)
    return in_memory_model(model, Path(checkpoint_dir), table_names)


def progress_tables(global_step: int) -> str:
    """The directory, in the progress directory, of the tiered tables saved with the progress at `global_step`."""
    return f"tables-{global_step:09d}"


def best_tables(epoch: int) -> str:
    """The directory, in the progress directory, of the tiered tables of best epoch `epoch`."""
    return f"best-tables-{epoch:04d}"


def save_tiered_progress(model: keras.Model, path: Path, tiered: Any, saver: ProgressCheckpoint) -> bool:
    """ProgressCheckpoint's save with tiered tables: the tables (flushed, then copied) before the weights, so a
    progress state names weights whose tables are on disk; older table copies go, except the one the current
    state names (a kill before the new state is written leaves it)."""
    name = progress_tables(saver.global_step)
    tiered.snapshot(path.parent / name)
    current = read_progress(path.parent, saver.identity)
    keep = {name, *([progress_tables(current.global_step)] if current is not None else [])}
    for old in path.parent.glob("tables-*"):
        if old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)
    model.save_weights(path)
    return True


def remove_other(directory: Path, pattern: str, keep: str) -> None:
    """Removes the directories under `directory` matching `pattern`, except `keep`."""
    for old in Path(directory).glob(pattern):
        if old.name != keep:
            shutil.rmtree(old, ignore_errors=True)


def warm_start_model(model: keras.Model, warm_start: WarmStart, tiered: Any, seed: int,
                     table_names: Sequence[str]) -> dict[str, int]:
    """Seeds `model` from the warm start's checkpoint. Tables in memory take the parent's rows as
    warm_start_weights does; a tiered table's store is made from the parent's store (or, when the parent held
    it in memory, from its rows there), the reset rows drawn afresh. A tiered parent whose tables do not match
    is read into memory first."""
    from trainer.tiered_tables import tiered_layer
    from trainer.tiered_training import linear_part

    previous = load_checkpoint(warm_start.checkpoint_dir)
    parent_tiered = tiered_layer(previous)
    if tiered is None:
        if parent_tiered is not None:
            previous = load_in_memory(warm_start.checkpoint_dir, table_names)
        return warm_start_weights(model, previous, warm_start.reset_rows)
    parent_tables: Path | None = warm_start.checkpoint_dir
    parent_rows: dict[int, np.ndarray] = {}
    if parent_tiered is None or set(parent_tiered.tiered_tables) != set(tiered.layer.tiered_tables):
        if parent_tiered is not None:
            previous = load_in_memory(warm_start.checkpoint_dir, table_names)
        parent_tables = None
        # A model with a linear part keeps each row's linear weight after its values (TieredTables.width).
        linear = linear_part(previous) if tiered.linear is not None else None
        layers = [previous.embedding, *([linear] if linear is not None else [])]
        parent_rows = {table: np.concatenate([np.asarray(layer.embeddings)[
            int(layer.offsets[table]):int(layer.offsets[table]) + layer.table_sizes[table]] for layer in layers],
            axis=1) for table in tiered.layer.tiered_tables}
    counts = tiered.create(seed, parent_tables, warm_start.reset_rows, parent_rows)
    summary = warm_start_weights(model, previous, warm_start.reset_rows, skip=tiered.hot_paths())
    return {key: summary.get(key, 0) + counts.get(key, 0) for key in {**summary, **counts}}


# A progress interval no epoch reaches (progress_every).
NO_SAVES_INSIDE_EPOCHS = 1 << 62


def fit_tiered_epoch(model: keras.Model, tiered: Any, train_data: Any, eval_data: Any, epoch: int,
                     callbacks: Sequence[keras.callbacks.Callback],
                     score: Callable[[keras.Model, Any], dict[str, float]] | None = None) -> dict[str, list[float]]:
    """Epoch `epoch` of `fit` with the batches of `train_data` through the hot tiers of `tiered` (a
    TieredTables), then the held-out batches `eval_data` scored through them the same way: fit's history, the
    held-out metrics under Keras' names ("val_" first), also logged where fit's would be. Either backend.
    `score(model, batches)` scores the held-out batches instead of `evaluate` (several devices: a direct call
    of the model, which takes batches of any size; trainer/devices.py `held_out_metrics`)."""
    stream, tier_callback = tiered.training(train_data)
    fitted = model.fit(stream, initial_epoch=epoch, epochs=epoch + 1, callbacks=[tier_callback, *callbacks],
                       shuffle=False, verbose=0).history
    held_out = tiered.evaluate(model, eval_data) if score is None else score(model, tiered.applied(eval_data))
    fitted.update({name: [value] for name, value in held_out.items()})
    for callback in callbacks:
        if isinstance(callback, StepMetricsLogger):
            callback.log_fn(held_out, callback.step)
    return fitted


def progress_every(config: TrainConfig, tiered: Any) -> int:
    """Training batches between progress saves: `checkpoint_every_steps`; for tiered tables with micro-batches,
    none inside an epoch (only the saves at epoch ends, where the tiered stream ends with an optimizer step: a
    save inside a step would keep gradients accumulated on hot slots that a resumed run's new hot tiers give
    other rows)."""
    if tiered is None or config.micro_batches <= 1:
        return config.checkpoint_every_steps
    return NO_SAVES_INSIDE_EPOCHS


def update_best(best: BestEpoch, epoch: int, logs: Mapping[str, float], model: keras.Model, tiered: Any,
                progress_dir: Path) -> bool:
    """`best.update` (trainer/early_stopping.py BestEpoch), whether to stop; with tiered tables, an epoch
    better than the best so far keeps a copy of its tables beside its weights, and only the best's copy stays."""
    if tiered is not None and best.improves(logs):
        tiered.snapshot(progress_dir / best_tables(epoch))
    stop = best.update(epoch, logs, model)
    if tiered is not None and best.best is not None:
        remove_other(progress_dir, "best-tables-*", best_tables(best.best.epoch))
    return stop


def restore_best(best: BestEpoch, model: keras.Model, tiered: Any, progress_dir: Path) -> int | None:
    """`best.restore(model)`, the best epoch; with tiered tables, their stores put back to that epoch's too."""
    reloads = best.reloads()
    best_epoch = best.restore(model)
    if tiered is not None and best_epoch is not None and reloads:
        tiered.restore(progress_dir / best_tables(best_epoch))
    return best_epoch


def embedding_shapes(model: keras.Model) -> list[tuple[int, ...]]:
    """The shapes of the model's embedding tables (plain and multi-hash)."""
    return [tuple(int(d) for d in v.shape) for v in model.weights if v.name == EMBEDDING_VARIABLE_NAME]


def dense_accumulation_warning(config: TrainConfig, tables: Sequence[tuple[int, ...]]) -> str | None:
    """What micro-batching costs on these tables, when they are large enough for it to matter; else None.

    Keras accumulates micro-batch gradients in dense variables the shape of the weights, so with
    `micro_batches` > 1 each micro-batch reads and writes every embedding row and its accumulator, and
    row-sparse updates are off. A scratch timing of micro-batches of 1,024 rows (one dense layer over 26
    features, 2 cores): 6.9 ms a step without micro-batching and 88.8 ms a micro-batch with 2, on 2.6 M rows
    (41.6 M parameters); 6.2 and 11.6 ms on 260 K rows."""
    rows = sum(shape[0] for shape in tables)
    if config.micro_batches <= 1 or rows < DENSE_ACCUMULATION_WARN_ROWS:
        return None
    parameters = sum(int(np.prod(shape)) for shape in tables)
    return (f"train.micro_batches={config.micro_batches} accumulates gradients densely: every micro-batch reads "
            f"and writes all {rows:,} embedding rows ({parameters:,} parameters) and their "
            "accumulator, not only the rows it looked up, and row-sparse updates are off. On large tables a "
            "micro-batch can take 10x the time of a whole step without micro-batching; unless the batch does "
            "not fit in memory, set train.micro_batches=1")


def micro_batch_size_of(config: TrainConfig) -> int:
    if config.micro_batches < 1 or config.batch_size % config.micro_batches:
        raise ValueError(
            f"train.micro_batches={config.micro_batches} must be >= 1 and divide train.batch_size="
            f"{config.batch_size}; pick a batch size that is a multiple of the micro-batch count"
        )
    return config.batch_size // config.micro_batches


def _distribution_strategy() -> Any:
    """MirroredStrategy over the visible GPUs when there are several; else the default one-device strategy.
    Batches stay global: each replica gets batch_size / num_replicas rows of every step."""
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    if len(gpus) > 1:
        return tf.distribute.MirroredStrategy([gpu.name for gpu in gpus])
    return tf.distribute.get_strategy()


def speed_flags_of(config: TrainConfig, num_replicas: int) -> dict[str, Any]:
    """The speed settings a run used, as they took effect (not only as configured)."""
    return {
        "batch_size": config.batch_size,
        "micro_batches": config.micro_batches,
        "micro_batch_size": config.batch_size // config.micro_batches,
        "jit_compile": config.jit_compile,
        "mixed_precision": config.mixed_precision,
        "dtype_policy": MIXED_PRECISION_POLICY if config.mixed_precision else keras.config.dtype_policy().name,
        # Keras accumulates micro-batch gradients densely, so accumulation turns the row-sparse path off.
        "row_sparse_updates": config.row_sparse_updates and config.micro_batches == 1,
        "num_replicas": num_replicas,
    }


def save_checkpoint(model: keras.Model, directory: Path, *, version: str, extra_files: Sequence[str] = (),
                     **manifest: Any) -> dict[str, Any]:
    """model.keras (and `extra_files`, already written into `directory`) with the manifest written last;
    returns the manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    # Written under a temporary name first: a crash never leaves a truncated model.keras behind.
    partial = directory / f".{uuid.uuid4().hex}.partial.keras"
    model.save(partial)
    os.replace(partial, directory / MODEL_FILE)
    return write_manifest(directory, kind=CHECKPOINT_KIND, version=version, files=[MODEL_FILE, *extra_files],
                          **manifest)


def input_hash(
    config: TrainConfig, table_sizes: Mapping[str, int], train_files: Sequence[str], eval_files: Sequence[str]
) -> str:
    identity = {
        "config": dataclasses.asdict(config),
        "table_sizes": dict(sorted(table_sizes.items())),
        "train_files": [str(f) for f in train_files],
        "eval_files": [str(f) for f in eval_files],
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def _floats(logs: Mapping[str, Any] | None) -> dict[str, float]:
    return {name: float(value) for name, value in (logs or {}).items()}
