"""The minute DAG's sensor: a minute is ready once its partition's completion marker is there; the wait ends
incremental.wait_for_data_s after the minute closed. Outside Airflow the runner polls a sensor step."""

from __future__ import annotations

from datetime import timedelta

import pytest

from components.config import load_config
from components.interval import Interval
from components.layout import Layout
from components.synthetic import SUCCESS_MARKER, generate
from pipelines.context import RunContext, Step
from pipelines.incremental import STEPS, data_ready
from pipelines.runner import run_steps


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
