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


def airflow_environment(config: PipelineConfig, base: dict[str, str] | None = None, api_port: int = 8080) -> dict:
    env = dict(os.environ if base is None else base)
    home = config.paths.root / "airflow"
    home.mkdir(parents=True, exist_ok=True)
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS_FOLDER),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTOR": env.get("AIRFLOW__CORE__EXECUTOR", "LocalExecutor"),
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
        "AIRFLOW__API__BASE_URL": env.get("AIRFLOW__API__BASE_URL", f"http://localhost:{api_port}"),
        "AIRFLOW__API__PORT": str(api_port),
        "AIRFLOW__LOGGING__LOGGING_LEVEL": env.get("AIRFLOW__LOGGING__LOGGING_LEVEL", "INFO"),
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
