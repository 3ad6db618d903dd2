"""AUGRU, DIEN's interest evolution layer (Zhou et al. 2019): a GRU whose update gate is scaled by attention."""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from trainer.arguments import require_integer


@keras.saving.register_keras_serializable(package="ctr")
class AttentionalUpdateGRU(keras.layers.Layer):
    """`layer(inputs, attention, mask)`: inputs [batch, length, dim], attention [batch, length] (one weight per
    step), optional bool mask [batch, length] -> the last state [batch, units].

        z_t = sigmoid(W_z x_t + b_z + U_z h_{t-1} + c_z),  r_t = sigmoid(W_r x_t + b_r + U_r h_{t-1} + c_r)
        h~_t = tanh(W_h x_t + b_h + r_t * (U_h h_{t-1} + c_h))
        u_t = a_t * z_t,  h_t = (1 - u_t) * h_{t-1} + u_t * h~_t

    A step with attention 0 leaves the state unchanged, so behaviours unrelated to the target barely move the
    interest. Masked steps leave it unchanged too; the state starts at zeros. The loop over steps is unrolled
    (the length must be known when the layer is called).
    """

    def __init__(
        self,
        units: int,
        kernel_initializer: str | keras.initializers.Initializer = "glorot_uniform",
        recurrent_initializer: str | keras.initializers.Initializer = "orthogonal",
        kernel_regularizer: str | keras.regularizers.Regularizer | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        require_integer("units", units)
        self.units = int(units)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.recurrent_initializer = keras.initializers.get(recurrent_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.supports_masking = True  # takes the sequence's mask; the last state has none

    def build(self, inputs_shape: tuple[int | None, ...], attention_shape: tuple[int | None, ...]) -> None:
        if len(inputs_shape) != 3 or inputs_shape[-1] is None or tuple(attention_shape)[1:] != tuple(inputs_shape)[1:2]:
            raise ValueError(
                "AttentionalUpdateGRU needs inputs [batch, length, dim] with a known dim and attention "
                f"[batch, length]. Received: inputs_shape={inputs_shape}, attention_shape={attention_shape}"
            )
        gates = 3 * self.units
        self.kernel = self.add_weight(
            name="kernel", shape=(inputs_shape[-1], gates),
            initializer=self.kernel_initializer, regularizer=self.kernel_regularizer,
        )
        self.recurrent_kernel = self.add_weight(
            name="recurrent_kernel", shape=(self.units, gates),
            initializer=self.recurrent_initializer, regularizer=self.kernel_regularizer,
        )
        self.bias = self.add_weight(name="bias", shape=(gates,), initializer="zeros")
        self.recurrent_bias = self.add_weight(name="recurrent_bias", shape=(gates,), initializer="zeros")

    def call(self, inputs: Any, attention: Any, mask: Any = None) -> Any:
        projected = ops.add(ops.matmul(inputs, self.kernel), self.bias)  # all steps at once
        attention = ops.cast(attention, projected.dtype)
        state = ops.zeros_like(projected[:, 0, : self.units])
        for step in range(inputs.shape[1]):
            update_input, reset_input, candidate_input = ops.split(projected[:, step], 3, axis=-1)
            recurrent = ops.add(ops.matmul(state, self.recurrent_kernel), self.recurrent_bias)
            update_recurrent, reset_recurrent, candidate_recurrent = ops.split(recurrent, 3, axis=-1)
            update = ops.sigmoid(ops.add(update_input, update_recurrent))
            reset = ops.sigmoid(ops.add(reset_input, reset_recurrent))
            candidate = ops.tanh(ops.add(candidate_input, ops.multiply(reset, candidate_recurrent)))
            update = ops.multiply(ops.expand_dims(attention[:, step], -1), update)
            new_state = ops.add(state, ops.multiply(update, ops.subtract(candidate, state)))  # (1 - u) h + u h~
            if mask is not None:
                new_state = ops.where(ops.expand_dims(mask[:, step], -1), new_state, state)
            state = new_state
        return state

    def compute_mask(self, inputs: Any, previous_mask: Any = None) -> None:
        return None

    def compute_output_shape(
        self, inputs_shape: tuple[int | None, ...], attention_shape: tuple[int | None, ...]
    ) -> tuple[int | None, ...]:
        return (inputs_shape[0], self.units)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            {
                "units": self.units,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "recurrent_initializer": keras.initializers.serialize(self.recurrent_initializer),
                "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
            }
        )
        return config
