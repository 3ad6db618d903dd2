"""The optimizer: Adagrad everywhere, with its own learning rate for embedding tables.

Why Adagrad for every weight: an embedding row that a step did not touch must keep its exact value (cheap
steps on big tables, small model deltas), and Adagrad's state is per weight and only changes with that
weight's gradient, so a row-sparse gradient gives a row-sparse update. Adam's moments decay every step: every
row would move every step. One optimizer (not one per variable group) keeps `fit`, gradient accumulation,
XLA and saving stock Keras on every backend.
"""

from __future__ import annotations

from typing import Any

import keras

from trainer.arguments import require_positive_number

# Variables with this name get `embedding_learning_rate`: CategoricalEmbedding's and keras Embedding's tables.
EMBEDDING_VARIABLE_NAME = "embeddings"
# Keras' default (0.1, from TF1) damps the small per-row gradients of embedding tables: on 40 K planted-signal
# rows (tests/trainer/synthetic.py), 3 epochs, eval AUC was 0.66 with 0.1 and 0.88 with 1e-4 (close to
# PyTorch's 0); Adam at 1e-3 reached 0.89.
INITIAL_ACCUMULATOR_VALUE = 1e-4
# What updates the weights that are not tables' (dense layers, cross layers, attention): "adagrad" as the tables,
# or "adam" (Keras' Adam, moments for those weights only: the tables stay row-sparse either way).
DENSE_OPTIMIZERS = ("adagrad", "adam")
ADAM_BETA_1 = 0.9
ADAM_BETA_2 = 0.999
ADAM_EPSILON = 1e-7


@keras.saving.register_keras_serializable(package="ctr")
class EmbeddingAdagrad(keras.optimizers.Adagrad):
    """Adagrad whose variables named "embeddings" use `embedding_learning_rate`, the rest `learning_rate`.

    On the TensorFlow backend a gradient that arrives as `tf.IndexedSlices` (an `ops.take` lookup) is applied
    to the touched rows only: O(rows touched), where Keras' Adagrad also reads the whole accumulator every
    step. Duplicate row ids are summed first, as TF1's and PyTorch's sparse Adagrad do (Keras 3 squares each
    occurrence), so the step equals dense Adagrad's and micro-batching, whose accumulated gradients are
    dense, gives the same weights. `row_sparse_updates=False` applies such gradients densely (every row read
    and written; the values equal the sparse path's), to measure what the sparse path saves. The dedup
    (tf.unique) is the cost: on 2 CPU cores ~14 ms per 4096 x 26
    lookups, ~80 ms under XLA, whose sort-based unique is slow on CPU.
    """

    def __init__(
        self,
        learning_rate: float = 0.05,
        embedding_learning_rate: float = 0.05,
        initial_accumulator_value: float = INITIAL_ACCUMULATOR_VALUE,
        row_sparse_updates: bool = True,
        dense_optimizer: str = "adagrad",
        **kwargs: Any,
    ) -> None:
        super().__init__(
            learning_rate=learning_rate, initial_accumulator_value=initial_accumulator_value, **kwargs
        )
        require_positive_number("embedding_learning_rate", embedding_learning_rate)
        self.embedding_learning_rate = float(embedding_learning_rate)
        if not isinstance(row_sparse_updates, bool):
            raise ValueError(
                f"`row_sparse_updates` must be True or False. Received: row_sparse_updates={row_sparse_updates!r}"
            )
        self.row_sparse_updates = row_sparse_updates
        if dense_optimizer not in DENSE_OPTIMIZERS:
            raise ValueError(
                f"`dense_optimizer` must be one of {DENSE_OPTIMIZERS}. Received: dense_optimizer={dense_optimizer!r}"
            )
        self.dense_optimizer = dense_optimizer
        self._embedding_indices: set[int] = set()
        self._adam_moments: dict[int, tuple[Any, Any]] = {}

    def build(self, var_list: list[Any]) -> None:
        if self.built:
            return
        super().build(var_list)
        # By index: update_step may receive the backend's variable (a tf.Variable named "embeddings:0").
        self._embedding_indices = {
            self._get_variable_index(v) for v in var_list if v.name == EMBEDDING_VARIABLE_NAME
        }
        if self.dense_optimizer == "adam":
            for variable in var_list:
                index = self._get_variable_index(variable)
                if index not in self._embedding_indices:
                    self._adam_moments[index] = (
                        self.add_variable_from_reference(variable, "momentum"),
                        self.add_variable_from_reference(variable, "velocity"),
                    )

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        index = self._get_variable_index(variable)
        if index in self._adam_moments:
            self._adam_update_step(gradient, variable, learning_rate, *self._adam_moments[index])
            return
        if index in self._embedding_indices:
            learning_rate = self.embedding_learning_rate
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            if isinstance(gradient, tf.IndexedSlices):
                if self.row_sparse_updates:
                    self._sparse_update_step(gradient, variable, learning_rate)
                    return
                gradient = tf.convert_to_tensor(gradient)  # the whole table: for comparison only
        super().update_step(gradient, variable, learning_rate)

    def _sparse_update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        import tensorflow as tf

        accumulator = self._accumulators[self._get_variable_index(variable)]
        rows, positions = tf.unique(gradient.indices)
        values = tf.math.unsorted_segment_sum(
            tf.cast(gradient.values, variable.dtype), positions, tf.shape(rows)[0]
        )
        self.assign_add(accumulator, tf.IndexedSlices(tf.square(values), rows))
        scale = tf.sqrt(tf.gather(accumulator.value, rows) + self.epsilon)
        lr = tf.cast(learning_rate, variable.dtype)
        # Not `lr * values / scale`: in a tf.function, Grappler rewrites x / sqrt(y) as x * rsqrt(y), and Eigen's
        # vectorised rsqrt is not correctly rounded, so a row's new value would depend by an ulp on where it sits
        # in the batch's rows (which other rows the batch touched, and the table's layout). divide_no_nan is
        # not rewritten and divides exactly (scale > 0, so it never takes the "no nan" branch): each row's update
        # depends on its own gradient and accumulator alone, which is what lets a tiered table
        # (trainer/hot_tier.py) train bit for bit like the same table in memory.
        self.assign_sub(variable, tf.IndexedSlices(tf.math.divide_no_nan(lr * values, scale), rows))

    def _adam_update_step(self, gradient: Any, variable: Any, learning_rate: Any, m: Any, v: Any) -> None:
        """keras.optimizers.Adam's step (beta_1 0.9, beta_2 0.999), for a weight that is not a table's."""
        ops = keras.ops
        lr = ops.cast(learning_rate, variable.dtype)
        gradient = ops.cast(gradient, variable.dtype)
        step = ops.cast(self.iterations + 1, variable.dtype)
        alpha = lr * ops.sqrt(1 - ops.power(ADAM_BETA_2, step)) / (1 - ops.power(ADAM_BETA_1, step))
        self.assign_add(m, ops.multiply(ops.subtract(gradient, m), 1 - ADAM_BETA_1))
        self.assign_add(v, ops.multiply(ops.subtract(ops.square(gradient), v), 1 - ADAM_BETA_2))
        self.assign_sub(variable, ops.divide(ops.multiply(m, alpha), ops.add(ops.sqrt(v), ADAM_EPSILON)))

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config["dense_optimizer"] = self.dense_optimizer
        config["embedding_learning_rate"] = self.embedding_learning_rate
        config["row_sparse_updates"] = self.row_sparse_updates
        return config
