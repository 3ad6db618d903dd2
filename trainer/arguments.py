"""Constructor-argument checks shared by layers, models, optimizers and callbacks.

Messages name the argument and echo the value, Keras-style: "`units` must be ... Received: units=0".
"""

from __future__ import annotations

from typing import Any

import numpy as np


def is_integer(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def require_integer(name: str, value: Any, minimum: int = 1, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not is_integer(value) or value < minimum:
        expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        if allow_none:
            expected += " or None"
        raise ValueError(f"`{name}` must be {expected}. Received: {name}={value!r}")


def require_integer_list(name: str, value: Any) -> None:
    if isinstance(value, str | bytes) or not hasattr(value, "__len__") or not len(value):
        valid = False
    else:
        valid = all(is_integer(item) and item >= 1 for item in value)
    if not valid:
        raise ValueError(
            f"`{name}` must be a non-empty list of positive integers. Received: {name}={value!r}"
        )


def require_positive_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating) or not value > 0:
        raise ValueError(f"`{name}` must be a positive number. Received: {name}={value!r}")
