"""Rows of an embedding table variable, read without reading the whole table."""

from __future__ import annotations

from typing import Any

import keras
from keras import ops


def take_rows(table: Any, rows: Any) -> Any:
    """`ops.take(table, rows, axis=0)` for a table variable (autocast=False), [..., dim] for rows [...].

    On the TensorFlow backend it gathers from the variable itself (ResourceGather) instead of from a read of
    its value (ReadVariableOp, then a gather), which is what `ops.take` does. The two differ once a sparse op
    has written the variable, as the row-sparse optimizer (trainer.optimizers) does on the first step:
    TensorFlow then keeps the variable in copy-on-read mode, and every whole read copies the whole table.
    ResourceGather reads only the rows. Its gradient is the same `tf.IndexedSlices`. Other backends take."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.gather(table.value, rows)  # a tf.Variable: ResourceVariable.sparse_read
    return ops.take(table, rows, axis=0)
