"""Triggering a DAG run through Airflow's public REST API (POST /api/v2/dags/{dag_id}/dagRuns).

The run's data interval is what its schedule would give it: a UTC day for ctr_daily, a minute for
ctr_incremental (`trigger_interval`). The token comes from the simple auth manager (POST /auth/token): with
the user and password of `_AIRFLOW_WWW_USER_USERNAME` and `_AIRFLOW_WWW_USER_PASSWORD` when they are set (the
variables docker-compose.yml creates its user from), else with the admin password Airflow generated under the
project's Airflow home, which is what `ctr-pipeline ui airflow` and the benchmarks start. `ctr-pipeline stack env`
exports the stack's login and its API URL (CTR_AIRFLOW_API_URL, the default of `--api-url`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from components.config import PipelineConfig
from components.interval import Interval, parse_time

PASSWORDS_FILE = "simple_auth_manager_passwords.json.generated"


class TriggerError(RuntimeError):
    """The Airflow API refused or could not be reached."""


USER_VARIABLE = "_AIRFLOW_WWW_USER_USERNAME"
PASSWORD_VARIABLE = "_AIRFLOW_WWW_USER_PASSWORD"
GENERATED_USER = "admin"


def credentials(config: PipelineConfig, environ: Mapping[str, str]) -> tuple[str, str]:
    """(user, password) for the Airflow API: the compose stack's variables when set, else the password Airflow
    generated for `admin` under the project's Airflow home."""
    if environ.get(PASSWORD_VARIABLE):
        return environ.get(USER_VARIABLE) or "airflow", environ[PASSWORD_VARIABLE]
    passwords = config.paths.root / "airflow" / PASSWORDS_FILE
    if not passwords.is_file():
        raise TriggerError(f"no {passwords}: start Airflow with `ctr-pipeline ui airflow` (or the benchmark) first; it "
                           f"writes the admin password there. For the stack of `ctr-pipeline stack up`, run "
                           f"`eval \"$(ctr-pipeline stack env)\"` first; for another Airflow (the compose stack), set "
                           f"{USER_VARIABLE} and "
                           f"{PASSWORD_VARIABLE}")
    generated = json.loads(passwords.read_text())
    user = environ.get(USER_VARIABLE) or GENERATED_USER
    if user not in generated:
        raise TriggerError(f"{passwords} has no password for user {user!r} (it has {sorted(generated)}); set "
                           f"{PASSWORD_VARIABLE}")
    return user, generated[user]


def api_token(config: PipelineConfig, api_url: str, environ: Mapping[str, str] | None = None) -> str:
    import httpx

    username, password = credentials(config, os.environ if environ is None else environ)
    try:
        response = httpx.post(f"{api_url}/auth/token", json={"username": username, "password": password}, timeout=10)
    except httpx.HTTPError as err:
        raise TriggerError(f"cannot reach the Airflow API at {api_url} ({err}); is `ctr-pipeline ui airflow` "
                           "running?") from err
    if response.status_code not in (200, 201):
        raise TriggerError(f"{api_url}/auth/token answered {response.status_code}: {response.text[:300]}")
    return response.json()["access_token"]


def trigger_interval(pipeline: str, at: str | None = None, now: datetime | None = None) -> Interval:
    """The data interval a run of `pipeline` covers, as its schedule would give it:
    - incremental: the minute starting at `at`, or the last complete minute;
    - daily: the UTC day ending at `at` (a midnight, e.g. 2026-01-02T00:00 for the day of 2026-01-01), or the
      last complete day."""
    if pipeline not in ("daily", "incremental"):
        raise ValueError(f"unknown pipeline {pipeline!r}; expected daily or incremental")
    if pipeline == "incremental":
        if at is not None:
            return Interval.minute(at)
        end = (now or datetime.now(UTC)).replace(second=0, microsecond=0)
        return Interval(end - timedelta(minutes=1), end)
    if at is not None:
        end = parse_time(at)
        if (end.hour, end.minute, end.second, end.microsecond) != (0, 0, 0, 0):
            raise ValueError(f"--minute {at!r} for the daily pipeline is the day's end, a UTC midnight, e.g. "
                             f"{end:%Y-%m-%d}T00:00 for the day before it")
    else:
        end = (now or datetime.now(UTC)).astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return Interval(end - timedelta(days=1), end)


API_URL_VARIABLE = "CTR_AIRFLOW_API_URL"


def default_api_url(environ: Mapping[str, str] | None = None) -> str:
    """The Airflow API: CTR_AIRFLOW_API_URL (`ctr-pipeline stack env` sets it), else the embedded UI's port."""
    return (os.environ if environ is None else environ).get(API_URL_VARIABLE) or "http://localhost:8080"


def trigger_dag(config: PipelineConfig, dag_id: str, *, api_url: str, interval: Interval,
                overrides: dict[str, Any] | None = None, environ: Mapping[str, str] | None = None,
                unpause: bool = False) -> dict[str, Any]:
    """Triggers `dag_id` for `interval` (trigger_interval), with config overrides as the run's params (a key the
    trigger form has a field for in that field, any other in the `config` object);
    with `unpause`, unpauses the DAG first (DAGs start paused, and a paused DAG's runs wait). Returns the created
    DAG run."""
    import httpx

    from pipelines.run_params import fields_for, params_from_overrides

    fields = fields_for(dag_id.removeprefix("ctr_")) if dag_id in ("ctr_daily", "ctr_incremental") else ()
    body = {
        "dag_run_id": f"manual__{interval.tag}__{datetime.now(UTC):%H%M%S}",
        "logical_date": interval.start.isoformat(),
        "data_interval_start": interval.start.isoformat(),
        "data_interval_end": interval.end.isoformat(),
        "conf": params_from_overrides(overrides or {}, fields),
    }
    headers = {"Authorization": f"Bearer {api_token(config, api_url, environ)}"}
    try:
        if unpause:
            response = httpx.patch(f"{api_url}/api/v2/dags/{dag_id}", json={"is_paused": False}, headers=headers,
                                   timeout=30)
            if response.status_code != 200:
                raise TriggerError(f"unpausing {dag_id} failed: {response.status_code} {response.text[:500]}")
        response = httpx.post(f"{api_url}/api/v2/dags/{dag_id}/dagRuns", json=body, headers=headers, timeout=30)
    except httpx.HTTPError as err:
        raise TriggerError(f"cannot reach the Airflow API at {api_url} ({err})") from err
    if response.status_code not in (200, 201):
        raise TriggerError(f"triggering {dag_id} failed: {response.status_code} {response.text[:500]}")
    return response.json()
