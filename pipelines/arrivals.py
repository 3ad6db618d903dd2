"""What the step worker does as soon as a minute's raw partitions are complete, before any run asks.

A minute run starts with its sensor task and `plan`, 1.3-1.5 s after the minute closed, while the live writer's
completion marker lands 0.6-0.7 s after it. Two pieces of the run's work depend only on the partition's bytes,
so the step worker watches for the markers of the minutes that just closed and does them then:

- **validation** (`incremental.validate_on_arrival`): the partitions are validated
  (components.validation.validate_arrived) and the run's validate step finds them validated (the same
  _VALIDATED marker, checked against the bytes' SHA-256 and the suite's version); it only writes its report and
  Data Docs page. It used to spend 2-2.5 s of CPU beside the samples step's Spark jobs on two cores. When both
  come to a partition at once, the step waits for the validation under way instead of doing it again. A
  partition that fails is left where it is, unmarked: the run's validate step validates it again, quarantines
  it and fails the run with its report, as before.
- **the rows in Spark's memory** (`incremental.cache_on_arrival`, for a source whose raw rows carry their labels,
  the click log): the minute's rows, built as the samples step builds them (`Source.rows`, with the hold-out
  column), are persisted and counted on the Spark Connect server. Spark matches the samples step's frame to
  this copy by its plan, so the fold's first job reads parsed columns instead of the file, and the samples step
  lets the copy go when it ends, as it does its own. A copy no run took is let go after KEEP_ROWS_S. A run with
  other settings (another spec, hold-out fraction, or more than this minute) builds its own as before.

Both happen in the step worker whether a run comes or not (a paused DAG's minutes too: about a second of one
core per 60 K-row minute for validation, less for the Spark copy). Errors are logged and the watch goes on: the
run's steps do the work themselves when it was not done here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

POLL_S = 0.1
# A minute's rows kept in Spark's memory on arrival are let go this long after they were kept, if no samples step
# has (a paused DAG, a run that failed before its samples step).
KEEP_ROWS_S = 120.0


class Arrivals:
    """Watches the minutes that closed within the last `incremental.wait_for_data_s` and, once a minute's source
    says it is complete (`Source.ready`), validates its partitions and keeps its rows in Spark's memory, once
    per minute."""

    def __init__(self, config, clock: Callable[[], float] = time.time) -> None:
        from components.layout import Layout
        from pipelines.sources import source_for

        self._config = config
        self._clock = clock
        self._layout = Layout(config.paths.root)
        self._source = source_for(config)
        self._datasets = self._source.datasets(config.feature_spec)
        self._validators: dict[str, Any] = {}
        self._done: dict[datetime, float] = {}  # minute -> when it arrived (clock seconds)
        self._kept: dict[datetime, tuple[float, Any]] = {}  # minute -> (when, the persisted frame)
        self._lock = threading.Lock()
        self.validated: list[tuple[str, datetime, bool, float]] = []  # (dataset, minute, passed, seconds), last few
        self.rows_kept: list[tuple[datetime, int, float]] = []  # (minute, rows, seconds), last few

    def _watched(self, now: float) -> list[datetime]:
        """The minutes that closed at most wait_for_data_s ago (at least the newest closed one), oldest first."""
        wait = self._config.incremental.wait_for_data_s
        close = now // 60 * 60  # the newest closed minute's end
        minutes: list[datetime] = []
        while not minutes or close >= now - wait:
            minutes.append(datetime.fromtimestamp(close - 60, UTC))
            close -= 60
        return minutes[::-1]

    def poll(self, keep_rows_async: bool = True) -> list[datetime]:
        """Handles the watched minutes that became complete since the last poll (their rows kept in a thread of
        their own unless `keep_rows_async` is false, then validated here); returns them."""
        now = self._clock()
        for minute in [m for m, at in self._done.items() if now - at > 3600]:
            del self._done[minute]
        self._let_go(now)
        arrived = []
        for minute in self._watched(now):
            if minute in self._done or not self._source.ready(self._layout, minute):
                continue
            self._done[minute] = now
            arrived.append(minute)
            if self._config.incremental.cache_on_arrival and self._source.labels_in_rows:
                if keep_rows_async:
                    threading.Thread(target=self._keep_rows, args=(minute, now), daemon=True,
                                     name=f"arrival-rows-{minute:%H%M}").start()
                else:
                    self._keep_rows(minute, now)
            if self._config.incremental.validate_on_arrival:
                self._validate(minute)
        return arrived

    def _validate(self, minute: datetime) -> None:
        from components.validation import SliceValidator, validate_arrived

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
            if result.success:
                log.info("validated on arrival: %s of %s, %d rows, %.2f s", dataset.name, minute.strftime("%H:%M"),
                         result.num_rows, seconds)
            else:
                log.warning("validation on arrival: %s of %s failed (%s); the run's validate step will quarantine "
                            "it", dataset.name, minute.strftime("%H:%M"), result.summary())

    def _keep_rows(self, minute: datetime, now: float) -> None:
        """The minute's rows as the samples step builds them, persisted as it persists them, and counted (which
        fills Spark's copy)."""
        from components.interval import Interval
        from pipelines.context import RunContext
        from spark_jobs.session import MINUTE_CACHE_CONF, session_conf

        started = time.monotonic()
        try:
            ctx = RunContext(config=self._config, interval=Interval(minute, minute + timedelta(minutes=1)),
                             pipeline="incremental", run_id="arrival")
            spark = ctx.spark()
            with session_conf(spark, MINUTE_CACHE_CONF):
                rows = self._source.rows(ctx, [minute], Path(ctx.layout.root),
                                         holdout_fraction=self._config.incremental.holdout_fraction)
                if rows is None:
                    return
                rows = rows.persist()
            with self._lock:
                self._kept[minute] = (now, rows)
            count = rows.count()
        except Exception:  # noqa: BLE001 - a head start only: the samples step reads the minute itself
            log.warning("keeping the rows of %s in Spark's memory on arrival failed; the samples step reads them",
                        minute.strftime("%H:%M"), exc_info=True)
            return
        seconds = time.monotonic() - started
        self.rows_kept = [*self.rows_kept[-19:], (minute, count, seconds)]
        log.info("kept on arrival: the %d rows of %s in Spark's memory, %.2f s", count, minute.strftime("%H:%M"),
                 seconds)

    def _let_go(self, now: float, keep_s: float = KEEP_ROWS_S) -> None:
        """Unpersists the copies kept longer than `keep_s` (a no-op where the samples step let them go)."""
        with self._lock:
            old = [(m, frame) for m, (at, frame) in self._kept.items() if now - at > keep_s]
            for minute, _ in old:
                del self._kept[minute]
        for minute, frame in old:
            try:
                frame.unpersist()
            except Exception:  # noqa: BLE001 - a Connect server that went away took its copies with it
                log.debug("letting go of the rows of %s failed", minute, exc_info=True)

    def run(self, stop: threading.Event, poll_s: float = POLL_S) -> None:
        """Polls until `stop` is set. An error is logged and the watch goes on: the run's steps still do what
        was not done here."""
        while not stop.wait(poll_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - a head start, never a dependency
                log.exception("work on arrival failed; the runs' steps do it themselves")
                stop.wait(5.0)


def start(config, stop: threading.Event) -> threading.Thread | None:
    """Starts watching for arrivals in a daemon thread, when `incremental.validate_on_arrival` or
    `incremental.cache_on_arrival` is on."""
    if not (config.incremental.validate_on_arrival or config.incremental.cache_on_arrival):
        return None
    watcher = Arrivals(config)
    thread = threading.Thread(target=watcher.run, args=(stop,), daemon=True, name="arrivals")
    thread.start()
    return thread
