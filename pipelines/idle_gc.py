"""Python's full garbage collections in the step worker, moved out of the minute's path.

The step worker holds TensorFlow, Keras, Spark Connect's client, great-expectations and a model for hours, a
heap of millions of objects. CPython's collector scans the whole heap now and then (a generation-2 collection),
whenever a step happens to allocate enough: the whole process stops while it runs. So the worker:
- logs every collection that takes longer than SLOW_S, with its generation (`IdleCollector.install`);
- after its warm-up, and when a run's last step (or a failed step) has ended and no other step runs, collects
  everything, then freezes what survived (`gc.freeze`: CPython's collections skip frozen objects), so that the
  collections during the next run only scan what that run allocated. The next idle collection unfreezes
  first, so cycles that became garbage among the frozen objects are still collected, one minute later.
`incremental.worker_idle_gc=false` leaves CPython's collector as it is (only the logging stays).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

SLOW_S = 0.1  # collections at least this long are logged


class IdleCollector:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._started: dict[int, float] = {}  # thread -> when its collection started
        self._idle = threading.local()
        self._lock = threading.Lock()
        self.slow: list[tuple[int, float]] = []  # (generation, seconds) of the slow collections outside idle time

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        ident = threading.get_ident()
        if phase == "start":
            self._started[ident] = self._clock()
            return
        started = self._started.pop(ident, None)
        if started is None or getattr(self._idle, "active", False):
            return
        seconds = self._clock() - started
        if seconds >= SLOW_S:
            with self._lock:
                self.slow = [*self.slow[-99:], (int(info.get("generation", -1)), seconds)]
            log.info("garbage collection of generation %d stopped the worker for %.2f s (%d objects collected)",
                     info.get("generation", -1), seconds, info.get("collected", 0))

    def collect_idle(self, why: str) -> dict[str, float]:
        """A full collection, then every survivor frozen; returns its seconds and counts (also logged)."""
        self._idle.active = True
        started = self._clock()
        try:
            gc.unfreeze()
            collected = gc.collect()
            gc.freeze()
        finally:
            self._idle.active = False
        seconds = self._clock() - started
        frozen = gc.get_freeze_count()
        log.info("idle (%s): full garbage collection in %.2f s, %d objects collected, %d frozen", why, seconds,
                 collected, frozen)
        return {"seconds": seconds, "collected": collected, "frozen": frozen}
