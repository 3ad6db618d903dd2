"""ctr_incremental: one minute of traffic -> a gated delta in serving. Wiring only; the steps are in
pipelines/incremental.py.

The data interval is the minute that just closed. Runs are chained: each trains on from the newest standing
model (the previous minute's delta, or a newer daily full model, which starts a new chain), and only one runs
at a time. After an outage the scheduler starts only the latest minute (catchup=False) and that run learns the
missed minutes in order first (config incremental.catch_up="in_order"; "latest_only" skips them, logged).
Manual runs (UI, POST /api/v2/dags/ctr_incremental/dagRuns, `ctr trigger incremental`) can override any
config value through the `config` param, e.g. {"incremental.max_logloss_increase": 0.05}.
"""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, CronDataIntervalTimetable, Param

from pipelines.airflow_tasks import chain_step_tasks
from pipelines.incremental import STEPS

with DAG(
    dag_id="ctr_incremental",
    description="minute -> validate -> Spark features/samples -> warm-start train -> delta -> gate -> publish",
    schedule=CronDataIntervalTimetable("* * * * *", timezone="UTC"),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    dagrun_timeout=timedelta(minutes=10),
    tags=["ctr", "incremental", "training"],
    default_args={"retries": 2, "retry_delay": timedelta(seconds=5), "owner": "ctr"},
    params={
        "config": Param({}, type="object", description="Config overrides as {'section.key': value}."),
    },
    doc_md=__doc__,
) as dag:
    chain_step_tasks("incremental", STEPS)
