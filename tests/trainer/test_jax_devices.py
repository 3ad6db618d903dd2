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


HOT_ROWS = 162  # not a multiple of 4: the hot variable gets 164 slots, the tier hands out 162


def train_tiered_one_and_four(root, model: str):
    """A spec whose C1 table is tiered (fewer hot slots than its 402 rows, so rows are evicted and loaded
    again), trained with `model` on one device and on four with every table and hot tier sharded
    (`shard_table_rows=0`), on the same batches (one training file: one reader process; 3,072 rows, so both take
    batches of 128): {devices: (result, checkpoint directory)}."""
    from tests.trainer.synthetic import table_sizes
    from tests.trainer.test_tiered_train_model import NUM_VALUES, tiered_spec
    from trainer.jax_train import train_in_jax_process

    train = write_block_files(random_rows(3072, NUM_VALUES, seed=1), root / "train", num_files=1, block_rows=512)
    held_out = write_block_files(random_rows(1001, NUM_VALUES, seed=2), root / "eval", num_files=1, block_rows=500)
    config = dataclasses.replace(CONFIG, model=model, batch_size=128, epochs=2, early_stopping_patience=0,
                                 calibrate=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XLA_FLAGS", FOUR)
        return {devices: (train_in_jax_process(dataclasses.replace(config, devices=devices, shard_table_rows=0),
                                               table_sizes(NUM_VALUES), train, held_out, root / f"d{devices}",
                                               num_rows=3072, spec=tiered_spec(HOT_ROWS)), root / f"d{devices}")
                for devices in (1, 4)}


@pytest.fixture(scope="module")
def tiered_one_and_four(tmp_path_factory):
    return train_tiered_one_and_four(tmp_path_factory.mktemp("tiered-devices"), CONFIG.model)


@pytest.mark.integration
def test_a_tiered_table_on_four_devices_shards_its_hot_slots_and_trains_to_the_weights_of_one(tiered_one_and_four):
    from tests.trainer.test_tiered_train_model import store_rows

    (one, one_dir), (four, four_dir) = tiered_one_and_four[1], tiered_one_and_four[4]
    # The hot slots and their accumulator, a quarter on each device; the tier itself hands out HOT_ROWS.
    assert four.speed_flags["shard_rows"]["hot_tables"] == {"0": [41] * 4}
    assert four.speed_flags["shard_rows"]["hot_optimizer"] == {"0": [41] * 4}
    assert four.speed_flags["sharded_hot_rows"] == 164 and one.speed_flags["sharded_hot_rows"] == 0
    assert one.speed_flags["shard_rows"]["hot_tables"] == {"0": [HOT_ROWS]}
    counters = four.tiered_tables["C1"]
    assert counters["tier_rows_loaded"] > HOT_ROWS and counters["tier_rows_written_back"] > 0  # rows went out
    # The same plans (the host plans for the whole variable). Whether a load was prefetched or deferred, and
    # the store's own I/O counts, depend on timing.
    def planned(counts):
        return {name: value for name, value in counts.items()
                if name.startswith("tier_") and name not in ("tier_rows_prefetched", "tier_rows_deferred")}

    assert planned(counters) == planned(one.tiered_tables["C1"])

    assert one.global_step == four.global_step and one.num_train_examples == four.num_train_examples == 3072
    # The table on disk and every other weight: the one-device run's, to float32's reordered sums.
    np.testing.assert_allclose(store_rows(four_dir, "C1"), store_rows(one_dir, "C1"), rtol=1e-4, atol=1e-5)
    for single, sharded in zip(one.model.weights, four.model.weights, strict=True):
        assert single.path == sharded.path
        expected, got = np.asarray(single), np.asarray(sharded)
        if got.shape != expected.shape:  # a padded variable: the rows past the one-device run's are never read
            got = got[:expected.shape[0]]
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5, err_msg=single.path)
    # Every held-out row scored (1,001 is not a multiple of 4), through the hot tier, to the same predictions.
    assert len(four.eval_predictions) == 1001
    np.testing.assert_allclose(four.eval_predictions, one.eval_predictions, atol=1e-5)
    assert four.history["val_auc"] == pytest.approx(one.history["val_auc"], abs=2e-3)  # exact vs Keras'


@pytest.fixture(scope="module")
def tiered_deepfm_one_and_four(tmp_path_factory):
    """tiered_one_and_four's runs with a DeepFM, whose linear part keeps hot slots of the same table (width 1)."""
    return train_tiered_one_and_four(tmp_path_factory.mktemp("tiered-deepfm-devices"), "deepfm")


@pytest.mark.integration
def test_a_tiered_deepfm_on_four_devices_shards_its_linear_hot_slots_too_and_trains_to_the_weights_of_one(
        tiered_deepfm_one_and_four):
    from tests.trainer.test_tiered_train_model import store_rows

    (one, one_dir), (four, four_dir) = tiered_deepfm_one_and_four[1], tiered_deepfm_one_and_four[4]
    # The linear part's hot slots (width 1) and their accumulator split like the embedding's: a quarter each.
    shards = four.speed_flags["shard_rows"]
    assert shards["hot_tables"] == shards["linear_hot_tables"] == {"0": [41] * 4}
    assert shards["linear_hot_optimizer"] == {"0": [41] * 4}
    assert one.speed_flags["shard_rows"]["linear_hot_tables"] == {"0": [HOT_ROWS]}
    assert one.global_step == four.global_step and one.num_train_examples == four.num_train_examples == 3072
    # The records on disk (each row's values and its linear weight) and every other weight: the one-device
    # run's, to float32's reordered sums.
    np.testing.assert_allclose(store_rows(four_dir, "C1"), store_rows(one_dir, "C1"), rtol=1e-4, atol=1e-5)
    for single, sharded in zip(one.model.weights, four.model.weights, strict=True):
        assert single.path == sharded.path
        expected, got = np.asarray(single), np.asarray(sharded)
        if got.shape != expected.shape:  # a padded variable: the rows past the one-device run's are never read
            got = got[:expected.shape[0]]
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5, err_msg=single.path)
    np.testing.assert_allclose(four.eval_predictions, one.eval_predictions, atol=1e-5)
