"""The Airflow side of a pipeline, shared by the DAG files: one task per step, chained in order.

A task body imports only inside (DAG files parse fast) and maps the pipeline's outcomes to Airflow's: data or
models that fail their checks fail the task without retries (retrying cannot fix them), and a minute run that
has nothing to learn is skipped.
"""

from __future__ import annotations

from collections.abc import Sequence

from airflow.sdk import task

from pipelines.context import Step


def run_step_task(pipeline: str, step_name: str, context: dict) -> None:
    from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

    from components.evaluation import DeltaGateError, QualityGateError
    from components.validation import DataValidationError
    from pipelines.incremental import NothingToLearn
    from pipelines.runner import run_airflow_step

    try:
        run_airflow_step(pipeline, step_name, context)
    except NothingToLearn as err:  # the parent already holds this minute: the rest of the run is skipped
        raise AirflowSkipException(str(err)) from err
    except (DataValidationError, QualityGateError, DeltaGateError) as err:  # bad data or a bad model
        raise AirflowFailException(str(err)) from err


def chain_step_tasks(pipeline: str, steps: Sequence[Step]) -> None:
    """Inside a `with DAG(...)` block: a task per step, downstream of the steps it names in `upstream`, or
    else of the one before it."""
    tasks: dict[str, object] = {}
    previous = None
    for step in steps:

        @task(task_id=step.name, doc=step.description)
        def run_step(step_name: str = step.name, **context) -> None:
            run_step_task(pipeline, step_name, context)

        current = run_step()
        upstream = step.upstream if step.upstream is not None else ((previous,) if previous else ())
        unknown = [name for name in upstream if name not in tasks]
        if unknown:
            raise ValueError(f"{pipeline} step {step.name!r} needs {unknown}, which are not steps before it")
        for name in upstream:
            tasks[name] >> current
        tasks[step.name] = current
        previous = step.name
