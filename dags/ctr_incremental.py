"""ctr_incremental: one minute of traffic -> a gated delta in serving. Wiring only; the steps are in
pipelines/incremental.py.

The data interval is the minute that just closed; the scheduler creates its run `incremental.run_lead_s` before the
close (pipelines/timetables.py), so that `wait_for_data`, a sensor (reschedule mode) on the minute's completion
marker, is already waiting when the marker lands. Runs are chained: each trains on from the newest standing model
(the previous minute's delta, or a newer daily full model, which starts a new chain), and only one runs at a time.
After an outage the scheduler starts only the latest minute (catchup=False) and that run learns the missed minutes
in order first (catch_up "in_order"; "latest_only" skips them, logged). Manual runs (the UI's form, POST
/api/v2/dags/ctr_incremental/dagRuns, `ctr-pipeline trigger incremental`) set epochs, catch-up and the delta gate as
fields, any other config key through the `config` object. Its tasks weigh more than the daily DAG's in the shared pools
ctr_spark and ctr_training; `publish` produces the asset `ctr_model`.
"""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG

from components.config import load_config
from pipelines import run_params
from pipelines.airflow_tasks import chain_step_tasks, failure_callback
from pipelines.incremental import STEPS
from pipelines.timetables import LeadingCronTimetable

CONFIG = load_config()

with DAG(
    dag_id="ctr_incremental",
    description="minute -> validate -> Spark features/samples -> warm-start train -> delta -> gate -> publish -> spans",
    schedule=LeadingCronTimetable("* * * * *", timezone="UTC", lead_s=CONFIG.incremental.run_lead_s),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    dagrun_timeout=timedelta(minutes=10),
    tags=["ctr", "incremental", "training"],
    default_args={"retries": 2, "retry_delay": timedelta(seconds=5), "owner": "ctr",
                  "priority_weight": 10, "weight_rule": "absolute",
                  "on_failure_callback": failure_callback("incremental")},
    params=run_params.airflow_params(run_params.INCREMENTAL, CONFIG),
    doc_md=__doc__,
) as dag:
    chain_step_tasks("incremental", STEPS)
