"""Triggering a DAG run through Airflow's public REST API (POST /api/v2/dags/{dag_id}/dagRuns).

The token comes from the simple auth manager (POST /auth/token) with the admin password Airflow generated
under the project's Airflow home, which is what `ctr ui airflow` and the benchmarks start.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

from components.config import PipelineConfig

PASSWORDS_FILE = "simple_auth_manager_passwords.json.generated"


class TriggerError(RuntimeError):
    """The Airflow API refused or could not be reached."""


def api_token(config: PipelineConfig, api_url: str, username: str = "admin") -> str:
    import httpx

    passwords = config.paths.root / "airflow" / PASSWORDS_FILE
    if not passwords.is_file():
        raise TriggerError(f"no {passwords}: start Airflow with `ctr ui airflow` (or the benchmark) first; it writes "
                           "the admin password there")
    password = json.loads(passwords.read_text()).get(username)
    try:
        response = httpx.post(f"{api_url}/auth/token", json={"username": username, "password": password}, timeout=10)
    except httpx.HTTPError as err:
        raise TriggerError(f"cannot reach the Airflow API at {api_url} ({err}); is `ctr ui airflow` running?") from err
    if response.status_code not in (200, 201):
        raise TriggerError(f"{api_url}/auth/token answered {response.status_code}: {response.text[:300]}")
    return response.json()["access_token"]


def trigger_dag(config: PipelineConfig, dag_id: str, *, api_url: str, minute: str | None = None,
                overrides: dict[str, Any] | None = None, now: datetime | None = None) -> dict[str, Any]:
    """Triggers `dag_id` for the data interval ending at `minute`'s end (incremental) or the last complete
    minute, with config overrides as the run's `config` param. Returns the created DAG run."""
    import httpx

    from components.interval import Interval

    if minute is not None:
        interval = Interval.minute(minute)
    else:
        end = (now or datetime.now(UTC)).replace(second=0, microsecond=0)
        interval = Interval(end - timedelta(minutes=1), end)
    body = {
        "dag_run_id": f"manual__{interval.tag}__{datetime.now(UTC):%H%M%S}",
        "logical_date": interval.start.isoformat(),
        "data_interval_start": interval.start.isoformat(),
        "data_interval_end": interval.end.isoformat(),
        "conf": {"config": overrides or {}},
    }
    headers = {"Authorization": f"Bearer {api_token(config, api_url)}"}
    try:
        response = httpx.post(f"{api_url}/api/v2/dags/{dag_id}/dagRuns", json=body, headers=headers, timeout=30)
    except httpx.HTTPError as err:
        raise TriggerError(f"cannot reach the Airflow API at {api_url} ({err})") from err
    if response.status_code not in (200, 201):
        raise TriggerError(f"triggering {dag_id} failed: {response.status_code} {response.text[:500]}")
    return response.json()
