"""The run's own baseline: a hashed logistic regression on the same training rows, scored on the same held-out rows.

Every team that evaluates a CTR model compares it with the simplest model it trusts. The daily run does that
itself: scikit-learn's `LogisticRegression` over one-hot features hashed into `num_features` columns
(`FeatureHasher`), one token per categorical value (every value, however rare: hashing keeps the tail a
vocabulary's admission sends to its shared row), one per value of a multi-valued or sequence feature, and one
per dense value's log2 bucket (the classic treatment of Criteo's counts). Its inverse regularization `C` is
chosen by logloss on the last `validation_fraction` of the training rows in time, never on the held-out rows,
and so is its feature set where the spec has history features (feature_sets).

`lift_auc` is the model's AUC minus the baseline's on the same rows; `bootstrap_auc_difference` gives its
interval, so a gate can refuse a model that is worse than its baseline beyond the noise of the held-out slice.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from components.evaluation import log_loss, roc_auc
from components.feature_spec import (
    CategoricalFeature,
    DenseFeature,
    FeatureSpec,
    MultiCategoricalFeature,
    SequenceFeature,
)

LABEL = "label"
MINUTE = "minute"


@dataclass(frozen=True)
class BaselineResult:
    auc: float
    logloss: float
    mean_prediction: float
    # The inverse regularization strength kept (the best validation logloss), and the validation AUC and
    # logloss of every one tried.
    regularization_c: float
    # The candidate feature set kept (feature_sets), and the validation scores keyed "C" (one set) or "set:C".
    feature_set: str
    validation_auc_by_c: dict[str, float]
    validation_logloss_by_c: dict[str, float]
    train_rows: int
    eval_rows: int
    # Training rows the interval held (train_rows is at most max_train_rows of them).
    available_train_rows: int
    seconds: float
    predictions: np.ndarray = field(repr=False, compare=False)

    def metrics(self) -> dict[str, float]:
        skip = ("predictions", "validation_auc_by_c", "validation_logloss_by_c", "feature_set")
        return {k: float(v) for k, v in asdict(self).items() if k not in skip}


# The feature sets the baseline chooses between on its validation rows (`feature_sets`).
LOG_COLUMNS = "log_columns"  # the features the log holds: every one but the history sequences
ALL_FEATURES = "all_features"


def feature_sets(spec: FeatureSpec) -> dict[str, tuple[str, ...]]:
    """The baseline's candidate feature sets, by name: the log's own columns, and with history features (which
    the spec computes from earlier rows) every feature too. A bag of a user's last liked items is collaborative
    signal a linear model mostly overfits: on MovieLens it took the baseline's validation AUC from 0.722 to 0.695,
    so the baseline keeps whichever set its validation rows prefer rather than being weakened by it."""
    names = tuple(f.name for f in spec.features if isinstance(
        f, DenseFeature | CategoricalFeature | MultiCategoricalFeature | SequenceFeature))
    log_columns = tuple(n for n in names if n not in {f.name for f in spec.histories})
    return {LOG_COLUMNS: log_columns} if log_columns == names else {LOG_COLUMNS: log_columns, ALL_FEATURES: names}


def row_tokens(rows: Iterable[dict[str, Any]], spec: FeatureSpec, names: Sequence[str] | None = None
               ) -> list[list[str]]:
    """The hashed model's tokens of parsed rows (spark_jobs.raw.parse_raw's columns, by feature name), of the
    features named in `names` (every one by default)."""
    features = [f for f in spec.features if isinstance(f, DenseFeature | CategoricalFeature | MultiCategoricalFeature
                                                       | SequenceFeature) and (names is None or f.name in names)]
    out = []
    for row in rows:
        tokens = []
        for feature in features:
            value = row.get(feature.name)
            if isinstance(feature, DenseFeature):
                tokens.append(f"{feature.name}={_dense_bucket(value)}")
            elif isinstance(feature, CategoricalFeature):
                if feature.derivation == "buckets":
                    continue  # the dense value's own bucket token stands for it
                tokens.append(f"{feature.name}={'' if value is None else value}")
            else:
                items = [] if value is None else list(value)
                tokens.extend(f"{feature.name}={item}" for item in items[-feature.max_length:])
                if not items:
                    tokens.append(f"{feature.name}=")
        out.append(tokens)
    return out


def fit_baseline_on_rows(train_rows: Sequence[dict[str, Any]], train_labels: np.ndarray,
                         eval_rows: Sequence[dict[str, Any]], eval_labels: np.ndarray, spec: FeatureSpec,
                         **settings: Any) -> BaselineResult:
    """fit_baseline on parsed rows, over the spec's candidate feature sets (feature_sets)."""
    candidates = {name: (row_tokens(train_rows, spec, names), row_tokens(eval_rows, spec, names))
                  for name, names in feature_sets(spec).items()}
    return fit_baseline(candidates, train_labels, eval_labels, **settings)


def _dense_bucket(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "missing"
    number = float(value)
    bucket = int(math.floor(math.log2(1.0 + abs(number))))
    return f"{'-' if number < 0 else ''}{bucket}"


def fit_baseline(candidates: Mapping[str, tuple[Sequence[Sequence[str]], Sequence[Sequence[str]]]],
                 train_labels: np.ndarray, eval_labels: np.ndarray, *, regularization_grid: Sequence[float],
                 validation_fraction: float, num_features: int, available_train_rows: int | None = None
                 ) -> BaselineResult:
    """`candidates`: feature set name -> (training rows' tokens, held-out rows' tokens). Chooses the feature set
    and C by logloss on the last `validation_fraction` of the training rows (in the order given: time order),
    refits on all training rows with them, and scores the held-out rows."""
    from sklearn.feature_extraction import FeatureHasher
    from sklearn.linear_model import LogisticRegression

    started = time.monotonic()
    train_labels = np.asarray(train_labels).astype(np.int64).ravel()
    eval_labels = np.asarray(eval_labels).astype(np.int64).ravel()
    if len(np.unique(train_labels)) < 2:
        raise ValueError(f"the baseline needs clicks and non-clicks among its {len(train_labels)} training rows, "
                         f"got only label {train_labels[:1].tolist()}")
    if not regularization_grid:
        raise ValueError("baseline.regularization_grid is empty: give at least one C, e.g. 0.1,0.3,1")
    if not candidates:
        raise ValueError("the baseline needs at least one feature set")
    hasher = FeatureHasher(n_features=num_features, input_type="string", alternate_sign=False)
    matrices = {name: (hasher.transform(train), hasher.transform(held_out))
                for name, (train, held_out) in candidates.items()}

    def model(c: float):
        return LogisticRegression(C=c, solver="liblinear", max_iter=1000)

    num_fit = int(round(len(train_labels) * (1.0 - validation_fraction)))
    validation_auc: dict[str, float] = {}
    validation_logloss: dict[str, float] = {}
    fit_labels, check_labels = train_labels[:num_fit], train_labels[num_fit:]
    grid = list(regularization_grid)
    both_classes = min(len(np.unique(fit_labels)), len(np.unique(check_labels))) == 2
    choices = [(name, c) for name in matrices for c in grid]
    if len(choices) > 1 and both_classes:
        for name, c in choices:
            x_train = matrices[name][0]
            probabilities = model(c).fit(x_train[:num_fit], fit_labels).predict_proba(x_train[num_fit:])[:, 1]
            key = _choice_key(name, c, len(matrices))
            validation_auc[key] = roc_auc(check_labels, probabilities)
            validation_logloss[key] = log_loss(check_labels, probabilities)
        # By logloss, a proper score: AUC ignores the level, and a C so small that every weight is near zero can
        # rank as well as a fitted one while predicting the same probability for every row.
        chosen_set, chosen = min(choices, key=lambda choice: validation_logloss[_choice_key(*choice, len(matrices))])
    else:
        chosen_set, chosen = next(iter(matrices)), grid[len(grid) // 2]
    x_train, x_eval = matrices[chosen_set]
    fitted = model(chosen).fit(x_train, train_labels)
    predictions = fitted.predict_proba(x_eval)[:, 1].astype(np.float64)
    return BaselineResult(
        auc=roc_auc(eval_labels, predictions), logloss=log_loss(eval_labels, predictions),
        mean_prediction=float(predictions.mean()), regularization_c=float(chosen), feature_set=chosen_set,
        validation_auc_by_c=validation_auc, validation_logloss_by_c=validation_logloss,
        train_rows=len(train_labels), eval_rows=len(eval_labels),
        available_train_rows=available_train_rows if available_train_rows is not None else len(train_labels),
        seconds=time.monotonic() - started, predictions=predictions)


def _choice_key(feature_set: str, c: float, num_sets: int) -> str:
    return repr(c) if num_sets == 1 else f"{feature_set}:{c!r}"


def bootstrap_auc_difference(labels: np.ndarray, scores: np.ndarray, baseline_labels: np.ndarray,
                             baseline_scores: np.ndarray, *, paired: bool, num_resamples: int = 200, seed: int = 0,
                             max_rows: int = 200_000) -> tuple[float, float]:
    """The 95 % bootstrap interval of AUC(scores) - AUC(baseline_scores).

    `paired`: both models scored the same rows in the same order (labels == baseline_labels), and each resample
    draws the same rows for both, which cancels the rows' shared difficulty. Unpaired, each side is resampled on
    its own: the right interval when the two sets hold the same rows in different orders (the daily run's
    samples are shuffled), wider than the paired one, so a gate reading it refuses less. At most `max_rows` rows
    a side are used, drawn once at random."""
    labels, scores = _flat(labels, scores, "model")
    baseline_labels, baseline_scores = _flat(baseline_labels, baseline_scores, "baseline")
    rng = np.random.default_rng(seed)
    if paired:
        if labels.shape != baseline_labels.shape or not np.array_equal(labels, baseline_labels):
            raise ValueError("a paired bootstrap needs both models' scores on the same rows in the same order: "
                             f"got {labels.shape[0]} and {baseline_labels.shape[0]} rows with different labels")
        if len(labels) > max_rows:
            keep = rng.choice(len(labels), size=max_rows, replace=False)
            labels, scores, baseline_scores = labels[keep], scores[keep], baseline_scores[keep]
            baseline_labels = labels
    else:
        labels, scores = _at_most(rng, max_rows, labels, scores)
        baseline_labels, baseline_scores = _at_most(rng, max_rows, baseline_labels, baseline_scores)
    differences = []
    for _ in range(num_resamples):
        index = rng.integers(0, len(labels), size=len(labels))
        other = index if paired else rng.integers(0, len(baseline_labels), size=len(baseline_labels))
        sample, baseline_sample = labels[index], baseline_labels[other]
        if sample.all() or not sample.any() or baseline_sample.all() or not baseline_sample.any():
            continue
        differences.append(roc_auc(sample, scores[index]) - roc_auc(baseline_sample, baseline_scores[other]))
    if not differences:
        raise ValueError(f"bootstrap: no resample of the {len(labels)} held-out rows had both classes")
    low, high = np.percentile(differences, [2.5, 97.5])
    return float(low), float(high)


def _flat(labels: np.ndarray, scores: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    labels = np.asarray(labels).astype(bool).ravel()
    scores = np.asarray(scores, dtype=np.float64).ravel()
    if labels.shape != scores.shape:
        raise ValueError(f"bootstrap: {labels.shape[0]} labels but {scores.shape[0]} {what} scores")
    return labels, scores


def _at_most(rng: np.random.Generator, max_rows: int, labels: np.ndarray, scores: np.ndarray):
    if len(labels) <= max_rows:
        return labels, scores
    keep = rng.choice(len(labels), size=max_rows, replace=False)
    return labels[keep], scores[keep]
