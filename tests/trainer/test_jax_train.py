"""train.backend=jax: the train step in a child process on the JAX backend without TensorFlow, its checkpoint
exported by the TensorFlow step, and the TensorFlow-free reader on every kind of feature."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from components.block_codec import encode_blocks, frame_records
from components.config import ConfigError, TrainConfig, load_config
from components.feature_spec import load_spec
from tests.trainer.synthetic import Rows, random_rows, roc_auc, write_block_files
from tests.trainer.test_export import RAW_DENSE, feature_state, raw_categorical, reference_inputs
from trainer.block_reader import block_batches
from trainer.model_inputs import model_inputs
from trainer.parallel_reader import parallel_block_batches

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.unit
def test_backend_is_a_checked_config_value():
    assert load_config({"train.backend": "jax"}).train.backend == "jax"
    assert load_config().train.backend == "tensorflow"
    with pytest.raises(ConfigError, match="train.backend"):
        load_config({"train.backend": "torch"})


@pytest.mark.integration
def test_reader_follows_the_spec_for_every_kind(tmp_path):
    """movielens: no dense values, categorical features, a multi-valued and a sequence feature. The numpy
    readers give what the tf.data reader gives, batch for batch."""
    from trainer.input import block_dataset

    inputs = model_inputs(load_spec("movielens"))
    rng = np.random.default_rng(0)
    num_rows = 700
    labels = (rng.random(num_rows) < 0.3).astype(np.float32)
    dense = np.zeros((num_rows, inputs.dense_dim), np.float32)
    categorical = rng.integers(0, 50, (num_rows, len(inputs.feature_tables)))
    categorical[:, 0] = np.arange(num_rows)
    lists = {item.key: rng.integers(1, 40, (num_rows, item.length)) for item in inputs.lists}
    path = tmp_path / "part-00000.tfrecord"
    path.write_bytes(frame_records(encode_blocks(labels, dense, categorical, 128, lists)))

    expected = list(block_dataset([str(path)], 256, shuffle=False, seed=0, inputs=inputs).as_numpy_iterator())
    actual = list(block_batches([path], 256, inputs=inputs))
    assert [len(y) for _, y in actual] == [256, 256, 188]
    for (features, y), (expected_features, expected_y) in zip(actual, expected, strict=True):
        assert sorted(features) == sorted(expected_features) == ["categorical", "dense", "genres", "liked_items",
                                                                  "rated_items"]
        for name, values in features.items():
            assert values.shape == expected_features[name].shape
            np.testing.assert_array_equal(values, expected_features[name])
        np.testing.assert_array_equal(y, expected_y)

    parallel = list(parallel_block_batches([path], 256, num_workers=1, shuffle=False, inputs=inputs))
    assert len(parallel) == 2
    for (features, y), (expected_features, expected_y) in zip(parallel, actual, strict=False):
        assert features["liked_items"].dtype == np.int32 and features["dense"].shape == (256, 0)
        for name, values in features.items():
            np.testing.assert_array_equal(values, expected_features[name])
        np.testing.assert_array_equal(y, expected_y)

    with pytest.raises(ValueError, match=r"no \['genres', 'liked_items', 'rated_items'\] feature.*spec they were "
                                         r"written under"):
        criteo_blocks = frame_records(encode_blocks(labels, dense, categorical, 128))
        (tmp_path / "criteo.tfrecord").write_bytes(criteo_blocks)
        list(block_batches([tmp_path / "criteo.tfrecord"], 256, inputs=inputs))


def _rows_within(rows: Rows, sizes: list[int]) -> Rows:
    """The rows with each categorical id inside its feature's table."""
    return Rows(rows.labels, rows.dense, np.minimum(rows.categorical, np.array(sizes) - 1))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Block files of synthetic rows within the tables of the export test's feature state."""
    from components.schema import CATEGORICAL_FEATURES

    state = feature_state()
    table_sizes = state.table_sizes()
    sizes = [table_sizes[name] for name in CATEGORICAL_FEATURES]
    root = tmp_path_factory.mktemp("jax-data")
    train_rows = _rows_within(random_rows(6000, 3, seed=1), sizes)
    eval_rows = _rows_within(random_rows(1500, 3, seed=2), sizes)
    train_files = write_block_files(train_rows, root / "train", num_files=3, block_rows=500)
    eval_files = write_block_files(eval_rows, root / "eval", num_files=1, block_rows=500)
    return state, train_files, eval_files, eval_rows


CONFIG = TrainConfig(backend="jax", mlp_units=(32, 16), batch_size=256, epochs=3, early_stopping_patience=1,
                     log_every_steps=5, checkpoint_every_steps=7)


@pytest.fixture(scope="module")
def jax_run(data, tmp_path_factory):
    """One train step on JAX, run as the pipeline runs it: train_in_jax_process from this TensorFlow process."""
    from trainer.jax_train import train_in_jax_process
    from trainer.train import StepMetricsLogger

    state, train_files, eval_files, eval_rows = data
    checkpoint = tmp_path_factory.mktemp("jax-train") / "checkpoint"
    logged: list[tuple[int, dict]] = []
    result = train_in_jax_process(CONFIG, state.table_sizes(), train_files, eval_files, checkpoint,
                                  [StepMetricsLogger(lambda metrics, step: logged.append((step, metrics)), 5)],
                                  num_rows=6000)
    return result, checkpoint, eval_rows, logged, state


@pytest.mark.integration
def test_jax_step_trains_and_writes_the_usual_checkpoint(jax_run):
    result, checkpoint, eval_rows, logged, _ = jax_run
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["kind"] == "checkpoint" and "model.keras" in manifest["files"]
    assert manifest["tensorflow_imported"] is False
    assert manifest["train_config"]["backend"] == "jax"
    assert result.speed_flags["backend"] == "jax" and result.speed_flags["jit_compile"] is True
    assert not (checkpoint / "progress").exists()  # superseded by the checkpoint
    # Early stopping kept the best held-out epoch; its metrics are the manifest's.
    val_auc = result.history["val_auc"]
    assert result.best_epoch == int(np.argmax(val_auc))
    assert manifest["final_metrics"]["val_auc"] == pytest.approx(val_auc[result.best_epoch])
    assert result.num_train_examples == 6000
    assert roc_auc(result.eval_labels, result.eval_predictions) > 0.75
    np.testing.assert_array_equal(result.eval_labels, eval_rows.labels)
    # Calibration moved the level onto the click rate of its rows.
    assert result.calibration["prediction_mean_after"] == pytest.approx(result.calibration["label_mean"], abs=1e-4)
    # Step metrics came through from the child: every 5th step, and each epoch's end with its held-out AUC.
    per_epoch = result.global_step // len(val_auc)
    assert per_epoch == 24  # 6,000 rows in even batches of 250
    assert [step for step, m in logged if "val_auc" in m] == [per_epoch * (e + 1) for e in range(len(val_auc))]
    assert [step for step, m in logged if "val_auc" not in m] == list(range(5, result.global_step + 1, 5))
    assert [m["val_auc"] for _, m in logged if "val_auc" in m] == pytest.approx(val_auc)
    # The result's model is the checkpoint loaded on TensorFlow: same predictions as the JAX model's.
    predictions = result.model.predict({"dense": eval_rows.dense, "categorical": eval_rows.categorical}, verbose=0)
    np.testing.assert_allclose(predictions.reshape(-1), result.eval_predictions, atol=1e-5)


@pytest.mark.integration
def test_export_of_the_jax_checkpoint_predicts_what_the_jax_model_does(jax_run, tmp_path):
    import tensorflow as tf

    from trainer.export import export_serving_model
    from trainer.train import load_checkpoint

    _, checkpoint, _, _, state = jax_run
    export_serving_model(load_checkpoint(checkpoint), state, tmp_path)
    served = tf.saved_model.load(str(tmp_path / "saved_model")).signatures["serving_default"]
    categorical = raw_categorical(state)
    from components.schema import CATEGORICAL_FEATURES, DENSE_FEATURES

    raw = {**{name: tf.constant(RAW_DENSE[:, i]) for i, name in enumerate(DENSE_FEATURES)},
           **{name: tf.constant(categorical[:, i].astype(str)) for i, name in enumerate(CATEGORICAL_FEATURES)}}
    exported = served(**raw)["probability"].numpy()

    inputs = reference_inputs(state, RAW_DENSE, categorical)
    np.savez(tmp_path / "inputs.npz", **inputs)
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["tensorflow"] = None  # as on a JAX host without TensorFlow
        import keras, numpy as np
        import trainer.models, trainer.metrics, trainer.optimizers  # noqa: F401 (registered classes)
        assert keras.backend.backend() == "jax"
        model = keras.saving.load_model({str(checkpoint / "model.keras")!r})
        inputs = dict(np.load({str(tmp_path / "inputs.npz")!r}))
        np.save({str(tmp_path / "jax.npy")!r}, keras.ops.convert_to_numpy(model(inputs, training=False)).reshape(-1))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                          env={**os.environ, "KERAS_BACKEND": "jax"})
    assert done.returncode == 0, done.stderr[-3000:]
    on_jax = np.load(tmp_path / "jax.npy")
    assert on_jax.shape == exported.shape == (len(RAW_DENSE),)
    assert np.ptp(on_jax) > 1e-3  # the rows differ, so the comparison means something
    np.testing.assert_allclose(exported, on_jax, atol=1e-5, rtol=0)


@pytest.mark.integration
def test_a_killed_jax_step_resumes_and_a_later_one_warm_starts(data, jax_run, tmp_path):
    """Progress saves keep their meaning under JAX: a step killed (SIGKILL) after a save resumes from it; and a
    warm start copies the previous checkpoint's weights."""
    import pickle
    import time

    from trainer.jax_train import JaxTrainRequest, train_in_jax_process
    from trainer.train import WarmStart

    state, train_files, eval_files, _ = data
    config = TrainConfig(**{**CONFIG.__dict__, "epochs": 2, "early_stopping_patience": 0,
                            "checkpoint_every_steps": 30})
    checkpoint = tmp_path / "checkpoint"
    request = JaxTrainRequest(config=config, table_sizes=state.table_sizes(), train_files=train_files,
                              eval_files=eval_files, checkpoint_dir=str(checkpoint), version=None, warm_start=None,
                              layout="block-v1", num_rows=6000, spec=None, log_every_steps=None)
    (tmp_path / "request.pkl").write_bytes(pickle.dumps(request))
    child = subprocess.Popen([sys.executable, "-m", "trainer.jax_train", str(tmp_path / "request.pkl"),
                              str(tmp_path)], cwd=REPO_ROOT, env={**os.environ, "KERAS_BACKEND": "jax"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state_file = checkpoint / "progress" / "state.json"
    deadline = time.monotonic() + 240
    while not state_file.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    child.kill()
    child.wait()
    assert state_file.exists(), "the child saved no progress before it was killed"
    saved = json.loads(state_file.read_text())
    assert not (checkpoint / "manifest.json").exists()

    resumed = train_in_jax_process(config, state.table_sizes(), train_files, eval_files, checkpoint, num_rows=6000)
    assert resumed.resumed_from_step == saved["global_step"] >= 24  # the end of epoch 1 at the latest
    assert resumed.global_step == 48  # 2 epochs of 24 batches, counting those before the kill
    assert len(resumed.history["val_auc"]) == 2 - saved["epoch"]

    _, previous, _, _, _ = jax_run
    warm = train_in_jax_process(TrainConfig(**{**config.__dict__, "epochs": 1}), state.table_sizes(), train_files,
                                eval_files, tmp_path / "warm", warm_start=WarmStart(previous, {0: [2]}),
                                num_rows=6000)
    manifest = json.loads((tmp_path / "warm" / "manifest.json").read_text())
    assert manifest["inputs"]["warm_start"] == str(previous)
    assert warm.warm_start["weights_copied"] == len(manifest["weight_specs"])
    assert warm.warm_start["rows_reset"] == 1


@pytest.mark.integration
def test_a_minute_run_on_jax_trains_its_parent_and_changes_only_the_rows_it_read(data, jax_run, tmp_path):
    """ctr_incremental's train step on JAX (train_increment in a kept child without TensorFlow), from the JAX daily
    checkpoint: it trains the minute's rows once, and the rows of the table it changed are rows its batches
    read, so the delta the export step forms from the two checkpoints stays a minute's rows. The next minute
    trains the model the child kept, to the weights a new child reaches from the checkpoint."""
    from components.delta import saved_weights
    from components.schema import CATEGORICAL_FEATURES
    from trainer.incremental import checkpoint_weights
    from trainer.jax_train import stop_minute_process, train_increment_in_jax_process
    from trainer.train import load_checkpoint

    state, _, eval_files, _ = data
    _, parent, _, _, _ = jax_run
    sizes = [state.table_sizes()[name] for name in CATEGORICAL_FEATURES]
    minute = _rows_within(random_rows(600, 3, seed=5), sizes)
    files = write_block_files(minute, tmp_path / "minute", num_files=1, block_rows=200)
    stop_minute_process()
    result = train_increment_in_jax_process(parent, files, eval_files, tmp_path / "child", new_rows={},
                                            batch_size=200, epochs=1, seed=7, version="202601010001", num_rows=600)
    # The step the checkpoint's weights and optimizer state are at: the manifest's `global_step` counts every step
    # the daily run trained, and early stopping keeps the best epoch's weights, which may be an earlier one.
    trained = json.loads((parent / "manifest.json").read_text())["global_step"]
    parent_step = int(load_checkpoint(parent).optimizer.iterations.numpy())
    assert 0 < parent_step <= trained
    assert result["train_rows"] == 600 and result["global_step"] == parent_step + 3
    assert result["parent_from_memory"] is False and result["minute_process_started"] is True
    assert np.isfinite(result["holdout_logloss"]) and result["holdout_logloss"] != result["parent_holdout_logloss"]

    # The next minute goes to the same process, which kept the model it trained: the same weights as a minute
    # trained by a new process from the checkpoint on disk.
    later = write_block_files(_rows_within(random_rows(400, 3, seed=6), sizes), tmp_path / "later", num_files=1,
                              block_rows=200)
    arguments = {"new_rows": {}, "batch_size": 200, "epochs": 1, "seed": 7, "version": "202601010002",
                 "num_rows": 400}
    kept = train_increment_in_jax_process(tmp_path / "child", later, eval_files, tmp_path / "kept", **arguments)
    assert kept["parent_from_memory"] is True and kept["minute_process_started"] is False
    assert kept["seconds"]["load_parent"] < result["seconds"]["load_parent"]
    stop_minute_process()
    loaded = train_increment_in_jax_process(tmp_path / "child", later, eval_files, tmp_path / "loaded", **arguments)
    assert loaded["parent_from_memory"] is False and loaded["minute_process_started"] is True
    assert kept["global_step"] == loaded["global_step"] == parent_step + 5
    for got, expected in zip(saved_weights(tmp_path / "kept")[1], saved_weights(tmp_path / "loaded")[1], strict=True):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)

    specs, child_weights = saved_weights(tmp_path / "child")
    _, parent_weights = checkpoint_weights(parent)
    table = next(i for i, spec in enumerate(specs) if spec["path"].endswith("embedding/embeddings"))
    changed = set(np.flatnonzero(np.any(child_weights[table] != parent_weights[table], axis=1)).tolist())
    offsets = load_checkpoint(parent).embedding.offsets
    read = set((minute.categorical + offsets[np.arange(len(sizes))]).reshape(-1).tolist())
    assert changed and changed <= read, sorted(changed - read)[:10]
    assert load_checkpoint(tmp_path / "child").optimizer.iterations.numpy() == parent_step + 3  # on TensorFlow
