"""Python's garbage collections in the step worker, moved out of the minute's path.

CPython collects reference cycles whenever enough objects were allocated since the last collection, in whatever
thread allocates, and stops the whole process while it runs. In the step worker such a collection lands in a
minute's steps, and one that frees what a step left behind (Keras' and tf.data's objects of a training, whose
finalizers release TensorFlow resources) took 1.9 s under bench-freshness: a generation-1 collection at 1.94 s
during a cold start, and one at 1.86 s between a steady minute's export_delta and gate (its publish came 2.3 s
later than its neighbours'). So, with `incremental.worker_idle_gc` on (the default), the worker:
- turns CPython's automatic collections off;
- collects (a full collection) when it is idle: after warming up, IDLE_DELAY_S after a run's last step or a
  failed step when no step runs, and at least every MAX_INTERVAL_S when no step runs (validation on arrival
  and a paused DAG still allocate);
- collects at a run's end when the run before it ended with no collection after it (no idle time came), or
  when none came for MAX_INTERVAL_S: a worker catching up on a backlog runs one minute after another, and
  otherwise collected only when a poll happened to fall between two steps (under bench-worker-memory's
  back-to-back minutes its resident memory rose and fell between 1.4 and 3.0 GiB, docs/review.md). Catching up,
  it collects every second run;
- logs every collection that takes longer than SLOW_S, with its generation, and every idle one.
Reference counting still frees everything that is not in a cycle at once; cycles wait for the next idle
collection, at most a run's length plus IDLE_DELAY_S. With it off, CPython collects as usual and the slow
collections are still logged.
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
IDLE_DELAY_S = 3.0  # after a run's end: the model server loads what was just published first
MAX_INTERVAL_S = 120.0


class IdleCollector:
    def __init__(self, clock: Callable[[], float] = time.monotonic, automatic: bool = False) -> None:
        self._clock = clock
        self.automatic = automatic  # CPython's automatic collections stay on (only the logging is added)
        self._started: dict[int, float] = {}  # thread -> when its collection started
        self._idle = threading.local()
        self._lock = threading.Lock()
        self._disabled = False
        self.last_collection = clock()
        self.ended_at: float | None = None  # a run ended then and nothing was collected since
        self.slow: list[tuple[int, float]] = []  # (generation, seconds) of the slow collections outside idle time

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        if not self.automatic and gc.isenabled():
            gc.disable()
            self._disabled = True

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        if self._disabled:
            gc.enable()
            self._disabled = False

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        ident = threading.get_ident()
        if phase == "start":
            self._started[ident] = time.perf_counter()
            return
        started = self._started.pop(ident, None)
        if started is None or getattr(self._idle, "active", False):
            return
        seconds = time.perf_counter() - started
        if seconds >= SLOW_S:
            with self._lock:
                self.slow = [*self.slow[-99:], (int(info.get("generation", -1)), seconds)]
            log.info("garbage collection of generation %d stopped the worker for %.2f s (%d objects collected)",
                     info.get("generation", -1), seconds, info.get("collected", 0))

    def run_ended(self) -> None:
        """A run's last step (or a failed step) ended: collect once IDLE_DELAY_S have passed with no step."""
        self.ended_at = self._clock()

    def due(self) -> str | None:
        """Why an idle collection is due now (the caller knows that no step runs), or None."""
        if self.automatic:
            return None
        now = self._clock()
        if self.ended_at is not None and now - self.ended_at >= IDLE_DELAY_S:
            return "after a run"
        if now - self.last_collection >= MAX_INTERVAL_S:
            return f"{MAX_INTERVAL_S:.0f} s since the last one"
        return None

    def overdue(self) -> str | None:
        """Why a collection is due at a run's end although the next run may follow at once, or None: the run
        before this one ended and no collection came after it (a worker catching up leaves no idle time for
        `due`), or none came for MAX_INTERVAL_S."""
        if self.automatic:
            return None
        if self.ended_at is not None:
            return "a run's end, the run before it not collected after"
        since = self._clock() - self.last_collection
        return f"a run's end, {since:.0f} s since the last one" if since >= MAX_INTERVAL_S else None

    def collect_idle(self, why: str) -> dict[str, float]:
        """A full collection; returns its seconds and the objects it freed (also logged)."""
        self._idle.active = True
        started = time.perf_counter()
        try:
            collected = gc.collect()
        finally:
            self._idle.active = False
        seconds = time.perf_counter() - started
        self.last_collection, self.ended_at = self._clock(), None
        log.info("idle (%s): full garbage collection in %.2f s, %d objects collected", why, seconds, collected)
        return {"seconds": seconds, "collected": collected}
