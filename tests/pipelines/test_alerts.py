"""A task that fails for good: its MLflow run is marked FAILED with the task and error, and the webhook (a real
HTTP server here) gets a message; an unreachable webhook costs nothing but a warning."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from components.config import load_config
from components.interval import Interval
from pipelines.airflow_tasks import failure_callback
from pipelines.alerts import WEBHOOK_VARIABLE, failure_message, record_failure
from pipelines.context import RunContext
from tests.webhook_receiver import webhook_receiver


@pytest.fixture
def webhook():
    with webhook_receiver() as receiver:
        yield receiver


def test_failure_message_is_one_line_for_chat_and_fields_for_routing():
    message = failure_message(dag_id="ctr_incremental", run_id="r1", task_id="train", try_number=3,
                              error="RuntimeError: boom", interval="202601010010", log_url="http://x/log")
    assert message["text"] == ("ctr: ctr_incremental task train failed (try 3, run r1, data 202601010010): "
                               "RuntimeError: boom - log: http://x/log")
    assert message["task_id"] == "train" and message["try_number"] == 3


def test_failure_is_recorded_on_the_mlflow_run_and_posted(tmp_path, webhook):
    from mlflow.tracking import MlflowClient

    url, received = webhook
    config = load_config(overrides={"paths.data_root": str(tmp_path)}, environ={})
    ctx = RunContext(config=config, interval=Interval.minute("2026-01-01T00:10"), pipeline="incremental",
                     run_id="scheduled__x", dag_id="ctr_incremental")
    done = record_failure(ctx, task_id="samples", try_number=3, error="RuntimeError: Spark is gone",
                          environ={WEBHOOK_VARIABLE: url})
    assert done["webhook_status"] == 200
    run = MlflowClient(tracking_uri=config.tracking_uri).get_run(done["mlflow_run_id"])
    assert run.info.status == "FAILED"
    assert run.data.tags["ctr.failed_task"] == "samples"
    assert run.data.tags["ctr.failure"] == "RuntimeError: Spark is gone"
    assert run.data.tags["airflow.run_id"] == "scheduled__x"
    assert received == [failure_message(dag_id="ctr_incremental", run_id="scheduled__x", task_id="samples",
                                        try_number=3, error="RuntimeError: Spark is gone",
                                        interval=ctx.interval.tag, mlflow_run_id=done["mlflow_run_id"])]


def test_an_unreachable_webhook_does_not_raise(tmp_path):
    config = load_config(overrides={"paths.data_root": str(tmp_path)}, environ={})
    ctx = RunContext(config=config, interval=Interval.minute("2026-01-01T00:10"), pipeline="incremental",
                     run_id="r", dag_id="ctr_incremental")
    done = record_failure(ctx, task_id="train", try_number=1, error="x",
                          environ={WEBHOOK_VARIABLE: "http://127.0.0.1:9/closed"})
    assert done["webhook_status"] is None and "webhook_error" in done


def test_the_airflow_callback_reads_the_task_context(tmp_path, webhook, monkeypatch):
    url, received = webhook
    monkeypatch.setenv(WEBHOOK_VARIABLE, url)
    monkeypatch.setenv("CTR_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    start = datetime(2026, 1, 1, tzinfo=UTC)
    context = {"ti": SimpleNamespace(task_id="export", try_number=3, log_url="http://airflow/log"),
               "exception": ValueError("disk full"), "params": {"epochs": 1, "config": {}},
               "data_interval_start": start, "data_interval_end": start.replace(day=2), "run_id": "manual__1",
               "dag_run": SimpleNamespace(dag_id="ctr_daily")}
    failure_callback("daily")(context)
    (message,) = received
    assert message["task_id"] == "export" and message["error"] == "ValueError: disk full"
    assert message["dag_id"] == "ctr_daily" and message["log_url"] == "http://airflow/log"
    assert message["data_interval"] == Interval(start, start.replace(day=2)).tag
