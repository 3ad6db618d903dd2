"""train_model with a tiered table (storage: tiered in the feature spec): the same weights as in memory, progress
and the best epoch with the tables, warm start from the parent's store, the checkpoint's stores and the model in
memory that the export reads."""

import dataclasses
import importlib.util
import os

import numpy as np
import pytest

from components.config import TrainConfig
from components.feature_spec import load_spec, spec_from_dict
from components.manifest import read_manifest
from tests.trainer.synthetic import random_rows, table_sizes, write_block_files
from trainer.input import samples_dataset
from trainer.model_inputs import model_inputs
from trainer.row_store import RowStore
from trainer.tiered_tables import TABLES_DIR
from trainer.train import WarmStart, load_checkpoint, load_in_memory, train_model

pytestmark = pytest.mark.integration

NUM_VALUES = 400
HOT_ROWS = 160  # fewer than C1's 402 rows: rows are evicted and loaded again every epoch
CONFIG = TrainConfig(embedding_dim=8, num_cross_layers=1, mlp_units=(16,), batch_size=128, epochs=2,
                     jit_compile=False, checkpoint_every_steps=1000)


def tiered_spec(hot_rows: int = HOT_ROWS):
    data = load_spec("criteo").as_dict()
    for feature in data["features"]:
        if feature.get("name") == "C1":
            feature.update(storage="tiered", hot_rows=hot_rows)
    return spec_from_dict(data)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiered_train")
    return {
        "train": write_block_files(random_rows(3000, NUM_VALUES, seed=1), directory / "train", 2, 512),
        "eval": write_block_files(random_rows(1000, NUM_VALUES, seed=2), directory / "eval", 1, 512),
    }


def table_rows(model, name: str, spec) -> np.ndarray:
    """Table `name`'s rows in an in-memory model."""
    layer = model.embedding
    index = list(model_inputs(spec).tables).index(name)
    start = int(layer.offsets[index])
    return np.asarray(layer.embeddings)[start:start + layer.table_sizes[index]]


def store_rows(checkpoint, name: str) -> np.ndarray:
    with RowStore.open(checkpoint / TABLES_DIR / f"{name}.rows", writable=False) as store:
        return store.read(np.arange(store.num_rows))[0]


def assert_same_weights_in_memory(checkpoint, spec, model):
    """The checkpoint's model read into memory (its tiered tables from their stores) has `model`'s weights, bit for
    bit and in the same order; returns it."""
    served = load_in_memory(checkpoint, model_inputs(spec).tables)
    for got, expected in zip(served.weights, model.weights, strict=True):
        assert got.path == expected.path
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected), err_msg=got.path)
    return served


def assert_delta_gives_child(arrays, served_parent, served_child) -> None:
    """A delta's arrays (components.delta.served_weight_arrays), applied to the served parent's weights, give the
    served child's bit for bit."""
    for index, (before, after) in enumerate(zip(served_parent.weights, served_child.weights, strict=True)):
        applied = np.array(before)
        rows = arrays[f"rows_{index:03d}"]
        if applied.ndim == 0:
            applied = arrays[f"values_{index:03d}"].reshape(()) if len(rows) else applied
        else:
            applied[rows] = arrays[f"values_{index:03d}"]
        np.testing.assert_array_equal(applied, np.asarray(after), err_msg=after.path)


@pytest.fixture(scope="module")
def parent(data, tmp_path_factory):
    """A first day trained in memory: what both runs below warm-start from, so they start from the same rows."""
    directory = tmp_path_factory.mktemp("parent") / "checkpoint"
    train_model(dataclasses.replace(CONFIG, epochs=1), table_sizes(NUM_VALUES), data["train"], data["eval"], directory,
                spec=load_spec("criteo"))
    return directory


def test_a_tiered_table_trains_to_the_weights_of_the_same_table_in_memory(data, parent, tmp_path):
    criteo, tiered = load_spec("criteo"), tiered_spec()
    warm = WarmStart(parent, {})
    memory = train_model(CONFIG, table_sizes(NUM_VALUES), data["train"], data["eval"], tmp_path / "memory",
                         warm_start=warm, spec=criteo)
    from trainer.train import StepMetricsLogger

    logged: list[tuple[int, dict]] = []
    result = train_model(CONFIG, table_sizes(NUM_VALUES), data["train"], data["eval"], tmp_path / "tiered",
                         warm_start=warm, spec=tiered,
                         callbacks=[StepMetricsLogger(lambda metrics, step: logged.append((step, metrics)), 1000)])
    # Each epoch's held-out metrics reach the logger, as fit's validation would hand them over.
    assert [metrics["val_auc"] for _, metrics in logged if "val_auc" in metrics] == result.history["val_auc"]

    # The table on disk, every other weight and the held-out metrics equal the in-memory run's, bit for bit.
    np.testing.assert_array_equal(store_rows(tmp_path / "tiered", "C1"), table_rows(memory.model, "C1", criteo))
    served = assert_same_weights_in_memory(tmp_path / "tiered", tiered, memory.model)
    assert not served.embedding.tiered_tables
    assert result.history["val_auc"] == memory.history["val_auc"]
    assert result.history["loss"] == memory.history["loss"]
    np.testing.assert_array_equal(result.eval_labels, memory.eval_labels)
    np.testing.assert_allclose(result.eval_predictions, memory.eval_predictions, rtol=0, atol=1e-6)
    assert result.warm_start["rows_kept"] == memory.warm_start["rows_kept"]

    # The rows really went through the hot tier: the model holds HOT_ROWS slots, not the table.
    model = load_checkpoint(tmp_path / "tiered")
    assert model.embedding.tiered_tables == {0: HOT_ROWS}
    assert tuple(model.embedding.hot_table(0).embeddings.shape) == (HOT_ROWS, 8)
    manifest = read_manifest(tmp_path / "tiered", kind="checkpoint")
    assert "tables/C1.rows" in manifest["files"] and manifest["tiered_tables"] == {"C1": HOT_ROWS}
    assert not (tmp_path / "tiered" / "progress").exists()

    # The model in memory predicts what the run scored on the held-out rows.
    features = next(iter(samples_dataset(data["eval"], 256, shuffle=False, seed=0)))[0]
    np.testing.assert_allclose(served.predict(features, verbose=0).reshape(-1), result.eval_predictions[:256],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="JAX is not installed")
def test_on_the_jax_backend_a_tiered_table_trains_to_the_weights_of_the_same_table_in_memory(data, parent, tmp_path):
    """train.backend=jax (the train step in a child process without TensorFlow): the same comparison. The rows
    in one file: the JAX step's readers hand over batches as they finish them, so with two files (two reader
    processes) the batches' order, and the weights, differ from run to run even in memory."""
    from trainer.jax_train import train_in_jax_process

    criteo, tiered = load_spec("criteo"), tiered_spec()
    config, warm = dataclasses.replace(CONFIG, backend="jax"), WarmStart(parent, {})
    train = write_block_files(random_rows(3000, NUM_VALUES, seed=1), tmp_path / "train", 1, 512)
    memory = train_in_jax_process(config, table_sizes(NUM_VALUES), train, data["eval"], tmp_path / "memory",
                                  warm_start=warm, spec=criteo)
    result = train_in_jax_process(config, table_sizes(NUM_VALUES), train, data["eval"], tmp_path / "tiered",
                                  warm_start=warm, spec=tiered)
    assert result.speed_flags["backend"] == "jax"
    assert read_manifest(tmp_path / "tiered", kind="checkpoint")["tensorflow_imported"] is False
    np.testing.assert_array_equal(store_rows(tmp_path / "tiered", "C1"), table_rows(memory.model, "C1", criteo))
    assert_same_weights_in_memory(tmp_path / "tiered", tiered, memory.model)
    assert result.history["val_auc"] == memory.history["val_auc"]
    assert result.history["loss"] == memory.history["loss"]
    np.testing.assert_allclose(result.eval_predictions, memory.eval_predictions, rtol=0, atol=1e-6)
    counters = result.tiered_tables["C1"]
    assert counters["tier_rows_loaded"] > HOT_ROWS and counters["tier_rows_written_back"] > 0  # rows went out
    assert load_checkpoint(tmp_path / "tiered").embedding.tiered_tables == {0: HOT_ROWS}


def test_with_micro_batches_a_tiered_table_trains_to_the_weights_of_the_same_table_in_memory(parent, tmp_path):
    """train.micro_batches=2: the two micro-batches of each optimizer step are planned as one batch, so no hot
    slot changes rows while its gradient is accumulated. One epoch of 3,072 rows: 48 micro-batches of 64, whole
    optimizer steps, so the tiered run leaves none out and ends at the in-memory run's weights, bit for bit."""
    import keras

    criteo, tiered = load_spec("criteo"), tiered_spec()
    config, warm = dataclasses.replace(CONFIG, micro_batches=2, epochs=1), WarmStart(parent, {})
    data = {part: write_block_files(random_rows(rows, NUM_VALUES, seed=seed), tmp_path / part, 2, 512)
            for part, rows, seed in (("train", 3072, 1), ("eval", 1000, 2))}
    memory = train_model(config, table_sizes(NUM_VALUES), data["train"], data["eval"], tmp_path / "memory",
                         warm_start=warm, spec=criteo)
    result = train_model(config, table_sizes(NUM_VALUES), data["train"], data["eval"], tmp_path / "tiered",
                         warm_start=warm, spec=tiered)
    assert result.speed_flags["micro_batches"] == 2 and result.num_train_examples == memory.num_train_examples == 3072
    np.testing.assert_array_equal(store_rows(tmp_path / "tiered", "C1"), table_rows(memory.model, "C1", criteo))
    assert_same_weights_in_memory(tmp_path / "tiered", tiered, memory.model)
    assert result.history["val_auc"] == memory.history["val_auc"]
    counters = result.tiered_tables["C1"]
    assert counters["tier_rows_loaded"] > HOT_ROWS and counters["tier_rows_written_back"] > 0  # rows went out

    # Three epochs. Keras' fit counts one more micro-batch at each epoch's end (trainer/keras_internals.py
    # micro_steps), so from the second epoch on the optimizer's steps start one micro-batch into the epoch: the
    # tiered stream follows that count, and cuts each epoch to end with an optimizer step, so no gradient is
    # pending on a hot slot when the held-out rows and the next epoch's plans reuse the slots.
    from trainer.keras_internals import micro_steps

    phases, pending = [], []

    class Phases(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            phases.append(micro_steps(self.model.optimizer) % 2)

        def on_epoch_end(self, epoch, logs=None):
            pending.append(max(float(np.abs(keras.ops.convert_to_numpy(v)).max())
                               for v in self.model.optimizer.variables
                               if v.name.endswith("gradient_accumulator") and "tiered_table" in v.name))

    longer = train_model(dataclasses.replace(config, epochs=3, early_stopping_patience=0), table_sizes(NUM_VALUES),
                         data["train"], data["eval"], tmp_path / "three", warm_start=warm, spec=tiered,
                         callbacks=[Phases()])
    assert phases == [0, 1, 1] and pending == [0.0, 0.0, 0.0]
    assert longer.num_train_examples == 47 * 64  # the last epoch: one micro-batch at its end left out
    assert longer.history["val_auc"][0] == result.history["val_auc"][0]  # the first epoch as above


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="JAX is not installed")
def test_on_the_jax_backend_micro_batches_train_a_tiered_table_to_the_weights_in_memory_over_epochs(parent, tmp_path):
    """train.backend=jax, train.micro_batches=2, three epochs: the JAX step's fit counts no extra micro-batch at
    an epoch's end, so every epoch is whole optimizer steps, nothing is left out, and the tiered table ends at
    the in-memory one's weights bit for bit after every epoch (one file: the JAX readers' order, above)."""
    from trainer.jax_train import train_in_jax_process

    criteo, tiered = load_spec("criteo"), tiered_spec()
    config = dataclasses.replace(CONFIG, backend="jax", micro_batches=2, epochs=3, early_stopping_patience=0)
    train = write_block_files(random_rows(3072, NUM_VALUES, seed=1), tmp_path / "train", 1, 512)
    held_out = write_block_files(random_rows(1000, NUM_VALUES, seed=2), tmp_path / "eval", 1, 512)
    runs = {name: train_in_jax_process(config, table_sizes(NUM_VALUES), train, held_out, tmp_path / name,
                                       warm_start=WarmStart(parent, {}), spec=spec, num_rows=3072)
            for name, spec in (("memory", criteo), ("tiered", tiered))}
    assert runs["tiered"].num_train_examples == runs["memory"].num_train_examples == 3072
    np.testing.assert_array_equal(store_rows(tmp_path / "tiered", "C1"), table_rows(runs["memory"].model, "C1", criteo))
    assert runs["tiered"].history["val_auc"] == runs["memory"].history["val_auc"]
    assert runs["tiered"].tiered_tables["C1"]["tier_rows_written_back"] > 0


def test_the_best_epoch_keeps_its_tables_and_a_resumed_run_ends_where_an_unbroken_one_does(data, tmp_path):
    spec = tiered_spec()
    # Over-fitting settings: the held-out AUC peaks early, so the kept epoch is not the last one run and its
    # tables come back from the best epoch's copy.
    config = dataclasses.replace(CONFIG, epochs=6, learning_rate=0.1, embedding_learning_rate=1.0,
                                 early_stopping_patience=1, calibrate=False)
    unbroken = train_model(config, table_sizes(NUM_VALUES), data["train"], data["eval"], tmp_path / "unbroken",
                           spec=spec)
    assert unbroken.best_epoch is not None and len(unbroken.history["val_auc"]) > unbroken.best_epoch + 1
    best = unbroken.history["val_auc"][unbroken.best_epoch]
    from sklearn.metrics import roc_auc_score

    assert roc_auc_score(unbroken.eval_labels, unbroken.eval_predictions) == pytest.approx(best, abs=0.005)

    # The same run with progress saved every 7 steps, stopped after step 30 and started again.
    saving = dataclasses.replace(config, checkpoint_every_steps=7)

    class Stop(Exception):
        pass

    import keras

    class StopAt(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.steps = 0

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1
            if self.steps == 30:
                raise Stop

    with pytest.raises(Stop):
        train_model(saving, table_sizes(NUM_VALUES), data["train"], data["eval"], tmp_path / "broken",
                    callbacks=[StopAt()], spec=spec)
    progress = tmp_path / "broken" / "progress"
    kept = sorted(p.name for p in progress.glob("tables-*"))  # the last save's tables and the one before
    assert len(kept) == 2 and kept[-1] == "tables-000000028"
    resumed = train_model(saving, table_sizes(NUM_VALUES), data["train"], data["eval"], tmp_path / "broken",
                          spec=spec)
    assert resumed.resumed_from_step == 28
    assert resumed.best_epoch == unbroken.best_epoch
    np.testing.assert_array_equal(store_rows(tmp_path / "broken", "C1"), store_rows(tmp_path / "unbroken", "C1"))
    for got, expected in zip(resumed.model.weights, unbroken.model.weights, strict=True):
        if "tiered_table" not in got.path:  # the hot slots hold whichever rows each run had loaded
            np.testing.assert_array_equal(np.asarray(got), np.asarray(expected), err_msg=got.path)


def test_a_warm_start_from_a_tiered_parent_copies_its_store_and_draws_the_reset_rows_afresh(data, tmp_path):
    from trainer.row_store import uniform_initializer

    spec = tiered_spec()
    train_model(dataclasses.replace(CONFIG, epochs=1), table_sizes(NUM_VALUES), data["train"], data["eval"],
                tmp_path / "day1", spec=spec)
    parent_rows = store_rows(tmp_path / "day1", "C1")
    sizes = {**table_sizes(NUM_VALUES), "C1": NUM_VALUES + 2 + 50}  # 50 rows admitted on day 2
    reset = [5, 17]
    config = dataclasses.replace(CONFIG, epochs=1, learning_rate=1e-30, embedding_learning_rate=1e-30, calibrate=False)
    result = train_model(config, sizes, data["train"], data["eval"], tmp_path / "day2",
                         warm_start=WarmStart(tmp_path / "day1", {0: reset}), spec=spec)
    rows = store_rows(tmp_path / "day2", "C1")  # learning rate 1e-30: the rows as the warm start made them
    fresh = uniform_initializer(8, CONFIG.seed + 0)(0, len(rows))
    kept = np.setdiff1d(np.arange(len(parent_rows)), reset)
    np.testing.assert_array_equal(rows[kept], parent_rows[kept])
    np.testing.assert_array_equal(rows[reset], fresh[reset])
    np.testing.assert_array_equal(rows[len(parent_rows):], fresh[len(parent_rows):])
    assert result.warm_start["rows_new"] == 50
    assert result.warm_start["rows_reset"] >= 2


def test_a_spec_that_tiers_a_table_refuses_what_the_hot_tier_cannot_do(data, tmp_path):
    spec = tiered_spec()
    for change, message in ((dict(multi_hash_features=("C1",), multi_hash_buckets=64),
                             r"no train.multi_hash_features among the tiered tables \['C1'\]"),
                            (dict(average_epochs=True, early_stopping_patience=1), "average_epochs"),
                            (dict(backend="jax", processes=2), r"one process \(train.processes=1")):
        with pytest.raises(ValueError, match=message):
            train_model(dataclasses.replace(CONFIG, **change), table_sizes(NUM_VALUES), data["train"], data["eval"],
                        tmp_path / "refused", spec=spec)
    # A hot tier smaller than a batch's distinct rows.
    with pytest.raises(ValueError, match="Tiered table 'C1'.*more than its hot tier's hot_rows=20"):
        train_model(CONFIG, table_sizes(NUM_VALUES), data["train"], data["eval"], tmp_path / "small",
                    spec=tiered_spec(hot_rows=20))


def chain_rows(checkpoint, name: str) -> np.ndarray:
    from trainer.tiered_tables import ChainRows

    with ChainRows(checkpoint, name) as table:
        return table.read(np.arange(table.num_rows))[0]


def test_a_minute_on_a_tiered_parent_keeps_only_the_rows_it_read_and_its_delta_is_those_rows(data, tmp_path):
    from components.delta import saved_weights, served_weight_arrays, weight_specs
    from trainer.incremental import train_increment
    from trainer.tiered_tables import LIVE_STATE, live_directory, read_overlays

    spec = tiered_spec()
    names = model_inputs(spec).tables
    sizes = table_sizes(NUM_VALUES)
    train_model(dataclasses.replace(CONFIG, epochs=1), sizes, data["train"], data["eval"], tmp_path / "day",
                spec=spec)
    day_rows = store_rows(tmp_path / "day", "C1")
    minute_files = write_block_files(random_rows(300, NUM_VALUES, seed=3), tmp_path / "minute", 1, 128)

    def minute(parent, name, seed):
        return train_increment(tmp_path / parent, minute_files, data["eval"], tmp_path / name,
                               new_rows={"C1": [7, 9], "C2": [4]}, batch_size=128, epochs=1, seed=seed,
                               version="2", spec=spec)

    result = minute("day", "m1", 11)
    np.testing.assert_array_equal(store_rows(tmp_path / "day", "C1"), day_rows)  # the parent's store untouched
    overlay = read_overlays(tmp_path / "m1")["C1"]
    touched = overlay["rows"]
    assert {7, 9} <= set(touched.tolist()) and 0 < len(touched) < NUM_VALUES + 2
    assert not (tmp_path / "m1" / TABLES_DIR / "C1.rows").exists()  # a minute holds its rows, not the table
    assert result["tiered_rows_touched"] == {"C1": len(touched)} and result["tiered_live_reused"] is False
    assert result["tiered_tables"]["C1"]["tier_rows_loaded"] > 0
    child_rows = chain_rows(tmp_path / "m1", "C1")
    untouched = np.setdiff1d(np.arange(len(day_rows)), touched)
    np.testing.assert_array_equal(child_rows[untouched], day_rows[untouched])  # only the rows it read moved
    assert not np.array_equal(child_rows[touched], day_rows[touched])

    # The delta, in the served model's layout, applied to the served parent gives the served child bit for bit.
    served_parent = load_in_memory(tmp_path / "day", names)
    served_child = load_in_memory(tmp_path / "m1", names)
    parent_specs, parent_weights = saved_weights(tmp_path / "day")
    specs, weights = saved_weights(tmp_path / "m1")
    assert parent_specs == specs
    arrays = served_weight_arrays(parent_weights, weights, specs, weight_specs(served_parent), sizes, [],
                                  {"C1": (touched, overlay["values"])})
    assert_delta_gives_child(arrays, served_parent, served_child)
    table = next(i for i, v in enumerate(served_parent.weights) if v.path.endswith("embedding/embeddings"))
    assert len(arrays[f"rows_{table:03d}"]) < served_parent.weights[table].shape[0]

    # The next minute trains the live stores the first one left, in place; one made again from the chain (the
    # base store and the first minute's rows) ends with the same table.
    live = live_directory(tmp_path / "m1", "C1")
    second = minute("m1", "m2", 12)
    assert second["tiered_live_reused"] is True
    (live / LIVE_STATE).unlink()
    assert minute("m1", "m2_rebuilt", 12)["tiered_live_reused"] is False
    np.testing.assert_array_equal(chain_rows(tmp_path / "m2", "C1"), chain_rows(tmp_path / "m2_rebuilt", "C1"))
    # The second minute of the chain spans both (trainer/tiered_tables.py, `span_pieces`): its chain is the daily
    # store and one piece, the rows either minute read, as of the second.
    from components.manifest import read_manifest
    from trainer.tiered_tables import table_chain

    assert result["tiered_span_rows"] == {}  # the first minute spans only itself: no span
    base, pieces = table_chain(tmp_path / "m2", "C1")
    assert base == tmp_path / "day" / TABLES_DIR / "C1.rows" and [p.name for p in pieces] == ["C1.span.npz"]
    both = np.union1d(touched, read_overlays(tmp_path / "m2")["C1"]["rows"])
    with np.load(pieces[0]) as span:
        np.testing.assert_array_equal(span["rows"], both)
    assert second["tiered_span_rows"] == {"C1": len(both)}
    manifest = read_manifest(tmp_path / "m2", kind="checkpoint")
    assert manifest["tables_chain_position"] == 2 and "tables/C1.span.npz" in manifest["files"]
    assert manifest["inputs"]["tables_span_parent"] == str(tmp_path / "day")
    # incremental.tiered_span_max_mib=0: no span, the position recorded all the same, the same table.
    unspanned = train_increment(tmp_path / "m1", minute_files, data["eval"], tmp_path / "m2_unspanned",
                                new_rows={"C1": [7, 9], "C2": [4]}, batch_size=128, epochs=1, seed=12,
                                version="2", spec=spec, span_max_bytes=0)
    assert unspanned["tiered_span_rows"] == {}
    assert [p.name for p in table_chain(tmp_path / "m2_unspanned", "C1")[1]] == ["C1.overlay.npz"] * 2
    assert read_manifest(tmp_path / "m2_unspanned", kind="checkpoint")["tables_chain_position"] == 2
    np.testing.assert_array_equal(chain_rows(tmp_path / "m2_unspanned", "C1"), chain_rows(tmp_path / "m2", "C1"))
    never = np.setdiff1d(untouched, read_overlays(tmp_path / "m2")["C1"]["rows"])  # read by neither minute
    assert len(never) and len(never) < len(day_rows)
    np.testing.assert_array_equal(chain_rows(tmp_path / "m2", "C1")[never], day_rows[never])

    # Two minute runs of one chain at once would train the same live stores: the second is refused while the
    # first holds the chain's lock, with who holds it; a failed run lets go of it.
    from trainer.tiered_tables import lock_live

    holder = lock_live(live)
    with pytest.raises(RuntimeError, match=rf"being trained by another minute run \(pid {os.getpid()} on "):
        minute("m2", "m3", 13)
    assert not (tmp_path / "m3").exists()
    holder.close()
    with pytest.raises(Exception, match="no-such-file"):
        train_increment(tmp_path / "m2", [str(tmp_path / "no-such-file")], data["eval"], tmp_path / "m3_failed",
                        new_rows={}, batch_size=128, epochs=1, seed=13, version="2", spec=spec)
    lock_live(live).close()  # free again
    assert minute("m2", "m3", 13)["tiered_live_reused"] is False  # the failed run left stores to rebuild
