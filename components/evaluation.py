"""Offline evaluation and the two gates: the daily model's quality gate and a minute delta's gate."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from components.config import GateConfig, IncrementalConfig


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve with ties counted as one half (Mann-Whitney U)."""
    labels = np.asarray(labels).astype(bool).ravel()
    scores = np.asarray(scores, dtype=np.float64).ravel()
    if labels.shape != scores.shape:
        raise ValueError(f"roc_auc: {labels.shape[0]} labels but {scores.shape[0]} scores")
    num_positive = int(labels.sum())
    num_negative = len(labels) - num_positive
    if num_positive == 0 or num_negative == 0:
        raise ValueError(f"roc_auc needs both classes, got {num_positive} positives and {num_negative} negatives")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores), dtype=np.float64)
    # Average ranks (1-based) over runs of tied scores.
    boundaries = np.flatnonzero(np.diff(sorted_scores)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [len(scores)]])
    average = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(average, ends - starts)
    return float((ranks[labels].sum() - num_positive * (num_positive + 1) / 2.0) / (num_positive * num_negative))


def log_loss(labels: np.ndarray, probabilities: np.ndarray, eps: float = 1e-7) -> float:
    y = np.asarray(labels, dtype=np.float64).ravel()
    p = np.clip(np.asarray(probabilities, dtype=np.float64).ravel(), eps, 1.0 - eps)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log(1.0 - p)))


@dataclass(frozen=True)
class Evaluation:
    auc: float
    logloss: float
    mean_prediction: float
    mean_label: float
    num_examples: int

    @property
    def label_mean_standard_error(self) -> float:
        """The standard error of the held-out click rate as an estimate of the traffic's: sqrt(p (1 - p) / n)."""
        p = min(max(self.mean_label, 0.0), 1.0)
        return float(np.sqrt(p * (1.0 - p) / max(self.num_examples, 1)))

    @property
    def auc_standard_error(self) -> float:
        """The standard error of the AUC from its value and the numbers of positives and negatives (Hanley and
        McNeil 1982): about 0.1 on a slice with 8 clicks, under 0.01 with thousands of each."""
        return self.auc_standard_error_at(self.auc)

    def auc_standard_error_at(self, auc: float) -> float:
        """Hanley and McNeil's standard error of an AUC of `auc` on this slice's positives and negatives. At an
        AUC of 0 or 1 it is 0 whatever the slice's size (one click ranked last on 8 rows gives 0 and a standard
        error of 0), so a test of whether an AUC is below a threshold also takes it at the threshold."""
        positives = round(min(max(self.mean_label, 0.0), 1.0) * self.num_examples)
        negatives = self.num_examples - positives
        if positives == 0 or negatives == 0:
            return float("inf")
        a = min(max(auc, 0.0), 1.0)
        q1, q2 = a / (2.0 - a), 2.0 * a * a / (1.0 + a)
        variance = (a * (1 - a) + (positives - 1) * (q1 - a * a) + (negatives - 1) * (q2 - a * a)) / (
            positives * negatives)
        return float(np.sqrt(max(variance, 0.0)))

    @property
    def calibration_error(self) -> float:
        """|mean prediction - mean label| / mean label."""
        return abs(self.mean_prediction - self.mean_label) / max(self.mean_label, 1e-12)

    def metrics(self) -> dict[str, float]:
        return {**asdict(self), "calibration_error": self.calibration_error}


def evaluate(labels: np.ndarray, probabilities: np.ndarray) -> Evaluation:
    return Evaluation(
        auc=roc_auc(labels, probabilities),
        logloss=log_loss(labels, probabilities),
        mean_prediction=float(np.mean(probabilities)),
        mean_label=float(np.mean(labels)),
        num_examples=int(np.size(labels)),
    )


class QualityGateError(RuntimeError):
    """A model failed the quality gate and must not be published."""


def check_gate(evaluation: Evaluation, gate: GateConfig, baseline: dict | None = None) -> list[str]:
    """The reasons the model fails the gate; empty when it passes. `baseline`: the comparison with the run's
    baseline on the same rows (`baseline_auc`, `lift_auc`, `lift_auc_ci95`), when there is one."""
    failures = []
    if not np.isfinite([evaluation.auc, evaluation.logloss, evaluation.mean_prediction]).all():
        failures.append(f"non-finite metrics: {evaluation.metrics()}")
    # The larger of the standard errors at the AUC measured and at the threshold: at an AUC of 0 or 1 the first
    # is 0 however few the rows (Evaluation.auc_standard_error_at).
    auc_noise = gate.auc_noise_z * max(evaluation.auc_standard_error, evaluation.auc_standard_error_at(gate.min_auc))
    if evaluation.auc + auc_noise < gate.min_auc:
        failures.append(
            f"AUC {evaluation.auc:.4f} is below gate.min_auc={gate.min_auc} by more than gate.auc_noise_z="
            f"{gate.auc_noise_z} standard errors ({auc_noise:.4f}) of an AUC on {evaluation.num_examples} held-out "
            f"rows with a click rate of {evaluation.mean_label:.4f}: the model ranks clicks little better than "
            "chance. Look at the run's training curve, the features' admission (features.min_count), and "
            "whether the held-out rows carry the signal the training rows do")
    if evaluation.logloss > gate.max_logloss:
        failures.append(f"logloss {evaluation.logloss:.4f} is above gate.max_logloss={gate.max_logloss}")
    noise = gate.calibration_noise_z * evaluation.label_mean_standard_error
    if evaluation.calibration_error > gate.max_calibration_error and \
            abs(evaluation.mean_prediction - evaluation.mean_label) > noise:
        failures.append(
            f"calibration error {evaluation.calibration_error:.3f} (mean prediction {evaluation.mean_prediction:.4f} "
            f"vs mean label {evaluation.mean_label:.4f}) is above "
            f"gate.max_calibration_error={gate.max_calibration_error}, and the difference is more than "
            f"gate.calibration_noise_z={gate.calibration_noise_z} standard errors ({noise:.4f}) of the click rate of "
            f"{evaluation.num_examples} held-out rows: the model's level is off on later traffic. When the click rate "
            "drifts from the training rows to the held-out ones, a longer interval or more recent training rows "
            "help; train.calibrate=true (the default) fits the level on the training rows"
        )
    if baseline is not None and gate.min_lift_auc > -1:
        low, high = baseline["lift_auc_ci95"]
        if high < gate.min_lift_auc:
            failures.append(
                f"AUC {evaluation.auc:.4f} is {-baseline['lift_auc']:.4f} below its own baseline's "
                f"{baseline['baseline_auc']:.4f} (a hashed logistic regression on the same rows), and even the top of "
                f"the 95 % interval of the difference ({low:+.4f} to {high:+.4f}) is below "
                f"gate.min_lift_auc={gate.min_lift_auc}: the model learned less than a linear model on these rows. "
                "Look at the run's training curve (an epoch count or batch size that stopped it early), the "
                "features' admission (features.min_count), or try train.model=wide_deep")
    return failures


class DeltaGateError(RuntimeError):
    """A delta failed its gate: it is not published and serving stays on the last good version."""


@dataclass(frozen=True)
class DeltaGate:
    failures: list[str]
    max_embedding_norm: float  # the largest L2 norm of a changed embedding row
    logloss_increase: float  # holdout logloss of the child minus the parent's

    @property
    def passed(self) -> bool:
        return not self.failures


def check_delta_gate(weight_specs: list[dict], arrays: dict[str, np.ndarray], holdout_logloss: float,
                     parent_holdout_logloss: float, config: IncrementalConfig) -> DeltaGate:
    """A delta passes when every changed value is finite, every changed embedding row is within
    `max_embedding_norm`, and the child's holdout logloss is at most `max_logloss_increase` over the parent's.
    `weight_specs` and `arrays` as components.delta.read_delta returns them."""
    from components.delta import rows_name, values_name

    failures = []
    non_finite = [spec["path"] for i, spec in enumerate(weight_specs) if not np.isfinite(arrays[values_name(i)]).all()]
    if non_finite:
        failures.append(f"non-finite values in {non_finite}")
    max_norm = 0.0
    for index, spec in enumerate(weight_specs):
        values = arrays[values_name(index)]
        if spec["path"].endswith("embeddings") and len(arrays[rows_name(index)]) and values.ndim == 2:
            max_norm = max(max_norm, float(np.nanmax(np.linalg.norm(values, axis=1))))
    for name, values in arrays.items():  # a tiered table's rows (components.delta.served_weight_arrays)
        if name.startswith("tiered_values_") and len(values):
            if not np.isfinite(values).all():
                failures.append(f"non-finite values in {name}")
            max_norm = max(max_norm, float(np.nanmax(np.linalg.norm(values, axis=1))))
    if not max_norm <= config.max_embedding_norm:
        failures.append(f"a changed embedding row has L2 norm {max_norm:.2f} > {config.max_embedding_norm} "
                        "(incremental.max_embedding_norm)")
    increase = holdout_logloss - parent_holdout_logloss
    if not increase <= config.max_logloss_increase:
        failures.append(f"holdout logloss {holdout_logloss:.4f} is {increase:+.4f} over the parent's "
                        f"{parent_holdout_logloss:.4f}, more than {config.max_logloss_increase} "
                        "(incremental.max_logloss_increase)")
    return DeltaGate(failures, max_norm, increase)
