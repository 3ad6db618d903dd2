from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from components.feature_state import (
    DENSE_FILE,
    FEATURE_STATE_KIND,
    VOCABULARY_FILE,
    DenseTransform,
    FeatureState,
    categorical_rows,
    load_feature_state,
    save_feature_state,
    signed_log1p,
    transform_dense,
)
from components.manifest import ManifestError, commit_dir, read_manifest, staging_dir, write_manifest
from components.schema import (
    CATEGORICAL_FEATURES,
    DENSE_FEATURES,
    MISSING_ROW,
    NUM_RESERVED_ROWS,
    RARE_ROW,
)

pytestmark = pytest.mark.unit


def _state(version: str = "20260101T0000-20260102T0000") -> FeatureState:
    vocabularies = {name: () for name in CATEGORICAL_FEATURES}
    counts = {name: () for name in CATEGORICAL_FEATURES}
    vocabularies["C1"], counts["C1"] = ("aaaa0001", "bbbb0002", "cccc0003"), (50, 20, 5)
    vocabularies["C7"], counts["C7"] = ("deadbeef",), (9,)
    # I1: log values clipped to [0, 2], mean 1, std 0.5; the others are the identity on [-10, 10].
    dense = tuple(
        DenseTransform(name, 0.0, 2.0, 1.0, 0.5)
        if name == "I1"
        else DenseTransform(name, -10.0, 10.0, 0.0, 1.0)
        for name in DENSE_FEATURES
    )
    return FeatureState(version=version, min_count=5, vocabularies=vocabularies, counts=counts, dense=dense)


def test_categorical_rows_maps_known_unknown_and_missing_values():
    vocabulary = pa.array(["aaaa0001", "bbbb0002", "cccc0003"])
    values = pa.array(["cccc0003", "aaaa0001", "ffff9999", None, "", "bbbb0002", "AAAA0001"])
    rows = categorical_rows(values, vocabulary)
    assert rows.dtype == np.int64
    assert rows.tolist() == [
        NUM_RESERVED_ROWS + 2,
        NUM_RESERVED_ROWS + 0,
        RARE_ROW,
        MISSING_ROW,
        MISSING_ROW,
        NUM_RESERVED_ROWS + 1,
        RARE_ROW,  # matching is exact, case included
    ]
    assert rows.tolist() == [4, 2, 0, 1, 1, 3, 0]


def test_categorical_rows_with_an_empty_vocabulary():
    rows = categorical_rows(pa.array(["x", None, ""]), pa.array([], pa.string()))
    assert rows.tolist() == [RARE_ROW, MISSING_ROW, MISSING_ROW]


def test_signed_log1p():
    assert signed_log1p(np.array([0.0, 3.0, -3.0])).tolist() == pytest.approx(
        [0.0, math.log(4), -math.log(4)]
    )


def test_transform_dense_hand_computed():
    state = _state()
    raw = np.zeros((4, 13))
    raw[:, 0] = [math.e - 1, np.nan, 1000.0, -5.0]  # I1: log1p -> 1, missing, clipped to 2, clipped to 0
    raw[:, 1] = [-3.0, 0.0, np.nan, 1.0]  # I2: identity on signed log1p
    out = transform_dense(raw, state)
    assert out.shape == (4, 26)
    assert out.dtype == np.float32
    # I1 standardized: (clip(x) - 1) / 0.5
    np.testing.assert_allclose(out[:, 0], [0.0, 0.0, 2.0, -2.0], atol=1e-6)
    np.testing.assert_allclose(out[:, 1], [-math.log(4), 0.0, 0.0, math.log(2)], rtol=1e-6)
    # Other dense fields were 0 -> 0.
    np.testing.assert_array_equal(out[:, 2:13], 0.0)
    # Indicators follow the values: 1 exactly where the raw value was missing.
    np.testing.assert_array_equal(out[:, 13], [0, 1, 0, 0])
    np.testing.assert_array_equal(out[:, 14], [0, 0, 1, 0])
    np.testing.assert_array_equal(out[:, 15:], 0.0)


def test_transform_dense_missing_is_zero_even_when_the_mean_is_not():
    state = _state()
    raw = np.full((1, 13), np.nan)
    out = transform_dense(raw, state)
    # Without the missing mask, I1 would come out as (0 - 1) / 0.5 = -2.
    np.testing.assert_array_equal(out[0, :13], 0.0)
    np.testing.assert_array_equal(out[0, 13:], 1.0)


def test_transform_dense_reshapes_a_flat_row():
    state = _state()
    out = transform_dense(np.arange(13, dtype=np.float64), state)
    assert out.shape == (1, 26)
    assert out[0, 0] == pytest.approx((0.0 - 1.0) / 0.5)  # log1p(0) = 0, mean 1, std 0.5
    assert out[0, 12] == pytest.approx(math.log(13))


def test_table_sizes_count_reserved_rows():
    state = _state()
    assert state.table_size("C1") == NUM_RESERVED_ROWS + 3
    assert state.table_size("C2") == NUM_RESERVED_ROWS
    assert sum(state.table_sizes().values()) == 26 * NUM_RESERVED_ROWS + 4


def _write(state: FeatureState, directory):
    """As spark_jobs.features.write_feature_state: files in a staging dir, manifest, then commit."""
    staging = staging_dir(directory)
    files = save_feature_state(state, staging)
    write_manifest(
        staging,
        kind=FEATURE_STATE_KIND,
        version=state.version,
        files=files,
        extra={"min_count": state.min_count, "table_sizes": state.table_sizes()},
    )
    return commit_dir(staging, directory)


def test_save_load_round_trip(tmp_path):
    state = _state()
    directory = _write(state, tmp_path / "features" / "x")
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [VOCABULARY_FILE, DENSE_FILE, "manifest.json"]
    )
    loaded = load_feature_state(directory)
    assert loaded == state
    assert loaded.vocabularies["C1"] == ("aaaa0001", "bbbb0002", "cccc0003")
    assert loaded.counts["C1"] == (50, 20, 5)
    assert loaded.dense[0] == DenseTransform("I1", 0.0, 2.0, 1.0, 0.5)
    table = pq.read_table(directory / VOCABULARY_FILE)
    assert table.num_rows == 4
    assert table.filter(pa.compute.equal(table["feature"], "C7")).to_pylist() == [
        {"feature": "C7", "value": "deadbeef", "row": NUM_RESERVED_ROWS, "count": 9}
    ]
    assert read_manifest(directory)["table_sizes"]["C1"] == 5


def test_load_feature_state_verifies_checksums(tmp_path):
    directory = _write(_state(), tmp_path / "fs")
    doc = json.loads((directory / DENSE_FILE).read_text())
    doc["dense"][0]["mean"] = 99.0
    (directory / DENSE_FILE).write_text(json.dumps(doc, indent=2))
    with pytest.raises(ManifestError, match=r"file 'dense\.json' does not match its manifest checksum"):
        load_feature_state(directory)
    assert load_feature_state(directory, verify=False).dense[0].mean == 99.0


def test_load_feature_state_needs_a_committed_dir(tmp_path):
    staging = staging_dir(tmp_path / "fs")
    save_feature_state(_state(), staging)  # crashed before the manifest was written
    with pytest.raises(ManifestError, match=r"has no manifest\.json"):
        load_feature_state(staging)


def test_load_feature_state_rejects_another_kind(tmp_path):
    staging = staging_dir(tmp_path / "fs")
    files = save_feature_state(_state(), staging)
    write_manifest(staging, kind="checkpoint", version="v", files=files)
    with pytest.raises(ManifestError, match=r"describes a 'checkpoint', expected a 'feature_state'"):
        load_feature_state(staging)


def test_load_feature_state_rejects_a_vocabulary_gap(tmp_path):
    staging = staging_dir(tmp_path / "fs")
    save_feature_state(_state(), staging)
    table = pq.read_table(staging / VOCABULARY_FILE)
    rows = table["row"].to_pylist()
    rows[2] = 7  # C1's third value jumps from row 4 to 7
    pq.write_table(table.set_column(2, "row", pa.array(rows, pa.int64())), staging / VOCABULARY_FILE)
    write_manifest(staging, kind=FEATURE_STATE_KIND, version="v", files=[VOCABULARY_FILE, DENSE_FILE])
    with pytest.raises(ValueError, match=r"vocabulary of C1 has a gap at row 7"):
        load_feature_state(staging)
