"""Validation on arrival (pipelines/arrivals.py): the step worker validates a minute once its completion marker
lands, and the run's validate step finds it validated."""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest

from components.config import GenerateConfig, load_config
from components.interval import Interval
from components.layout import Layout
from components.synthetic import RAW_FILE, SUCCESS_MARKER, write_minute
from components.validation import (
    DATA_DOCS,
    VALIDATED_MARKER,
    DataValidationError,
    validate_interval,
)
from pipelines.arrivals import ArrivalValidator

pytestmark = pytest.mark.unit

MINUTE = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
CLOSE = (MINUTE + timedelta(minutes=1)).timestamp()
ROWS = 300


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _config(tmp_path, **overrides):
    return load_config(overrides={"paths.data_root": str(tmp_path), **overrides}, environ={})


def _write(layout: Layout, minute: datetime, index: int = 0) -> None:
    write_minute(GenerateConfig(rows_per_minute=ROWS, seed=5), layout, index, minute)


def test_the_minutes_watched_are_those_closed_within_the_wait_for_data(tmp_path):
    clock = Clock(CLOSE + 5)
    watcher = ArrivalValidator(_config(tmp_path, **{"incremental.wait_for_data_s": 30}), clock=clock)
    assert watcher._watched(clock()) == [MINUTE]
    assert watcher._watched(CLOSE + 59) == [MINUTE]  # closed 59 s ago: still the newest closed minute
    assert watcher._watched(CLOSE + 65) == [MINUTE + timedelta(minutes=1)]
    wide = ArrivalValidator(_config(tmp_path, **{"incremental.wait_for_data_s": 90}), clock=clock)
    assert wide._watched(CLOSE + 5) == [MINUTE - timedelta(minutes=1), MINUTE]


def test_a_minute_is_validated_once_its_marker_lands_and_the_validate_step_takes_the_verdict(tmp_path,
                                                                                              monkeypatch):
    config = _config(tmp_path)
    layout = Layout(config.paths.root)
    watcher = ArrivalValidator(config, clock=Clock(CLOSE + 1))
    directory = layout.raw_minute_dir(MINUTE)
    _write(layout, MINUTE)
    (directory / SUCCESS_MARKER).unlink()  # the writer is not done: nothing is validated yet
    assert watcher.poll() == 0
    assert not (directory / VALIDATED_MARKER).exists()

    (directory / SUCCESS_MARKER).write_text("")
    assert watcher.poll() == 1
    marker = json.loads((directory / VALIDATED_MARKER).read_text())
    assert marker["num_rows"] == ROWS
    assert [(name, minute, ok) for name, minute, ok, _ in watcher.validated] == [("raw_click_log", MINUTE, True)]
    assert watcher.poll() == 0  # once per minute

    # The run's validate step: no second validation, and still the Data Docs page of the slice it passed.
    import components.validation as validation

    def fail(*args, **kwargs):
        raise AssertionError("validated again")

    monkeypatch.setattr(validation, "SliceValidator", fail)
    report_path = layout.validation_report(Interval(MINUTE, MINUTE + timedelta(minutes=1)))
    report = validate_interval(layout, [MINUTE], report_path, docs_dir=report_path.parent / DATA_DOCS)
    assert (report["num_passed"], report["num_validated_before"], report["num_rows"]) == (1, 1, ROWS)
    assert report["data_docs"] == ["raw_click_log-20260301T1200.html"]
    page = (report_path.parent / DATA_DOCS / report["data_docs"][0]).read_text()
    assert "raw_click_log" in page and "C26" in page and "Successful Expectations" in page


def test_a_bad_minute_is_left_to_the_validate_step_which_quarantines_it(tmp_path):
    config = _config(tmp_path)
    layout = Layout(config.paths.root)
    _write(layout, MINUTE)
    path = layout.raw_minute_dir(MINUTE) / RAW_FILE
    lines = path.read_text().split("\n")
    lines[3] = "7" + lines[3][1:]  # a label of 7
    path.write_text("\n".join(lines))

    watcher = ArrivalValidator(config, clock=Clock(CLOSE + 1))
    assert watcher.poll() == 1
    assert [ok for _, _, ok, _ in watcher.validated] == [False]
    assert path.exists() and not (path.parent / VALIDATED_MARKER).exists()  # not moved, not marked

    report_path = layout.validation_report(Interval(MINUTE, MINUTE + timedelta(minutes=1)))
    with pytest.raises(DataValidationError, match="label"):
        validate_interval(layout, [MINUTE], report_path)
    assert not path.exists()
    assert (layout.quarantine_minute_dir(MINUTE) / RAW_FILE).exists()


def test_the_validate_step_waits_for_a_validation_under_way_instead_of_doing_it_again(tmp_path, monkeypatch):
    config = _config(tmp_path)
    layout = Layout(config.paths.root)
    _write(layout, MINUTE)
    import components.validation as validation

    calls = []
    real = validation.SliceValidator.validate

    def slow(self, minute, path):  # a validation that takes a while, counted
        calls.append(minute)
        time.sleep(1.0)
        return real(self, minute, path)

    monkeypatch.setattr(validation.SliceValidator, "validate", slow)
    watcher = ArrivalValidator(config, clock=Clock(CLOSE + 1))
    arrival = threading.Thread(target=watcher.poll)
    arrival.start()
    while not calls:
        time.sleep(0.01)
    report = validate_interval(layout, [MINUTE], tmp_path / "report.json")  # the run's step, meanwhile
    arrival.join()
    assert calls == [MINUTE]
    assert (report["num_passed"], report["num_validated_before"]) == (1, 1)


def test_the_locks_of_partitions_no_one_validates_are_dropped_once_there_are_many(tmp_path, monkeypatch):
    import components.validation as validation

    monkeypatch.setattr(validation, "SLICE_LOCKS_KEPT", 10)
    monkeypatch.setattr(validation, "SLICE_LOCKS", {})
    held = validation.slice_lock(tmp_path / "held")
    with held:
        for index in range(25):
            validation.slice_lock(tmp_path / str(index))
            assert len(validation.SLICE_LOCKS) <= 10
        assert validation.slice_lock(tmp_path / "held") is held  # one in use is never dropped


def test_a_watch_that_cannot_start_is_logged_and_the_worker_goes_on(tmp_path, caplog, monkeypatch):
    import pipelines.sources
    from pipelines import arrivals

    def unreadable(config):
        raise OSError("the spec's file went away")

    monkeypatch.setattr(pipelines.sources, "source_for", unreadable)
    config = _config(tmp_path)
    stop = threading.Event()
    thread = arrivals.start(config, stop)
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert "validation on arrival could not start" in caplog.text
    assert arrivals.start(_config(tmp_path, **{"incremental.validate_on_arrival": False}), stop) is None
