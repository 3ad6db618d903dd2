"""Training a model whose CategoricalEmbedding has tiered tables, with stock `model.fit`.

Three pieces, used together:

- `TieredBatches` wraps a source of (features, label) numpy batches. A producer thread of its own reads the
  source, plans each batch in each tiered table's HotTier (prefetching the rows that are safe to read early,
  trainer/hot_tier.py), rewrites the tiered columns from row ids to slot ids, and queues the batch and its
  plans. Its own thread, not Keras' data pipeline, runs ahead, so plans are ready whatever adapter Keras picks.
- `HotTierCallback` applies the plans in batch order at `on_train_batch_begin` (or, for a stream made with
  training=False, at `on_test_batch_begin` / `on_predict_batch_begin`): Keras calls it after step i - 1
  returned and before step i reads its batch, the one point where a write-back sees step i - 1's update and a
  load lands before step i. It writes the rows into the HotTable's variable and the optimizer's accumulator
  rows of that variable, and flushes every dirty slot at the end of training.
- `TieredCheckpoint` saves, every N steps: flush, a snapshot of each store, the model's weights with the
  optimizer's state, and last a state file naming them with the step; `restore_tiered_checkpoint` puts a run
  back there.

List inputs (multi-valued and sequence features) that read a tiered table through `embed_table` are remapped
too (`lists`): their items become slots, planned with the batch's columns, and their padding (MISSING_ROW or a
negative id) becomes -1, which the models mask for a tiered table (trainer/models/blocks.py `list_mask`).

Limits: `steps_per_execution` must be 1 (plans are applied between steps), and validation during `fit` is
refused (evaluate afterwards with a training=False stream).
"""

from __future__ import annotations

import functools
import json
import os
import queue
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import keras
import numpy as np

from trainer.arguments import require_integer
from trainer.hot_tier import HotTier, PreparedPlan
from trainer.layers.categorical_embedding import CategoricalEmbedding
from trainer.layers.embedding_rows import take_rows
from trainer.layers.linear_logit import LinearLogit
from trainer.model_inputs import PADDING_ROW
from trainer.row_store import RowStore

STATE_FILE = "state.json"
# How long the training thread waits for the producer to plan the next batch before calling it stuck.
PLAN_WAIT_SECONDS = 600.0
END = object()  # queued after the last batch


def accumulator_of(optimizer: keras.optimizers.Optimizer, variable: keras.Variable) -> keras.Variable:
    """The optimizer's accumulator of `variable`, found by the name Keras gives it (`add_variable_from_reference`:
    the variable's path with "/" as "_", then "_accumulator"), from the public `optimizer.variables`."""
    name = variable.path.replace("/", "_") + "_accumulator"
    found = [v for v in optimizer.variables if v.name == name]
    if len(found) != 1 or tuple(found[0].shape) != tuple(variable.shape):
        raise ValueError(
            f"Found {len(found)} optimizer variables named {name!r} of shape {tuple(variable.shape)} for "
            f"{variable.path}; the optimizer has {[v.name for v in optimizer.variables]}. Tiered tables need an "
            "Adagrad optimizer (EmbeddingAdagrad) built on the model's trainable variables")
    return found[0]


class VariableSlots:
    """Slots of a HotTable's variable and of its accumulator (trainer.hot_tier.SlotAccess), row by row: on
    TensorFlow a gather and a scatter of the slots named, never the whole variable; a plan's write-backs are
    one gather per variable and its loads one scatter per variable.

    With `linear` (the HotTable variable of the same table in a linear part's CategoricalEmbedding of width 1,
    `linear_layer`) and its accumulator, a slot is one record of `width` columns: the row's values, then its
    linear weight; reads join the two variables' slots on the column, writes split them there."""

    def __init__(self, embeddings: keras.Variable, accumulator: keras.Variable | None,
                 linear: keras.Variable | None = None, linear_accumulator: keras.Variable | None = None) -> None:
        self.embeddings = embeddings
        self.accumulator = accumulator
        self.linear = linear
        self.linear_accumulator = linear_accumulator
        self.columns = int(embeddings.shape[1])  # where the linear weight starts in a record
        self.width = self.columns + (int(linear.shape[1]) if linear is not None else 0)

    def read(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.accumulator is None or (self.linear is not None and self.linear_accumulator is None):
            raise ValueError(f"Writing slots of {self.embeddings.path} back needs their accumulator, and the model "
                             "has no optimizer: compile the model before running batches through its hot tier")
        values, accumulators = read_rows(self.embeddings, slots), read_rows(self.accumulator, slots)
        if self.linear is None:
            return values, accumulators
        return (np.concatenate([values, read_rows(self.linear, slots)], axis=1),
                np.concatenate([accumulators, read_rows(self.linear_accumulator, slots)], axis=1))

    def write(self, slots: np.ndarray, values: np.ndarray, accumulators: np.ndarray) -> None:
        if values.shape[1] != self.width:
            raise ValueError(f"The slots of {self.embeddings.path} hold records of {self.width} columns (the row's "
                             f"{self.columns} values{', then its linear weight' if self.linear is not None else ''})"
                             f"; the store's rows have {values.shape[1]}. A model with a linear part (DeepFM, Wide & "
                             "Deep) needs the stores its tiered tables were made with (trainer/tiered_tables.py)")
        write_rows(self.embeddings, slots, values[:, :self.columns])
        if self.linear is not None:
            write_rows(self.linear, slots, values[:, self.columns:])
        if self.accumulator is not None:
            write_rows(self.accumulator, slots, accumulators[:, :self.columns])
        if self.linear_accumulator is not None:
            write_rows(self.linear_accumulator, slots, accumulators[:, self.columns:])


def linear_layer(model: keras.Model | None, layer: CategoricalEmbedding) -> CategoricalEmbedding | None:
    """The CategoricalEmbedding of width 1 of `model`'s linear part (LinearLogit: DeepFM, Wide & Deep) when it
    tiers tables, else None. It reads the same input columns as `layer` with the same tiered tables, so once a
    stream has rewritten them to slot ids, slot s holds the same row in both layers' HotTables: a tiered table's
    store keeps the row's values and its linear weight as one record (`VariableSlots`)."""
    value_weights = linear_part(model)
    if value_weights is None or not value_weights.tiered_tables:
        return None
    if value_weights.tiered_tables != layer.tiered_tables or value_weights.feature_tables != layer.feature_tables:
        raise ValueError(f"The linear part {value_weights.name!r} tiers tables {value_weights.tiered_tables} read by "
                         f"columns {value_weights.feature_tables}, the embedding {layer.tiered_tables} read by "
                         f"{layer.feature_tables}: their hot tiers must be the same to share slot ids")
    return value_weights


def linear_part(model: keras.Model | None) -> CategoricalEmbedding | None:
    """The per-value weights (a CategoricalEmbedding of width 1) of `model`'s LinearLogit, tiered or not; None
    for a model without a linear part."""
    for sublayer in getattr(model, "layers", None) or ():
        if isinstance(sublayer, LinearLogit):
            return sublayer.value_weights
    return None


def variable_slots(model: keras.Model | None, layer: CategoricalEmbedding,
                   optimizer: keras.optimizers.Optimizer | None) -> dict[int, VariableSlots]:
    """Per tiered table of `layer`, the slot access of its hot variables and their accumulators in `optimizer`
    (none without one): `layer`'s HotTable, and the linear part's of the same table where `model` has one."""
    linear = linear_layer(model, layer)
    slots = {}
    for table in layer.tiered_tables:
        variables = [layer.hot_table(table).embeddings]
        if linear is not None:
            variables.append(linear.hot_table(table).embeddings)
        pairs = [(variable, accumulator_of(optimizer, variable) if optimizer is not None else None)
                 for variable in variables]
        slots[table] = VariableSlots(*pairs[0], *(pairs[1] if linear is not None else ()))
    return slots


def read_rows(variable: keras.Variable, rows: np.ndarray) -> np.ndarray:
    """Rows `rows` of `variable`, float32 numpy. On TensorFlow one ResourceGather op on the variable's handle
    (what `tf.Variable.sparse_read` runs, without its Python wrapper: 30 us a call instead of 35-70); on JAX
    one compiled gather (`jax_slot_ops`)."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        handle = variable.value.handle
        gathered = tf.raw_ops.ResourceGather(resource=handle, indices=np.asarray(rows, np.int64),
                                             dtype=variable.value.dtype)
        return np.asarray(gathered.numpy(), dtype=np.float32)
    if keras.backend.backend() == "jax":
        gather, _ = jax_slot_ops()
        rows = np.asarray(rows)
        padded = padded_rows(rows)
        return np.asarray(gather(variable.value, padded), dtype=np.float32)[:len(rows)]
    return np.asarray(keras.ops.convert_to_numpy(take_rows(variable, rows)), dtype=np.float32)


def write_rows(variable: keras.Variable, rows: np.ndarray, values: np.ndarray) -> None:
    """Writes `values` into rows `rows` of `variable`: on TensorFlow one ResourceScatterUpdate op on the
    variable's handle (what `tf.Variable.scatter_update` runs: 30 us a call instead of 65); on JAX one compiled
    scatter that takes the variable's buffer (`jax_slot_ops`); elsewhere a scatter into a copy assigned whole."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.raw_ops.ResourceScatterUpdate(resource=variable.value.handle, indices=np.asarray(rows, np.int64),
                                         updates=np.asarray(values, variable.value.dtype.as_numpy_dtype))
    elif keras.backend.backend() == "jax":
        _, scatter = jax_slot_ops()
        rows = np.asarray(rows)
        padded = padded_rows(rows)
        values = np.asarray(values, dtype=variable.value.dtype)
        # The padding repeats the last row with its own value: the same value written twice.
        values = np.concatenate([values, np.repeat(values[-1:], len(padded) - len(rows), axis=0)])
        variable.assign(scatter(variable.value, padded, values))
    else:
        variable.assign(keras.ops.scatter_update(variable.value, np.asarray(rows)[:, None], values))


def padded_rows(rows: np.ndarray) -> np.ndarray:
    """`rows` (int) padded to the next power of two by repeating its last, so that a compiled gather or scatter
    sees a few dozen shapes over a run instead of one per count of rows (each new shape compiles again: a scratch
    timing on 200,000 x 16 slots, 100-2,000 rows a call, took 264-372 ms a write eagerly, 0.4-1.7 ms padded)."""
    rows = np.asarray(rows, dtype=np.int32)
    if not len(rows):
        return rows
    size = 1 << (len(rows) - 1).bit_length()
    return np.concatenate([rows, np.full(size - len(rows), rows[-1], dtype=np.int32)])


@functools.cache
def jax_slot_ops() -> tuple[Any, Any]:
    """(gather, scatter) compiled by JAX: `gather(table, rows)` -> table[rows]; `scatter(table, rows, values)`
    -> table with rows set, the table's buffer donated, so the write is in place where the device allows it
    (the caller assigns the result back to the variable, whose old value is not read again)."""
    import jax

    return (jax.jit(lambda table, rows: table[rows]),
            jax.jit(lambda table, rows, values: table.at[rows].set(values), donate_argnums=0))


class TieredBatches:
    """(features, label) batches from `source` with the tiered columns of `layer` as slot ids of `tiers`
    (table -> HotTier). Iterate it once; pass `iter(batches)` (a generator) to `fit`, `evaluate` or `predict`,
    with a HotTierCallback on the same object.

    `key` names the features entry holding the layer's input ids (None: the features are that array). `lists`
    maps the features entries of list inputs (int [batch, length]) to the table each reads; those of tiered
    tables are remapped too, padding to -1. With `training`, the batches' slots are marked dirty (the step
    updates them). `ahead` bounds the batches the producer runs ahead of the consumer.

    `steps` > 1: the batches are micro-batches and the optimizer applies their gradients every `steps` of them
    (Keras' `gradient_accumulation_steps`): the micro-batches of one optimizer step are planned as one batch,
    and their plan is applied before the first of them, so no slot changes rows while a gradient of it is
    accumulated. `offset`: the micro-batches of the optimizer step under way already taken when the stream
    starts (trainer.keras_internals.micro_steps modulo `steps`), so the first group is the rest of that step.
    The stream must end at an optimizer step's last micro-batch: one that ended inside a step would leave
    gradients pending on slots the next stream's plans may give other rows (`whole_steps` cuts a source so).
    """

    def __init__(self, source: Iterable[tuple[Any, Any]], layer: CategoricalEmbedding, tiers: Mapping[int, HotTier],
                 key: str | None = "categorical", training: bool = True, ahead: int = 2,
                 lists: Mapping[str, int] | None = None, steps: int = 1, offset: int = 0) -> None:
        require_integer("ahead", ahead)
        require_integer("steps", steps)
        require_integer("offset", offset, minimum=0)
        if steps < 1 or not 0 <= offset < steps:
            raise ValueError(f"`steps` must be >= 1 and `offset` in [0, steps). Received: steps={steps}, "
                             f"offset={offset}")
        self.steps, self.offset = int(steps), int(offset)
        if set(tiers) != set(layer.tiered_tables) or any(
                tiers[table].hot_rows != hot_rows for table, hot_rows in layer.tiered_tables.items()):
            raise ValueError(
                f"`tiers` must give each tiered table of the layer a HotTier of its hot_rows; the layer's are "
                f"{layer.tiered_tables}. Received: { {t: tier.hot_rows for t, tier in tiers.items()} }")
        self.source = source
        self.layer = layer
        self.tiers = dict(tiers)
        self.key = key
        self.lists = {name: int(table) for name, table in (lists or {}).items() if int(table) in self.tiers}
        if self.lists and key is None:
            raise ValueError(f"List inputs {sorted(self.lists)} need the features as a dict: give `key`, the entry "
                             "of the layer's input ids")
        self.training = bool(training)
        self.batches: queue.Queue[Any] = queue.Queue(maxsize=ahead)
        self.plans: queue.Queue[Any] = queue.Queue()
        self.stop = threading.Event()
        self.started = False
        self.ended = False

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        if self.started:
            raise ValueError("A TieredBatches stream is iterated once (its plans are applied once, in order); make "
                             "a new TieredBatches for another pass")
        pending = {table: tier.num_pending for table, tier in self.tiers.items() if tier.num_pending}
        if pending:
            raise ValueError(f"The hot tiers hold plans made and never applied (table: plans {pending}), left by "
                             "a stream that stopped early: call HotTierCallback.reset() before a new stream")
        self.started = True
        threading.Thread(target=self.produce, name="tiered-batches", daemon=True).start()
        try:
            while True:
                item = self.batches.get()
                if item is END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.stop.set()

    def produce(self) -> None:
        try:
            group: list[tuple[Any, Any]] = []
            size = self.steps - self.offset  # the rest of the optimizer step under way, then whole ones
            for batch in self.source:
                group.append(batch)
                if len(group) == size:
                    if not self.emit(group):
                        return
                    group, size = [], self.steps
            if group and not self.emit(group):
                return
            self.plans.put(END)
            self.put(END)
        except BaseException as error:  # noqa: BLE001 -- handed to the consumer threads, which raise it
            self.plans.put(error)
            self.put(error)

    def emit(self, group: list[tuple[Any, Any]]) -> bool:
        """Plans the batches of `group` as one batch of rows in each tier, queues the plans (then, for the
        other batches of the group, nothing to apply) and the batches with their ids as slots; False if the
        consumer stopped."""
        columns = {table: self.layer.tiered_columns(table) for table in self.tiers}
        ids = [np.asarray(features if self.key is None else features[self.key]) for features, _ in group]
        lists = [{name: np.asarray(features[name]) for name in self.lists} for features, _ in group]
        slot_ids = [batch_ids.copy() for batch_ids in ids]
        remapped: list[dict[str, np.ndarray]] = [{} for _ in group]
        plans = {}
        for table, tier in self.tiers.items():
            read = [name for name, t in self.lists.items() if t == table]
            # Per batch: its columns' ids, then each list's items; planned as one batch of rows.
            items = [{name: list_items(batch_lists[name]) for name in read} for batch_lists in lists]
            parts = []
            for batch_ids, batch_lists, batch_items in zip(ids, lists, items, strict=True):
                parts.append(batch_ids[:, columns[table]].reshape(-1))
                parts += [batch_lists[name][batch_items[name]] for name in read]
            prepared = tier.prepare(np.concatenate(parts) if len(parts) > 1 else parts[0], training=self.training)
            slots = iter(np.split(prepared.plan.slot_ids.reshape(-1), np.cumsum([len(part) for part in parts])[:-1]))
            for batch, (batch_ids, batch_lists, batch_items) in enumerate(zip(ids, lists, items, strict=True)):
                slot_ids[batch][:, columns[table]] = next(slots).reshape(len(batch_ids), -1)
                for name in read:
                    remapped[batch][name] = np.full(batch_lists[name].shape, -1, dtype=batch_lists[name].dtype)
                    remapped[batch][name][batch_items[name]] = next(slots)
            plans[table] = prepared
        self.plans.put(plans)  # before the batches: the consumer's step waits on it
        for _ in group[1:]:
            self.plans.put({})  # the group's other micro-batches: their rows are loaded already
        for (features, label), batch_slots, batch_remapped in zip(group, slot_ids, remapped, strict=True):
            batch = batch_slots if self.key is None else {**features, self.key: batch_slots, **batch_remapped}
            if not self.put((batch, label)):
                return False
        return True

    def put(self, item: Any) -> bool:
        """Queues `item` for the consumer unless the consumer stopped; False if it did."""
        while not self.stop.is_set():
            try:
                self.batches.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def next_plans(self) -> dict[int, PreparedPlan] | None:
        """The next batch's plans, waiting for the producer; None once the source is exhausted."""
        if self.ended:
            return None
        try:
            item = self.plans.get(timeout=PLAN_WAIT_SECONDS)
        except queue.Empty:
            raise TimeoutError(f"No plan for the next batch after {PLAN_WAIT_SECONDS} s: the batch source is stuck, "
                               "or the stream was never iterated (pass iter(batches) to fit)") from None
        if item is END:
            self.ended = True
            return None
        if isinstance(item, BaseException):
            raise item
        return item


def whole_steps(batches: Iterable[Any], steps: int, offset: int = 0) -> Iterator[Any]:
    """`batches` cut to end with an optimizer step, `offset` micro-batches of whose first step were taken before
    them (`steps` micro-batches a step): at most steps - 1 at the end are left out."""
    group: list[Any] = []
    size = steps - offset
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield from group
            group, size = [], steps


def list_items(ids: np.ndarray) -> np.ndarray:
    """Where a list input holds an item, not padding (MISSING_ROW or a negative id), as the models read it."""
    return (ids >= 0) & (ids != PADDING_ROW)


class HotTierCallback(keras.callbacks.Callback):
    """Applies a TieredBatches stream's plans before each step and flushes the hot tiers when training ends.
    `apply_seconds` is the time spent applying plans (write-backs, deferred loads, slot writes)."""

    def __init__(self, batches: TieredBatches) -> None:
        super().__init__()
        self.batches = batches
        self.slots: dict[int, VariableSlots] = {}
        self.in_fit = False
        self.apply_seconds = 0.0

    def slot_access(self) -> dict[int, VariableSlots]:
        if not self.slots:
            optimizer = getattr(self.model, "optimizer", None)
            if optimizer is not None and not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            self.slots = variable_slots(self.model, self.batches.layer, optimizer)
        return self.slots

    def synced_slots(self) -> dict[int, VariableSlots]:
        """`slot_access()`, with the variables holding the latest step's values. On JAX, `fit` and `evaluate`
        keep the state between steps outside the variables; Keras' `Callback.model` puts it back
        (`jax_state_sync`), and the loop then reads the variables again, slot writes included, before its next
        step. On TensorFlow the variables are the state, and this is `slot_access()`."""
        _ = self.model  # None outside a Keras loop (`TieredTables.applied`): nothing to put back
        return self.slot_access()

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        if self.model.steps_per_execution != 1:
            raise ValueError(f"Tiered tables apply a plan between steps, so the model must be compiled with "
                             f"steps_per_execution=1. Received: steps_per_execution={self.model.steps_per_execution}")
        if not self.batches.training:
            raise ValueError("This stream was made with training=False, and fit trains: make the TieredBatches with "
                             "training=True, or pass this one to evaluate or predict")
        self.in_fit = True

    def on_train_end(self, logs: Mapping[str, Any] | None = None) -> None:
        self.in_fit = False
        self.flush()

    def on_train_batch_begin(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        self.apply_next()

    def on_test_batch_begin(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        if self.in_fit:
            raise ValueError("Validation batches during fit do not go through the hot tier (its plans are in the "
                             "order of the training batches): fit without validation_data, then evaluate with a "
                             "TieredBatches(..., training=False)")
        self.apply_next()

    def on_predict_batch_begin(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        self.apply_next()

    def apply_next(self) -> None:
        plans = self.batches.next_plans()
        if plans is None:
            return
        start = time.perf_counter()
        slots = self.synced_slots()
        for table, prepared in plans.items():
            self.batches.tiers[table].apply(prepared, slots[table])
        self.apply_seconds += time.perf_counter() - start

    def flush(self) -> None:
        """Writes every dirty slot back: each store then holds its whole table as of the last step."""
        slots = self.synced_slots()
        for table, tier in self.batches.tiers.items():
            tier.flush(slots[table])

    def reset(self) -> None:
        """Flushes and empties every tier (for a new stream after one that stopped early)."""
        slots = self.synced_slots()
        for table, tier in self.batches.tiers.items():
            tier.reset(slots[table])


class TieredCheckpoint(keras.callbacks.Callback):
    """Every `every_n_steps` training steps (counted from `first_step`): flush, snapshot each table's store,
    save the model's weights and optimizer state, then write `state.json` naming them with the step. Each file
    is written under a temporary name and renamed, the state last, and older files are removed after it: a kill
    at any moment (even in the middle of a write-back to the live store) leaves a complete checkpoint."""

    def __init__(self, directory: Path, tiers: HotTierCallback, every_n_steps: int, first_step: int = 0) -> None:
        super().__init__()
        require_integer("every_n_steps", every_n_steps)
        self.directory = Path(directory)
        self.tiers = tiers
        self.every_n_steps = every_n_steps
        self.step = first_step

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        self.step += 1
        if self.step % self.every_n_steps == 0:
            self.save()

    def save(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.tiers.flush()
        tables = {}
        for table, tier in self.tiers.batches.tiers.items():
            name = f"table-{table}-{self.step:09d}.rows"
            tier.store.snapshot(self.directory / name)
            tables[str(table)] = name
        weights = f"weights-{self.step:09d}.weights.h5"
        partial = self.directory / f".{uuid.uuid4().hex}.partial.weights.h5"
        self.model.save_weights(partial)
        os.replace(partial, self.directory / weights)
        state = self.directory / f".{uuid.uuid4().hex}.partial.json"
        state.write_text(json.dumps({"step": self.step, "weights": weights, "tables": tables}))
        os.replace(state, self.directory / STATE_FILE)
        kept = {weights, *tables.values()}
        for old in [*self.directory.glob("table-*.rows"), *self.directory.glob("weights-*.weights.h5")]:
            if old.name not in kept:
                old.unlink()


def restore_tiered_checkpoint(directory: Path, model: keras.Model, store_paths: Mapping[int, Path]) -> int | None:
    """Puts a run back at its last TieredCheckpoint in `directory`: each table's snapshot copied to its live
    store path in `store_paths` (the snapshot itself stays as it was), the model's weights and optimizer state
    loaded. Returns the step to go on from (batches to skip), or None when there is no checkpoint. Open the
    stores and make fresh HotTiers afterwards: the hot tier starts empty, every row on disk."""
    state_path = Path(directory) / STATE_FILE
    if not state_path.exists():
        return None
    state = json.loads(state_path.read_text())
    if {int(table) for table in state["tables"]} != set(store_paths):
        raise ValueError(f"The checkpoint in {directory} holds tables {sorted(state['tables'])}. Received store "
                         f"paths for {sorted(store_paths)}; give one live path per checkpointed table")
    for table, name in state["tables"].items():
        with RowStore.open(Path(directory) / name, writable=False) as snapshot:
            snapshot.snapshot(store_paths[int(table)])
    if model.optimizer is not None and not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    model.load_weights(Path(directory) / state["weights"])
    return int(state["step"])
