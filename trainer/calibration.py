"""Calibration after training: the held-out rows' scale and level (Platt scaling), or one logit shift so that
the mean prediction on training rows equals their click rate.

Why: with Adagrad's per-weight steps the model's overall level wanders while ranking is already good. On the
demo's day the mean prediction of the last weights swung between 0.094 and 0.181 from one 10-step probe to
the next (label mean 0.127), on training and held-out rows alike, and the exported model over-predicted by
20 %. Bidding and budget pacing use the probability itself, so the level is fixed once at the end: the shift
moves every logit by the same amount (AUC unchanged) and is folded into the model's output bias, so the
checkpoint, the export and serving all carry it.

The level is not all: a model whose best epoch by held-out AUC has already fit its training rows closely is
overconfident on rows it has not seen. On MovieLens 100K (80,000 ratings, the later 20,000 scored) the default
model's held-out logits wanted a scale of 0.52: its served logloss was 0.7065 (worse than a constant) at an AUC
of 0.6975, and the same scores through sigmoid(0.52 logit + 0.09) gave 0.6428 at the same AUC. So by default
(`train.calibrate_on: held_out`) a scale and a shift are fitted on half the held-out rows (every other row; the
held-out slice is the latest of the interval, so this is also the level the next day starts from) and folded
into the Dense head's kernel and bias; the other half measures the fit (`check_logloss_before` / `_after`). A
model whose output is a sum of logits (DeepFM, Wide&Deep) gets the held-out shift only. With fewer than
`min_clicks` clicks or non-clicks in that half the fit would follow noise, and the training rows' level shift
is used instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import keras
import numpy as np

# Newton steps on the mean of sigmoid(logit + shift); each halves the error's digits, 8 are plenty.
_NEWTON_STEPS = 8
# Where a step had to bisect: steps at most, the relative error of the level to reach, and the shifts searched
# (logits are clipped to about +-16.1, so +-100 reaches any level a finite set of labels has).
_MAX_STEPS = 200
_LEVEL_TOLERANCE = 1e-9
_SHIFT_BOUND = 100.0
_EPSILON = 1e-7


class CalibrationError(ValueError):
    """The model has no output bias to shift, or the rows cannot define a level."""


def logit_bias(model: keras.Model) -> Any:
    """The bias added last before the sigmoid: the Dense head's, or the deep logit's where the head is the
    sigmoid of a sum of logits (DeepFM, Wide&Deep)."""
    for name in ("head", "deep_logit"):
        layer = getattr(model, name, None)
        bias = getattr(layer, "bias", None)
        if bias is not None:
            return bias
    raise CalibrationError(
        f"model {model.name!r} has no output bias (a Dense 'head' or 'deep_logit' layer) to calibrate; "
        "set train.calibrate=false"
    )


def level_shift(labels: np.ndarray, probabilities: np.ndarray) -> float:
    """The logit shift d with mean(sigmoid(logit(p) + d)) == mean(labels)."""
    labels = np.asarray(labels, dtype=np.float64).reshape(-1)
    target = labels.mean() if labels.size else float("nan")
    if not 0.0 < target < 1.0:
        raise CalibrationError(
            f"cannot calibrate on {labels.size} rows with click rate {target}: the rows need both clicks and "
            "non-clicks"
        )
    # Newton's steps, kept inside a bracket of the root (the mean rises with the shift): where the predictions
    # are saturated (a model that fit a few rows exactly: every slope ~1e-7), a Newton step jumps by millions of
    # logits and the next one back, and the shift it stopped at made every prediction 1.0; such a step is a
    # bisection of the bracket instead, and the search goes on until the level is reached.
    logits, shift = _logits(probabilities), 0.0
    low, high = -_SHIFT_BOUND, _SHIFT_BOUND
    bisected = False
    for step in range(_MAX_STEPS):
        shifted = _sigmoid(logits + shift)
        error = float(shifted.mean()) - target
        if step >= _NEWTON_STEPS and (abs(error) <= _LEVEL_TOLERANCE * target or high - low <= _EPSILON):
            break
        if error > 0:
            high = min(high, shift)
        else:
            low = max(low, shift)
        slope = float(np.mean(shifted * (1.0 - shifted)))
        candidate = shift - error / max(slope, _EPSILON)
        if not low < candidate < high:
            candidate, bisected = 0.5 * (low + high), True
        shift = candidate
        if step + 1 == _NEWTON_STEPS and not bisected:
            break
    return shift


def platt_scaling(labels: np.ndarray, probabilities: np.ndarray) -> tuple[float, float]:
    """(scale, shift) minimizing the logloss of sigmoid(scale * logit(p) + shift) on the rows (Newton's method on
    the two parameters, from (1, 0)). Raises CalibrationError when the rows lack a class or the fit does not give
    a positive scale (which would reverse the ranking)."""
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    if not 0.0 < (y.mean() if y.size else float("nan")) < 1.0:
        raise CalibrationError(f"cannot fit a scale on {y.size} rows without both clicks and non-clicks")
    design = np.stack([_logits(probabilities), np.ones_like(y)], axis=1)
    weights = np.array([1.0, 0.0])
    for _ in range(25):
        fitted = _sigmoid(design @ weights)
        gradient = design.T @ (fitted - y)
        hessian = (design * (fitted * (1.0 - fitted))[:, None]).T @ design + 1e-9 * np.eye(2)
        step = np.linalg.solve(hessian, gradient)
        weights -= step
        if np.abs(step).max() < 1e-10:
            break
    scale, shift = float(weights[0]), float(weights[1])
    if not (np.isfinite([scale, shift]).all() and scale > 0):
        raise CalibrationError(f"the held-out rows gave a scale of {scale}: their scores do not rank their clicks")
    return scale, shift


def predictions_of(model: keras.Model, batches: Iterable[tuple[Any, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """(labels, predictions) of `batches` of (features, labels)."""
    labels, predictions = [], []
    for features, batch_labels in batches:
        predictions.append(keras.ops.convert_to_numpy(model(features, training=False)).reshape(-1))
        labels.append(keras.ops.convert_to_numpy(batch_labels).reshape(-1))
    if not labels:
        raise CalibrationError("no rows to calibrate on")
    return np.concatenate(labels).astype(np.float64), np.concatenate(predictions).astype(np.float64)


def calibrate(model: keras.Model, training_batches: Iterable[tuple[Any, Any]],
              held_out_batches: Iterable[tuple[Any, Any]] | None, min_clicks: int) -> dict[str, float]:
    """Calibrates the model on half the held-out rows (see the module's text), or on the training rows' level
    when `held_out_batches` is None or the half holds fewer than `min_clicks` clicks or non-clicks. Returns what
    it did: `held_out` (1 or 0), `scale`, `shift`, `rows`, `label_mean`, `prediction_mean_before` and
    `_after` on the rows it fitted, and for the held-out fit `check_rows` and `check_logloss_before` /
    `_after` on the other half."""
    if held_out_batches is not None:
        y, p = predictions_of(model, held_out_batches)
        fit = np.arange(len(y)) % 2 == 0
        clicks = int(y[fit].sum())
        head = getattr(model, "head", None)
        if min(clicks, int(fit.sum()) - clicks) >= min_clicks:
            scalable = isinstance(head, keras.layers.Dense) and getattr(head, "bias", None) is not None
            try:
                scale, shift = platt_scaling(y[fit], p[fit]) if scalable else (1.0, level_shift(y[fit], p[fit]))
            except CalibrationError:  # scores that do not rank the held-out clicks: their level only
                scale, shift = 1.0, level_shift(y[fit], p[fit])
            if scalable:
                head.kernel.assign(keras.ops.convert_to_numpy(head.kernel) * np.asarray(scale, head.kernel.dtype))
                head.bias.assign(keras.ops.convert_to_numpy(head.bias) * np.asarray(scale, head.bias.dtype)
                                 + np.asarray(shift, head.bias.dtype))
            else:
                bias = logit_bias(model)
                bias.assign(keras.ops.convert_to_numpy(bias) + np.asarray(shift, dtype=bias.dtype))
            calibrated = _sigmoid(scale * _logits(p) + shift)
            check = ~fit
            return {"held_out": 1.0, "scale": scale, "shift": shift, "rows": float(fit.sum()),
                    "label_mean": float(y[fit].mean()), "prediction_mean_before": float(p[fit].mean()),
                    "prediction_mean_after": float(calibrated[fit].mean()), "check_rows": float(check.sum()),
                    "check_logloss_before": _logloss(y[check], p[check]),
                    "check_logloss_after": _logloss(y[check], calibrated[check])}
    return {"held_out": 0.0, "scale": 1.0, **calibrate_level(model, training_batches)}


def calibrate_level(model: keras.Model, batches: Iterable[tuple[Any, Any]]) -> dict[str, float]:
    """Predicts `batches` of (features, labels), shifts the model's output bias so their mean prediction equals
    their mean label, and returns the shift and the levels before and after."""
    y, p = predictions_of(model, batches)
    shift = level_shift(y, p)
    bias = logit_bias(model)
    bias.assign(keras.ops.convert_to_numpy(bias) + np.asarray(shift, dtype=bias.dtype))
    return {"shift": shift, "rows": float(len(y)), "label_mean": float(y.mean()),
            "prediction_mean_before": float(p.mean()),
            "prediction_mean_after": float(_sigmoid(_logits(p) + shift).mean())}


def _logloss(labels: np.ndarray, probabilities: np.ndarray) -> float:
    p = np.clip(probabilities, _EPSILON, 1 - _EPSILON)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log1p(-p)))


def _logits(probabilities: np.ndarray) -> np.ndarray:
    p = np.clip(np.asarray(probabilities, dtype=np.float64).reshape(-1), _EPSILON, 1 - _EPSILON)
    return np.log(p) - np.log1p(-p)


def _sigmoid(logits: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(logits, -500.0, 500.0)))
