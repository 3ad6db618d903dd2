"""ctr_daily: the daily CTR pipeline. Wiring only; each step is defined in pipelines/daily.py.

The data interval is the previous UTC day. Manual runs can override any config value through the `config`
param, e.g. {"train.epochs": 1, "features.min_count": 10}.
"""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, CronDataIntervalTimetable, Param

from pipelines.airflow_tasks import chain_step_tasks
from pipelines.daily import STEPS

with DAG(
    dag_id="ctr_daily",
    description="validate -> Spark features -> Spark samples -> train -> evaluate/gate -> export/publish",
    schedule=CronDataIntervalTimetable("0 0 * * *", timezone="UTC"),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    tags=["ctr", "daily", "training"],
    default_args={"retries": 2, "retry_delay": timedelta(minutes=1), "owner": "ctr"},
    params={
        "config": Param({}, type="object", description="Config overrides as {'section.key': value}."),
    },
    doc_md=__doc__,
) as dag:
    chain_step_tasks("daily", STEPS)
