"""`make demo`: generate a click log, run `ctr_daily` through Airflow, serve the model and query it.

Runs on the embedded defaults (Airflow on SQLite, local Spark, CPU training, MLflow on SQLite, local model
store), everything under the data root (default ./var).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

from components.config import PipelineConfig, load_config
from components.feature_spec import FeatureSpec
from components.interval import Interval, parse_time
from components.layout import Layout
from pipelines.airflow_env import airflow_environment, prepare_database

DAG_ID = "ctr_daily"


def banner(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def run_logged(command: list[str], env: dict, log_path: Path, show: tuple[str, ...] = ()) -> int:
    """Runs a command with its full output in `log_path`, echoing lines that contain any of `show`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log, subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                                      stderr=subprocess.STDOUT, text=True) as process:
        for line in process.stdout:
            log.write(line)
            # TensorFlow's probe for a GPU logs an ERROR line on a machine without one; training runs on the CPU.
            if any(marker in line for marker in show) and _CUDA_PROBE not in line:
                # Airflow's structured log wraps our progress lines; show only the message, whole.
                text = line.rstrip()
                if "[ctr " in text:
                    text = text[text.index("[ctr "):].split(" [ctr.progress]")[0]
                else:
                    text = text[-220:]
                print("    " + text, flush=True)
        return process.wait()


_CUDA_PROBE = "failed call to cuInit"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_json(url: str, payload: dict | None = None, timeout: float = 30.0) -> dict:
    data = json.dumps(payload).encode() if payload is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return {"body": json.loads(response.read()), "headers": dict(response.headers)}


def example_instance(layout: Layout, minute, spec: FeatureSpec) -> tuple[dict, int]:
    """The first row of a held-out minute as a raw-feature instance (the request a client would send), read by
    the spec, and its label."""
    from components.validation import read_raw_slice

    row = read_raw_slice(layout.raw_minute_dir(minute) / spec.source.file_name, minute, spec=spec).iloc[0]
    return spec.request_instance(row.to_dict()), int(float(row[spec.label.column]))


def main() -> int:
    started = time.monotonic()
    config: PipelineConfig = load_config()
    layout = Layout(config.paths.root)
    day_start = parse_time(config.generate.start).replace(hour=0, minute=0)
    interval = Interval(day_start, day_start + timedelta(days=1))
    logs = layout.root / "demo-logs"

    banner(f"1/4 generating {config.generate.minutes} minutes x {config.generate.rows_per_minute} rows of "
           f"click log into {layout.root / 'raw'}")
    code = run_logged([sys.executable, "-m", "pipelines.cli", "generate"], None, logs / "generate.log",
                      show=("generated", "planted model AUC"))
    if code:
        print(f"generation failed; see {logs / 'generate.log'}")
        return code

    banner(f"2/4 running the Airflow DAG {DAG_ID} for {interval.start:%Y-%m-%d} (airflow dags test, SQLite "
           f"metadata DB in {layout.airflow_home})")
    env = airflow_environment(config)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    airflow = [sys.executable, "-m", "airflow"]
    try:
        prepare_database(env, logs / "airflow-db-migrate.log")
    except RuntimeError as err:
        print(err)
        return 1
    code = run_logged([*airflow, "dags", "test", DAG_ID, interval.end.isoformat()], env, logs / "airflow-dags-test.log",
                      show=("[ctr daily]", "Marking task as", "ERROR"))
    report_path = layout.evaluation_dir(interval) / "report.json"
    if code:
        print(f"the DAG run failed (exit {code}); full log: {logs / 'airflow-dags-test.log'}")
        return code
    # The UI's duration of the run: `dags test` records the logical date as its start (see the function).
    subprocess.run([sys.executable, "-m", "pipelines.airflow_env", "correct-test-run-start", DAG_ID], env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)

    banner("3/4 serving the newest published model (TF-Serving REST API)")
    port = free_port()
    server_log = open(logs / "serve.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "serve", "--port", str(port)], env=env,
                              stdout=server_log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/v1/models/ctr"
    try:
        deadline = time.monotonic() + 180
        status = None
        while time.monotonic() < deadline and server.poll() is None:
            try:
                status = http_json(base, timeout=5)["body"]
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1)
        if status is None:
            print(f"the model server did not come up; see {logs / 'serve.log'}")
            return 1
        from pipelines.context import RunContext
        from pipelines.daily import split_minutes

        ctx = RunContext(config=config, interval=interval, pipeline="daily", run_id="demo")
        instance, label = example_instance(layout, split_minutes(ctx)[1][0], ctx.spec)
        answer = http_json(base + ":predict", {"instances": [instance]})
        prediction = answer["body"]["predictions"][0]
        served_version = answer["headers"].get("X-Model-Version") or answer["headers"].get("x-model-version")
    finally:
        server.terminate()
        server.wait(timeout=30)
        server_log.close()

    banner("4/4 results")
    report = json.loads(report_path.read_text())
    metrics = report["metrics"]
    planted = report.get("planted_auc")
    gap = planted - metrics["auc"]
    print(f"  test AUC            {metrics['auc']:.4f}   (planted model: {planted:.4f}, gap {gap:+.4f})")
    print(f"  logloss             {metrics['logloss']:.4f}")
    print(f"  mean prediction     {metrics['mean_prediction']:.4f}   (mean label {metrics['mean_label']:.4f})")
    print(f"  model version       {served_version}   (status: {json.dumps(status)})")
    print(f"  served prediction   {prediction:.4f} for a held-out impression with label {label}")
    print(f"  request             curl -s -X POST {base.replace(str(port), '8501')}:predict -d "
          f"'{{\"instances\": [{json.dumps({k: instance[k] for k in ('I1', 'I2', 'C1', 'C2')})}]}}'")
    print(f"\n  finished in {time.monotonic() - started:.0f} s. Look closer:")
    print("    make airflow-ui     # Airflow UI on http://localhost:8080 (ctr_daily and its run)")
    from components.tracking import UI_TRAINING_VIEW

    print(f"    make mlflow-ui      # MLflow UI on http://localhost:5000/{UI_TRAINING_VIEW} "
          "(experiment 'ctr': params, metrics, plots, datasets, the registered model)")
    print("    make serve          # serve the newest model on http://127.0.0.1:8501")
    return 0


if __name__ == "__main__":
    sys.exit(main())
