"""What a failed task leaves behind: the failure on its MLflow run, and a message to a webhook when one is set.

The webhook's URL is a secret (a Slack or Teams incoming-webhook URL carries its token), so it comes only from
the environment (CTR_ALERT_WEBHOOK_URL), never from the config that is logged to MLflow. The message is JSON
with a `text` line (what Slack and Mattermost show) and the fields a receiver can route on.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.request
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

WEBHOOK_VARIABLE = "CTR_ALERT_WEBHOOK_URL"
WEBHOOK_TIMEOUT_S = 5.0
FAILURE_TAGS = ("ctr.failed_task", "ctr.failure", "ctr.failed_try")


def failure_message(*, dag_id: str, run_id: str, task_id: str, try_number: int, error: str,
                    interval: str, log_url: str = "", mlflow_run_id: str | None = None) -> dict[str, Any]:
    """The webhook's JSON body for one failed task."""
    text = f"ctr: {dag_id} task {task_id} failed (try {try_number}, run {run_id}, data {interval}): {error}"
    if log_url:
        text += f" - log: {log_url}"
    return {"text": text[:3000], "dag_id": dag_id, "run_id": run_id, "task_id": task_id, "try_number": try_number,
            "data_interval": interval, "error": error[:3000], "log_url": log_url, "mlflow_run_id": mlflow_run_id}


def post_webhook(url: str, message: Mapping[str, Any], timeout: float = WEBHOOK_TIMEOUT_S) -> int:
    """POSTs `message` as JSON; returns the HTTP status. Raises on a network error or a non-2xx answer."""
    request = urllib.request.Request(url, data=json.dumps(message).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "User-Agent": "ctr-pipeline"})
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - an http(s) URL we were given
        return response.status


def record_failure(ctx, task_id: str, try_number: int, error: str, log_url: str = "",
                   environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Marks the run's MLflow run FAILED with the failed task and its error as tags, then posts to the webhook
    if one is set. Never raises: a failure report must not hide the failure. Returns what was done."""
    tracker = ctx.tracker
    tracker.set_tags({"ctr.failed_task": task_id, "ctr.failure": error[:5000], "ctr.failed_try": str(try_number)})
    tracker.end("FAILED")
    done: dict[str, Any] = {"mlflow_run_id": tracker.run_id, "webhook_status": None}
    url = (os.environ if environ is None else environ).get(WEBHOOK_VARIABLE, "")
    if not url:
        return done
    message = failure_message(dag_id=ctx.dag_id, run_id=ctx.run_id, task_id=task_id, try_number=try_number,
                              error=error, interval=ctx.interval.tag, log_url=log_url,
                              mlflow_run_id=tracker.run_id)
    try:
        done["webhook_status"] = post_webhook(url, message)
    except Exception as err:  # noqa: BLE001 - the task has failed already; the alert is best effort
        log.warning("the failure webhook (%s) could not be reached: %s", WEBHOOK_VARIABLE, err)
        done["webhook_error"] = str(err)
    return done
