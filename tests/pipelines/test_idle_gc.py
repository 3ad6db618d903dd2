"""The step worker's garbage collections: slow ones logged, full ones run while idle, survivors frozen."""

from __future__ import annotations

import gc
import logging

import pytest

from pipelines.idle_gc import SLOW_S, IdleCollector


class Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def collector():
    collector = IdleCollector()
    collector.install()
    yield collector
    collector.uninstall()
    gc.unfreeze()


def test_an_idle_collection_frees_cycles_and_freezes_the_survivors(collector, caplog):
    gc.disable()  # no automatic collection before the idle one
    try:
        kept = [Cycle() for _ in range(100)]
        for _ in range(1000):
            Cycle()  # unreachable at once: only a collection frees a cycle
        with caplog.at_level(logging.INFO, logger="pipelines.idle_gc"):
            first = collector.collect_idle("test")
    finally:
        gc.enable()
    assert first["collected"] >= 1000
    assert first["frozen"] > len(kept) and gc.get_freeze_count() > len(kept)
    assert "idle (test): full garbage collection in" in caplog.text
    # A frozen cycle that becomes garbage is collected by the next idle collection, which unfreezes first.
    del kept
    second = collector.collect_idle("again")
    assert second["collected"] >= 100
    assert collector.slow == []  # idle collections are not counted as pauses


def test_a_slow_collection_outside_idle_time_is_logged_with_its_generation(caplog):
    ticks = iter([0.0, 0.05, 1.0, 1.0 + SLOW_S + 0.4])
    collector = IdleCollector(clock=lambda: next(ticks))
    with caplog.at_level(logging.INFO, logger="pipelines.idle_gc"):
        collector._callback("start", {"generation": 0})
        collector._callback("stop", {"generation": 0, "collected": 3})  # 0.05 s: not logged
        collector._callback("start", {"generation": 2})
        collector._callback("stop", {"generation": 2, "collected": 7})
    assert collector.slow == [(2, pytest.approx(SLOW_S + 0.4))]
    assert caplog.text.count("garbage collection of generation") == 1
    assert "generation 2 stopped the worker for 0.50 s (7 objects collected)" in caplog.text


def test_install_is_idempotent_and_uninstall_removes_the_callback():
    collector = IdleCollector()
    before = len(gc.callbacks)
    collector.install()
    collector.install()
    assert len(gc.callbacks) == before + 1
    collector.uninstall()
    assert len(gc.callbacks) == before
