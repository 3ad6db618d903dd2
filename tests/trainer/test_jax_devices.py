"""train.devices on the JAX backend: four forced CPU devices split every batch and shard the embedding table
row-wise (keras.distribution, trainer/devices.py), and train to the weights one device gives."""

import dataclasses

import numpy as np
import pytest

from tests.trainer.synthetic import Rows, random_rows, write_block_files
from tests.trainer.test_export import feature_state
from tests.trainer.test_jax_train import CONFIG
from trainer.train import WarmStart

FOUR = "--xla_force_host_platform_device_count=4"


def rows_within(rows: Rows, sizes: list[int]) -> Rows:
    """The rows with each categorical id inside its feature's table."""
    return Rows(rows.labels, rows.dense, np.minimum(rows.categorical, np.array(sizes) - 1))


@pytest.fixture(scope="module")
def one_and_four(tmp_path_factory):
    """The same batches on one device and on four (6,000 rows in batches of 200, a multiple of 4). One training
    file, so one reader process: with several, batches arrive in the order the processes finish them, which
    differs between runs on a busy machine."""
    from components.schema import CATEGORICAL_FEATURES
    from trainer.jax_train import train_in_jax_process

    state = feature_state()
    sizes = [state.table_sizes()[name] for name in CATEGORICAL_FEATURES]
    root = tmp_path_factory.mktemp("devices-data")
    train_files = write_block_files(rows_within(random_rows(6000, 3, seed=1), sizes), root / "train", num_files=1,
                                    block_rows=500)
    eval_files = write_block_files(rows_within(random_rows(1500, 3, seed=2), sizes), root / "eval", num_files=1,
                                   block_rows=500)
    config = dataclasses.replace(CONFIG, batch_size=200, epochs=2, early_stopping_patience=0, calibrate=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XLA_FLAGS", FOUR)
        checkpoints = {devices: tmp_path_factory.mktemp(f"devices-{devices}") / "checkpoint" for devices in (1, 4)}
        runs = {devices: train_in_jax_process(dataclasses.replace(config, devices=devices, shard_table_rows=0),
                                              state.table_sizes(), train_files, eval_files, checkpoints[devices],
                                              num_rows=6000)
                for devices in (1, 4)}
        # A run that goes on from the sharded one (warm start, as a minute or the next day does), on other rows.
        more = write_block_files(rows_within(random_rows(2000, 3, seed=3), sizes), root / "more", num_files=1,
                                 block_rows=500)
        runs["4, then more"] = train_in_jax_process(
            dataclasses.replace(config, devices=4, shard_table_rows=0, epochs=1), state.table_sizes(), more,
            eval_files, tmp_path_factory.mktemp("devices-more") / "checkpoint", num_rows=2000,
            warm_start=WarmStart(checkpoints[4], {}))
    return runs, sum(state.table_sizes().values())


@pytest.mark.integration
def test_four_devices_hold_a_quarter_of_the_table_each(one_and_four):
    runs, rows = one_and_four
    padded = -(-rows // 4) * 4
    one, four = runs[1].speed_flags, runs[4].speed_flags
    assert (one["devices"], four["devices"]) == (1, 4)
    assert one["shard_rows"]["table"] == [rows] and one["sharded_table_rows"] == 0
    assert four["shard_rows"]["table"] == [padded // 4] * 4 and four["sharded_table_rows"] == padded
    # Adagrad's accumulator of the table is sharded with it.
    assert four["shard_rows"]["optimizer"] == [padded // 4] * 4
    assert runs[4].model.embedding.embeddings.shape[0] == padded  # the checkpoint, loaded on TensorFlow


@pytest.mark.integration
def test_four_devices_train_to_the_weights_of_one(one_and_four):
    runs, rows = one_and_four
    # The same steps over the same rows: no batch of the four-device run was cut down.
    assert runs[1].global_step == runs[4].global_step
    assert runs[1].num_train_examples == runs[4].num_train_examples == 6000
    for single, sharded in zip(runs[1].model.weights, runs[4].model.weights, strict=True):
        assert single.path == sharded.path
        expected, got = np.asarray(single), np.asarray(sharded)
        if got.shape != expected.shape:  # the table: the padding rows past `rows` are never read
            assert (got.shape[0], expected.shape[0]) == (-(-rows // 4) * 4, rows)
            got = got[:rows]
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5, err_msg=single.path)
    np.testing.assert_allclose(runs[4].eval_predictions, runs[1].eval_predictions, atol=1e-5)
    assert runs[4].history["val_auc"] == pytest.approx(runs[1].history["val_auc"], abs=2e-3)  # exact vs Keras'


@pytest.mark.integration
def test_a_delta_between_two_sharded_runs_takes_the_parents_export_to_the_childs_predictions(one_and_four,
                                                                                          tmp_path):
    """The checkpoint of a sharded run is the whole table (the shards gathered), so the delta of a minute is the
    rows that changed, as on one device: applied by serving to the parent's export it gives the child's model."""
    from components.delta import delta_arrays, read_delta, write_delta
    from serving.model import LoadedModel
    from tests.serving.delta_chain import export_full, predictions, raw_rows
    from trainer.export import weight_specs

    runs, _ = one_and_four
    parent, child = runs[4], runs["4, then more"]
    assert child.warm_start is not None and child.speed_flags["devices"] == 4
    state = feature_state()
    parent_weights = [np.asarray(w) for w in parent.model.weights]
    child_weights = [np.asarray(w) for w in child.model.weights]
    table = next(i for i, w in enumerate(parent.model.weights) if w.path.endswith("embedding/embeddings"))
    arrays = delta_arrays(parent_weights, child_weights, state, state)
    changed = arrays[f"rows_{table:03d}"]
    assert 0 < len(changed) < len(parent_weights[table])  # the rows the second run's batches read, not all
    export_full(parent.model, state, tmp_path / "202601020000", "202601020000")
    write_delta(tmp_path / "202601020001", arrays, version="202601020001", parent="202601020000",
                chain_root="202601020000", weight_specs=weight_specs(child.model), extra={})
    served = LoadedModel.load(tmp_path / "202601020000").apply_delta(*read_delta(tmp_path / "202601020001"))
    columns = raw_rows(state, 300, seed=4)
    np.testing.assert_allclose(served.predict_columns(columns), predictions(child.model, state, columns),
                               rtol=0, atol=1e-6)
    assert not np.allclose(predictions(parent.model, state, columns), predictions(child.model, state, columns),
                           atol=1e-4)


@pytest.mark.unit
def test_more_devices_than_the_host_shows_is_refused():
    from trainer.devices import resolve_devices

    with pytest.raises(ValueError, match=r"train.devices=64, but this host shows 1 cpu device\(s\)"):
        resolve_devices(64)
    assert resolve_devices(0) == resolve_devices(1) == 1
