"""Runs pipeline steps in order, from the CLI or from one Airflow task."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from components.config import PipelineConfig, load_config
from components.interval import Interval
from pipelines import step_client
from pipelines.context import RunContext, Step
from pipelines.step_auth import worker_secret

log = logging.getLogger(__name__)
worker_log = logging.getLogger("ctr.step_worker")  # a step's log lines as the step worker sends them

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
            ctx.progress("step %s FAILED after %.1f s", step.name, time.monotonic() - started)
            ctx.tracker.end("FAILED")
            raise
        ctx.progress("step %s done in %.1f s", step.name, time.monotonic() - started)
    return outputs


SENSOR_POLL_S = 0.2


def _poll(ctx: RunContext, step: Step) -> bool:
    """A sensor step outside Airflow: asked until it answers True (it raises when waiting is pointless)."""
    while not step.run(ctx):
        time.sleep(SENSOR_POLL_S)
    return True


# An Airflow sensor task's poke asks its step every SENSOR_HOLD_POLL_S for up to SENSOR_HOLD_S before it answers
# no (and Airflow reschedules the task). A minute run is created before its minute closes
# (pipelines/timetables.py), so its sensor is already asking when the completion marker lands, rather than
# seeing it at its next poke, up to a poke interval and a task start later.
SENSOR_HOLD_S = 10.0
SENSOR_HOLD_POLL_S = 0.05


def hold_sensor(ctx: RunContext, step: Step, hold_s: float = SENSOR_HOLD_S,
                clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> bool:
    """One poke of an Airflow sensor task: True as soon as the step answers yes, False if it has not within
    `hold_s` (the step's own errors, such as data that is late, are raised)."""
    deadline = clock() + hold_s
    while not step.run(ctx):
        if clock() >= deadline:
            return False
        sleep(SENSOR_HOLD_POLL_S)
    return True


def _task_config_inputs(pipeline: str, context: Mapping[str, Any],
                        environ: Mapping[str, str] | None) -> tuple[dict[str, Any], dict[str, str]]:
    """What an Airflow task's config is built from: its params' overrides and the environment's config keys."""
    from components.config import ENVIRONMENT_KEYS
    from pipelines.run_params import fields_for, overrides_from_params

    env = os.environ if environ is None else environ
    return (overrides_from_params(context.get("params") or {}, fields_for(pipeline)),
            {name: env[name] for name in ENVIRONMENT_KEYS if env.get(name)})


def airflow_run_context(pipeline: str, context: Mapping[str, Any],
                        environ: Mapping[str, str] | None = None) -> RunContext:
    """The run an Airflow task belongs to: interval, run id and the params' config overrides from its context."""
    overrides, env = _task_config_inputs(pipeline, context, environ)
    config: PipelineConfig = load_config(overrides=overrides, environ=env)
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
    """Entry point of an Airflow task. A sensor step is asked for up to SENSOR_HOLD_S (one poke) and its answer
    returned; its yes is told to the step worker, which then starts the steps after it (pipelines/run_ahead.py)."""
    ctx = airflow_run_context(pipeline, context, environ)
    (step,) = select_steps(pipeline, [step_name])
    on_worker = pipeline in step_client.PIPELINES and ctx.config.incremental.step_worker
    request: dict[str, Any] = {}
    secret: bytes | None = None
    if on_worker:
        overrides, env = _task_config_inputs(pipeline, context, environ)
        request = {"pipeline": pipeline, "step": step_name, "run_id": ctx.run_id, "dag_id": ctx.dag_id,
                   "start": ctx.interval.start.isoformat(), "end": ctx.interval.end.isoformat(),
                   "overrides": overrides, "environ": env, "run_ahead": ctx.config.incremental.run_ahead}
        secret = worker_secret(os.environ if environ is None else environ)
    if step.sensor:
        answer = hold_sensor(ctx, step)
        if answer and on_worker and ctx.config.incremental.run_ahead:
            try:
                step_client.notify_done(ctx.config.paths.root, request, secret)
            except step_client.WorkerUnavailable as err:  # the next task runs its step where it can
                worker_log.debug("%s: the steps after %s start with their tasks", err, step_name)
        return answer
    if on_worker:
        try:
            return step_client.run_on_worker(ctx.config.paths.root, request,
                                             lambda level, text: worker_log.log(level, "%s", text), secret)
        except step_client.WorkerUnavailable as err:
            ctx.progress("%s; the step runs in this task's process", err)
    return run_steps(ctx, [step])[step_name]
