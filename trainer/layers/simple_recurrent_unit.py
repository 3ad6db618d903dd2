"""The simple recurrent unit (SRU, Lei et al. 2018): a recurrent layer whose recurrence is elementwise."""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from trainer.arguments import require_integer


@keras.saving.register_keras_serializable(package="ctr")
class SimpleRecurrentUnit(keras.layers.Layer):
    """inputs [batch, length, dim] (and an optional bool mask [batch, length]) -> states [batch, length, units].

    Every matrix product is one product over the whole sequence; step t only does elementwise work:

        x~_t = W x_t,  f_t = sigmoid(W_f x_t + v_f * c_{t-1} + b_f),  r_t = sigmoid(W_r x_t + v_r * c_{t-1} + b_r)
        c_t = f_t * c_{t-1} + (1 - f_t) * x~_t,  h_t = r_t * c_t + (1 - r_t) * x'_t

    where x'_t (the highway input) is x_t when dim == units and W' x_t otherwise. A masked step keeps c and
    outputs zeros, like keras.layers.GRU(return_sequences=True); padding may sit anywhere in the sequence.
    The loop over steps is unrolled (the length must be known when the layer is called).
    """

    def __init__(
        self,
        units: int,
        kernel_initializer: str | keras.initializers.Initializer = "glorot_uniform",
        kernel_regularizer: str | keras.regularizers.Regularizer | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        require_integer("units", units)
        self.units = int(units)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.supports_masking = True  # the output sequence keeps the input's mask

    def build(self, inputs_shape: tuple[int | None, ...]) -> None:
        dim = inputs_shape[-1]
        if len(inputs_shape) != 3 or dim is None:
            raise ValueError(
                f"SimpleRecurrentUnit needs inputs [batch, length, dim] with a known dim. "
                f"Received: inputs_shape={inputs_shape}"
            )
        self.projects_highway = dim != self.units
        num_blocks = 4 if self.projects_highway else 3
        self.kernel = self.add_weight(
            name="kernel", shape=(dim, num_blocks * self.units),
            initializer=self.kernel_initializer, regularizer=self.kernel_regularizer,
        )
        self.recurrent_weights = self.add_weight(name="recurrent_weights", shape=(2, self.units), initializer="zeros")
        self.bias = self.add_weight(name="bias", shape=(2, self.units), initializer="zeros")

    def call(self, inputs: Any, mask: Any = None) -> Any:
        projected = ops.matmul(inputs, self.kernel)
        blocks = ops.split(projected, 4 if self.projects_highway else 3, axis=-1)
        candidate, forget_input, reset_input = blocks[:3]
        highway = blocks[3] if self.projects_highway else inputs
        forget_weight, reset_weight = self.recurrent_weights[0], self.recurrent_weights[1]
        forget_bias, reset_bias = self.bias[0], self.bias[1]
        state = ops.zeros_like(candidate[:, 0])
        outputs = []
        for step in range(inputs.shape[1]):
            forget = ops.sigmoid(_affine(forget_input[:, step], forget_weight, state, forget_bias))
            reset = ops.sigmoid(_affine(reset_input[:, step], reset_weight, state, reset_bias))
            new_state = _mix(forget, state, candidate[:, step])
            output = _mix(reset, new_state, highway[:, step])
            if mask is None:
                state = new_state
            else:
                valid = ops.expand_dims(mask[:, step], -1)
                state = ops.where(valid, new_state, state)
                output = ops.where(valid, output, ops.zeros_like(output))
            outputs.append(output)
        return ops.stack(outputs, axis=1)

    def compute_output_shape(self, inputs_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        return (*inputs_shape[:-1], self.units)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            {
                "units": self.units,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
            }
        )
        return config


def _mix(gate: Any, kept: Any, new: Any) -> Any:
    """gate * kept + (1 - gate) * new."""
    return ops.add(ops.multiply(gate, kept), ops.multiply(ops.subtract(1.0, gate), new))


def _affine(projected: Any, weight: Any, state: Any, bias: Any) -> Any:
    """projected + weight * state + bias."""
    return ops.add(ops.add(projected, ops.multiply(weight, state)), bias)
