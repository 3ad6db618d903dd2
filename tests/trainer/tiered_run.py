"""A small training with one tiered table, in its own process, for the kill test of
tests/trainer/test_tiered_training.py, and the model and batches that test's other cases use.

Either Keras backend (KERAS_BACKEND).

`python -m tests.trainer.tiered_run WORK_DIR [PAUSE_FLAG PAUSE_AT_STEP]` trains TOTAL_STEPS steps, checkpointing
every CHECKPOINT_EVERY steps under WORK_DIR/checkpoint, and resumes from the checkpoint when there is one. With
PAUSE_FLAG, the first write-back of two rows or more from step PAUSE_AT_STEP on writes half of its rows to
the live store, writes PAUSE_FLAG ("step rows_written rows_in_write_back") and sleeps, for the test to kill
the process there. At the end it leaves WORK_DIR/final.rows (the store) and WORK_DIR/final_weights.npz (every
other weight and optimizer variable).

`python -m tests.trainer.tiered_run --compare WORK_DIR` trains the in-memory and the tiered model of
`in_memory_and_tiered` on the same batches (COMPARE_STEPS steps a epoch, COMPARE_EPOCHS epochs) and prints one line
per number compared, "name equal|differs max_abs_difference", then the hot tier's counters.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import keras
import numpy as np

from trainer.hot_tier import HotTier, PreparedPlan, SlotAccess
from trainer.layers.categorical_embedding import CategoricalEmbedding
from trainer.optimizers import INITIAL_ACCUMULATOR_VALUE, EmbeddingAdagrad
from trainer.row_store import RowStore, uniform_initializer
from trainer.tiered_training import (
    HotTierCallback,
    TieredBatches,
    TieredCheckpoint,
    accumulator_of,
    restore_tiered_checkpoint,
)

# Tables 0 and 2 stay in memory; table 1 (1,000 rows, read by columns 1 and 2) is tiered.
TABLE_SIZES = [50, 1000, 30]
FEATURE_TABLES = [0, 1, 1, 2]
TIERED, HOT_ROWS, DIM, BATCH = 1, 80, 4, 32
TOTAL_STEPS, CHECKPOINT_EVERY = 40, 7


def batches(seed: int = 0, num_batches: int = TOTAL_STEPS) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """(features, label) numpy batches; table 1's ids are Zipf-distributed, so some rows come back often and the
    rest are evicted and reloaded."""
    rng = np.random.default_rng(seed)
    popular = rng.permutation(TABLE_SIZES[TIERED])
    for _ in range(num_batches):
        tiered = popular[np.minimum(rng.zipf(1.2, (BATCH, 2)) - 1, TABLE_SIZES[TIERED] - 1)]
        ids = np.column_stack([rng.integers(0, 50, BATCH), tiered, rng.integers(0, 30, BATCH)]).astype(np.int64)
        dense = rng.standard_normal((BATCH, 3)).astype(np.float32)
        label = ((ids[:, 1] % 3 == 0) ^ (dense[:, 0] > 0)).astype(np.float32)
        yield {"categorical": ids, "dense": dense}, label


def embedding_layer(tiered: bool) -> CategoricalEmbedding:
    return CategoricalEmbedding(TABLE_SIZES, DIM, feature_tables=FEATURE_TABLES,
                                tiered_tables={TIERED: HOT_ROWS} if tiered else None, name="embedding")


def small_model(layer: CategoricalEmbedding) -> keras.Model:
    """The embedding, flattened beside 3 dense inputs, a hidden layer of 8 and a sigmoid head; EmbeddingAdagrad,
    built."""
    ids = keras.Input((len(FEATURE_TABLES),), dtype="int64", name="categorical")
    dense = keras.Input((3,), name="dense")
    hidden = keras.layers.Concatenate()([keras.layers.Flatten()(layer(ids)), dense])
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(hidden)
    output = keras.layers.Dense(1, activation="sigmoid", name="head")(hidden)
    model = keras.Model({"categorical": ids, "dense": dense}, output)
    model.compile(optimizer=EmbeddingAdagrad(0.05, 0.1), loss="binary_crossentropy", jit_compile=False)
    model.optimizer.build(model.trainable_variables)
    return model


class PausingTier(HotTier):
    """A HotTier that, from step `pause_at_step` on, stops in the middle of a write-back: half its rows written
    to the live store (and fsynced), then a flag file, then a long sleep."""

    def __init__(self, store: RowStore, hot_rows: int, flag: Path, pause_at_step: int,
                 checkpoint: TieredCheckpoint | None = None) -> None:
        super().__init__(store, hot_rows)
        self.flag, self.pause_at_step, self.checkpoint = flag, pause_at_step, checkpoint

    def apply(self, prepared: PreparedPlan, slots: SlotAccess) -> None:
        rows = prepared.plan.write_back_rows
        step = self.checkpoint.step if self.checkpoint is not None else 0
        if step >= self.pause_at_step and len(rows) >= 2:
            values, accumulators = slots.read(prepared.plan.write_back_slots)
            half = len(rows) // 2
            self.store.write(rows[:half], values[:half], accumulators[:half])
            self.store.flush()
            self.flag.write_text(f"{step} {half} {len(rows)}")
            time.sleep(3600)
        super().apply(prepared, slots)


# Rows of tables 0 and 2 in the in-memory model's one table; table 1 owns rows 50..1049 there.
IN_MEMORY_ROWS = np.r_[0:50, 1050:1080]
COMPARE_STEPS, COMPARE_EPOCHS = 20, 3


def in_memory_and_tiered(directory: Path) -> tuple[keras.Model, keras.Model, CategoricalEmbedding, RowStore]:
    """Two models with the same starting weights: one with every table in memory, one with table 1 tiered; and
    table 1's store, made from the in-memory model's initial rows."""
    keras.utils.set_random_seed(1)
    memory = small_model(embedding_layer(tiered=False))
    layer = embedding_layer(tiered=True)
    tiered = small_model(layer)
    table = keras.ops.convert_to_numpy(memory.get_layer("embedding").embeddings)
    tiered.get_layer(layer.name).embeddings.assign(table[IN_MEMORY_ROWS])
    for name in ("hidden", "head"):
        tiered.get_layer(name).set_weights(memory.get_layer(name).get_weights())
    store = RowStore.from_arrays(directory / "table-1.rows", table[50:1050],
                                 initial_accumulator=INITIAL_ACCUMULATOR_VALUE)
    return memory, tiered, layer, store


def compare(work: Path) -> None:
    """The --compare mode (module text)."""
    work.mkdir(parents=True, exist_ok=True)
    memory, tiered, layer, store = in_memory_and_tiered(work)
    num_batches = COMPARE_STEPS * COMPARE_EPOCHS
    memory.fit(batches(num_batches=num_batches), steps_per_epoch=COMPARE_STEPS, epochs=COMPARE_EPOCHS,
               shuffle=False, verbose=0)
    tier = HotTier(store, HOT_ROWS)
    stream = TieredBatches(batches(num_batches=num_batches), layer, {TIERED: tier})
    tiered.fit(iter(stream), steps_per_epoch=COMPARE_STEPS, epochs=COMPARE_EPOCHS,
               callbacks=[HotTierCallback(stream)], shuffle=False, verbose=0)

    def numpy(variable: keras.Variable) -> np.ndarray:
        return keras.ops.convert_to_numpy(variable)

    memory_table = memory.get_layer("embedding").embeddings
    memory_accumulator = numpy(accumulator_of(memory.optimizer, memory_table))
    values, accumulators = store.read(np.arange(TABLE_SIZES[TIERED]))
    tiered_table = tiered.get_layer(layer.name).embeddings
    pairs = {"store_values": (values, numpy(memory_table)[50:1050]),
             "store_accumulators": (accumulators, memory_accumulator[50:1050]),
             "memory_rows": (numpy(tiered_table), numpy(memory_table)[IN_MEMORY_ROWS]),
             "memory_rows_accumulators": (numpy(accumulator_of(tiered.optimizer, tiered_table)),
                                          memory_accumulator[IN_MEMORY_ROWS])}
    for name in ("hidden", "head"):
        for got, expected in zip(tiered.get_layer(name).weights, memory.get_layer(name).weights, strict=True):
            pairs[got.path] = (numpy(got), numpy(expected))
            pairs[got.path + "_accumulator"] = (numpy(accumulator_of(tiered.optimizer, got)),
                                                numpy(accumulator_of(memory.optimizer, expected)))
    for name, (got, expected) in pairs.items():
        difference = float(np.abs(got - expected).max())
        print(name, "equal" if np.array_equal(got, expected) else "differs", difference)
    trained = int((accumulators != INITIAL_ACCUMULATOR_VALUE).any(axis=1).sum())
    counters = tier.counters
    print("counters", counters.plans_applied, counters.rows_loaded, counters.rows_written_back, trained)


def main() -> None:
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.enable_op_determinism()
    work = Path(sys.argv[1])
    work.mkdir(parents=True, exist_ok=True)
    keras.utils.set_random_seed(1)
    layer = embedding_layer(tiered=True)
    model = small_model(layer)
    live = work / "live.rows"
    start = restore_tiered_checkpoint(work / "checkpoint", model, {TIERED: live})
    if start is None:
        RowStore.create(live, TABLE_SIZES[TIERED], DIM, uniform_initializer(DIM, seed=3),
                        initial_accumulator=INITIAL_ACCUMULATOR_VALUE).close()
    store = RowStore.open(live)
    if len(sys.argv) > 3:
        tier: HotTier = PausingTier(store, HOT_ROWS, Path(sys.argv[2]), int(sys.argv[3]))
    else:
        tier = HotTier(store, HOT_ROWS)
    stream = TieredBatches(itertools.islice(batches(), start or 0, None), layer, {TIERED: tier})
    tiers = HotTierCallback(stream)
    checkpoint = TieredCheckpoint(work / "checkpoint", tiers, CHECKPOINT_EVERY, first_step=start or 0)
    if isinstance(tier, PausingTier):
        tier.checkpoint = checkpoint
    model.fit(iter(stream), steps_per_epoch=TOTAL_STEPS - (start or 0), epochs=1, callbacks=[tiers, checkpoint],
              shuffle=False, verbose=0)
    store.snapshot(work / "final.rows")  # flushed by the callback at the end of training
    hot = layer.hot_table(TIERED).embeddings.path.replace("/", "_")
    kept = [v for v in model.weights if v.path != layer.hot_table(TIERED).embeddings.path]
    kept += [v for v in model.optimizer.variables if hot not in v.name]
    np.savez(work / "final_weights.npz",
             **{f"{i:03d}_{v.path}": keras.ops.convert_to_numpy(v) for i, v in enumerate(kept)})
    print(f"resumed_from={start} steps={checkpoint.step}")


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(Path(sys.argv[2]))
    else:
        main()
