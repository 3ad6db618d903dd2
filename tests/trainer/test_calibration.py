import re

import keras
import numpy as np
import pytest

from components.config import TrainConfig
from tests.trainer.synthetic import random_rows, table_sizes
from trainer.calibration import CalibrationError, calibrate, calibrate_level, level_shift, logit_bias, platt_scaling
from trainer.models import build_model

pytestmark = pytest.mark.unit


def test_level_shift_reaches_the_click_rate_from_saturated_predictions():
    # A model that fit 80 training rows exactly: every prediction ~0 or ~1 (slopes ~1e-7), six non-clicks among
    # the ones. Newton's steps alone jumped by millions of logits and stopped at +1.5e6: every prediction 1.0.
    labels = np.array([0] * 66 + [1] * 14, dtype=float)
    saturated = np.concatenate([np.full(60, 1e-9), np.full(20, 1 - 1e-9)])
    shift = level_shift(labels, saturated)
    logits = np.log(np.clip(saturated, 1e-7, 1 - 1e-7) / (1 - np.clip(saturated, 1e-7, 1 - 1e-7)))
    assert -20 < shift < 0
    assert np.mean(1 / (1 + np.exp(-(logits + shift)))) == pytest.approx(labels.mean(), rel=1e-6)
    # Predictions that are not saturated take Newton's steps as before.
    p = np.concatenate([np.full(60, 1e-9), np.full(6, 0.3), np.full(14, 1 - 1e-9)])
    assert level_shift(labels, p) == -7.211329522453629


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


def test_platt_scaling_recovers_the_scale_and_shift_the_labels_were_drawn_with():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, 200_000)
    labels = rng.random(logits.size) < 1 / (1 + np.exp(-(0.5 * logits + 0.3)))
    scale, shift = platt_scaling(labels, 1 / (1 + np.exp(-logits)))
    assert scale == pytest.approx(0.5, abs=0.01) and shift == pytest.approx(0.3, abs=0.015)
    with pytest.raises(CalibrationError, match="do not rank their clicks"):
        platt_scaling(labels, 1 / (1 + np.exp(logits)))  # scores that rank the clicks last


def _scored_rows(seed, num_rows=4096):
    rows = random_rows(num_rows, 10, seed=seed)
    return {"dense": rows.dense, "categorical": rows.categorical}, rows.labels


@pytest.mark.parametrize(("name", "scaled"), [("dcnv2", True), ("dlrm", True), ("deepfm", False)])
def test_held_out_calibration_folds_the_fit_into_the_output_layer(name, scaled):
    model = build_model(TrainConfig(model=name, embedding_dim=4, mlp_units=(8,), num_cross_layers=1),
                        table_sizes(10))
    features, _ = _scored_rows(5)
    before = keras.ops.convert_to_numpy(model(features)).reshape(-1).astype(np.float64)
    logits = np.log(before) - np.log1p(-before)
    # Labels drawn from the model's own scores (their logits standardized, shifted to a click rate near 0.3).
    standardized = (logits - logits.mean()) / logits.std()
    labels = (np.random.default_rng(0).random(len(before)) < 1 / (1 + np.exp(-(standardized - 0.85)))).astype(
        np.float32)
    result = calibrate(model, [], [(features, labels)], min_clicks=100)
    after = keras.ops.convert_to_numpy(model(features)).reshape(-1).astype(np.float64)
    assert result["held_out"] == 1.0 and result["rows"] == 2048 and result["check_rows"] == 2048
    # Every prediction is the fitted transform of its old value, folded into the model.
    np.testing.assert_allclose(after, 1 / (1 + np.exp(-(result["scale"] * logits + result["shift"]))), atol=2e-5)
    assert (result["scale"] != 1.0) == scaled
    fit = np.arange(len(labels)) % 2 == 0
    assert after[fit].mean() == pytest.approx(labels[fit].mean(), abs=1e-4)  # the fit's level is its click rate
    assert result["check_logloss_after"] <= result["check_logloss_before"] + 1e-3


def test_too_few_held_out_clicks_fall_back_to_the_training_rows_level():
    model = build_model(TrainConfig(embedding_dim=4, mlp_units=(8,), num_cross_layers=1), table_sizes(10))
    features, labels = _scored_rows(6, num_rows=512)
    few = np.zeros_like(labels)
    few[:40] = 1  # 20 clicks in the fitted half
    train_features, train_labels = _scored_rows(7)
    result = calibrate(model, [(train_features, train_labels)], [(features, few)], min_clicks=100)
    assert result["held_out"] == 0.0 and result["scale"] == 1.0 and result["rows"] == 4096
    after = keras.ops.convert_to_numpy(model(train_features)).reshape(-1)
    assert after.mean() == pytest.approx(train_labels.mean(), abs=1e-4)
