"""A tracking server that is away costs a run seconds, and what the run logged meanwhile is delivered later.

A real `mlflow server` (SQLite backend, artifacts served) on a loopback port: nothing listening there first,
then the server, then the server killed in the middle of a run and started again.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from components.config import load_config
from components.tracking import DELIVERED_LATE_TAG, RUN_KEY_TAG, Tracker, deliver_outbox, outbox_dir
from components.tracking_outbox import Outbox

# How long MLflow's own HTTP retries hold one call to a server that does not answer (7 retries, backoff factor
# 2: about 4 minutes), which components/mlflow_settings.apply_http_limits bounds.
MLFLOW_DEFAULT_RETRY_S = 240.0

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class TrackingServer:
    def __init__(self, root: Path, port: int):
        self.root, self.port, self.process = root, port, None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> None:
        log = open(self.root / "server.log", "ab")  # noqa: SIM115 - the child writes to it until stopped
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--serve-artifacts", "--artifacts-destination", (self.root / "artifacts").as_uri()],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                assert self.process.poll() is None, (self.root / "server.log").read_text()[-3000:]
                time.sleep(0.5)
        raise AssertionError(f"mlflow server did not answer in {timeout_s} s")

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            import os

            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)


@pytest.fixture
def server(tmp_path):
    root = tmp_path / "server"
    root.mkdir()
    server = TrackingServer(root, _free_port())
    yield server
    server.kill()


def _config(data_root: Path, url: str):
    return load_config(overrides={"paths.data_root": str(data_root), "tracking.tracking_uri": url,
                                  "tracking.strict": False}, environ={})


def _run(client, run_key: str):
    (run,) = client.search_runs(["0", *[e.experiment_id for e in client.search_experiments()]],
                                filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'")
    return run


def test_a_run_whose_server_is_away_takes_seconds_and_is_delivered_when_it_answers(server, tmp_path, caplog):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlflow.tracking import MlflowClient

    data = tmp_path / "data"
    config = _config(data, server.url)
    report = tmp_path / "report.json"
    report.write_text('{"rows": 1200}')

    started = time.monotonic()
    tracker = Tracker(config, "ctr_incremental/manual__1", "incremental 1", {"ctr.pipeline": "incremental"})
    assert tracker.start() is None and tracker.offline
    tracker.log_params({"train.epochs": 1, "train.batch_size": 512})
    tracker.log_metrics({"train.auc": 0.71, "train.loss": 0.45}, step=3)
    logged_at_ms = int(time.time() * 1000)
    tracker.set_tags({"gate": "passed"})
    tracker.log_artifact(report, "validation")
    report.unlink()  # the run's files may be gone by delivery: the outbox kept a copy
    tracker.log_dict({"a": 1}, "feature_spec.json")
    figure, axes = plt.subplots()
    axes.plot([1, 2, 3])
    tracker.log_figure(figure, "plots/freshness.png")
    tracker.end("FINISHED")
    elapsed = time.monotonic() - started
    # Seconds, not minutes: MLflow's own retries would hold each call for about 4 minutes. The bound is loose on
    # purpose (a busy machine is slow); what the settings take away is minutes.
    assert elapsed < MLFLOW_DEFAULT_RETRY_S / 2, f"a run with its tracking server away spent {elapsed:.1f} s"
    assert "does not answer" in caplog.text and str(outbox_dir(config)) in caplog.text
    assert Outbox(outbox_dir(config)).count() == (1, 7)

    status = subprocess.run([sys.executable, "-m", "pipelines.cli", "tracking", "flush",
                             "--set", f"paths.data_root={data}", "--set", f"tracking.tracking_uri={server.url}"],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 1 and "nothing answers at" in status.stderr, status.stderr
    assert "7 call(s) of 1 run(s) wait in" in status.stdout

    server.start()
    # The next run that reaches the server delivers what waits, before its own calls.
    later = Tracker(config, "ctr_incremental/manual__2", "incremental 2", {})
    assert later.start() is not None and not later.offline
    assert Outbox(outbox_dir(config)).count() == (0, 0)
    assert not any(outbox_dir(config).iterdir())  # the kept copies went with their calls

    client = MlflowClient(server.url)
    run = _run(client, "ctr_incremental/manual__1")
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "incremental 1"
    assert run.data.params == {"train.epochs": "1", "train.batch_size": "512"}
    assert run.data.metrics == {"train.auc": 0.71, "train.loss": 0.45}
    (auc,) = client.get_metric_history(run.info.run_id, "train.auc")
    assert auc.step == 3 and logged_at_ms - 5000 <= auc.timestamp <= logged_at_ms  # when it was logged
    assert run.data.tags["gate"] == "passed" and run.data.tags["ctr.pipeline"] == "incremental"
    assert run.data.tags[DELIVERED_LATE_TAG] == "7"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"validation", "feature_spec.json", "plots"}
    assert [a.path for a in client.list_artifacts(run.info.run_id, "plots")] == ["plots/freshness.png"]
    local = client.download_artifacts(run.info.run_id, "validation/report.json", str(tmp_path))
    assert json.loads(Path(local).read_text()) == {"rows": 1200}


def test_a_server_lost_in_the_middle_of_a_run_costs_seconds_and_loses_nothing(server, tmp_path):
    from mlflow.tracking import MlflowClient

    config = _config(tmp_path / "data", server.url)
    server.start()
    tracker = Tracker(config, "ctr_daily/scheduled__1", "daily 1", {})
    assert tracker.start() is not None
    tracker.log_metrics({"train.auc": 0.70}, step=1)

    server.kill()
    started = time.monotonic()
    tracker.log_metrics({"train.auc": 0.75}, step=2)
    tracker.set_tags({"gate": "passed"})
    tracker.end("FINISHED")
    elapsed = time.monotonic() - started
    assert tracker.offline
    assert elapsed < MLFLOW_DEFAULT_RETRY_S / 2, f"losing the tracking server cost the run {elapsed:.1f} s"
    assert Outbox(outbox_dir(config)).count() == (1, 3)

    server.start()
    delivery = deliver_outbox(config, model_logger=None)
    assert (delivery.runs, delivery.calls, delivery.pending_runs) == (1, 3, 0)
    client = MlflowClient(server.url)
    run = _run(client, "ctr_daily/scheduled__1")
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train.auc")] == [(1, 0.70),
                                                                                                    (2, 0.75)]
    assert run.info.status == "FINISHED" and run.data.tags["gate"] == "passed"


def test_a_call_the_server_refuses_is_dropped_without_blocking_the_rest(server, tmp_path):
    from mlflow.tracking import MlflowClient

    config = _config(tmp_path / "data", server.url)
    outbox = Outbox(outbox_dir(config))
    header = {"run_key": "ctr_daily/refused", "run_name": "refused", "tags": {}, "start_time_ms": 1_700_000_000_000}
    now = int(time.time() * 1000)
    # A metric name MLflow refuses (400 INVALID_PARAMETER_VALUE), between two good calls.
    outbox.append(header, {"op": "log_params", "params": {"ok": "1"}, "time_ms": now})
    outbox.append(header, {"op": "log_metrics", "metrics": {"auc?<bad>": 0.5}, "step": 0, "time_ms": now})
    outbox.append(header, {"op": "set_tags", "tags": {"after": "yes"}, "time_ms": now})
    server.start()
    assert deliver_outbox(config, model_logger=None).pending_runs == 0
    run = _run(MlflowClient(server.url), "ctr_daily/refused")
    assert run.data.params == {"ok": "1"} and run.data.metrics == {} and run.data.tags["after"] == "yes"
    assert run.info.start_time == 1_700_000_000_000
