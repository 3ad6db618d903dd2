"""The hot tier's planner and the row map in C (trainer/native/hot_tier.c), compiled on first use
(components.native_build). trainer.hot_tier.NativePlanner and trainer.row_map.NativeRowMap drive it;
HotTierPlanner and RowMap, in numpy, do the same where it cannot be built.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

from components import native_build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "hot_tier.c"
COMPILE_FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC")
TOO_MANY_ROWS, NEGATIVE_ID = -1, -2  # hot_tier.c's CTR_PLAN_TOO_MANY_ROWS and CTR_PLAN_NEGATIVE_ID


def build() -> Path:
    """Compiles hot_tier.c if its library is not built yet; returns the library's path."""
    return native_build.build(SOURCE, COMPILE_FLAGS)


@functools.cache
def library() -> ctypes.PyDLL | None:
    """hot_tier.c's library, built on first use; None (logged once) where it cannot be built or loaded."""
    try:
        # PyDLL: calls keep Python's GIL. Each takes tens of microseconds; released, the GIL would pass to the
        # store's I/O threads and the producer would wait to take it back (up to the interpreter's switch interval).
        lib = ctypes.PyDLL(str(build()))
    except (RuntimeError, OSError) as err:
        logger.warning("native hot tier unavailable, plans and row maps are made in numpy: %s", err)
        return None
    pointer, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    lib.ctr_plan.restype = i64
    lib.ctr_plan.argtypes = [i64, i64, pointer, pointer, pointer, pointer, i64, i32, pointer, pointer, pointer]
    lib.ctr_map_lookup.restype = i64
    lib.ctr_map_lookup.argtypes = [pointer, i64, pointer, i64, pointer]
    lib.ctr_map_set.restype = i64
    lib.ctr_map_set.argtypes = [pointer, i64, pointer, pointer, i64]
    lib.ctr_map_remove.restype = i64
    lib.ctr_map_remove.argtypes = [pointer, i64, pointer, i64]
    lib.ctr_map_rehash.restype = None
    lib.ctr_map_rehash.argtypes = [pointer, i64, pointer, i64]
    return lib
