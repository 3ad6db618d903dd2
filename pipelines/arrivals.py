"""Validation on arrival: the step worker validates each minute's raw partitions as soon as they are complete.

A minute run's validate step used to start after the run's sensor task and plan, 1.3-1.5 s after the minute
closed, and spend 2-2.5 s of CPU beside the samples step's Spark jobs on two cores. Its verdict depends only on
the partition's bytes and the suite, which are known as soon as the writer's completion marker lands (0.6-0.7 s
after the close with the live writer). So the step worker watches for the markers of the minutes that just
closed and validates their partitions then (components.validation.validate_arrived); the run's validate step
finds them validated (the same _VALIDATED marker, checked against the bytes' SHA-256 and the suite's version)
and only writes its report and Data Docs page. When both come to a partition at once, the step waits for the
validation under way instead of doing it again.

What it does not change: a partition that fails is left where it is, unmarked, and the run's validate step
validates it again, quarantines it and fails the run with its report, as before. Validation still happens in
the step worker for every minute, runs or not (a paused DAG's minutes too: about a second of one core per
60 K-row minute). `incremental.validate_on_arrival=false` leaves validation to the validate step alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

log = logging.getLogger(__name__)

POLL_S = 0.1


class ArrivalValidator:
    """Watches the minutes that closed within the last `incremental.wait_for_data_s` and validates each one's
    partitions once its source says it is complete (`Source.ready`), once per minute."""

    def __init__(self, config, clock: Callable[[], float] = time.time) -> None:
        from components.feature_spec import spec_for
        from components.layout import Layout
        from pipelines.sources import source_for

        self._config = config
        self._clock = clock
        self._layout = Layout(config.paths.root)
        self._source = source_for(config)
        self._datasets = self._source.datasets(spec_for(config))
        self._validators: dict[str, Any] = {}
        self._done: dict[datetime, float] = {}  # minute -> when its arrival was seen (clock seconds)
        self.validated: list[tuple[str, datetime, bool, float]] = []  # (dataset, minute, passed, seconds), last few

    def _watched(self, now: float) -> list[datetime]:
        """The minutes that closed at most wait_for_data_s ago (at least the newest closed one), oldest first."""
        wait = self._config.incremental.wait_for_data_s
        close = now // 60 * 60  # the newest closed minute's end
        minutes: list[datetime] = []
        while not minutes or close >= now - wait:
            minutes.append(datetime.fromtimestamp(close - 60, UTC))
            close -= 60
        return minutes[::-1]

    def poll(self) -> int:
        """Validates the watched minutes that became complete since the last poll; returns how many."""
        from components.validation import SliceValidator, validate_arrived

        now = self._clock()
        for minute in [m for m, at in self._done.items() if now - at > 3600]:
            del self._done[minute]
        count = 0
        for minute in self._watched(now):
            if minute in self._done or not self._source.ready(self._layout, minute):
                continue
            self._done[minute] = now
            for dataset in self._datasets:
                started = time.monotonic()
                validator = self._validators.get(dataset.name)
                if validator is None:
                    validator = self._validators[dataset.name] = SliceValidator(dataset)
                result = validate_arrived(self._layout, minute, dataset, validator)
                if result is None:
                    continue
                seconds = time.monotonic() - started
                self.validated = [*self.validated[-19:], (dataset.name, minute, result.success, seconds)]
                count += 1
                if result.success:
                    log.info("validated on arrival: %s of %s, %d rows, %.2f s", dataset.name,
                             minute.strftime("%H:%M"), result.num_rows, seconds)
                else:
                    log.warning("validation on arrival: %s of %s failed (%s); the run's validate step will "
                                "quarantine it", dataset.name, minute.strftime("%H:%M"), result.summary())
        return count

    def run(self, stop: threading.Event, poll_s: float = POLL_S) -> None:
        """Polls until `stop` is set. An error is logged and the watch goes on: the validate step still
        validates what was not validated here."""
        while not stop.wait(poll_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - validation on arrival is a head start, never a dependency
                log.exception("validation on arrival failed; the runs' validate steps validate their minutes")
                stop.wait(5.0)


def start(config, stop: threading.Event) -> threading.Thread | None:
    """Starts validating on arrival in a daemon thread, when `incremental.validate_on_arrival` is on. The watch
    is set up in that thread: a spec or source that cannot be read there is logged, and the worker still serves
    steps (whose own config may differ)."""
    if not config.incremental.validate_on_arrival:
        return None

    def watch() -> None:
        try:
            watcher = ArrivalValidator(config)
        except Exception:  # noqa: BLE001 - a head start, never a dependency
            log.exception("validation on arrival could not start; the runs' validate steps validate their minutes")
            return
        watcher.run(stop)

    thread = threading.Thread(target=watch, daemon=True, name="arrivals")
    thread.start()
    return thread
