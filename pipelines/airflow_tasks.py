"""The Airflow side of a pipeline, shared by the DAG files: one task per step, chained in order.

A task body imports only inside (DAG files parse fast) and maps the pipeline's outcomes to Airflow's: data or
models that fail their checks fail the task without retries (retrying cannot fix them), and a minute run that
has nothing to learn is skipped.

What a step declares (pipelines/context.py Step) becomes the task's Airflow settings:
- `sensor`: a sensor in reschedule mode, poked every SENSOR_POKE_S without holding a worker slot between pokes;
- `pool`: one of POOLS, which `ensure_pools` creates: Spark jobs and trainings of both DAGs share them, so
  neither DAG can take every slot from the other (the minute DAG's tasks also weigh more: they get a freed slot
  first);
- `inlets` / `outlets`: ASSETS. Each published model is an asset event of `ctr_model` whose extra names the
  version, its kind (full or delta) and the store, so a downstream DAG can be scheduled on a new model
  (`schedule=[Asset(name="ctr_model", uri=MODEL_ASSET_URI)]`).

A task that fails for good (retries spent) runs `failure_callback`: its MLflow run is marked FAILED with the
task and the error as tags, and the webhook of CTR_ALERT_WEBHOOK_URL, when set, gets a message
(pipelines/alerts.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from airflow.sdk import Asset, task

from pipelines.context import Step, step_upstream

log = logging.getLogger(__name__)

SENSOR_POKE_S = 2.0
# A sensor gives up after this long (its step raises sooner, when its data is late: incremental.wait_for_data_s).
SENSOR_TIMEOUT_S = 600.0

# name -> (slots, description)
POOLS: dict[str, tuple[int, str]] = {
    "ctr_spark": (2, "Spark jobs of ctr_daily and ctr_incremental (one each at a time)"),
    "ctr_training": (2, "Trainings of ctr_daily and ctr_incremental (one each at a time)"),
}
STEP_POOLS = {"spark": "ctr_spark", "training": "ctr_training"}

RAW_ASSET_URI = "x-ctr://raw/minutes"
MODEL_ASSET_URI = "x-ctr://models/ctr"
ASSETS: dict[str, Asset] = {
    "raw_minutes": Asset(name="ctr_raw_minutes", uri=RAW_ASSET_URI, group="ctr",
                         extra={"what": "raw minute partitions of the click log (or impression and click streams)"}),
    "model": Asset(name="ctr_model", uri=MODEL_ASSET_URI, group="ctr",
                   extra={"what": "a model version published to the model store (full or delta)"}),
}


def run_step_task(pipeline: str, step_name: str, context: dict):
    from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

    from components.evaluation import DeltaGateError, QualityGateError
    from components.validation import DataValidationError
    from pipelines.incremental import NothingToLearn
    from pipelines.runner import run_airflow_step

    try:
        return run_airflow_step(pipeline, step_name, context)
    except NothingToLearn as err:  # the parent already holds this minute: the rest of the run is skipped
        raise AirflowSkipException(str(err)) from err
    except (DataValidationError, QualityGateError, DeltaGateError) as err:  # bad data or a bad model
        raise AirflowFailException(str(err)) from err


def model_event_extra(output: dict, pipeline: str) -> dict:
    """The extra of a `ctr_model` asset event, from what the publishing step returned."""
    return {"version": str(output["version"]), "kind": "full" if pipeline == "daily" else "delta",
            "store": str(output.get("uri", "")), "pipeline": pipeline}


def failure_callback(pipeline: str) -> Callable[[dict], None]:
    """on_failure_callback of the pipeline's tasks (see the module's doc)."""

    def on_failure(context: dict) -> None:
        try:
            from pipelines.alerts import record_failure
            from pipelines.runner import airflow_run_context

            ti = context.get("ti") or context.get("task_instance")
            error = context.get("exception")
            ctx = airflow_run_context(pipeline, context)
            record_failure(ctx, task_id=getattr(ti, "task_id", "?"), try_number=int(getattr(ti, "try_number", 0)),
                           error=f"{type(error).__name__}: {error}" if error else "failed",
                           log_url=str(getattr(ti, "log_url", "") or ""))
        except Exception:  # noqa: BLE001 - a callback that raises would only hide the task's own failure
            log.exception("recording the failure of a %s task failed", pipeline)

    return on_failure


def chain_step_tasks(pipeline: str, steps: Sequence[Step]) -> None:
    """Inside a `with DAG(...)` block: a task per step, downstream of the steps it needs (step_upstream)."""
    try:
        upstream = step_upstream(steps)
    except ValueError as err:
        raise ValueError(f"{pipeline}: {err}") from err
    tasks: dict[str, object] = {}
    for step in steps:
        tasks[step.name] = _step_task(pipeline, step)()
        for name in upstream[step.name]:
            tasks[name] >> tasks[step.name]


def _step_task(pipeline: str, step: Step):
    unknown = [n for n in (*step.inlets, *step.outlets) if n not in ASSETS]
    if unknown or (step.pool and step.pool not in STEP_POOLS):
        raise ValueError(f"{pipeline} step {step.name!r}: unknown assets {unknown} or pool {step.pool!r}; "
                         f"expected assets of {sorted(ASSETS)} and pools of {sorted(STEP_POOLS)}")
    settings = {"task_id": step.name, "doc": step.description,
                "inlets": [ASSETS[n] for n in step.inlets], "outlets": [ASSETS[n] for n in step.outlets]}
    if step.pool:
        settings["pool"] = STEP_POOLS[step.pool]
    if step.sensor:
        @task.sensor(poke_interval=SENSOR_POKE_S, timeout=SENSOR_TIMEOUT_S, mode="reschedule", **settings)
        def poke(step_name: str = step.name, **context) -> bool:
            return bool(run_step_task(pipeline, step_name, context))

        return poke

    @task(**settings)
    def run_step(step_name: str = step.name, **context) -> None:
        output = run_step_task(pipeline, step_name, context)
        if "model" in step.outlets and isinstance(output, dict) and "version" in output:
            context["outlet_events"][ASSETS["model"]].extra = model_event_extra(output, pipeline)

    return run_step
