"""Models with a linear part (DeepFM, Wide & Deep) over a tiered table: the store's record holds the row's values
and its linear weight (trainer/tiered_tables.py, docs/tiers.md "A linear part over a tiered table"). The same
weights as the table in memory, bit for bit; the export's model in memory; warm starts from a tiered parent;
a minute's overlay and its delta in the served layout."""

import dataclasses
import importlib.util

import numpy as np
import pytest

from components.config import TrainConfig
from components.feature_spec import load_spec
from tests.trainer.synthetic import random_rows, table_sizes, write_block_files
from tests.trainer.test_tiered_train_model import (
    HOT_ROWS,
    NUM_VALUES,
    assert_delta_gives_child,
    assert_same_weights_in_memory,
    tiered_spec,
)
from trainer.model_inputs import model_inputs
from trainer.optimizers import INITIAL_ACCUMULATOR_VALUE
from trainer.row_store import RowStore, uniform_initializer
from trainer.tiered_tables import TABLES_DIR
from trainer.train import WarmStart, load_checkpoint, load_in_memory, train_model

DIM = 8
CONFIG = TrainConfig(embedding_dim=DIM, mlp_units=(16,), batch_size=128, epochs=2, jit_compile=False,
                     checkpoint_every_steps=1000)
LINEAR_MODELS = ("deepfm", "wide_deep")


def linear_rows(model, name: str, spec) -> np.ndarray:
    """Table `name`'s linear weights in an in-memory model with a linear part: [rows, 1]."""
    from trainer.tiered_training import linear_part

    layer = linear_part(model)
    index = list(model_inputs(spec).tables).index(name)
    start = int(layer.offsets[index])
    return np.asarray(layer.embeddings)[start:start + layer.table_sizes[index]]


def embedding_rows(model, name: str, spec) -> np.ndarray:
    layer = model.embedding
    index = list(model_inputs(spec).tables).index(name)
    start = int(layer.offsets[index])
    return np.asarray(layer.embeddings)[start:start + layer.table_sizes[index]]


def store_records(checkpoint, name: str) -> tuple[np.ndarray, np.ndarray]:
    with RowStore.open(checkpoint / TABLES_DIR / f"{name}.rows", writable=False) as store:
        return store.read(np.arange(store.num_rows))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiered_linear")
    return {
        "train": write_block_files(random_rows(3000, NUM_VALUES, seed=1), directory / "train", 2, 512),
        "eval": write_block_files(random_rows(1000, NUM_VALUES, seed=2), directory / "eval", 1, 512),
    }


@pytest.fixture(scope="module")
def parents(data, tmp_path_factory):
    """Per model, a first day trained in memory: what the runs below warm-start from, so both sides start from
    the same rows and the same linear weights (trained, not zeros)."""
    out = {}
    for model in LINEAR_MODELS:
        directory = tmp_path_factory.mktemp(f"parent_{model}") / "checkpoint"
        train_model(dataclasses.replace(CONFIG, model=model, epochs=1), table_sizes(NUM_VALUES), data["train"],
                    data["eval"], directory, spec=load_spec("criteo"))
        out[model] = directory
    return out


@pytest.mark.unit
def test_a_store_of_records_with_a_linear_weight_draws_its_values_as_the_table_alone_and_zeros_after(tmp_path):
    rows = np.array([0, 5, 399, 12345])
    plain, with_linear = uniform_initializer(DIM, 7), uniform_initializer(DIM + 1, 7, zero_columns=1)
    drawn = with_linear.rows(rows)
    np.testing.assert_array_equal(drawn[:, :DIM], plain.rows(rows))  # the values as a table of DIM columns
    np.testing.assert_array_equal(drawn[:, DIM], 0.0)
    with RowStore.create(tmp_path / "t.rows", 20_000, DIM + 1, with_linear,
                         initial_accumulator=INITIAL_ACCUMULATOR_VALUE):
        pass
    with RowStore.open(tmp_path / "t.rows", writable=False) as store:  # the header keeps the zero columns
        assert store.fresh == with_linear
        values, accumulators = store.read(rows)
    np.testing.assert_array_equal(values, drawn)
    np.testing.assert_array_equal(accumulators, np.float32(INITIAL_ACCUMULATOR_VALUE))
    with pytest.raises(ValueError, match=r"`zero_columns` must be in \[0, embedding_dim=8\)"):
        uniform_initializer(DIM, 7, zero_columns=DIM)


@pytest.mark.integration
@pytest.mark.parametrize("model", LINEAR_MODELS)
def test_a_model_with_a_linear_part_trains_a_tiered_table_to_the_weights_in_memory(data, parents, model, tmp_path):
    """C1 tiered in 160 slots of its 402 rows: the store's records hold the embedding rows and the linear
    weights the same run in memory ends with, bit for bit; so do every other weight (the model read into memory
    for the export), the losses and the held-out AUCs."""
    criteo, tiered = load_spec("criteo"), tiered_spec()
    config, warm = dataclasses.replace(CONFIG, model=model), WarmStart(parents[model], {})
    memory = train_model(config, table_sizes(NUM_VALUES), data["train"], data["eval"], tmp_path / "memory",
                         warm_start=warm, spec=criteo)
    result = train_model(config, table_sizes(NUM_VALUES), data["train"], data["eval"], tmp_path / "tiered",
                         warm_start=warm, spec=tiered)

    values, accumulators = store_records(tmp_path / "tiered", "C1")
    assert values.shape == accumulators.shape == (NUM_VALUES + 2, DIM + 1)
    np.testing.assert_array_equal(values[:, :DIM], embedding_rows(memory.model, "C1", criteo))
    np.testing.assert_array_equal(values[:, DIM:], linear_rows(memory.model, "C1", criteo))
    assert np.count_nonzero(values[:, DIM]) > 100  # the linear weights were trained, not left at zero
    assert_same_weights_in_memory(tmp_path / "tiered", tiered, memory.model)
    assert result.history["loss"] == memory.history["loss"]
    assert result.history["val_auc"] == memory.history["val_auc"]
    np.testing.assert_allclose(result.eval_predictions, memory.eval_predictions, rtol=0, atol=1e-6)
    counters = result.tiered_tables["C1"]
    assert counters["tier_rows_loaded"] > HOT_ROWS and counters["tier_rows_written_back"] > 0  # rows went out

    # Both layers hold HOT_ROWS slots of C1, not the table.
    from trainer.tiered_training import linear_part

    trained = load_checkpoint(tmp_path / "tiered")
    assert tuple(trained.embedding.hot_table(0).embeddings.shape) == (HOT_ROWS, DIM)
    assert tuple(linear_part(trained).hot_table(0).embeddings.shape) == (HOT_ROWS, 1)


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="JAX is not installed")
@pytest.mark.parametrize("model", LINEAR_MODELS)
def test_on_the_jax_backend_a_model_with_a_linear_part_trains_a_tiered_table_to_the_weights_in_memory(
        data, parents, model, tmp_path):
    """train.backend=jax: the same comparison (the rows in one file, as the other JAX comparisons read them),
    within the tolerance of the JAX comparisons across devices (rtol 1e-4, atol 1e-5) rather than bit for bit.
    The sums over the features (the linear part's, DeepFM's factorization machine) are not: XLA on the CPU
    sums a gather of the one table (the model in memory) in another order than the same values gathered from
    the table and the hot slots and put together (a scratch check of one CategoricalEmbedding of width 1, 26
    columns of N(0, 1) values: sums equal to 3e-6, the gathered values themselves equal), so the two runs part
    in the last bits from the first step. DCNv2, which sums no features, is bit for bit
    (test_tiered_train_model.py); on TensorFlow these models are too (above)."""
    from trainer.jax_train import train_in_jax_process

    criteo, tiered = load_spec("criteo"), tiered_spec()
    config, warm = dataclasses.replace(CONFIG, model=model, backend="jax"), WarmStart(parents[model], {})
    train = write_block_files(random_rows(3000, NUM_VALUES, seed=1), tmp_path / "train", 1, 512)
    runs = {name: train_in_jax_process(config, table_sizes(NUM_VALUES), train, data["eval"], tmp_path / name,
                                       warm_start=warm, spec=spec)
            for name, spec in (("memory", criteo), ("tiered", tiered))}
    close = {"rtol": 1e-4, "atol": 1e-5}
    values, _ = store_records(tmp_path / "tiered", "C1")
    np.testing.assert_allclose(values[:, :DIM], embedding_rows(runs["memory"].model, "C1", criteo), **close)
    np.testing.assert_allclose(values[:, DIM:], linear_rows(runs["memory"].model, "C1", criteo), **close)
    assert np.count_nonzero(values[:, DIM]) > 100
    served = load_in_memory(tmp_path / "tiered", model_inputs(tiered).tables)
    for got, expected in zip(served.weights, runs["memory"].model.weights, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), err_msg=got.path, **close)
    np.testing.assert_allclose(runs["tiered"].history["val_auc"], runs["memory"].history["val_auc"], rtol=0,
                               atol=1e-4)
    np.testing.assert_allclose(runs["tiered"].eval_predictions, runs["memory"].eval_predictions, rtol=0, atol=1e-5)
    assert runs["tiered"].tiered_tables["C1"]["tier_rows_written_back"] > 0


@pytest.mark.integration
def test_a_tiered_deepfm_warm_starts_from_its_store_and_its_minute_delta_carries_the_linear_weights(data, tmp_path):
    """A first day tiered from scratch (the linear column drawn as zeros), then: a tiered day and a day in memory
    warm-started from it train to the same weights (the store's records read back by ChainRows, and by the
    export's model in memory); a minute's overlay holds whole records, and its delta in the served layout (every
    table in memory) turns the served parent into the served child."""
    from components.delta import saved_weights, served_weight_arrays, weight_specs
    from trainer.incremental import train_increment
    from trainer.tiered_tables import ChainRows, read_overlays

    criteo, spec = load_spec("criteo"), tiered_spec()
    names, sizes = model_inputs(spec).tables, table_sizes(NUM_VALUES)
    config = dataclasses.replace(CONFIG, model="deepfm", epochs=1)
    train_model(config, sizes, data["train"], data["eval"], tmp_path / "day", spec=spec)
    with RowStore.open(tmp_path / "day" / TABLES_DIR / "C1.rows", writable=False) as store:
        assert store.fresh == uniform_initializer(DIM + 1, CONFIG.seed + 0, zero_columns=1)
        values, _, written = store.read_marked(np.arange(store.num_rows))
    assert written.any() and not written.all()
    np.testing.assert_array_equal(values[~written, DIM], 0.0)  # never trained: the linear weight as drawn
    assert np.count_nonzero(values[written, DIM]) > 0

    # Warm starts from the tiered parent: tiered again, and in memory; the same rows in, the same weights out.
    warm = WarmStart(tmp_path / "day", {})
    tiered_child = train_model(config, sizes, data["train"], data["eval"], tmp_path / "tiered", warm_start=warm,
                               spec=spec)
    memory_child = train_model(config, sizes, data["train"], data["eval"], tmp_path / "memory", warm_start=warm,
                               spec=criteo)
    records, _ = store_records(tmp_path / "tiered", "C1")
    np.testing.assert_array_equal(records[:, :DIM], embedding_rows(memory_child.model, "C1", criteo))
    np.testing.assert_array_equal(records[:, DIM:], linear_rows(memory_child.model, "C1", criteo))
    assert tiered_child.history["val_auc"] == memory_child.history["val_auc"]

    # A minute on the tiered day: its overlay holds whole records, read back by the chain and the export.
    minute_files = write_block_files(random_rows(300, NUM_VALUES, seed=3), tmp_path / "minute", 1, 128)
    train_increment(tmp_path / "day", minute_files, data["eval"], tmp_path / "m1", new_rows={"C1": [7, 9]},
                    batch_size=128, epochs=1, seed=11, version="2", spec=spec)
    overlay = read_overlays(tmp_path / "m1")["C1"]
    assert overlay["values"].shape[1] == overlay["accumulators"].shape[1] == DIM + 1
    with ChainRows(tmp_path / "m1", "C1") as chain:
        chained, _ = chain.read(np.arange(chain.num_rows))
    np.testing.assert_array_equal(chained[overlay["rows"]], overlay["values"])
    served_parent = load_in_memory(tmp_path / "day", names)
    served_child = load_in_memory(tmp_path / "m1", names)
    np.testing.assert_array_equal(linear_rows(served_child, "C1", criteo), chained[:, DIM:])
    np.testing.assert_array_equal(embedding_rows(served_child, "C1", criteo), chained[:, :DIM])

    # The delta in the served model's layout (both tables in memory) gives the served child bit for bit.
    _, parent_weights = saved_weights(tmp_path / "day")
    specs, weights = saved_weights(tmp_path / "m1")
    arrays = served_weight_arrays(parent_weights, weights, specs, weight_specs(served_parent), sizes, [],
                                  {"C1": (overlay["rows"], overlay["values"])})
    assert_delta_gives_child(arrays, served_parent, served_child)
    linear_table = next(i for i, v in enumerate(served_parent.weights) if v.path.endswith("value_weights/embeddings"))
    assert len(arrays[f"rows_{linear_table:03d}"]) >= len(overlay["rows"])
