"""DAG integrity: every DAG file imports cleanly, fast, without heavy libraries or a metadata database."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from components.config import load_config
from pipelines.airflow_env import DAGS_FOLDER, airflow_environment
from pipelines.daily import STEP_NAMES
from pipelines.incremental import STEP_NAMES as INCREMENTAL_STEP_NAMES

pytestmark = pytest.mark.integration

PROBE = r"""
import json, sys, time
started = time.monotonic()
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1])
elapsed = time.monotonic() - started
heavy = sorted(m for m in ("tensorflow", "pyspark", "mlflow", "great_expectations", "keras") if m in sys.modules)
dags = {}
for dag_id, dag in bag.dags.items():
    dags[dag_id] = {
        "tags": sorted(dag.tags),
        "max_active_runs": dag.max_active_runs,
        "timetable": type(dag.timetable).__name__,
        "tasks": ([t.task_id for t in dag.topological_sort()] if hasattr(dag, "topological_sort")
                  else sorted(dag.task_ids)),
        "retries": {t.task_id: t.retries for t in dag.tasks},
        "upstream": {t.task_id: sorted(t.upstream_task_ids) for t in dag.tasks},
        "params": sorted(dag.params.keys()),
        "schemas": {k: {**dag.params.get_param(k).schema, "description": dag.params.get_param(k).description}
                    for k in dag.params.keys()},
        "pools": {t.task_id: t.pool for t in dag.tasks},
        "priority": {t.task_id: t.priority_weight for t in dag.tasks},
        "modes": {t.task_id: getattr(t, "mode", None) for t in dag.tasks},
        "inlets": {t.task_id: [a.name for a in t.inlets] for t in dag.tasks},
        "outlets": {t.task_id: [a.name for a in t.outlets] for t in dag.tasks},
        "failure_callbacks": sorted(t.task_id for t in dag.tasks if t.on_failure_callback),
    }
print(json.dumps({"errors": {k: str(v) for k, v in bag.import_errors.items()}, "dags": dags, "heavy": heavy,
                  "seconds": elapsed}))
"""


@pytest.fixture(scope="module")
def parsed(tmp_path_factory):
    root = tmp_path_factory.mktemp("airflow")
    config = load_config(overrides={"paths.data_root": str(root)}, environ={})
    env = airflow_environment(config, base={"PATH": "/usr/bin:/bin"})
    # Any metadata-DB access while parsing fails loudly: the configured database cannot be opened.
    env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{root}/missing-dir/none.db"
    result = subprocess.run([sys.executable, "-c", PROBE, str(DAGS_FOLDER)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_no_import_errors(parsed):
    assert parsed["errors"] == {}


def test_dag_ids_match_file_stems(parsed):
    stems = sorted(p.stem for p in DAGS_FOLDER.glob("*.py") if not p.name.startswith("_"))
    assert sorted(parsed["dags"]) == stems


def test_daily_dag_wires_the_pipeline_steps_in_order(parsed):
    dag = parsed["dags"]["ctr_daily"]
    assert sorted(dag["tasks"]) == sorted(STEP_NAMES)
    # The baseline reads the labelled rows after the join and runs beside features, samples and training;
    # evaluation waits for both the model and the baseline.
    assert dag["upstream"] == {"validate": [], "join": ["validate"], "features": ["join"], "samples": ["features"],
                               "baseline": ["join"], "train": ["samples"], "evaluate": ["baseline", "train"],
                               "export": ["evaluate"]}
    assert dag["timetable"] == "CronDataIntervalTimetable"
    assert dag["max_active_runs"] == 1
    assert "config" in dag["params"]


def test_incremental_dag_runs_every_minute_one_at_a_time_over_the_minute_pipeline(parsed):
    dag = parsed["dags"]["ctr_incremental"]
    assert sorted(dag["tasks"]) == sorted(INCREMENTAL_STEP_NAMES)
    # Validation and the Spark samples job run side by side after planning; training waits for both.
    assert dag["upstream"] == {"wait_for_data": [], "plan": ["wait_for_data"], "validate": ["plan"],
                               "samples": ["plan"], "train": ["samples", "validate"], "export_delta": ["train"],
                               "gate": ["export_delta"], "publish": ["gate"], "spans": ["publish"]}
    assert dag["tasks"][:2] == ["wait_for_data", "plan"] and dag["tasks"][-3:] == ["gate", "publish", "spans"]
    # The wait for the minute's data is a sensor that frees its worker slot between pokes.
    assert dag["modes"]["wait_for_data"] == "reschedule"
    # Created before the minute closes (pipelines/timetables.py), with the cron timetable's intervals.
    assert dag["timetable"] == "LeadingCronTimetable"
    assert dag["max_active_runs"] == 1
    assert "config" in dag["params"]
    assert "incremental" in dag["tags"]


def test_every_task_has_retries_and_every_dag_tags(parsed):
    for dag_id, dag in parsed["dags"].items():
        assert dag["tags"], f"{dag_id} has no tags"
        assert all(r >= 1 for r in dag["retries"].values()), dag["retries"]


def test_parsing_imports_no_heavy_library(parsed):
    assert parsed["heavy"] == []


def test_trigger_form_has_typed_fields(parsed):
    daily = parsed["dags"]["ctr_daily"]["schemas"]
    assert daily["model"]["enum"] == [None, "dcnv2", "deepfm", "dien", "din", "dlrm", "wide_deep"]
    assert daily["epochs"]["type"] == ["null", "integer"] and daily["epochs"]["minimum"] == 1
    assert daily["learning_rate"]["type"] == ["null", "number"]
    assert daily["spec"]["enum"] == [None, "avazu", "criteo", "events", "movielens", "obd", "taobao"]
    assert daily["source"]["enum"] == [None, "click_log", "events"]
    assert "configured value (20)" in daily["epochs"]["description"]
    assert daily["config"]["type"] == "object"
    incremental = parsed["dags"]["ctr_incremental"]["schemas"]
    assert incremental["catch_up"]["enum"] == [None, "in_order", "latest_only"]
    assert incremental["epochs"]["type"] == ["null", "integer"]


def test_spark_and_training_run_in_shared_pools_minute_tasks_first(parsed):
    daily, minute = parsed["dags"]["ctr_daily"], parsed["dags"]["ctr_incremental"]
    assert {t: p for t, p in daily["pools"].items() if p != "default_pool"} == {
        "join": "ctr_spark", "features": "ctr_spark", "samples": "ctr_spark", "baseline": "ctr_spark",
        "train": "ctr_training"}
    assert {t: p for t, p in minute["pools"].items() if p != "default_pool"} == {
        "samples": "ctr_spark", "train": "ctr_training"}
    assert min(minute["priority"].values()) > max(daily["priority"].values())


def test_published_models_are_assets_and_raw_minutes_inlets(parsed):
    daily, minute = parsed["dags"]["ctr_daily"], parsed["dags"]["ctr_incremental"]
    assert daily["outlets"]["export"] == ["ctr_model"] and minute["outlets"]["publish"] == ["ctr_model"]
    assert sum(bool(v) for v in daily["outlets"].values()) == 1
    assert "ctr_raw_minutes" in daily["inlets"]["validate"] and "ctr_raw_minutes" in minute["inlets"]["validate"]


def test_every_task_reports_its_failure(parsed):
    for dag in parsed["dags"].values():
        assert dag["failure_callbacks"] == sorted(dag["tasks"])
