"""Training metrics beside the loss: AUC, and prediction mean next to label mean as a calibration check."""

from __future__ import annotations

from typing import Any

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="ctr")
def prediction_mean(y_true: Any, y_pred: Any) -> Any:
    return ops.mean(ops.cast(y_pred, "float32"), axis=-1)


@keras.saving.register_keras_serializable(package="ctr")
def label_mean(y_true: Any, y_pred: Any) -> Any:
    return ops.cast(y_true, "float32")


@keras.saving.register_keras_serializable(package="ctr")
class ExampleCount(keras.metrics.Metric):
    """Number of examples seen since the last reset (per epoch in `fit`, per pass in `evaluate`).

    int32, exact up to 2**31 - 1 examples per epoch, and portable to JAX without x64 mode."""

    def __init__(self, name: str = "num_examples", **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        self.count = self.add_variable(shape=(), initializer="zeros", dtype="int32", name="count")

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        self.count.assign_add(ops.cast(ops.shape(y_pred)[0], "int32"))

    def result(self) -> Any:
        # A copy: Keras keeps the epoch's results while evaluation resets and reuses the variable.
        return ops.copy(self.count)


def ctr_metrics() -> list[Any]:
    return [
        keras.metrics.AUC(name="auc", num_thresholds=1000),
        keras.metrics.MeanMetricWrapper(prediction_mean, name="prediction_mean"),
        keras.metrics.MeanMetricWrapper(label_mean, name="label_mean"),
        ExampleCount(),
    ]
