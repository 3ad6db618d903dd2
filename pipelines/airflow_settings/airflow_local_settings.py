"""Airflow local settings for the project's Airflow processes. This folder is on their PYTHONPATH
(pipelines/airflow_env.py for the embedded Airflow, docker-compose.yml for the stack); Airflow imports this
module when it starts any of its processes.

Warm task processes. Each Airflow task runs in a process forked from an executor worker (LocalExecutor:
workers forked from the scheduler; CeleryExecutor: the Celery worker), so whatever the scheduler or worker
imported before forking is already loaded in every task. The pipeline steps import great-expectations,
TensorFlow/Keras, MLflow and the Spark Connect client, which take 10-15 s of CPU to import together on a
2-core machine: paid by every task of every minute run otherwise, and paid once here.

Only third-party libraries are preloaded, never the project's own modules, so a changed DAG or step is picked
up by the next task as usual. Importing does not initialise TensorFlow's runtime or a GPU (that happens at the
first op, inside the task), which is what makes forking after it safe. CTR_AIRFLOW_PRELOAD=0 turns it off.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time

# Airflow copies every public name of this module into airflow.settings unless __all__ says which: none.
__all__: list[str] = []

PRELOAD = (
    "numpy", "pandas", "pyarrow", "pyarrow.parquet",
    "great_expectations", "mlflow", "mlflow.tracking",
    "tensorflow", "keras",
    "pyspark.sql", "pyspark.sql.connect.session",
    "matplotlib", "matplotlib.pyplot",
    "boto3",
)


def forks_tasks(argv: list[str]) -> bool:
    """True for the processes whose children run tasks: the scheduler (LocalExecutor) and a Celery worker."""
    args = [a for a in argv[1:] if not a.startswith("-")]
    return args[:1] == ["scheduler"] or args[:2] == ["celery", "worker"]


def preload(modules: tuple[str, ...] = PRELOAD) -> dict[str, float]:
    """Imports `modules`, skipping any that are not installed; returns seconds per module."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    seconds = {}
    for name in modules:
        started = time.monotonic()
        try:
            importlib.import_module(name)
        except ImportError as err:
            logging.getLogger(__name__).warning("preload: %s is not importable (%s)", name, err)
            continue
        seconds[name] = round(time.monotonic() - started, 2)
    return seconds


if os.environ.get("CTR_AIRFLOW_PRELOAD", "1") != "0" and forks_tasks(sys.argv):
    _started = time.monotonic()
    _seconds = preload()
    print(f"[ctr] preloaded {len(_seconds)} libraries for task processes in "
          f"{time.monotonic() - _started:.1f} s: {_seconds}", file=sys.stderr, flush=True)
