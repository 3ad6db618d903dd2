"""The step worker's garbage collections: automatic ones off, full ones while idle, slow ones logged."""

from __future__ import annotations

import gc
import logging

import pytest

from pipelines import idle_gc
from pipelines.idle_gc import IDLE_DELAY_S, MAX_INTERVAL_S, SLOW_S, IdleCollector


class Cycle:
    def __init__(self) -> None:
        self.me = self


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def collector(clock):
    was_enabled = gc.isenabled()
    collector = IdleCollector(clock=clock)
    collector.install()
    yield collector
    collector.uninstall()
    assert gc.isenabled() == was_enabled


def test_automatic_collections_are_off_and_an_idle_collection_frees_the_cycles(collector, clock, caplog):
    assert not gc.isenabled()
    gc.collect()  # not an idle one: logged as slow if it is (a heap with TensorFlow's objects takes 0.3 s)
    collector.slow = []
    for _ in range(5000):  # far past CPython's threshold of 700 allocations: nothing collects them by itself
        Cycle()
    assert gc.get_count()[0] >= 5000
    clock.now += 7
    with caplog.at_level(logging.INFO, logger="pipelines.idle_gc"):
        done = collector.collect_idle("test")
    assert done["collected"] >= 5000
    assert collector.last_collection == 107.0
    assert "idle (test): full garbage collection in" in caplog.text
    assert collector.slow == []  # an idle collection is not a pause


def test_a_collection_is_due_after_a_runs_end_and_at_least_every_max_interval(collector, clock):
    assert collector.due() is None
    collector.run_ended()
    clock.now += IDLE_DELAY_S - 0.5
    assert collector.due() is None  # the model server loads the new version first
    clock.now += 0.5
    assert collector.due() == "after a run"
    collector.collect_idle("after a run")
    assert collector.due() is None
    clock.now += MAX_INTERVAL_S
    assert collector.due() == "120 s since the last one"


def test_with_automatic_collections_on_nothing_is_due_and_cpython_collects_as_usual(clock):
    collector = IdleCollector(clock=clock, automatic=True)
    collector.install()
    try:
        assert gc.isenabled()
        collector.run_ended()
        clock.now += MAX_INTERVAL_S * 2
        assert collector.due() is None
    finally:
        collector.uninstall()
    assert gc.isenabled()


def test_a_slow_collection_outside_idle_time_is_logged_with_its_generation(monkeypatch, caplog):
    ticks = iter([0.0, 0.05, 1.0, 1.0 + SLOW_S + 0.4])
    monkeypatch.setattr(idle_gc.time, "perf_counter", lambda: next(ticks))
    collector = IdleCollector(clock=Clock(), automatic=True)
    with caplog.at_level(logging.INFO, logger="pipelines.idle_gc"):
        collector._callback("start", {"generation": 0})
        collector._callback("stop", {"generation": 0, "collected": 3})  # 0.05 s: not logged
        collector._callback("start", {"generation": 1})
        collector._callback("stop", {"generation": 1, "collected": 7})
    assert collector.slow == [(1, pytest.approx(SLOW_S + 0.4))]
    assert caplog.text.count("garbage collection of generation") == 1
    assert "generation 1 stopped the worker for 0.50 s (7 objects collected)" in caplog.text


def test_install_is_idempotent_and_uninstall_removes_the_callback(clock):
    collector = IdleCollector(clock=clock, automatic=True)
    before = len(gc.callbacks)
    collector.install()
    collector.install()
    assert len(gc.callbacks) == before + 1
    collector.uninstall()
    assert len(gc.callbacks) == before


def test_a_collection_is_overdue_at_a_runs_end_after_an_uncollected_run_or_max_interval(collector, clock):
    collector.collect_idle("test")
    clock.now += 10
    assert collector.overdue() is None  # the first run's end: its idle time may still come
    collector.run_ended()
    clock.now += 10  # the next run followed at once and ends now
    assert collector.overdue() == "a run's end, the run before it not collected after"
    collector.collect_idle("a run's end")
    clock.now += MAX_INTERVAL_S - 0.5
    assert collector.overdue() is None
    clock.now += 0.5
    assert collector.overdue() == "a run's end, 120 s since the last one"
    assert IdleCollector(clock=clock, automatic=True).overdue() is None  # CPython collects as usual
