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
    for before, after in zip(STEP_NAMES, STEP_NAMES[1:], strict=False):
        assert dag["upstream"][after] == [before]
    assert dag["upstream"][STEP_NAMES[0]] == []
    assert dag["timetable"] == "CronDataIntervalTimetable"
    assert dag["max_active_runs"] == 1
    assert "config" in dag["params"]


def test_incremental_dag_runs_every_minute_one_at_a_time_over_the_minute_pipeline(parsed):
    dag = parsed["dags"]["ctr_incremental"]
    assert sorted(dag["tasks"]) == sorted(INCREMENTAL_STEP_NAMES)
    # Validation and the Spark samples job run side by side after planning; training waits for both.
    assert dag["upstream"] == {"plan": [], "validate": ["plan"], "samples": ["plan"],
                               "train": ["samples", "validate"], "export_delta": ["train"],
                               "gate": ["export_delta"], "publish": ["gate"]}
    assert dag["tasks"][0] == "plan" and dag["tasks"][-3:] == ["export_delta", "gate", "publish"]
    assert dag["timetable"] == "CronDataIntervalTimetable"
    assert dag["max_active_runs"] == 1
    assert "config" in dag["params"]
    assert "incremental" in dag["tags"]


def test_every_task_has_retries_and_every_dag_tags(parsed):
    for dag_id, dag in parsed["dags"].items():
        assert dag["tags"], f"{dag_id} has no tags"
        assert all(r >= 1 for r in dag["retries"].values()), dag["retries"]


def test_parsing_imports_no_heavy_library(parsed):
    assert parsed["heavy"] == []
