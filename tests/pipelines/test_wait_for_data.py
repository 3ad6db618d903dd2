"""The minute DAG's sensor: a minute is ready once its partition's completion marker is there; the wait ends
incremental.wait_for_data_s after the minute closed. Outside Airflow the runner polls a sensor step; in Airflow
each poke holds for up to SENSOR_HOLD_S, since the run is created before its minute closes."""

from __future__ import annotations

from datetime import timedelta

import pytest

from components.config import load_config
from components.interval import Interval
from components.layout import Layout
from components.synthetic import SUCCESS_MARKER, generate
from pipelines.context import RunContext, Step
from pipelines.incremental import STEPS, data_ready
from pipelines.runner import SENSOR_HOLD_POLL_S, hold_sensor, run_steps


def context(root, minute: str, **overrides) -> RunContext:
    config = load_config(overrides={"paths.data_root": str(root), "generate.minutes": 2,
                                    "generate.rows_per_minute": 50, **overrides}, environ={})
    return RunContext(config=config, interval=Interval.minute(minute), pipeline="incremental", run_id="t")


def test_ready_once_the_completion_marker_is_written(tmp_path):
    ctx = context(tmp_path, "2026-01-01T00:01")
    generate(ctx.config.generate, Layout(tmp_path))
    assert data_ready(ctx) is True
    marker = ctx.layout.raw_minute_dir(ctx.interval.start) / SUCCESS_MARKER
    marker.unlink()  # the writer has not finished this minute yet
    assert data_ready(ctx, now=ctx.interval.end + timedelta(seconds=5)) is False
    with pytest.raises(RuntimeError,
                       match=r"not complete 31 s after the minute closed \(incremental.wait_for_data_s = 30"):
        data_ready(ctx, now=ctx.interval.end + timedelta(seconds=31))


def test_a_minute_that_never_comes_fails_after_the_wait(tmp_path):
    ctx = context(tmp_path, "2026-01-01T05:00", **{"incremental.wait_for_data_s": 3})
    assert data_ready(ctx, now=ctx.interval.end + timedelta(seconds=2)) is False
    with pytest.raises(RuntimeError, match="no completion marker"):
        data_ready(ctx, now=ctx.interval.end + timedelta(seconds=4))


def test_the_runner_polls_a_sensor_until_it_answers(tmp_path):
    answers = iter([False, False, True])
    calls = []

    def poke(ctx):
        calls.append(1)
        return next(answers)

    ctx = context(tmp_path, "2026-01-01T00:01")
    outputs = run_steps(ctx, [Step("wait", "test sensor", poke, sensor=True)])
    assert outputs == {"wait": True} and len(calls) == 3


def test_the_minute_pipeline_starts_with_its_sensor():
    assert STEPS[0].name == "wait_for_data" and STEPS[0].sensor
    assert not any(step.sensor for step in STEPS[1:])


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_an_airflow_poke_holds_until_the_marker_lands_within_its_hold(tmp_path):
    # Minute 00:01 closed long ago by the real clock, which data_ready's lateness check reads: wait as long.
    ctx = context(tmp_path, "2026-01-01T00:01", **{"incremental.wait_for_data_s": 1e12})
    generate(ctx.config.generate, Layout(tmp_path))
    marker = ctx.layout.raw_minute_dir(ctx.interval.start) / SUCCESS_MARKER
    marker.unlink()  # the run was created before the minute closed: its writer is not done yet
    clock = FakeClock()

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        if len(clock.sleeps) == 7:  # the writer finishes
            marker.write_text("")

    assert hold_sensor(ctx, STEPS[0], hold_s=10, clock=clock, sleep=sleep) is True
    assert len(clock.sleeps) == 7 and clock.sleeps[0] == SENSOR_HOLD_POLL_S


def test_an_airflow_poke_answers_no_once_its_hold_is_over():
    clock = FakeClock()
    calls = []
    step = Step("wait", "test sensor", lambda ctx: calls.append(clock()) or False, sensor=True)
    assert hold_sensor(None, step, hold_s=1.0, clock=clock, sleep=clock.sleep) is False
    assert calls[0] == 0.0 and calls[-1] >= 1.0 and len(calls) == round(1.0 / SENSOR_HOLD_POLL_S) + 1
