"""ctr_daily: the daily CTR pipeline. Wiring only; each step is defined in pipelines/daily.py.

The data interval is the previous UTC day. A manual run's form offers the model, epochs, learning rates, the
feature spec and source and the quality gate as fields (pipelines/run_params.py; empty: the configured value),
and any other config key through the `config` object, e.g. {"features.num_shards": 8}. Spark jobs and the
training run in the pools ctr_spark and ctr_training; the export produces the asset `ctr_model`.
"""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, CronDataIntervalTimetable

from components.config import load_config
from pipelines import run_params
from pipelines.airflow_tasks import chain_step_tasks, failure_callback
from pipelines.daily import STEPS

with DAG(
    dag_id="ctr_daily",
    description="validate -> Spark features -> Spark samples -> train -> evaluate/gate -> export/publish",
    schedule=CronDataIntervalTimetable("0 0 * * *", timezone="UTC"),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    tags=["ctr", "daily", "training"],
    default_args={"retries": 2, "retry_delay": timedelta(minutes=1), "owner": "ctr",
                  "on_failure_callback": failure_callback("daily")},
    params=run_params.airflow_params(run_params.DAILY, load_config()),
    doc_md=__doc__,
) as dag:
    chain_step_tasks("daily", STEPS)
