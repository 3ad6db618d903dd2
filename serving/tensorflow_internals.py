"""The private names of TensorFlow serving reads, in one place, each with a test that fails if TensorFlow drops
or changes it (tests/serving/test_tensorflow_internals.py).

A ConcreteFunction's call binds its Python arguments to the signature before running its graph (about 0.07 ms
a call, docs/serving.md); the graph's own function (`_inference_function`, an AtomicFunction) runs it on flat
tensors. TensorFlow has no public name for that function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf


def preflattened_call(function: Any) -> Callable[[list[Any]], Any] | None:
    """The graph function of a ConcreteFunction, which takes the flat list of its inputs followed by its
    captured inputs; None where TensorFlow's internals differ (the caller then calls `function` itself)."""
    atomic = getattr(function, "_inference_function", None)
    call = getattr(atomic, "call_preflattened", None)
    return call if callable(call) else None


def direct_call(function: Any) -> Callable[..., Any]:
    """`function` (a ConcreteFunction) called as ConcreteFunction._call_flat calls it when no gradient tape
    records: its graph's function on the flattened arguments (nested ones, dicts included, in tf.nest's order,
    which is the signature's) and the captured variables; `function` itself where TensorFlow's internals
    differ."""
    call_preflattened = preflattened_call(function)
    if call_preflattened is None or not hasattr(function, "captured_inputs"):
        return function

    def call(*arguments: Any) -> Any:
        flat = arguments if all(isinstance(a, tf.Tensor) for a in arguments) else tf.nest.flatten(arguments)
        return call_preflattened([*flat, *function.captured_inputs])

    return call
