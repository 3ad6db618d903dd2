import keras
import numpy as np
import pytest

from trainer.early_stopping import BEST_STATE_FILE, BestEpoch


def _model(value: float) -> keras.Model:
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, kernel_initializer="zeros")])
    model.layers[0].kernel.assign(np.full((2, 1), value, dtype=np.float32))
    return model


def _kernel(model: keras.Model) -> float:
    return float(np.asarray(model.layers[0].kernel)[0, 0])


@pytest.mark.unit
def test_stops_after_patience_epochs_without_a_gain_and_restores_the_best(tmp_path):
    best = BestEpoch(tmp_path, "run", patience=2, min_delta=0.001)
    model = _model(0.0)
    scores = [0.70, 0.75, 0.7505, 0.74]  # epoch 2 gains less than min_delta: not a new best
    stops = []
    for epoch, score in enumerate(scores):
        model.layers[0].kernel.assign(np.full((2, 1), float(epoch), dtype=np.float32))
        stops.append(best.update(epoch, {"val_auc": score, "loss": 0.5}, model))
    assert stops == [False, False, False, True]
    assert best.restore(model) == 1
    assert _kernel(model) == 1.0  # epoch 1's weights
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best-0001.weights.h5", BEST_STATE_FILE]


@pytest.mark.unit
def test_a_resumed_run_compares_with_the_best_epoch_before_the_kill(tmp_path):
    first = BestEpoch(tmp_path, "run", patience=1)
    first.update(0, {"val_auc": 0.8}, _model(5.0))
    resumed = BestEpoch(tmp_path, "run", patience=1)  # a new process, same inputs
    model = _model(7.0)
    assert resumed.update(1, {"val_auc": 0.79}, model) is True
    assert resumed.restore(model) == 0 and _kernel(model) == 5.0
    other = BestEpoch(tmp_path, "other-inputs", patience=1)  # another run's record is ignored
    assert other.best is None


@pytest.mark.unit
def test_a_non_finite_score_is_never_the_best_and_patience_zero_is_off(tmp_path):
    best = BestEpoch(tmp_path / "a", "run", patience=1)
    model = _model(3.0)
    assert best.update(0, {"val_auc": float("nan")}, model) is False
    assert best.restore(model) is None and _kernel(model) == 3.0
    off = BestEpoch(tmp_path / "b", "run", patience=0)
    assert off.update(0, {"val_auc": 0.9}, model) is False and off.restore(model) is None
    assert not (tmp_path / "b").exists()
    assert not (tmp_path / "a").exists()  # nothing was recorded


@pytest.mark.unit
@pytest.mark.parametrize(("patience", "min_delta", "match"), [(-1, 0.0, "early_stopping_patience must be >= 0"),
                                                              (1, -0.1, "early_stopping_min_delta must be >= 0")])
def test_rejects_bad_settings(tmp_path, patience, min_delta, match):
    with pytest.raises(ValueError, match=match):
        BestEpoch(tmp_path, "run", patience=patience, min_delta=min_delta)


@pytest.mark.unit
def test_average_keeps_the_mean_of_the_best_epoch_and_the_ones_after_it(tmp_path):
    best = BestEpoch(tmp_path, "run", patience=2, average=True)
    model = _model(0.0)
    stops = []
    for epoch, score in enumerate([0.70, 0.75, 0.74, 0.73]):
        model.layers[0].kernel.assign(np.full((2, 1), float(epoch * epoch), dtype=np.float32))
        stops.append(best.update(epoch, {"val_auc": score}, model))
    assert stops == [False, False, False, True]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "best-0001.weights.h5", BEST_STATE_FILE, "epoch-0002.weights.h5", "epoch-0003.weights.h5"]
    resumed = BestEpoch(tmp_path, "run", patience=2, average=True)  # the record survives a new process
    assert resumed.best.following == ("epoch-0002.weights.h5", "epoch-0003.weights.h5")
    assert best.restore(model) == 1
    assert _kernel(model) == pytest.approx((1.0 + 4.0 + 9.0) / 3)  # epochs 1, 2 and 3: kernels 1, 4, 9
    assert best.averaged_epochs == [1, 2, 3]


@pytest.mark.unit
def test_a_new_best_drops_the_epochs_saved_after_the_old_one(tmp_path):
    best = BestEpoch(tmp_path, "run", patience=2, average=True)
    model = _model(0.0)
    for epoch, score in enumerate([0.70, 0.69, 0.71]):
        model.layers[0].kernel.assign(np.full((2, 1), float(epoch), dtype=np.float32))
        assert best.update(epoch, {"val_auc": score}, model) is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best-0002.weights.h5", BEST_STATE_FILE]
    assert best.restore(model) == 2 and _kernel(model) == 2.0 and best.averaged_epochs == []
