"""DIN's activation unit (Zhou et al. 2018): attention of a target item over a behaviour sequence."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
from keras import ops

from trainer.arguments import require_integer_list


@keras.saving.register_keras_serializable(package="ctr")
class TargetAttention(keras.layers.Layer):
    """Weights each behaviour by its relevance to the target and pools: `layer(target, behaviours, mask)`.

    target: [batch, dim]; behaviours: [batch, length, dim]; mask: bool [batch, length], False at padding.
    Output: [batch, dim], sum over positions of weight * behaviour; with `return_attention_scores=True` also the
    weights [batch, length] (0 at padding).

    The weight of position t is an MLP (`hidden_units`, then one output) of [target, b_t, target - b_t,
    target * b_t]. DIN keeps the raw scores, so that the pooled vector's size carries how strongly the history
    matches (`use_softmax=False`); DIEN normalizes them over the valid positions (`use_softmax=True`), and a
    history of padding only then pools to zeros.
    """

    def __init__(
        self,
        hidden_units: Sequence[int] = (80, 40),
        activation: str = "relu",
        use_softmax: bool = False,
        kernel_initializer: str | keras.initializers.Initializer = "glorot_uniform",
        kernel_regularizer: str | keras.regularizers.Regularizer | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        require_integer_list("hidden_units", hidden_units)
        if not isinstance(use_softmax, bool):
            raise ValueError(f"`use_softmax` must be True or False. Received: use_softmax={use_softmax!r}")
        self.hidden_units = [int(u) for u in hidden_units]
        self.activation = keras.activations.get(activation)
        self.use_softmax = use_softmax
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.supports_masking = True  # takes the history's mask; the pooled output has none

    def build(self, target_shape: tuple[int | None, ...], behaviours_shape: tuple[int | None, ...]) -> None:
        dim = target_shape[-1]
        if len(behaviours_shape) != 3 or behaviours_shape[-1] != dim or dim is None:
            raise ValueError(
                "TargetAttention needs target [batch, dim] and behaviours [batch, length, dim] of the same dim. "
                f"Received: target_shape={target_shape}, behaviours_shape={behaviours_shape}"
            )
        self.kernels, self.biases = [], []
        width = 4 * dim
        for index, units in enumerate([*self.hidden_units, 1]):
            self.kernels.append(
                self.add_weight(
                    name=f"kernel_{index}", shape=(width, units),
                    initializer=self.kernel_initializer, regularizer=self.kernel_regularizer,
                )
            )
            self.biases.append(self.add_weight(name=f"bias_{index}", shape=(units,), initializer="zeros"))
            width = units

    def call(
        self, target: Any, behaviours: Any, mask: Any = None, return_attention_scores: bool = False
    ) -> Any:
        query = ops.broadcast_to(ops.expand_dims(target, 1), ops.shape(behaviours))
        hidden = ops.concatenate(
            [query, behaviours, ops.subtract(query, behaviours), ops.multiply(query, behaviours)], axis=-1
        )
        for kernel, bias in zip(self.kernels[:-1], self.biases[:-1], strict=True):
            hidden = self.activation(ops.add(ops.matmul(hidden, kernel), bias))
        # Scores in float32: a masked softmax in bfloat16 loses the small weights.
        scores = ops.cast(ops.squeeze(ops.add(ops.matmul(hidden, self.kernels[-1]), self.biases[-1]), -1), "float32")
        valid = ops.ones_like(scores) if mask is None else ops.cast(mask, "float32")
        if self.use_softmax:
            scores = ops.softmax(ops.where(ops.cast(valid, "bool"), scores, -1e9), axis=-1)
        weights = ops.cast(ops.multiply(scores, valid), self.compute_dtype)
        pooled = ops.einsum("bt,btd->bd", weights, behaviours)
        return (pooled, weights) if return_attention_scores else pooled

    def compute_mask(self, inputs: Any, previous_mask: Any = None) -> None:
        return None

    def compute_output_shape(
        self, target_shape: tuple[int | None, ...], behaviours_shape: tuple[int | None, ...]
    ) -> tuple[int | None, ...]:
        return tuple(target_shape)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            {
                "hidden_units": list(self.hidden_units),
                "activation": keras.activations.serialize(self.activation),
                "use_softmax": self.use_softmax,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
            }
        )
        return config
