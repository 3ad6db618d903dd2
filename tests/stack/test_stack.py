"""`make test-stack`: the production topology brought up with `ctr stack up` and used as a user would.

Brings the stack up on free ports, under its own home, PostgreSQL databases and Redis database, with its
Spark steps on a standalone cluster of two workers; generates a small day; unpauses and triggers ctr_daily
through Airflow's REST API and waits for it; checks that serving answers from the model in S3; lets the
scheduler run ctr_incremental on live traffic for at least two minutes; checks that serving follows the
deltas, that the Spark tasks ran in the workers' executors (the master's JSON and the driver's REST API), and
that MLflow holds a run for every DAG run; that every published model is an asset event of `ctr_model`; that
the scheduled ctr_daily run of yesterday (no data: it fails at validate) marked its MLflow run FAILED and
posted to the failure webhook (a server in this test); then `ctr stack down` and checks that nothing it
started is left. About 11 minutes on 2 cores. Runs only when CTR_TEST_STACK=1 (`make test-stack` sets it):
it needs PostgreSQL and Redis on this machine and `tools/ensure_env.sh --stack`.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from tests.webhook_receiver import webhook_receiver

pytestmark = [
    pytest.mark.stack,
    pytest.mark.skipif(os.environ.get("CTR_TEST_STACK") != "1", reason="the whole stack: run `make test-stack`"),
    # Bringing the stack up and down and the waits below allow up to about an hour in all (pyproject's 15 minutes
    # is for one test of the suite).
    pytest.mark.timeout(3600),
]
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ctr(env: dict[str, str], *args: str, timeout: float = 600, show: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "pipelines.cli", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    output = f"{done.stdout[-3000:]}{done.stderr[-3000:]}" if show else "(output not shown: it holds secrets)"
    print(f"$ ctr {' '.join(args)}  (rc {done.returncode})\n{output}", flush=True)
    return done


def _wait(what: str, condition, timeout_s: float, every_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


def _answer(ask):
    """What `ask()` returns, or None (printed) when the server did not answer: for `_wait`."""
    try:
        return ask()
    except OSError as err:
        print(f"not answered yet: {err}", flush=True)
        return None


class Airflow:
    """The Airflow REST API, logged in as the stack's user."""

    def __init__(self, env: dict[str, str]) -> None:
        self.url = env["CTR_AIRFLOW_API_URL"]
        token = httpx.post(f"{self.url}/auth/token", timeout=10, json={
            "username": env["_AIRFLOW_WWW_USER_USERNAME"], "password": env["_AIRFLOW_WWW_USER_PASSWORD"]})
        token.raise_for_status()
        self.headers = {"Authorization": f"Bearer {token.json()['access_token']}"}

    def get(self, path: str) -> dict:
        response = httpx.get(f"{self.url}/api/v2/{path}", headers=self.headers, timeout=30)
        response.raise_for_status()
        return response.json()

    def patch(self, path: str, body: dict) -> dict:
        response = httpx.patch(f"{self.url}/api/v2/{path}", headers=self.headers, json=body, timeout=30)
        response.raise_for_status()
        return response.json()

    def runs(self, dag_id: str) -> list[dict]:
        return self.get(f"dags/{dag_id}/dagRuns?limit=100&order_by=-start_date")["dag_runs"]

    def tasks(self, dag_id: str, run_id: str) -> dict[str, str | None]:
        found = self.get(f"dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]
        return {t["task_id"]: t["state"] for t in found}


@pytest.fixture(scope="module")
def webhook():
    """A webhook receiver: what the failure callbacks post."""
    with webhook_receiver(status=204) as receiver:
        yield receiver


@pytest.fixture(scope="module")
def stack(tmp_path_factory, webhook):
    home = tmp_path_factory.mktemp("stack")
    env = {**os.environ, "CTR_ALERT_WEBHOOK_URL": webhook[0],
           "CTR_STACK_HOME": str(home / "home"), "CTR_STACK_NAME": f"ctrtest{os.getpid()}",
           "CTR_STACK_SECRETS": str(home / "secrets.env"), "CTR_STACK_REDIS": "redis://127.0.0.1:6379/11",
           # The Spark steps run on the stack's standalone cluster: two workers of one core each.
           "SPARK_MASTER": "standalone", "SPARK_WORKERS": "2", "SPARK_WORKER_CORES": "1",
           "SPARK_WORKER_MEMORY": "2g", "SPARK_EXECUTOR_MEMORY": "1g", "SPARK_WORKER_WEBUI_PORT": "0",
           "SPARK_DRIVER_MEMORY": "2g"}
    for key in ("AIRFLOW_API_PORT", "AIRFLOW_WORKER_LOG_PORT", "AIRFLOW_TRIGGERER_LOG_PORT", "MLFLOW_PORT",
                "S3_API_PORT", "SPARK_CONNECT_PORT", "SPARK_MASTER_PORT", "SPARK_MASTER_WEBUI_PORT", "SPARK_UI_PORT",
                "SERVING_PORT", "SERVING_GRPC_PORT"):
        env[key] = str(_free_port())
    for key in ("CTR_HOME", "CTR_MODEL_STORE", "CTR_S3_ENDPOINT_URL", "MLFLOW_TRACKING_URI", "SPARK_REMOTE"):
        env.pop(key, None)
    up = _ctr(env, "stack", "up")
    try:
        assert up.returncode == 0, "ctr stack up failed"
        exported = _ctr(env, "stack", "env", show=False)
        assert exported.returncode == 0
        for line in exported.stdout.splitlines():
            key, value = line.removeprefix("export ").split("=", 1)
            env[key] = value.strip("'")
        yield env
    finally:
        if os.environ.get("CTR_TEST_STACK_KEEP") != "1":
            _ctr(env, "stack", "logs", "-n", "15")
            down = _ctr(env, "stack", "down", "--purge")
            assert down.returncode == 0


def test_stack_runs_the_daily_and_minute_pipelines_as_a_user_would(stack, webhook, monkeypatch):
    env = stack
    run_home = Path(env["CTR_STACK_HOME"])
    status = _ctr(env, "stack", "status")
    assert status.returncode == 0, "a service is not healthy right after `up`"
    for service in ("s3", "spark-master", "spark-worker-1", "spark-worker-2", "spark-connect", "mlflow",
                    "airflow-api-server", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer",
                    "airflow-worker", "step-worker", "serving"):
        assert any(line.startswith(service) and line.endswith("healthy") for line in status.stdout.splitlines()), \
            service
    # Logins are required: the Airflow API and the MLflow server refuse anonymous requests.
    assert httpx.get(f"{env['CTR_AIRFLOW_API_URL']}/api/v2/dags", timeout=10).status_code == 401
    assert httpx.post(f"{env['MLFLOW_TRACKING_URI']}/api/2.0/mlflow/experiments/search", json={},
                      timeout=10).status_code == 401

    # Live traffic starts now, so minutes are waiting when ctr_incremental is unpaused after the daily run.
    live_started = datetime.now(UTC).replace(second=0, microsecond=0)
    live = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "generate", "--live", "--minutes", "8",
                             "--rows-per-minute", "2000"], env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    try:
        # A small day (its last 20 minutes) two days ago, and ctr_daily triggered for it through the REST API.
        today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        day_end = today - timedelta(days=1)
        generated = _ctr(env, "generate", "--start", (day_end - timedelta(minutes=20)).strftime("%Y-%m-%dT%H:%M"),
                         "--minutes", "20", "--rows-per-minute", "2000")
        assert generated.returncode == 0
        triggered = _ctr(env, "trigger", "daily", "--minute", day_end.strftime("%Y-%m-%dT%H:%M"), "--unpause",
                         "--param", "train.epochs=1", "--param", "features.num_shards=2")
        assert triggered.returncode == 0
        airflow = Airflow(env)
        daily_run = next(r for r in airflow.runs("ctr_daily") if r["run_type"] == "manual")
        state = _wait("ctr_daily to finish", lambda: (
            airflow.get(f"dags/ctr_daily/dagRuns/{daily_run['dag_run_id']}")["state"]
            if airflow.get(f"dags/ctr_daily/dagRuns/{daily_run['dag_run_id']}")["state"] in ("success", "failed")
            else None), 480)
        assert state == "success", airflow.tasks("ctr_daily", daily_run["dag_run_id"])
        # The trigger sent a typed field where the form has one, and the config object for the rest.
        assert daily_run["conf"] == {"epochs": 1, "config": {"features.num_shards": "2"}}
        print(f"ctr_daily {daily_run['dag_run_id']}: success", flush=True)

        # Serving loads the full model from S3.
        serving = env["CTR_SERVING_URL"]
        status_doc = _wait("serving to load the daily model", lambda: _served(serving), 120, 2)
        daily_version = status_doc["version"]
        assert status_doc["parent"] is None and status_doc["data_end"] == day_end.isoformat()
        rows = _instances(run_home / "data", day_end - timedelta(minutes=1), 3)
        predicted = httpx.post(f"{serving}/v1/models/ctr:predict", json={"instances": rows}, timeout=10)
        assert predicted.status_code == 200, predicted.text
        assert predicted.headers["X-Model-Version"] == daily_version
        assert len(predicted.json()["predictions"]) == 3

        # Minute runs under the scheduler, on live traffic: at least two published deltas, followed by serving.
        airflow.patch("dags/ctr_incremental", {"is_paused": False})
        minutes = _wait("two successful ctr_incremental runs", lambda: sorted(
            r["data_interval_start"] for r in airflow.runs("ctr_incremental") if r["state"] == "success")[:2]
            if len([r for r in airflow.runs("ctr_incremental") if r["state"] == "success"]) >= 2 else None, 330)
        print(f"ctr_incremental: minutes {minutes} learned and published", flush=True)
        # Their steps ran in the step worker (the Celery workers' tasks handed them over).
        worker_log = (run_home / "logs" / "step-worker.log").read_text()
        for step in ("samples", "train", "publish"):
            assert re.search(rf"incremental/{step} of scheduled__\S+: done in", worker_log), step
        followed = _wait("serving to follow the deltas", lambda: (
            doc if (doc := _served(serving)) and doc["parent"] is not None else None), 60, 2)
        print(f"serving: version {followed['version']} (parent {followed['parent']}, data to "
              f"{followed['data_end']})", flush=True)
        assert followed["chain_root"] == daily_version
        # The deltas learned the live minutes, not the day the daily run learned (at any time of day, midnight too).
        assert datetime.fromisoformat(followed["data_end"]) > live_started - timedelta(minutes=1), followed
        airflow.patch("dags/ctr_incremental", {"is_paused": True})
        _check_the_executors_did_the_spark_work(env)
    finally:
        live.terminate()
        live.wait(30)

    # MLflow holds a run for every finished DAG run, linked by its run id, and the registered model.
    import mlflow

    for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(key, env[key])
    client = mlflow.MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("ctr")
    tracked = {r.data.tags.get("airflow.run_id") for r in client.search_runs([experiment.experiment_id],
                                                                           max_results=500)}
    for dag_id in ("ctr_daily", "ctr_incremental"):
        succeeded = [r["dag_run_id"] for r in airflow.runs(dag_id) if r["state"] == "success"]
        assert succeeded and set(succeeded) <= tracked, (dag_id, set(succeeded) - tracked)
    model = client.get_registered_model("ctr")
    assert "challenger" in model.aliases
    (daily_mlflow,) = client.search_runs([experiment.experiment_id],
                                         filter_string=f"tags.`airflow.run_id` = '{daily_run['dag_run_id']}'")
    assert daily_mlflow.data.params["train.epochs"] == "1"

    # Every published model is an asset event of ctr_model, with its version, so a DAG can be scheduled on it.
    events = airflow.get("assets/events?limit=100")["asset_events"]
    published = {(e["source_dag_id"], e["extra"].get("version"), e["extra"].get("kind")) for e in events
                 if e["uri"] == "x-ctr://models/ctr"}
    assert ("ctr_daily", daily_version, "full") in published, events[:3]
    assert sum(1 for dag, _, kind in published if dag == "ctr_incremental" and kind == "delta") >= 2, published

    # The scheduled run of yesterday has no data: it fails at validate, and its failure is reported.
    failed = _wait("the scheduled ctr_daily run to fail", lambda: [
        r for r in airflow.runs("ctr_daily") if r["run_type"] == "scheduled" and r["state"] == "failed"], 300)
    alerts = _wait("the failure webhook", lambda: [m for m in webhook[1] if m["run_id"] == failed[0]["dag_run_id"]],
                   60, 2)
    assert alerts[0]["dag_id"] == "ctr_daily" and alerts[0]["task_id"] == "validate", alerts
    (failed_mlflow,) = client.search_runs([experiment.experiment_id],
                                          filter_string=f"tags.`airflow.run_id` = '{failed[0]['dag_run_id']}'")
    assert failed_mlflow.info.status == "FAILED" and failed_mlflow.data.tags["ctr.failed_task"] == "validate"
    assert alerts[0]["mlflow_run_id"] == failed_mlflow.info.run_id
    # Artifacts went through the tracking server into S3, not onto the task's disk.
    assert experiment.artifact_location.startswith("mlflow-artifacts:"), experiment.artifact_location
    import boto3

    s3 = boto3.client("s3", endpoint_url=env["CTR_S3_ENDPOINT_URL"], region_name=env["AWS_DEFAULT_REGION"],
                      aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket="mlflow")
            for o in page.get("Contents", [])]
    logged = [key for key in keys if "/models/" in key]  # the logged pyfunc model: MLmodel, signature, SavedModel
    assert any(key.endswith("/MLmodel") for key in logged), keys[:20]
    assert any(key.endswith("/manifest.json") for key in logged), logged[:20]
    assert any(key.endswith("/plots/training_curve.png") for key in keys)


def _check_the_executors_did_the_spark_work(env: dict[str, str]) -> None:
    """The master's JSON: both workers alive, the Connect server an application holding their cores. The driver's
    REST API: the tasks of the daily and minute runs' Spark jobs ran in the workers' executors, none in the
    driver."""
    from spark_jobs.connect import APP_NAME
    from spark_jobs.standalone import cluster_state, executor_tasks

    cluster = cluster_state(f"http://127.0.0.1:{env['SPARK_MASTER_WEBUI_PORT']}")
    assert cluster.status == "ALIVE" and cluster.alive_workers == 2, cluster
    (app,) = [a for a in cluster.applications if a["name"] == APP_NAME]
    assert app["cores"] == 2, cluster
    # The driver's UI shares the Connect server's JVM with the minute runs' last jobs: on a loaded host one request
    # can take longer than a health check's 5 s, so it is asked again (30 s each) for up to two minutes.
    tasks = _wait("the Spark driver's REST API", lambda: _answer(
        lambda: executor_tasks(f"http://127.0.0.1:{env['SPARK_UI_PORT']}", app["id"], timeout_s=30)), 120, 5)
    print(f"spark: {cluster.alive_workers} workers; tasks completed by executor: {tasks}", flush=True)
    assert tasks.get("driver", 0) == 0, tasks
    assert len([n for executor, n in tasks.items() if executor != "driver" and n > 0]) >= 2, tasks


def _instances(data_root: Path, minute: datetime, count: int) -> list[dict]:
    """Prediction instances from the raw rows of one generated minute, as a client sends them."""
    from components.config import load_config
    from components.feature_spec import spec_for
    from components.layout import Layout
    from components.validation import read_raw_slice

    spec = spec_for(load_config(environ={}))
    directory = Layout(data_root).raw_minute_dir(minute)
    frame = read_raw_slice(next(directory.glob("part-*")), minute, spec=spec).head(count)
    return [spec.request_instance(row) for row in frame.to_dict("records")]


def _served(serving: str) -> dict | None:
    try:
        response = httpx.get(f"{serving}/v1/models/ctr", timeout=5)
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


ARTIFACTS = REPO / "var" / "test-artifacts" / "browser"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def settled(locator, timeout_s: float = 15.0) -> None:
    """Waits until the element's box has stayed put for half a second: an opening section's animation is over,
    so a screenshot shows the page as a person reads it, not mid-slide."""
    last, still_since, deadline = None, None, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        box, now = locator.bounding_box(), time.monotonic()
        if box is not None and box == last:
            still_since = still_since or now
            if now - still_since >= 0.5:
                return
        else:
            still_since = None
        last = box
        time.sleep(0.1)
    raise AssertionError(f"{locator} still moving after {timeout_s:.0f} s")


def mlflow_model_training_view(page) -> None:
    """MLflow's UI opens on its GenAI view with an assistant panel over a third of the page: the model-training
    view is what this project's runs and models are read in, without the panel."""
    page.get_by_text("Model training", exact=True).first.click()
    close = page.get_by_role("button", name="Close")
    if close.count():
        close.first.click()
    page.get_by_placeholder("Ask a question").first.wait_for(state="hidden", timeout=10_000)  # the panel's box


def choose(page, label: str, values: list[str]) -> None:
    """Picks `values` in the compare view's select that follows `label`, as a person types and confirms them."""
    box = page.get_by_text(label, exact=True).locator("xpath=following::*[@role='combobox'][1]")
    for value in values:
        box.click()
        page.keyboard.type(value)
        page.get_by_role("option", name=value, exact=True).first.wait_for(state="attached", timeout=10_000)
        page.keyboard.press("Enter")
    page.keyboard.press("Escape")


def test_the_airflow_and_mlflow_uis_show_the_runs_and_the_model(stack, monkeypatch):
    """In headless Chromium (Debian's package, driven by Playwright), as a person would look: the Airflow UI after
    its login shows ctr_daily's successful run and its tasks, and the trigger form's typed fields once its
    section has opened; the MLflow UI, in its model-training view, shows the registered model with its
    `champion` alias (after `ctr promote`) and two daily runs (two days, two models) compared on their AUC,
    their baseline's AUC and the lift, the plot drawn. The screenshots are kept in var/test-artifacts/browser/
    (docs/images/stack-*.png are copies)."""
    import shutil

    from playwright.sync_api import sync_playwright

    env = stack
    chromium = shutil.which("chromium")
    assert chromium, "no chromium on PATH: `tools/ensure_env.sh --stack` installs Debian's package"
    airflow = Airflow(env)
    (daily,) = [r for r in airflow.runs("ctr_daily") if r["state"] == "success"]
    version = _served(env["CTR_SERVING_URL"])["chain_root"] if _served(env["CTR_SERVING_URL"]) else None
    assert version, "serving has no model"
    promoted = _ctr(env, "promote", version)
    assert promoted.returncode == 0

    # A second daily run to compare with the first: the day before, another model.
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    day_end = today - timedelta(days=2)
    assert _ctr(env, "generate", "--start", (day_end - timedelta(minutes=20)).strftime("%Y-%m-%dT%H:%M"),
                "--minutes", "20", "--rows-per-minute", "2000").returncode == 0
    assert _ctr(env, "trigger", "daily", "--minute", day_end.strftime("%Y-%m-%dT%H:%M"), "--param", "train.epochs=1",
                "--param", "features.num_shards=2", "--param", "train.model=wide_deep").returncode == 0
    before = next(r for r in airflow.runs("ctr_daily") if r["run_type"] == "manual"
                  and r["dag_run_id"] != daily["dag_run_id"])
    state = _wait("the second ctr_daily run", lambda: (
        found if (found := airflow.get(f"dags/ctr_daily/dagRuns/{before['dag_run_id']}")["state"])
        in ("success", "failed") else None), 480)
    assert state == "success", airflow.tasks("ctr_daily", before["dag_run_id"])

    import mlflow

    for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(key, env[key])
    client = mlflow.MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("ctr")
    compared = [client.search_runs([experiment.experiment_id],
                                   filter_string=f"tags.`airflow.run_id` = '{run['dag_run_id']}'")[0]
                for run in (daily, before)]
    assert [run.data.params["train.model"] for run in compared] == ["dcnv2", "wide_deep"]
    assert all("eval.lift_auc" in run.data.metrics for run in compared)

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    api, tracking = env["CTR_AIRFLOW_API_URL"], env["MLFLOW_TRACKING_URI"]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_context(viewport={"width": 1600, "height": 1000}).new_page()
            page.goto(f"{api}/", wait_until="load")
            page.fill("input[name=username]", env["_AIRFLOW_WWW_USER_USERNAME"])
            page.fill("input[type=password]", env["_AIRFLOW_WWW_USER_PASSWORD"])
            page.keyboard.press("Enter")
            page.wait_for_url(lambda url: "/login" not in url, timeout=30_000)
            page.goto(f"{api}/dags/ctr_daily/runs/{daily['dag_run_id']}", wait_until="load")
            page.get_by_text("export", exact=True).first.wait_for(timeout=30_000)
            page.get_by_text("success").first.wait_for(timeout=30_000)
            for task in ("validate", "features", "samples", "train", "evaluate", "export"):
                assert page.get_by_text(task, exact=True).count() >= 1, task
            page.screenshot(path=str(ARTIFACTS / "airflow-ctr_daily-run.png"))
            page.goto(f"{api}/dags/ctr_daily", wait_until="load")
            page.get_by_role("button", name="Trigger").first.click()
            form = page.get_by_role("dialog")
            form.get_by_text("Trigger Dag - ctr_daily").wait_for(timeout=30_000)
            form.get_by_text("Training", exact=True).first.click()  # the form's sections open collapsed
            epochs = form.get_by_text("Epochs", exact=True).first
            epochs.wait_for(timeout=30_000)
            settled(epochs)
            for field in ("Model", "Learning rate", "Batch size"):
                assert form.get_by_text(field, exact=True).first.is_visible(), field
            assert form.get_by_text("Empty: the configured value (20).", exact=False).first.is_visible()
            page.screenshot(path=str(ARTIFACTS / "airflow-ctr_daily-trigger-form.png"))
            form.get_by_text("Data", exact=True).first.click()
            settled(form.get_by_text("Feature spec", exact=True).first)
            assert form.get_by_text("Source", exact=True).first.is_visible()

            page = browser.new_context(viewport={"width": 1600, "height": 1000}, http_credentials={
                "username": env["MLFLOW_TRACKING_USERNAME"], "password": env["MLFLOW_TRACKING_PASSWORD"]}).new_page()
            page.goto(f"{tracking}/#/models/ctr", wait_until="load")
            page.get_by_text("champion").first.wait_for(timeout=60_000)
            mlflow_model_training_view(page)
            assert page.get_by_text("challenger").first.is_visible()
            page.screenshot(path=str(ARTIFACTS / "mlflow-registered-model.png"))
            runs = ",".join(f'"{r.info.run_id}"' for r in compared)
            page.goto(f'{tracking}/#/compare-runs?runs=[{runs}]&experiments=["{experiment.experiment_id}"]',
                      wait_until="load")
            page.get_by_text("Parallel Coordinates Plot").first.wait_for(timeout=60_000)
            if page.get_by_placeholder("Ask a question").first.is_visible():
                mlflow_model_training_view(page)
            for run in compared:
                page.get_by_text(run.info.run_name).first.wait_for(timeout=60_000)
            page.get_by_role("button", name="Clear All").click()
            choose(page, "Parameters:", ["train.model"])
            choose(page, "Metrics:", ["eval.auc", "eval.baseline_auc", "eval.lift_auc"])
            # The plot is drawn: an axis per choice, and both models on the parameter's axis.
            for title in ("train.model", "eval.auc", "eval.baseline_auc", "eval.lift_auc", "dcnv2", "wide_deep"):
                page.locator("svg text", has_text=title).first.wait_for(timeout=30_000)
            settled(page.locator("svg text", has_text="eval.lift_auc").first)
            page.screenshot(path=str(ARTIFACTS / "mlflow-compare-runs.png"), full_page=True)
        finally:
            browser.close()
    print(f"screenshots: {sorted(p.name for p in ARTIFACTS.glob('*.png'))} in {ARTIFACTS}", flush=True)
