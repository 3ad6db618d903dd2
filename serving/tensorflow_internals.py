"""The private names of TensorFlow serving reads, in one place, each with a test that fails if TensorFlow drops
or changes it (tests/serving/test_tensorflow_internals.py).

A ConcreteFunction's call binds its Python arguments to the signature before running its graph (about 0.07 ms
a call, docs/serving.md); the graph's own function (`_inference_function`, an AtomicFunction) runs it on flat
tensors. TensorFlow has no public name for that function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def preflattened_call(function: Any) -> Callable[[list[Any]], Any] | None:
    """The graph function of a ConcreteFunction, which takes the flat list of its inputs followed by its
    captured inputs; None where TensorFlow's internals differ (the caller then calls `function` itself)."""
    atomic = getattr(function, "_inference_function", None)
    call = getattr(atomic, "call_preflattened", None)
    return call if callable(call) else None
