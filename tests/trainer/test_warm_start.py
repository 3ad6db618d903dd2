import re

import numpy as np
import pytest

from components.config import TrainConfig
from components.schema import CATEGORICAL_FEATURES
from trainer.models import build_model
from trainer.warm_start import WarmStartError, reset_rows_by_feature, warm_start_weights

pytestmark = pytest.mark.unit

CONFIG = TrainConfig(embedding_dim=2, num_cross_layers=1, mlp_units=(4,))


def sizes(first: int, second: int) -> dict[str, int]:
    out = {name: 3 for name in CATEGORICAL_FEATURES}
    out["C1"], out["C2"] = first, second
    return out


def model_with_weights(table_sizes, fill: float):
    model = build_model(CONFIG, table_sizes)
    for index, variable in enumerate(model.weights):
        variable.assign(np.full(variable.shape, fill + index, dtype="float32"))
    return model


def table_of(model) -> np.ndarray:
    return np.asarray(model.get_layer("embedding").embeddings)


def test_kept_rows_are_copied_new_and_reset_rows_keep_their_fresh_values():
    previous = build_model(CONFIG, sizes(5, 4))
    old_table = np.arange(previous.get_layer("embedding").num_rows * 2, dtype="float32").reshape(-1, 2)
    previous.get_layer("embedding").embeddings.assign(old_table)
    model = build_model(CONFIG, sizes(7, 4))  # C1 grew from 5 to 7 rows
    fresh = table_of(model).copy()

    # C1: row 3 evicted; C2: row 2 handed to a newly admitted value.
    summary = warm_start_weights(model, previous, {0: [3], 1: [2]})
    table = table_of(model)
    np.testing.assert_array_equal(table[[0, 1, 2, 4]], old_table[[0, 1, 2, 4]])  # C1 kept rows
    np.testing.assert_array_equal(table[[3, 5, 6]], fresh[[3, 5, 6]])  # C1: reset, then the 2 new rows
    np.testing.assert_array_equal(table[[7, 8, 10]], old_table[[5, 6, 8]])  # C2 starts at 7 now, 5 before
    np.testing.assert_array_equal(table[9], fresh[9])  # C2 row 2 reset
    np.testing.assert_array_equal(table[11:], old_table[9:])  # C3.. unchanged, shifted by 2
    assert summary == {"weights_copied": len(model.weights), "rows_kept": 5 - 1 + 4 - 1 + 24 * 3,
                       "rows_reset": 2, "rows_new": 2}
    for variable, old in zip(model.weights[1:], previous.weights[1:], strict=True):
        np.testing.assert_array_equal(np.asarray(variable), np.asarray(old))


def test_a_shrunk_table_keeps_its_first_rows():
    previous = model_with_weights(sizes(6, 4), fill=1.0)
    model = build_model(CONFIG, sizes(4, 4))
    warm_start_weights(model, previous)
    np.testing.assert_array_equal(table_of(model)[:4], table_of(previous)[:4])
    np.testing.assert_array_equal(table_of(model)[4:8], table_of(previous)[6:10])


def test_another_layer_size_is_a_clear_error():
    previous = build_model(CONFIG, sizes(5, 4))
    wider = build_model(TrainConfig(embedding_dim=2, num_cross_layers=1, mlp_units=(6,)), sizes(5, 4))
    expected = "'dcnv2/deep_network/deep_0/kernel' has shape (78, 6) here and (78, 4) in the previous"
    with pytest.raises(WarmStartError, match=re.escape(expected)):
        warm_start_weights(wider, previous)
    other_model = build_model(TrainConfig(model="wide_deep", embedding_dim=2, mlp_units=(4,)), sizes(5, 4))
    with pytest.raises(WarmStartError, match="train.warm_start=false"):
        warm_start_weights(other_model, previous)


def test_reset_rows_by_feature_joins_evicted_and_new_rows():
    assert reset_rows_by_feature({"C2": (5, 9)}, {"C2": (3,), "C1": (2,)}, list(CATEGORICAL_FEATURES)) == {
        1: [5, 9, 3], 0: [2]}
