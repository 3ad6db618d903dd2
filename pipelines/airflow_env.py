"""Environment for Airflow processes started by the project on the embedded defaults:
Airflow home and its SQLite metadata DB under <data_root>/airflow, this repository's dags/ folder, no examples."""

from __future__ import annotations

import os
from pathlib import Path

from components.config import PipelineConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
DAGS_FOLDER = REPO_ROOT / "dags"
# airflow_local_settings.py: warm task processes (the scheduler preloads the steps' libraries before forking).
SETTINGS_FOLDER = REPO_ROOT / "pipelines" / "airflow_settings"
# The plugin that registers the DAGs' custom timetable (pipelines/timetables.py).
PLUGINS_FOLDER = REPO_ROOT / "pipelines" / "airflow_plugins"


SCHEDULER_IDLE_SLEEP_S = 0.2


def airflow_environment(config: PipelineConfig, base: dict[str, str] | None = None, api_port: int = 8080) -> dict:
    env = dict(os.environ if base is None else base)
    home = config.paths.root / "airflow"
    home.mkdir(parents=True, exist_ok=True)
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS_FOLDER),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(PLUGINS_FOLDER),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTOR": env.get("AIRFLOW__CORE__EXECUTOR", "LocalExecutor"),
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
        "AIRFLOW__API__BASE_URL": env.get("AIRFLOW__API__BASE_URL", f"http://localhost:{api_port}"),
        "AIRFLOW__API__PORT": str(api_port),
        "AIRFLOW__LOGGING__LOGGING_LEVEL": env.get("AIRFLOW__LOGGING__LOGGING_LEVEL", "INFO"),
        # The scheduler sleeps this long when a loop found nothing to do (Airflow's default: 1 s); a task that
        # ends mid-sleep waits that long for its downstream to be queued. Minute runs chain seven tasks.
        "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": env.get("AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME",
                                                                 str(SCHEDULER_IDLE_SLEEP_S)),
        # Tasks find the data, MLflow and the model store through the same config.
        "CTR_HOME": str(config.paths.root),
        "MLFLOW_TRACKING_URI": config.tracking_uri,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), str(SETTINGS_FOLDER), env.get("PYTHONPATH", ""))
                                      if p),
    })
    if config.paths.model_store:
        env["CTR_MODEL_STORE"] = config.paths.model_store
    if config.spark.remote:
        env["SPARK_REMOTE"] = config.spark.remote
    return env


def prepare_database(env: dict[str, str], log_path: Path, timeout_s: float = 900) -> None:
    """`airflow db migrate`, then the pools the DAGs' tasks run in (a task in a pool that does not exist is never
    scheduled). Raises RuntimeError naming the log on failure."""
    import subprocess
    import sys

    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        for command in (["-m", "airflow", "db", "migrate"], ["-m", "pipelines.airflow_env", "pools"]):
            done = subprocess.run([sys.executable, *command], env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout_s, cwd=REPO_ROOT)
            if done.returncode:
                raise RuntimeError(f"`{' '.join(command[1:])}` failed (exit {done.returncode}); see {log_path}")


def create_pools() -> list[str]:
    """In a process configured for the metadata DB: creates or resizes POOLS. Returns their names."""
    from airflow.models.pool import Pool

    from pipelines.airflow_tasks import POOLS

    for name, (slots, description) in POOLS.items():
        Pool.create_or_update_pool(name=name, slots=slots, description=description, include_deferred=False)
    return sorted(POOLS)


def correct_test_run_start(dag_id: str, run_id: str | None = None) -> dict[str, str] | None:
    """In a process configured for the metadata DB: sets the start of a run made by `airflow dags test` to its
    first task's start. `dags test` records the run's logical date as its start (apache/airflow#66127, open), so
    the UI would show a day's run of 2026-01-01 lasting from then until now. Returns the run's new bounds."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from airflow.utils.types import DagRunTriggeredByType
    from sqlalchemy import func, select

    with create_session() as session:
        query = select(DagRun).where(DagRun.dag_id == dag_id, DagRun.triggered_by == DagRunTriggeredByType.TEST)
        if run_id:
            query = query.where(DagRun.run_id == run_id)
        run = session.scalars(query.order_by(DagRun.id.desc()).limit(1)).first()
        if run is None:
            return None
        first = session.scalar(select(func.min(TaskInstance.start_date)).where(
            TaskInstance.dag_id == dag_id, TaskInstance.run_id == run.run_id))
        if first is not None and (run.start_date is None or run.start_date < first):
            run.start_date = first
        return {"run_id": run.run_id, "start_date": str(run.start_date), "end_date": str(run.end_date)}


if __name__ == "__main__":
    import json
    import sys

    if sys.argv[1:2] == ["pools"]:
        print(f"pools: {create_pools()}")
    elif sys.argv[1:2] == ["correct-test-run-start"]:
        print(json.dumps(correct_test_run_start(*sys.argv[2:4])))
    else:
        sys.exit("usage: python -m pipelines.airflow_env pools | correct-test-run-start DAG_ID [RUN_ID]")
