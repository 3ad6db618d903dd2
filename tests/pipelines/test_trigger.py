"""`ctr trigger incremental` against a real Airflow API server (SQLite metadata DB, started here): the run is
created through POST /api/v2/dags/ctr_incremental/dagRuns with the minute's data interval and the overrides."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from components.config import load_config
from pipelines.airflow_env import airflow_environment
from pipelines.trigger import TriggerError, trigger_dag, trigger_interval

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    root = tmp_path_factory.mktemp("trigger")
    port = free_port()
    config = load_config(overrides={"paths.data_root": str(root)}, environ={})
    env = airflow_environment(config, base={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                              api_port=port)
    airflow = [sys.executable, "-m", "airflow"]
    for command in (["db", "migrate"], ["dags", "reserialize"]):
        done = subprocess.run([*airflow, *command], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    log = open(root / "api-server.log", "wb")  # noqa: SIM115 - closed below
    server = subprocess.Popen([*airflow, "api-server", "--port", str(port)], env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{url}/api/v2/monitor/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            log.close()
            raise RuntimeError((root / "api-server.log").read_text()[-3000:])
        time.sleep(1)
    yield config, url
    server.terminate()
    server.wait(timeout=60)
    log.close()


def test_trigger_creates_the_minutes_run_with_its_overrides(api):
    config, url = api
    run = trigger_dag(config, "ctr_incremental", api_url=url,
                      interval=trigger_interval("incremental", "2026-01-02T00:05"),
                      overrides={"incremental.max_logloss_increase": "0.05", "incremental.holdout_fraction": 0.2},
                      environ={})
    assert run["dag_id"] == "ctr_incremental"
    assert run["data_interval_start"].startswith("2026-01-02T00:05:00")
    assert run["data_interval_end"].startswith("2026-01-02T00:06:00")
    # A key the trigger form has a field for goes into that field, typed as the form's schema wants; the others
    # into the free-form config object. Airflow validated the params against the DAG's schema.
    assert run["conf"] == {"max_logloss_increase": 0.05, "config": {"incremental.holdout_fraction": 0.2}}
    # The run is in Airflow's DB, as the UI and the scheduler see it.
    from pipelines.trigger import api_token

    listed = httpx.get(f"{url}/api/v2/dags/ctr_incremental/dagRuns", timeout=30,
                       headers={"Authorization": f"Bearer {api_token(config, url, {})}"}).json()
    assert [r["dag_run_id"] for r in listed["dag_runs"]] == [run["dag_run_id"]]


def test_unpause_unpauses_the_dag_before_triggering_it(api):
    config, url = api
    from pipelines.trigger import api_token

    headers = {"Authorization": f"Bearer {api_token(config, url, {})}"}
    assert httpx.get(f"{url}/api/v2/dags/ctr_daily", headers=headers, timeout=30).json()["is_paused"] is True
    run = trigger_dag(config, "ctr_daily", api_url=url, interval=trigger_interval("daily", "2026-01-02T00:00"),
                      environ={}, unpause=True)
    assert run["data_interval_start"].startswith("2026-01-01T00:00:00")
    assert httpx.get(f"{url}/api/v2/dags/ctr_daily", headers=headers, timeout=30).json()["is_paused"] is False
    httpx.patch(f"{url}/api/v2/dags/ctr_daily", headers=headers, json={"is_paused": True}, timeout=30)


def test_unknown_dag_and_unreachable_api_are_clear_errors(api, tmp_path):
    config, url = api
    minute = trigger_interval("incremental", "2026-01-02T00:05")
    with pytest.raises(TriggerError, match="triggering ctr_nope failed: 404"):
        trigger_dag(config, "ctr_nope", api_url=url, interval=minute, environ={})
    with pytest.raises(TriggerError, match="unpausing ctr_nope failed: 404"):
        trigger_dag(config, "ctr_nope", api_url=url, interval=minute, environ={}, unpause=True)
    with pytest.raises(TriggerError, match="cannot reach the Airflow API"):
        trigger_dag(config, "ctr_incremental", api_url=f"http://127.0.0.1:{free_port()}", interval=minute,
                    environ={})
    fresh = load_config(overrides={"paths.data_root": str(tmp_path)}, environ={})
    with pytest.raises(TriggerError, match=r"start Airflow with `ctr-pipeline ui airflow`.*"
                                           r"eval \"\$\(ctr-pipeline stack env\)\""):
        trigger_dag(fresh, "ctr_incremental", api_url=url, interval=minute, environ={})
    # The compose stack's user: the variables are used, and a wrong password is Airflow's 401, said as such.
    with pytest.raises(TriggerError, match="auth/token answered 401"):
        trigger_dag(config, "ctr_incremental", api_url=url, interval=minute,
                    environ={"_AIRFLOW_WWW_USER_USERNAME": "airflow", "_AIRFLOW_WWW_USER_PASSWORD": "wrong"})
    assert json.loads((config.paths.root / "airflow" / "simple_auth_manager_passwords.json.generated")
                      .read_text())["admin"]


def test_a_daily_run_covers_the_utc_day_ending_at_the_given_midnight():
    from datetime import UTC, datetime

    day = trigger_interval("daily", "2026-01-02T00:00")
    assert (day.start.isoformat(), day.end.isoformat()) == ("2026-01-01T00:00:00+00:00", "2026-01-02T00:00:00+00:00")
    last = trigger_interval("daily", now=datetime(2026, 3, 5, 17, 42, tzinfo=UTC))
    assert (last.start.isoformat(), last.end.isoformat()) == ("2026-03-04T00:00:00+00:00",
                                                              "2026-03-05T00:00:00+00:00")
    minute = trigger_interval("incremental", now=datetime(2026, 3, 5, 17, 42, 30, tzinfo=UTC))
    assert (minute.start.isoformat(), minute.end.isoformat()) == ("2026-03-05T17:41:00+00:00",
                                                                  "2026-03-05T17:42:00+00:00")
    with pytest.raises(ValueError, match=r"--minute '2026-01-02T05:00' for the daily pipeline is the day's end, a "
                                         r"UTC midnight, e.g. 2026-01-02T00:00"):
        trigger_interval("daily", "2026-01-02T05:00")


def test_the_api_url_defaults_to_the_stacks_then_the_embedded_ui():
    from pipelines.trigger import default_api_url

    assert default_api_url({"CTR_AIRFLOW_API_URL": "http://127.0.0.1:18080"}) == "http://127.0.0.1:18080"
    assert default_api_url({}) == "http://localhost:8080"


def test_credentials_come_from_the_compose_variables_else_the_generated_file(tmp_path):
    from pipelines.trigger import credentials

    config = load_config(overrides={"paths.data_root": str(tmp_path)}, environ={})
    assert credentials(config, {"_AIRFLOW_WWW_USER_USERNAME": "ops", "_AIRFLOW_WWW_USER_PASSWORD": "s3"}) == \
        ("ops", "s3")
    assert credentials(config, {"_AIRFLOW_WWW_USER_PASSWORD": "s3"}) == ("airflow", "s3")  # compose's default
    (tmp_path / "airflow").mkdir()
    (tmp_path / "airflow" / "simple_auth_manager_passwords.json.generated").write_text('{"admin": "gen"}')
    assert credentials(config, {}) == ("admin", "gen")
    with pytest.raises(TriggerError, match=r"has no password for user 'ops' \(it has \['admin'\]\); set "
                                           r"_AIRFLOW_WWW_USER_PASSWORD"):
        credentials(config, {"_AIRFLOW_WWW_USER_USERNAME": "ops"})
