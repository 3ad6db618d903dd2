"""The cross layer of DCNv2 (Wang et al. 2021): x_{l+1} = x0 * (W x_l + b) + x_l."""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from trainer.arguments import require_integer


@keras.saving.register_keras_serializable(package="ctr")
class FeatureCross(keras.layers.Layer):
    """One explicit feature-interaction layer of a DCNv2 cross network.

    Called as `layer(x0, x)`: `x0` is the network's input, `x` the output of the previous cross layer
    (`x0` itself for the first layer; `layer(x0)` means the same). Both are [batch, width].

    With `projection_dim` set, W is the low-rank product U V (U: [width, projection_dim],
    V: [projection_dim, width]), which costs 2 * width * projection_dim weights instead of width ** 2.
    """

    def __init__(
        self,
        projection_dim: int | None = None,
        use_bias: bool = True,
        kernel_initializer: str | keras.initializers.Initializer = "glorot_uniform",
        bias_initializer: str | keras.initializers.Initializer = "zeros",
        kernel_regularizer: str | keras.regularizers.Regularizer | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        require_integer("projection_dim", projection_dim, allow_none=True)
        self.projection_dim = projection_dim
        self.use_bias = bool(use_bias)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        width = input_shape[-1]
        if width is None:
            raise ValueError(
                f"FeatureCross needs a known last input dimension. Received: input_shape={input_shape}"
            )
        if self.projection_dim is None:
            self.kernel = self.add_weight(
                name="kernel", shape=(width, width),
                initializer=self.kernel_initializer, regularizer=self.kernel_regularizer,
            )
        else:
            self.down_kernel = self.add_weight(
                name="down_kernel", shape=(width, self.projection_dim),
                initializer=self.kernel_initializer, regularizer=self.kernel_regularizer,
            )
            self.up_kernel = self.add_weight(
                name="up_kernel", shape=(self.projection_dim, width),
                initializer=self.kernel_initializer, regularizer=self.kernel_regularizer,
            )
        if self.use_bias:
            self.bias = self.add_weight(name="bias", shape=(width,), initializer=self.bias_initializer)

    def call(self, x0: Any, x: Any = None) -> Any:
        if x is None:
            x = x0
        if self.projection_dim is None:
            mixed = ops.matmul(x, self.kernel)
        else:
            mixed = ops.matmul(ops.matmul(x, self.down_kernel), self.up_kernel)
        if self.use_bias:
            mixed = ops.add(mixed, self.bias)
        return ops.add(ops.multiply(x0, mixed), x)

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        return input_shape

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            {
                "projection_dim": self.projection_dim,
                "use_bias": self.use_bias,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
            }
        )
        return config
