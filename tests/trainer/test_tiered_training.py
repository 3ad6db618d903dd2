import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.trainer.tiered_run import (
    BATCH,
    COMPARE_EPOCHS,
    COMPARE_STEPS,
    DIM,
    FEATURE_TABLES,
    HOT_ROWS,
    IN_MEMORY_ROWS,
    TABLE_SIZES,
    TIERED,
    batches,
    embedding_layer,
    in_memory_and_tiered,
)
from trainer.hot_tier import HotTier
from trainer.layers.categorical_embedding import CategoricalEmbedding
from trainer.optimizers import INITIAL_ACCUMULATOR_VALUE, EmbeddingAdagrad
from trainer.row_store import RowStore
from trainer.tiered_training import HotTierCallback, TieredBatches, accumulator_of

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS_PER_EPOCH, EPOCHS = COMPARE_STEPS, COMPARE_EPOCHS


@pytest.mark.unit
def test_a_tiered_table_has_its_own_hot_variable_and_slot_id_columns():
    layer = CategoricalEmbedding([3, 100, 2], 2, feature_tables=[0, 1, 2, 1], tiered_tables={"1": 4},
                                 name="embedding")
    layer.build((None, 4))
    assert layer.tiered_tables == {1: 4} and layer.offsets.tolist() == [0, -1, 3] and layer.num_rows == 5
    assert [(w.path, tuple(w.shape)) for w in layer.weights] == [
        ("embedding/embeddings", (5, 2)), ("embedding/tiered_table_1/embeddings", (4, 2))]
    assert [w.name for w in layer.weights] == ["embeddings", "embeddings"]  # both get the embedding rate
    layer.embeddings.assign(np.arange(10, dtype="float32").reshape(5, 2))
    layer.hot_table(1).embeddings.assign(100 + np.arange(8, dtype="float32").reshape(4, 2))
    out = keras.ops.convert_to_numpy(layer(np.array([[2, 3, 1, 0]])))  # columns 1 and 3 hold slots 3 and 0
    np.testing.assert_array_equal(out[0], [[4, 5], [106, 107], [8, 9], [100, 101]])
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(layer.embed_table(np.array([2]), 1)), [[104, 105]])
    assert layer.tiered_columns(1) == [1, 3]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(np.array([[0, 2, 1, 2]])))
    gradient = tape.gradient(loss, layer.hot_table(1).embeddings.value)
    assert isinstance(gradient, tf.IndexedSlices) and gradient.indices.numpy().tolist() == [2, 2]


@pytest.mark.unit
def test_tiered_tables_config_round_trips_through_a_saved_model(tmp_path):
    layer = CategoricalEmbedding([3, 100, 7], 2, tiered_tables={2: 5, 1: 8})
    config = layer.get_config()
    assert config["tiered_tables"] == {1: 8, 2: 5}
    assert CategoricalEmbedding.from_config(config).get_config() == config
    ids = keras.Input((3,), dtype="int64")
    model = keras.Model(ids, layer(ids))
    for table, hot_rows in ((1, 8), (2, 5)):  # slots with values of their own, so the load is checked
        layer.hot_table(table).embeddings.assign(np.random.default_rng(table).standard_normal((hot_rows, 2)))
    model.save(tmp_path / "tiered.keras")  # JSON: the keys come back as strings
    loaded = keras.saving.load_model(tmp_path / "tiered.keras")
    assert loaded.layers[-1].tiered_tables == {1: 8, 2: 5}
    data = np.array([[0, 7, 4], [2, 0, 1]])
    np.testing.assert_array_equal(loaded.predict(data, verbose=0), model.predict(data, verbose=0))


@pytest.mark.unit
@pytest.mark.parametrize("tiered_tables", [{3: 5}, {0: 0}, {1: 2.5}, [1, 5], {"x": 5}, {2: 5}])
def test_invalid_tiered_tables(tiered_tables):
    # Table 2 is hashed, so it cannot be tiered too.
    with pytest.raises(ValueError, match=re.escape(f"Received: tiered_tables={tiered_tables!r}")):
        CategoricalEmbedding([3, 4, 5], 2, hashed_features=[2], num_hash_buckets=3, tiered_tables=tiered_tables)


@pytest.mark.unit
def test_tiered_tables_refuse_rare_rows_and_a_table_regularizer():
    with pytest.raises(ValueError, match=re.escape("rare_row_rate=0.1, embeddings_regularizer=None")):
        CategoricalEmbedding([3, 4], 2, tiered_tables={1: 2}, rare_row_rate=0.1)
    with pytest.raises(ValueError, match=re.escape("embeddings_regularizer='l2'")):
        CategoricalEmbedding([3, 4], 2, tiered_tables={1: 2}, embeddings_regularizer="l2")


@pytest.mark.integration
def test_training_with_a_tiered_table_gives_bit_for_bit_the_in_memory_weights(tmp_path):
    """80 slots for a 1,000-row table read by two columns of 32-row batches: rows are evicted and reloaded
    throughout. Every number the in-memory run ends with (table rows, their accumulators, the other tables,
    the dense weights and theirs) is equal bit for bit."""
    memory, tiered, layer, store = in_memory_and_tiered(tmp_path)
    num_batches = STEPS_PER_EPOCH * EPOCHS
    memory.fit(batches(num_batches=num_batches), steps_per_epoch=STEPS_PER_EPOCH, epochs=EPOCHS, shuffle=False,
               verbose=0)

    tier = HotTier(store, HOT_ROWS)
    stream = TieredBatches(batches(num_batches=num_batches), layer, {TIERED: tier})
    callback = HotTierCallback(stream)
    tiered.fit(iter(stream), steps_per_epoch=STEPS_PER_EPOCH, epochs=EPOCHS, callbacks=[callback],
               shuffle=False, verbose=0)

    counters = tier.counters
    assert counters.plans_applied == num_batches
    assert counters.rows_loaded > 700 and counters.rows_written_back > 600  # rows went out and came back
    memory_table = memory.get_layer("embedding").embeddings
    memory_accumulator = np.asarray(accumulator_of(memory.optimizer, memory_table))
    values, accumulators = store.read(np.arange(1000))
    np.testing.assert_array_equal(values, np.asarray(memory_table)[50:1050])
    np.testing.assert_array_equal(accumulators, memory_accumulator[50:1050])
    assert (accumulators != INITIAL_ACCUMULATOR_VALUE).any(axis=1).sum() > 200  # many rows trained
    tiered_table = tiered.get_layer(layer.name).embeddings
    np.testing.assert_array_equal(np.asarray(tiered_table), np.asarray(memory_table)[IN_MEMORY_ROWS])
    np.testing.assert_array_equal(np.asarray(accumulator_of(tiered.optimizer, tiered_table)),
                                  memory_accumulator[IN_MEMORY_ROWS])
    for name in ("hidden", "head"):
        for got_weight, expected_weight in zip(tiered.get_layer(name).weights, memory.get_layer(name).weights,
                                               strict=True):
            np.testing.assert_array_equal(np.asarray(got_weight), np.asarray(expected_weight))
            np.testing.assert_array_equal(np.asarray(accumulator_of(tiered.optimizer, got_weight)),
                                          np.asarray(accumulator_of(memory.optimizer, expected_weight)))


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="JAX is not installed")
def test_on_the_jax_backend_a_tiered_table_gives_bit_for_bit_the_in_memory_weights(tmp_path):
    """The same comparison on JAX (a child process with KERAS_BACKEND=jax): there `fit` holds the state outside
    the variables between steps, and the hot tier's callback must put it back before it reads or writes slots
    (else it writes into variables the next step never reads)."""
    done = subprocess.run([sys.executable, "-m", "tests.trainer.tiered_run", "--compare", str(tmp_path)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "KERAS_BACKEND": "jax", "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    compared = {name: (verdict, float(difference)) for name, verdict, difference in lines[:-1]}
    assert set(compared) == {"store_values", "store_accumulators", "memory_rows", "memory_rows_accumulators",
                             *(f"{layer}/{weight}{suffix}" for layer in ("hidden", "head")
                               for weight in ("kernel", "bias") for suffix in ("", "_accumulator"))}
    assert compared == dict.fromkeys(compared, ("equal", 0.0))
    _, plans, loaded, written_back, trained = lines[-1]
    assert int(plans) == STEPS_PER_EPOCH * EPOCHS
    assert int(loaded) > 700 and int(written_back) > 600 and int(trained) > 200


@pytest.mark.integration
def test_evaluating_through_the_hot_tier_after_training_gives_the_in_memory_loss(tmp_path):
    memory, tiered, layer, store = in_memory_and_tiered(tmp_path)
    memory.fit(batches(), steps_per_epoch=10, epochs=1, shuffle=False, verbose=0)
    tier = HotTier(store, HOT_ROWS)
    stream = TieredBatches(batches(), layer, {TIERED: tier})
    callback = HotTierCallback(stream)
    tiered.fit(iter(stream), steps_per_epoch=10, epochs=1, callbacks=[callback], shuffle=False, verbose=0)
    callback.reset()  # the training stream stopped early: its producer planned batches that never trained

    held_out = list(batches(seed=5, num_batches=6))
    evaluation = TieredBatches(held_out, layer, {TIERED: tier}, training=False)
    expected = memory.evaluate((batch for batch in held_out), steps=6, verbose=0)
    got = tiered.evaluate(iter(evaluation), steps=6, callbacks=[HotTierCallback(evaluation)], verbose=0)
    assert got == expected
    assert tier.counters.rows_loaded > 100


@pytest.mark.unit
def test_errors_name_what_was_wrong(tmp_path):
    _, tiered, layer, store = in_memory_and_tiered(tmp_path)
    with pytest.raises(ValueError, match=re.escape("the layer's are {1: 80}. Received: {1: 5}")):
        TieredBatches(batches(), layer, {TIERED: HotTier(store, 5)})
    too_small = HotTier(store, 3)
    layer_3 = CategoricalEmbedding(TABLE_SIZES, DIM, feature_tables=FEATURE_TABLES, tiered_tables={TIERED: 3})
    stream = TieredBatches(batches(), layer_3, {TIERED: too_small})
    with pytest.raises(ValueError, match=r"A batch reads \d+ distinct rows of this table, more than its hot tier's "
                                         r"hot_rows=3 slots"):
        next(iter(stream))
    stream = TieredBatches(batches(), layer, {TIERED: HotTier(store, HOT_ROWS)}, training=False)
    with pytest.raises(ValueError, match="made with training=False, and fit trains"):
        tiered.fit(iter(stream), steps_per_epoch=1, callbacks=[HotTierCallback(stream)], shuffle=False,
                   verbose=0)
    with pytest.raises(ValueError, match=re.escape("Found 0 optimizer variables named 'kernel_accumulator'")):
        accumulator_of(EmbeddingAdagrad(), keras.Variable(np.zeros((2, 2)), name="kernel"))


def run_tiered(work: Path, pause_flag: Path | None = None, pause_at_step: int = 0,
               backend: str = "tensorflow") -> subprocess.Popen:
    command = [sys.executable, "-m", "tests.trainer.tiered_run", str(work)]
    if pause_flag is not None:
        command += [str(pause_flag), str(pause_at_step)]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(REPO_ROOT), "KERAS_BACKEND": backend}
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def final_state(work: Path) -> list[np.ndarray]:
    with RowStore.open(work / "final.rows", writable=False) as store:
        values, accumulators = store.read(np.arange(store.num_rows))
    return [values, accumulators, *np.load(work / "final_weights.npz").values()]


@pytest.mark.integration
@pytest.mark.parametrize("backend", ["tensorflow", pytest.param("jax", marks=pytest.mark.skipif(
    importlib.util.find_spec("jax") is None, reason="JAX is not installed"))])
def test_a_run_killed_while_writing_back_resumes_from_its_checkpoint_to_the_unbroken_weights(tmp_path, backend):
    """The run checkpoints every 7 steps (flush, snapshot of the store, weights and optimizer state, the step).
    It is paused half-way through a write-back to the live store after its second checkpoint, and killed
    there with SIGKILL; the resumed run starts from the checkpoint, not from the half-written store."""
    unbroken = run_tiered(tmp_path / "unbroken", backend=backend)
    out, err = unbroken.communicate(timeout=300)
    assert unbroken.returncode == 0, err[-3000:]
    assert "resumed_from=None steps=40" in out

    flag = tmp_path / "paused"
    killed = run_tiered(tmp_path / "killed", flag, pause_at_step=17, backend=backend)
    deadline = time.monotonic() + 300
    while not flag.exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert flag.exists(), killed.communicate()[1][-3000:]
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL
    step, written, total = (int(n) for n in flag.read_text().split())
    assert 14 <= step < 40 and 0 < written < total  # a write-back of `total` rows stopped after `written`
    checkpoint_step = step - step % 7
    assert f'"step": {checkpoint_step}' in (tmp_path / "killed" / "checkpoint" / "state.json").read_text()

    resumed = run_tiered(tmp_path / "killed", backend=backend)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert f"resumed_from={checkpoint_step} steps=40" in out
    for got, expected in zip(final_state(tmp_path / "killed"), final_state(tmp_path / "unbroken"), strict=True):
        np.testing.assert_array_equal(got, expected)


LIST_HOT_ROWS, LIST_LENGTH = 240, 6


def list_batches(num_batches: int) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """`batches` with a list input "items" of table 1 (Zipf ids, the front padded with MISSING_ROW 1 or -1)."""
    rng = np.random.default_rng(11)
    popular = rng.permutation(TABLE_SIZES[TIERED] - 2) + 2  # items are never rows 0 and 1
    for features, label in batches(num_batches=num_batches):
        items = popular[np.minimum(rng.zipf(1.2, (BATCH, LIST_LENGTH)) - 1, len(popular) - 1)]
        padded = np.arange(LIST_LENGTH)[None, :] < rng.integers(0, LIST_LENGTH + 1, (BATCH, 1))
        items = np.where(padded, rng.choice([-1, 1], (BATCH, LIST_LENGTH)), items).astype(np.int64)
        yield {**features, "items": items}, label


class ListModel(keras.Model):
    """small_model with the "items" list pooled (mean, padding masked) beside the columns."""

    def __init__(self, layer: CategoricalEmbedding) -> None:
        super().__init__()
        self.embedding = layer
        self.hidden = keras.layers.Dense(8, activation="relu", name="hidden")
        self.head = keras.layers.Dense(1, activation="sigmoid", name="head")

    def call(self, inputs: dict[str, Any]) -> Any:
        from trainer.models.blocks import pooled_bags

        columns = keras.ops.reshape(self.embedding(inputs["categorical"]), (-1, len(FEATURE_TABLES) * DIM))
        pooled = pooled_bags(self.embedding, inputs, [{"key": "items", "table": TIERED, "pooling": "mean"}])[0]
        hidden = keras.ops.concatenate([columns, keras.ops.reshape(pooled, (-1, DIM)), inputs["dense"]], axis=-1)
        return self.head(self.hidden(hidden))


def list_model(layer: CategoricalEmbedding) -> keras.Model:
    model = ListModel(layer)
    model({"categorical": np.zeros((1, len(FEATURE_TABLES)), np.int64), "items": np.full((1, LIST_LENGTH), -1),
           "dense": np.zeros((1, 3), np.float32)})
    model.compile(optimizer=EmbeddingAdagrad(0.05, 0.1), loss="binary_crossentropy", jit_compile=False)
    model.optimizer.build(model.trainable_variables)
    return model


@pytest.mark.integration
def test_a_list_input_over_a_tiered_table_trains_to_the_in_memory_weights(tmp_path):
    """The items of a list input reading the tiered table are planned with the batch's columns and rewritten to
    slots, their padding to -1: the same table, accumulators and dense weights as in memory, bit for bit."""
    keras.utils.set_random_seed(2)
    memory = list_model(embedding_layer(tiered=False))
    layer = CategoricalEmbedding(TABLE_SIZES, DIM, feature_tables=FEATURE_TABLES,
                                 tiered_tables={TIERED: LIST_HOT_ROWS}, name="embedding")
    tiered = list_model(layer)
    table = np.asarray(memory.embedding.embeddings)
    layer.embeddings.assign(table[IN_MEMORY_ROWS])
    for name in ("hidden", "head"):
        getattr(tiered, name).set_weights(getattr(memory, name).get_weights())
    store = RowStore.from_arrays(tmp_path / "table-1.rows", table[50:1050],
                                 initial_accumulator=INITIAL_ACCUMULATOR_VALUE)
    num_batches = 40
    memory.fit(list_batches(num_batches), steps_per_epoch=num_batches, epochs=1, shuffle=False, verbose=0)
    tier = HotTier(store, LIST_HOT_ROWS)
    stream = TieredBatches(list_batches(num_batches), layer, {TIERED: tier}, lists={"items": TIERED})
    seen = []
    original = stream.put

    def recording(item):  # the batches as the model receives them
        if isinstance(item, tuple):
            seen.append(item[0])
        return original(item)

    stream.put = recording
    tiered.fit(iter(stream), steps_per_epoch=num_batches, epochs=1, callbacks=[HotTierCallback(stream)],
               shuffle=False, verbose=0)
    assert tier.counters.rows_loaded > LIST_HOT_ROWS and tier.counters.rows_written_back > 0  # evictions
    # Padding became -1 wherever it was (1 or -1), items became slots: in [0, hot_rows), slot 1 among them.
    sent = np.concatenate([batch["items"].reshape(-1) for batch in seen])
    source = np.concatenate([features["items"].reshape(-1) for features, _ in list_batches(num_batches)])
    np.testing.assert_array_equal(sent < 0, (source == 1) | (source < 0))
    assert sent.max() < LIST_HOT_ROWS and (sent == 1).any()
    memory_table = memory.embedding.embeddings
    values, accumulators = store.read(np.arange(1000))
    np.testing.assert_array_equal(values, np.asarray(memory_table)[50:1050])
    np.testing.assert_array_equal(accumulators, np.asarray(accumulator_of(memory.optimizer, memory_table))[50:1050])
    for name in ("hidden", "head"):
        for got_weight, expected_weight in zip(getattr(tiered, name).weights, getattr(memory, name).weights,
                                               strict=True):
            np.testing.assert_array_equal(np.asarray(got_weight), np.asarray(expected_weight))
