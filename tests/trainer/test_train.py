import dataclasses
import math
import re

import keras
import numpy as np
import pytest

from components.config import TrainConfig
from components.manifest import read_manifest
from components.schema import NUM_CATEGORICAL
from tests.trainer.synthetic import random_rows, roc_auc, table_sizes, write_block_files
from trainer.models import build_model
from trainer.train import (
    MODEL_FILE,
    StepMetricsLogger,
    dense_accumulation_warning,
    embedding_shapes,
    load_checkpoint,
    train_model,
)

NUM_VALUES = 20
SMALL = TrainConfig(
    embedding_dim=8, num_cross_layers=2, mlp_units=(32, 16), batch_size=256, epochs=3, jit_compile=False
)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("planted")
    train_rows, eval_rows = random_rows(6000, NUM_VALUES, seed=1), random_rows(2000, NUM_VALUES, seed=2)
    return {
        "train_files": write_block_files(train_rows, directory / "train", num_files=2, block_rows=1024),
        "eval_files": write_block_files(eval_rows, directory / "eval", num_files=1, block_rows=1024),
        "eval_rows": eval_rows,
    }


@pytest.mark.integration
def test_learns_the_planted_signal_and_writes_a_checkpoint(planted, tmp_path):
    logged: list[tuple[int, dict[str, float]]] = []
    logger = StepMetricsLogger(lambda metrics, step: logged.append((step, metrics)), every_n_steps=10)
    result = train_model(
        SMALL,
        table_sizes(NUM_VALUES),
        planted["train_files"],
        planted["eval_files"],
        tmp_path / "checkpoint",
        callbacks=[logger],
    )
    labels, predictions = result.eval_labels, result.eval_predictions
    np.testing.assert_array_equal(labels, planted["eval_rows"].labels)
    assert predictions.shape == (2000,) and predictions.dtype == np.float32
    auc = roc_auc(labels, predictions)
    assert auc > 0.7
    assert abs(predictions.mean() - labels.mean()) / labels.mean() < 0.25  # the quality gate's default bound
    assert abs(result.history["val_auc"][-1] - auc) < 0.01
    assert result.history["val_loss"][-1] < result.history["val_loss"][0]
    assert result.history["num_examples"] == [6000.0] * 3
    assert result.history["val_num_examples"] == [2000.0] * 3
    assert result.history["val_label_mean"][-1] == pytest.approx(labels.mean(), abs=1e-6)
    assert result.num_train_examples == 6000
    assert math.isfinite(result.examples_per_second) and result.examples_per_second > 0
    assert result.speed_flags == {
        "batch_size": 256, "micro_batches": 1, "micro_batch_size": 256, "jit_compile": False,
        "mixed_precision": False, "dtype_policy": "float32", "row_sparse_updates": True, "num_replicas": 1,
    }

    # 24 steps per epoch (6000 / 256): every 10th step, and each epoch's end.
    assert [step for step, _ in logged] == [10, 20, 24, 30, 40, 48, 50, 60, 70, 72]
    assert {"loss", "auc"} <= set(logged[0][1]) and "val_auc" in logged[2][1]

    manifest = read_manifest(tmp_path / "checkpoint", kind="checkpoint")
    assert list(manifest["files"]) == [MODEL_FILE, "weights.npz"]  # weights.npz: for delta exports
    assert manifest["row_counts"] == {"train": 6000, "eval": 2000}
    assert manifest["inputs"]["train_files"] == planted["train_files"]
    assert manifest["train_config"]["mlp_units"] == [32, 16]
    assert manifest["speed_flags"] == result.speed_flags
    loaded = load_checkpoint(tmp_path / "checkpoint")
    eval_rows = planted["eval_rows"]
    features = {"dense": eval_rows.dense[:50], "categorical": eval_rows.categorical[:50]}
    np.testing.assert_allclose(loaded.predict(features, verbose=0).reshape(-1), predictions[:50], atol=1e-6)


@pytest.mark.integration
def test_untouched_embedding_rows_keep_their_exact_values(tmp_path):
    # Every row uses only ids 2 and 3 of each feature: the other 18 rows of each table must not move,
    # also under XLA.
    rows = random_rows(512, num_values=2, seed=4)
    files = write_block_files(rows, tmp_path / "data", num_files=1, block_rows=1024)
    sizes = table_sizes(NUM_VALUES)
    config = dataclasses.replace(SMALL, epochs=1, jit_compile=True)
    keras.utils.set_random_seed(config.seed)
    before = build_model(config, sizes).embedding.embeddings.numpy()

    result = train_model(config, sizes, files, files, tmp_path / "checkpoint")
    after = result.model.embedding.embeddings.numpy()

    offsets = np.arange(NUM_CATEGORICAL) * (NUM_VALUES + 2)
    touched = np.zeros(len(before), dtype=bool)
    touched[np.concatenate([offsets + 2, offsets + 3])] = True
    np.testing.assert_array_equal(after[~touched], before[~touched])
    assert (after[touched] != before[touched]).any(axis=1).all()


@pytest.mark.integration
@pytest.mark.parametrize("jit_compile", [False, True])
def test_micro_batches_give_the_weights_of_one_big_batch(tmp_path, jit_compile):
    rows = random_rows(128, NUM_VALUES, seed=5)
    files = write_block_files(rows, tmp_path / "data", num_files=1, block_rows=1024)
    one_batch = dataclasses.replace(SMALL, batch_size=128, epochs=1, micro_batches=1, jit_compile=jit_compile)
    micro = dataclasses.replace(one_batch, micro_batches=4)  # 4 x 32 rows, one optimizer step
    keras.utils.set_random_seed(one_batch.seed)
    initial = build_model(one_batch, table_sizes(NUM_VALUES)).get_weights()

    results = [
        train_model(config, table_sizes(NUM_VALUES), files, files, tmp_path / name)
        for name, config in (("one", one_batch), ("micro", micro))
    ]

    # The big batch takes the row-sparse path; Keras accumulates micro-batch gradients densely.
    assert [r.speed_flags["row_sparse_updates"] for r in results] == [True, False]
    assert [r.speed_flags["micro_batch_size"] for r in results] == [128, 32]
    weights = [r.model.get_weights() for r in results]
    for big, accumulated, start in zip(*weights, initial, strict=True):
        np.testing.assert_allclose(accumulated, big, rtol=1e-5, atol=1e-6)
        assert not np.array_equal(big, start)


@pytest.mark.integration
def test_mixed_precision_trains_in_bfloat16_and_restores_the_policy(planted, tmp_path):
    config = dataclasses.replace(SMALL, epochs=1, mixed_precision=True)
    previous = keras.config.dtype_policy().name
    sizes = table_sizes(NUM_VALUES)
    result = train_model(config, sizes, planted["train_files"][:1], planted["eval_files"], tmp_path)
    assert keras.config.dtype_policy().name == previous
    assert result.model.cross_layers[0].compute_dtype == "bfloat16"
    assert result.model.head.compute_dtype == "float32"
    assert result.speed_flags["mixed_precision"] and result.speed_flags["dtype_policy"] == "mixed_bfloat16"
    assert result.eval_predictions.dtype == np.float32 and np.isfinite(result.eval_predictions).all()


@pytest.mark.unit
def test_micro_batches_must_divide_the_batch(tmp_path):
    config = dataclasses.replace(SMALL, batch_size=100, micro_batches=3)
    expected = "train.micro_batches=3 must be >= 1 and divide train.batch_size=100"
    with pytest.raises(ValueError, match=re.escape(expected)):
        train_model(config, table_sizes(NUM_VALUES), ["unused"], ["unused"], tmp_path)


@pytest.mark.unit
@pytest.mark.parametrize("every_n_steps", [0, -5, 1.5])
def test_step_logger_rejects_invalid_intervals(every_n_steps):
    with pytest.raises(ValueError, match=re.escape(f"every_n_steps={every_n_steps!r}")):
        StepMetricsLogger(lambda metrics, step: None, every_n_steps)


@pytest.mark.integration
def test_keeps_the_epoch_with_the_best_held_out_auc(planted, tmp_path):
    # A high learning rate on 6,000 rows over-fits after the first epochs (0.2 diverged to AUC 0.5 on some
    # CPUs; 0.1 peaks at epoch 1): the held-out AUC falls, training
    # stops one epoch later (patience 1), and the checkpoint holds the best epoch's weights.
    config = dataclasses.replace(SMALL, epochs=8, learning_rate=0.1, embedding_learning_rate=1.0,
                                 early_stopping_patience=1, calibrate=False)
    result = train_model(config, table_sizes(NUM_VALUES), planted["train_files"], planted["eval_files"],
                         tmp_path / "checkpoint")
    val_auc = result.history["val_auc"]
    assert result.best_epoch == int(np.argmax(val_auc))
    assert len(val_auc) == result.best_epoch + 2 < config.epochs  # stopped one epoch after the best
    assert val_auc[-1] <= val_auc[result.best_epoch]
    # The predictions are the best epoch's, not the last one's.
    assert roc_auc(result.eval_labels, result.eval_predictions) == pytest.approx(val_auc[result.best_epoch],
                                                                                 abs=0.005)
    manifest = read_manifest(tmp_path / "checkpoint", kind="checkpoint")
    assert manifest["best_epoch"] == result.best_epoch and manifest["epochs_run"] == len(val_auc)
    assert manifest["final_metrics"]["val_auc"] == val_auc[result.best_epoch]
    reloaded = load_checkpoint(tmp_path / "checkpoint")
    from trainer.input import samples_dataset

    batch = next(iter(samples_dataset(planted["eval_files"], 256, shuffle=False, seed=0)))[0]
    np.testing.assert_allclose(reloaded.predict(batch, verbose=0).reshape(-1), result.eval_predictions[:256],
                               rtol=1e-5, atol=1e-6)
    assert not (tmp_path / "checkpoint" / "progress").exists()


@pytest.mark.integration
def test_average_epochs_keeps_the_mean_of_the_best_epoch_and_the_ones_after_it(planted, tmp_path):
    # The over-fitting settings of the test above, patience 2: the kept weights are the mean of the best epoch's
    # and the two after it, so the predictions are neither the best epoch's nor the last one's.
    config = dataclasses.replace(SMALL, epochs=8, learning_rate=0.1, embedding_learning_rate=1.0,
                                 early_stopping_patience=2, calibrate=False, average_epochs=True)
    result = train_model(config, table_sizes(NUM_VALUES), planted["train_files"], planted["eval_files"],
                         tmp_path / "checkpoint")
    val_auc = result.history["val_auc"]
    best = result.best_epoch
    assert best == int(np.argmax(val_auc)) and len(val_auc) == best + 3
    assert result.averaged_epochs == (best, best + 1, best + 2)
    manifest = read_manifest(tmp_path / "checkpoint", kind="checkpoint")
    assert manifest["averaged_epochs"] == [best, best + 1, best + 2]
    kept_auc = roc_auc(result.eval_labels, result.eval_predictions)
    assert all(abs(kept_auc - val_auc[epoch]) > 1e-4 for epoch in (best, best + 2))
    reloaded = load_checkpoint(tmp_path / "checkpoint")
    from trainer.input import samples_dataset

    batch = next(iter(samples_dataset(planted["eval_files"], 256, shuffle=False, seed=0)))[0]
    np.testing.assert_allclose(reloaded.predict(batch, verbose=0).reshape(-1), result.eval_predictions[:256],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.integration
def test_patience_zero_keeps_the_last_epoch(planted, tmp_path):
    config = dataclasses.replace(SMALL, epochs=2, early_stopping_patience=0, calibrate=False)
    result = train_model(config, table_sizes(NUM_VALUES), planted["train_files"], planted["eval_files"],
                         tmp_path / "checkpoint")
    assert result.best_epoch is None and len(result.history["val_auc"]) == 2
    assert roc_auc(result.eval_labels, result.eval_predictions) == pytest.approx(result.history["val_auc"][-1],
                                                                                 abs=0.005)


def test_micro_batching_on_large_tables_is_warned_of_with_their_size():
    """The tables are the built model's (embedding_shapes): a hashed feature counts its buckets, not its values."""
    sizes = {name: 10 for name in table_sizes(NUM_VALUES)} | {"C1": 150_000, "C2": 10_000_000}
    model = build_model(dataclasses.replace(SMALL, embedding_dim=16, multi_hash_features=("C2",),
                                            multi_hash_buckets=1_000), sizes)
    assert sorted(embedding_shapes(model)) == [(2_000, 16), (150_240, 16)]  # C1, 24 x 10 rows; C2 hashed twice
    warning = dense_accumulation_warning(dataclasses.replace(SMALL, micro_batches=2), embedding_shapes(model))
    assert warning is not None and "all 152,240 embedding rows (2,435,840 parameters)" in warning
    assert "train.micro_batches=1" in warning
    assert dense_accumulation_warning(dataclasses.replace(SMALL, micro_batches=1), embedding_shapes(model)) is None
    assert dense_accumulation_warning(dataclasses.replace(SMALL, micro_batches=2), [(99_999, 16)]) is None
