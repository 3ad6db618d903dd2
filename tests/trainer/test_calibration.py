import re

import keras
import numpy as np
import pytest

from components.config import TrainConfig
from tests.trainer.synthetic import random_rows, table_sizes
from trainer.calibration import CalibrationError, calibrate_level, level_shift, logit_bias
from trainer.models import build_model

pytestmark = pytest.mark.unit


def test_level_shift_solves_for_the_click_rate():
    labels = np.array([1, 0, 0, 0], dtype=np.float32)
    probabilities = np.full(4, 0.5)
    # sigmoid(0 + d) = 0.25  =>  d = log(0.25 / 0.75)
    assert level_shift(labels, probabilities) == pytest.approx(np.log(1 / 3), abs=1e-9)
    p = np.array([0.1, 0.2, 0.6, 0.9])
    shift = level_shift(np.array([0, 1, 0, 0]), p)
    logits = np.log(p / (1 - p))
    assert np.mean(1 / (1 + np.exp(-(logits + shift)))) == pytest.approx(0.25, abs=1e-9)


def test_rows_without_both_classes_cannot_set_a_level():
    with pytest.raises(CalibrationError, match=re.escape("click rate 0.0")):
        level_shift(np.zeros(3), np.full(3, 0.2))


@pytest.mark.parametrize("name", ["dcnv2", "deepfm", "wide_deep", "dlrm"])
def test_calibration_shifts_the_output_bias_and_keeps_the_ranking(name):
    model = build_model(TrainConfig(model=name, embedding_dim=4, mlp_units=(8,), num_cross_layers=1),
                        table_sizes(10))
    rows = random_rows(512, 10, seed=4)
    features = {"dense": rows.dense, "categorical": rows.categorical}
    before = keras.ops.convert_to_numpy(model(features)).reshape(-1)
    bias_before = keras.ops.convert_to_numpy(logit_bias(model)).copy()
    result = calibrate_level(model, [(features, rows.labels)])
    after = keras.ops.convert_to_numpy(model(features)).reshape(-1)
    assert after.mean() == pytest.approx(rows.labels.mean(), abs=1e-4)
    assert result["prediction_mean_before"] == pytest.approx(before.mean(), abs=1e-6)
    assert result["prediction_mean_after"] == pytest.approx(after.mean(), abs=1e-4)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(logit_bias(model)), bias_before + result["shift"], atol=1e-6)
    # The ranking is kept: in the order of the scores before, the scores after never fall by more than float32
    # rounding (two untrained rows can score within 1e-7 of each other, and a shift can swap such a near tie).
    falls = np.diff(after[np.argsort(before, kind="stable")])
    assert falls.min() >= -1e-6, f"the ranking changed: a score fell by {-falls.min():.2e}"
