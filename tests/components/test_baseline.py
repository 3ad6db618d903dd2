"""The run's baseline: tokens from the spec, the regularization chosen on later training rows, the bootstrap."""

from __future__ import annotations

import numpy as np
import pytest

from components.baseline import (
    ALL_FEATURES,
    LOG_COLUMNS,
    bootstrap_auc_difference,
    feature_sets,
    fit_baseline,
    fit_baseline_on_rows,
    row_tokens,
)
from components.evaluation import roc_auc
from components.feature_spec import spec_from_dict

pytestmark = pytest.mark.unit

SPEC = spec_from_dict({
    "name": "tiny", "source": {"format": "csv", "header": True}, "label": {"column": "y"},
    "features": [
        {"name": "ad", "kind": "categorical"},
        {"name": "price", "kind": "dense"},
        {"name": "tags", "kind": "multi_categorical", "separator": "|", "max_length": 2},
    ],
})


def test_tokens_name_every_value_bucket_dense_values_and_mark_missing():
    rows = [{"ad": "a7", "price": 6.0, "tags": ["x", "y", "z"]},
            {"ad": None, "price": float("nan"), "tags": []},
            {"ad": "b", "price": -1.0, "tags": None}]
    assert row_tokens(rows, SPEC) == [
        ["ad=a7", "price=2", "tags=y", "tags=z"],  # log2(1 + 6) = 2.8; the newest max_length tags
        ["ad=", "price=missing", "tags="],
        ["ad=b", "price=-1", "tags="],
    ]


def _planted(num_rows: int, seed: int) -> tuple[list[list[str]], np.ndarray]:
    """Rows of one categorical value each; values 0-9 click 80 % of the time, 10-19 20 %."""
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 20, size=num_rows)
    labels = (rng.random(num_rows) < np.where(values < 10, 0.8, 0.2)).astype(np.int64)
    return [[f"ad={v}"] for v in values], labels


def test_fit_baseline_learns_a_planted_rule_and_chooses_c_on_the_last_training_rows():
    train_tokens, train_labels = _planted(4000, seed=1)
    eval_tokens, eval_labels = _planted(1000, seed=2)
    result = fit_baseline({LOG_COLUMNS: (train_tokens, eval_tokens)}, train_labels, eval_labels,
                          regularization_grid=(1e-4, 1.0), validation_fraction=0.25, num_features=1 << 10)
    # The planted rule's own AUC on these rows is the most any model can reach.
    best = roc_auc(eval_labels, np.array([0.8 if int(t[0][3:]) < 10 else 0.2 for t in eval_tokens]))
    assert result.auc == pytest.approx(best, abs=0.01)
    # C=1e-4 shrinks every weight to nearly nothing: it ranks the rows as well (AUC) but predicts about 0.5 for
    # all of them, a worse logloss, so C=1 is kept.
    assert result.regularization_c == 1.0
    assert set(result.validation_auc_by_c) == set(result.validation_logloss_by_c) == {"0.0001", "1.0"}
    assert result.validation_logloss_by_c["1.0"] < result.validation_logloss_by_c["0.0001"] - 0.1
    assert result.logloss < 0.6
    assert (result.train_rows, result.eval_rows) == (4000, 1000)
    assert result.predictions.shape == (1000,)
    assert result.mean_prediction == pytest.approx(float(np.mean(eval_labels)), abs=0.05)


HISTORY_SPEC = spec_from_dict({
    "name": "tiny_history", "source": {"format": "csv", "header": True}, "label": {"column": "y"},
    "features": [
        {"name": "ts", "kind": "timestamp"},
        {"name": "user", "kind": "categorical"},
        {"name": "item", "kind": "categorical"},
        {"name": "liked", "kind": "sequence", "shares": "item", "max_length": 3,
         "history": {"key": "user", "positive_only": True}},
    ],
})


def test_feature_sets_leave_history_sequences_out_of_the_log_columns():
    assert feature_sets(SPEC) == {LOG_COLUMNS: ("ad", "price", "tags")}
    assert feature_sets(HISTORY_SPEC) == {LOG_COLUMNS: ("user", "item"), ALL_FEATURES: ("user", "item", "liked")}


def test_the_baseline_keeps_the_feature_set_its_validation_rows_prefer():
    """The item decides the click; the history holds items drawn at random: noise that a linear model can only
    overfit, so the validation rows choose the log's own columns, and the held-out AUC is the planted one's."""
    rng = np.random.default_rng(5)

    def rows(count: int) -> tuple[list[dict], np.ndarray]:
        items = rng.integers(0, 10, size=count)
        labels = (rng.random(count) < np.where(items < 5, 0.75, 0.25)).astype(np.int64)
        return [{"user": f"u{rng.integers(0, 2000)}", "item": str(i),
                 "liked": [str(v) for v in rng.integers(0, 3000, size=3)]} for i in items], labels

    train, train_labels = rows(3000)
    held_out, held_out_labels = rows(1000)
    result = fit_baseline_on_rows(train, train_labels, held_out, held_out_labels, HISTORY_SPEC,
                                  regularization_grid=(0.3, 3.0), validation_fraction=0.2, num_features=1 << 16)
    assert result.feature_set == LOG_COLUMNS
    assert set(result.validation_logloss_by_c) == {"log_columns:0.3", "log_columns:3.0", "all_features:0.3",
                                                   "all_features:3.0"}
    best_all = min(v for k, v in result.validation_logloss_by_c.items() if k.startswith(ALL_FEATURES))
    assert result.validation_logloss_by_c[f"{LOG_COLUMNS}:{result.regularization_c!r}"] < best_all
    planted = roc_auc(held_out_labels, np.array([0.75 if int(r["item"]) < 5 else 0.25 for r in held_out]))
    assert result.auc == pytest.approx(planted, abs=0.01)


def test_fit_baseline_refuses_training_rows_of_one_class():
    with pytest.raises(ValueError, match="needs clicks and non-clicks among its 3 training rows"):
        fit_baseline({LOG_COLUMNS: ([["a=1"]] * 3, [["a=1"]])}, np.zeros(3), np.zeros(1), regularization_grid=(1.0,),
                     validation_fraction=0.1, num_features=16)


def test_paired_interval_of_a_better_model_lies_above_zero_and_is_narrower_than_unpaired():
    rng = np.random.default_rng(0)
    labels = rng.random(3000) < 0.3
    signal = labels + rng.normal(0, 1.0, 3000)
    better, worse = signal + rng.normal(0, 0.3, 3000), signal + rng.normal(0, 1.5, 3000)
    lift = roc_auc(labels, better) - roc_auc(labels, worse)
    paired = bootstrap_auc_difference(labels, better, labels, worse, paired=True)
    unpaired = bootstrap_auc_difference(labels, better, labels, worse, paired=False)
    assert 0 < paired[0] < lift < paired[1]
    assert unpaired[0] < lift < unpaired[1]
    assert paired[1] - paired[0] < unpaired[1] - unpaired[0]


def test_unpaired_interval_ignores_row_order():
    rng = np.random.default_rng(3)
    labels = rng.random(2000) < 0.4
    scores = labels + rng.normal(0, 1.0, 2000)
    order = rng.permutation(2000)
    low, high = bootstrap_auc_difference(labels, scores, labels[order], scores[order], paired=False)
    assert low < 0 < high  # the same model on the same rows, shuffled: no difference beyond the noise


def test_paired_bootstrap_refuses_rows_that_are_not_the_same():
    labels = np.array([0, 1, 0, 1])
    with pytest.raises(ValueError, match="same rows in the same order"):
        bootstrap_auc_difference(labels, np.ones(4), labels[::-1], np.ones(4), paired=True)
