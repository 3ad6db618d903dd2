"""Runs pipeline steps in order, from the CLI or from one Airflow task."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from components.config import PipelineConfig, load_config
from components.interval import Interval
from pipelines.context import RunContext, Step

log = logging.getLogger(__name__)

PIPELINES = ("daily", "incremental")


def pipeline_steps(pipeline: str) -> tuple[Step, ...]:
    if pipeline == "daily":
        from pipelines.daily import STEPS

        return STEPS
    if pipeline == "incremental":
        from pipelines.incremental import STEPS

        return STEPS
    raise ValueError(f"unknown pipeline {pipeline!r}: expected one of {list(PIPELINES)}")


def select_steps(pipeline: str, names: Sequence[str] | None) -> list[Step]:
    steps = pipeline_steps(pipeline)
    if not names:
        return list(steps)
    known = {s.name: s for s in steps}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown step(s) {unknown} for pipeline {pipeline!r}: expected some of {list(known)}")
    return [s for s in steps if s.name in names]


def run_steps(ctx: RunContext, steps: Sequence[Step]) -> dict[str, Any]:
    outputs: dict[str, Any] = {}
    for step in steps:
        started = time.monotonic()
        ctx.progress("step %s started: %s", step.name, step.description)
        try:
            if step.sensor:
                outputs[step.name] = _poll(ctx, step)
            elif step.system_metrics:
                with ctx.tracker.system_metrics():
                    outputs[step.name] = step.run(ctx)
            else:
                outputs[step.name] = step.run(ctx)
        except Exception:
            ctx.progress("step %s FAILED after %.0f s", step.name, time.monotonic() - started)
            ctx.tracker.end("FAILED")
            raise
        ctx.progress("step %s done in %.0f s", step.name, time.monotonic() - started)
    return outputs


SENSOR_POLL_S = 0.2


def _poll(ctx: RunContext, step: Step) -> bool:
    """A sensor step outside Airflow: asked until it answers True (it raises when waiting is pointless)."""
    while not step.run(ctx):
        time.sleep(SENSOR_POLL_S)
    return True


def airflow_run_context(pipeline: str, context: Mapping[str, Any],
                        environ: Mapping[str, str] | None = None) -> RunContext:
    """The run an Airflow task belongs to: interval, run id and the params' config overrides from its context."""
    from pipelines.run_params import fields_for, overrides_from_params

    overrides = overrides_from_params(context.get("params") or {}, fields_for(pipeline))
    config: PipelineConfig = load_config(overrides=overrides, environ=environ)
    start: datetime = context["data_interval_start"]
    end: datetime = context["data_interval_end"]
    dag_run = context.get("dag_run")
    return RunContext(
        config=config,
        interval=Interval(start, end),
        pipeline=pipeline,
        run_id=context["run_id"],
        dag_id=getattr(dag_run, "dag_id", "") or f"ctr_{pipeline}",
    )


def run_airflow_step(pipeline: str, step_name: str, context: Mapping[str, Any],
                     environ: Mapping[str, str] | None = None) -> Any:
    """Entry point of an Airflow task. A sensor step is asked once (one poke) and its answer returned."""
    ctx = airflow_run_context(pipeline, context, environ)
    (step,) = select_steps(pipeline, [step_name])
    if step.sensor:
        return bool(step.run(ctx))
    return run_steps(ctx, [step])[step_name]
