"""The delta format: changed rows, vocabulary entries, size, and the checks on reading."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from components.delta import (
    DELTA_FILE,
    DeltaError,
    changed_rows,
    delta_arrays,
    new_vocabulary_entries,
    read_delta,
    rows_name,
    values_name,
    weight_arrays,
    write_delta,
)
from components.feature_state import Vocabulary
from components.manifest import ManifestError
from tests.serving.delta_chain import admit, initial_state


def test_changed_rows_compares_whole_rows_and_treats_nan_as_equal():
    old = np.array([[1.0, 2.0], [3.0, np.nan], [5.0, 6.0], [7.0, 8.0]], dtype=np.float32)
    new = old.copy()
    new[2, 1] = 6.5
    new[3] = [np.nan, 8.0]
    assert changed_rows(old, new).tolist() == [2, 3]
    assert changed_rows(np.float32(1.0), np.float32(1.0)).tolist() == []
    assert changed_rows(np.float32(1.0), np.float32(2.0)).tolist() == [0]
    with pytest.raises(DeltaError, match=r"changed shape from \(4, 2\) to \(5, 2\)"):
        changed_rows(old, np.zeros((5, 2), np.float32))


def test_weight_arrays_hold_the_new_values_of_changed_rows_only():
    old = [np.zeros((5, 3), np.float32), np.zeros(4, np.float32)]
    new = [old[0].copy(), np.arange(4, dtype=np.float32)]
    new[0][1] = 7.0
    arrays = weight_arrays(old, new)
    assert arrays[rows_name(0)].tolist() == [1] and arrays[values_name(0)].tolist() == [[7.0, 7.0, 7.0]]
    assert arrays[rows_name(1)].tolist() == [1, 2, 3] and arrays[values_name(1)].tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(DeltaError, match="has 2 weights and this one 1"):
        weight_arrays(old, new[:1])


def test_new_vocabulary_entries_and_a_moved_value_is_refused():
    parent = initial_state()
    child = admit(admit(parent, "C3", "fresh", "v1"), "C26", "é", "v2")
    keys, rows = new_vocabulary_entries(parent, child)
    assert keys.tolist() == ["C3\x1ffresh", "C26\x1fé"] and rows.tolist() == [10, 10]
    moved = replace(child.vocabularies["C1"], rows=(11, *child.vocabularies["C1"].rows[1:]))
    with pytest.raises(DeltaError, match="C1 value 'C1-v0' moved from row 2 to 11"):
        new_vocabulary_entries(parent, replace(child, vocabularies={**child.vocabularies, "C1": moved}))
    assert isinstance(child.vocabularies["C1"], Vocabulary)


def test_write_then_read_checks_checksums_versions_and_weights(tmp_path):
    parent = initial_state()
    specs = [{"path": "m/embeddings", "shape": [6, 2], "dtype": "float32"}]
    old, new = [np.zeros((6, 2), np.float32)], [np.zeros((6, 2), np.float32)]
    new[0][4] = [1.0, -1.0]
    arrays = delta_arrays(old, new, parent, admit(parent, "C1", "x", "v1"))
    manifest = write_delta(tmp_path / "d", arrays, version="202601010001", parent="202601010000",
                           chain_root="202601010000", weight_specs=specs, extra={"data_end": "x"})
    assert manifest["rows_changed"] == {"m/embeddings": 1} and manifest["num_vocabulary_entries"] == 1
    read_manifest, read_arrays = read_delta(tmp_path / "d", specs)
    assert read_manifest["parent"] == "202601010000"
    np.testing.assert_array_equal(read_arrays[values_name(0)], [[1.0, -1.0]])
    with pytest.raises(DeltaError, match="computed for other weights"):
        read_delta(tmp_path / "d", [{"path": "m/embeddings", "shape": [7, 2], "dtype": "float32"}])
    with pytest.raises(DeltaError, match="must be above its parent's"):
        write_delta(tmp_path / "e", arrays, version="202601010000", parent="202601010000", chain_root="1",
                    weight_specs=specs, extra={})
    data = bytearray((tmp_path / "d" / DELTA_FILE).read_bytes())
    data[-10] ^= 0xFF
    (tmp_path / "d" / DELTA_FILE).write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="does not match its manifest checksum"):
        read_delta(tmp_path / "d")


@pytest.mark.integration
def test_a_minute_touching_one_percent_of_the_rows_ships_under_five_percent_of_the_model(tmp_path):
    import keras

    from components.config import TrainConfig
    from components.schema import CATEGORICAL_FEATURES, NUM_CATEGORICAL, NUM_DENSE
    from trainer.export import export_serving_model, weight_specs
    from trainer.models import build_model
    from trainer.train import compile_model

    keras.utils.set_random_seed(3)
    rows_per_table = 20_000
    state = initial_state()
    state = replace(state, vocabularies={name: replace(v, capacity=rows_per_table)
                                         for name, v in state.vocabularies.items()})
    config = TrainConfig(embedding_dim=16, num_cross_layers=1, mlp_units=(16,), batch_size=1024)
    model = build_model(config, state.table_sizes())
    compile_model(model, config)
    rng = np.random.default_rng(0)
    touched = rng.choice(np.arange(2, rows_per_table), size=(rows_per_table // 100, NUM_CATEGORICAL), replace=False)
    inputs = {"dense": rng.normal(size=(4096, 2 * NUM_DENSE)).astype(np.float32),
              "categorical": touched[rng.integers(0, len(touched), (4096, NUM_CATEGORICAL)),
                                     np.arange(NUM_CATEGORICAL)]}
    model(inputs)
    before = [np.array(v) for v in model.weights]
    model.fit(inputs, (rng.random(4096) < 0.2).astype(np.float32), batch_size=1024, epochs=1, verbose=0)
    arrays = delta_arrays(before, [np.array(v) for v in model.weights], state, state)
    manifest = write_delta(tmp_path / "delta", arrays, version="2", parent="1", chain_root="1",
                           weight_specs=weight_specs(model), extra={})
    table = next(i for i, s in enumerate(manifest["weight_specs"]) if s["path"].endswith("embeddings"))
    assert len(arrays[rows_name(table)]) == len(np.unique(touched + np.arange(NUM_CATEGORICAL) * rows_per_table))
    assert len(arrays[rows_name(table)]) == rows_per_table // 100 * len(CATEGORICAL_FEATURES)
    full = export_serving_model(model, state, tmp_path / "full")
    full_bytes = sum((tmp_path / "full" / name).stat().st_size for name in full)
    assert manifest["delta_bytes"] / full_bytes <= 0.05, (manifest["delta_bytes"], full_bytes)
