"""`ctr stack`'s parts that run without the stack: settings and secrets, process records, the S3 server's
snapshot. The whole stack is tests/stack (make test-stack)."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines import stack
from pipelines.stack import SECRET_KEYS, Service, StackError, load_settings

REPO = Path(__file__).resolve().parents[2]


def _environ(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"CTR_STACK_HOME": str(tmp_path / "home"), "CTR_STACK_SECRETS": str(tmp_path / "cfg" / "stack.env"),
            **extra}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.unit
def test_up_generates_every_secret_once_into_a_private_file_outside_the_repository(tmp_path):
    first = load_settings(_environ(tmp_path), create_secrets=True)
    path = tmp_path / "cfg" / "stack.env"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert all(len(first.secrets[key]) >= 24 for key in SECRET_KEYS)
    assert len(set(first.secrets[key] for key in SECRET_KEYS)) == len(SECRET_KEYS)
    again = load_settings(_environ(tmp_path), create_secrets=True)
    assert again.secrets == first.secrets
    # The environment wins over the file, and users have their compose defaults.
    overridden = load_settings(_environ(tmp_path, _AIRFLOW_WWW_USER_PASSWORD="from-env"))
    assert overridden.secrets["_AIRFLOW_WWW_USER_PASSWORD"] == "from-env"
    assert overridden.secrets["_AIRFLOW_WWW_USER_USERNAME"] == "airflow"
    from cryptography.fernet import Fernet

    Fernet(first.secrets["AIRFLOW__CORE__FERNET_KEY"].encode())  # a valid key, or Airflow refuses to start


@pytest.mark.unit
def test_missing_secrets_are_named_and_a_secrets_file_inside_the_repository_is_refused(tmp_path):
    with pytest.raises(StackError, match="lacks _AIRFLOW_WWW_USER_PASSWORD, POSTGRES_PASSWORD"):
        load_settings(_environ(tmp_path))
    assert load_settings(_environ(tmp_path), require_secrets=False).secrets["POSTGRES_PASSWORD"] == ""
    with pytest.raises(StackError, match="inside the repository"):
        load_settings(_environ(tmp_path, CTR_STACK_SECRETS=str(REPO / "stack.env")), create_secrets=True)
    assert not (REPO / "stack.env").exists()


@pytest.mark.unit
@pytest.mark.parametrize("key, value, message", [
    ("CTR_STACK_NAME", "ctr-prod; drop", "lower-case letters"),
    ("AIRFLOW_API_PORT", "80a", "not a port number"),
    ("SPARK_WORKERS", "two", "not a whole number"),
    ("SPARK_WORKERS", "0", "without workers"),
])
def test_bad_settings_are_refused_with_what_to_use(tmp_path, key, value, message):
    with pytest.raises(StackError, match=message):
        load_settings(_environ(tmp_path, **{key: value}), require_secrets=False)


@pytest.mark.unit
def test_components_get_postgres_celery_and_the_login_and_no_secret_is_on_a_command_line(tmp_path):
    settings = load_settings(_environ(tmp_path, CTR_STACK_NAME="prod", MLFLOW_PORT="5111"), create_secrets=True)
    env = stack.airflow_stack_environment(settings)
    password = settings.secrets["POSTGRES_PASSWORD"]
    assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] == (
        f"postgresql+psycopg2://prod_airflow:{password}@127.0.0.1:5432/prod_airflow")
    assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert env["AIRFLOW__CELERY__BROKER_URL"] == "redis://127.0.0.1:6379/0"
    assert env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS"] == "airflow:admin"
    assert env["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5111"
    assert env["MLFLOW_TRACKING_PASSWORD"] == settings.secrets["MLFLOW_TRACKING_PASSWORD"]
    assert env["CTR_MODEL_STORE"] == "s3://models/"
    names = [s.name for s in stack.services(settings)]
    assert names == ["s3", "spark-master", "spark-worker-1", "spark-worker-2", "spark-connect", "mlflow",
                     "airflow-api-server", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer",
                     "airflow-worker", "step-worker", "serving"]
    secret_values = [settings.secrets[key] for key in SECRET_KEYS]
    for service in stack.services(settings):
        assert not any(secret in arg for arg in service.command for secret in secret_values), service.name
    local = load_settings(_environ(tmp_path, AIRFLOW_EXECUTOR="LocalExecutor"), require_secrets=False)
    assert "airflow-worker" not in [s.name for s in stack.services(local)]


@pytest.mark.unit
def test_the_spark_steps_run_on_the_stacks_standalone_cluster_unless_a_master_is_named(tmp_path):
    settings = load_settings(_environ(tmp_path, SPARK_MASTER_PORT="7177", SPARK_WORKER_CORES="3"),
                             require_secrets=False)
    by_name = {s.name: s for s in stack.services(settings)}
    master = by_name["spark-master"]
    assert master.command[1:] == ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", "7177",
                                  "--webui-port", "8081"]
    assert master.command[0].endswith("/bin/spark-class")
    for index in (1, 2):
        worker = by_name[f"spark-worker-{index}"]
        assert worker.after == ("spark-master",)
        assert worker.command[-1] == "spark://127.0.0.1:7177"
        assert worker.command[worker.command.index("--cores") + 1] == "3"
        assert worker.command[worker.command.index("--webui-port") + 1] == str(8081 + index)
        # The executors import the project's modules: the jobs' Python functions are pickled by reference.
        assert worker.env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
    connect = by_name["spark-connect"]
    assert connect.after == ("spark-worker-1", "spark-worker-2")
    assert connect.command[connect.command.index("--master") + 1] == "spark://127.0.0.1:7177"
    assert connect.command[connect.command.index("--executor-memory") + 1] == "2g"
    assert "spark.ui.port=4040" in connect.command
    assert stack.pipeline_config(settings).spark.master == "spark://127.0.0.1:7177"
    assert all(by_name[name].env["SPARK_LOCAL_IP"] == "127.0.0.1"
               for name in ("spark-master", "spark-worker-1", "spark-connect"))

    local = load_settings(_environ(tmp_path, SPARK_MASTER="local[2]"), require_secrets=False)
    names = [s.name for s in stack.services(local)]
    assert not [n for n in names if n.startswith("spark-") and n != "spark-connect"]
    connect = next(s for s in stack.services(local) if s.name == "spark-connect")
    assert connect.command[connect.command.index("--master") + 1] == "local[2]"
    assert "--executor-memory" not in connect.command and connect.after == ()


@pytest.mark.unit
def test_config_files_hold_the_login_privately(tmp_path):
    settings = load_settings(_environ(tmp_path), create_secrets=True)
    stack.write_config_files(settings)
    passwords = settings.home / "airflow" / "passwords.json"
    assert passwords.read_text() == f'{{"airflow": "{settings.secrets["_AIRFLOW_WWW_USER_PASSWORD"]}"}}'
    ini = (settings.home / "mlflow" / "basic_auth.ini").read_text()
    assert "admin_username = admin" in ini and settings.secrets["MLFLOW_TRACKING_PASSWORD"] not in ini
    for path in (passwords, settings.home / "mlflow" / "basic_auth.ini"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.integration
def test_down_stops_the_whole_process_group_and_a_reused_pid_is_not_taken_for_the_service(tmp_path):
    settings = load_settings(_environ(tmp_path), require_secrets=False)
    child_pid_file = tmp_path / "child.pid"
    service = Service("sleeper", ["sh", "-c", f"sleep 300 & echo $! > {child_pid_file}; wait"], dict(os.environ),
                      "-", lambda: None)
    pid = stack.start_service(settings, service)
    deadline = time.monotonic() + 10
    while not child_pid_file.exists() or not child_pid_file.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(child_pid_file.read_text())
    assert stack.running_pid(settings, "sleeper") == pid
    said = []
    stack.down(settings, say=said.append)  # "sleeper" is no service of these settings: stopped all the same
    assert said == ["sleeper: stopped"]
    assert stack.running_pid(settings, "sleeper") is None
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split(")")[1][:3]
    assert not (settings.home / "run" / "sleeper.json").exists()
    # A record whose process has gone and whose pid now belongs to another process (different start time).
    other = subprocess.Popen(["sleep", "30"])
    try:
        (settings.home / "run" / "ghost.json").write_text(f'{{"pid": {other.pid}, "start": "1", "command": []}}')
        assert stack.running_pid(settings, "ghost") is None
        assert stack.stop_service(settings, "ghost") == "not running"
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


@pytest.mark.integration
def test_s3_server_keeps_its_buckets_across_a_restart(tmp_path):
    import boto3

    from pipelines.s3_server import read_index, restored_by

    port = _free_port()
    command = [sys.executable, "-m", "pipelines.s3_server", "--port", str(port), "--snapshot", str(tmp_path / "s3"),
               "--every", "60", "--bucket", "models"]

    def start() -> subprocess.Popen:
        process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                              aws_access_key_id="k", aws_secret_access_key="s")
        deadline = time.monotonic() + 60
        while restored_by(tmp_path / "s3") != process.pid:
            assert time.monotonic() < deadline and process.poll() is None, "the S3 server did not come up"
            time.sleep(0.1)
        return process, client

    process, client = start()
    try:
        client.put_object(Bucket="models", Key="ctr/1/manifest.json", Body=b'{"v": 1}')
        client.put_object(Bucket="models", Key="ctr/1/model.bin", Body=bytes(range(256)) * 100)
        client.put_object(Bucket="models", Key="ctr/old", Body=b"gone soon")
        client.delete_object(Bucket="models", Key="ctr/old")
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    process, client = start()
    try:
        keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket="models")["Contents"])
        assert keys == ["ctr/1/manifest.json", "ctr/1/model.bin"]
        assert client.get_object(Bucket="models", Key="ctr/1/model.bin")["Body"].read() == bytes(range(256)) * 100
        client.put_object(Bucket="models", Key="ctr/1/manifest.json", Body=b'{"v": 2}')
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    assert restored_by(tmp_path / "s3") is None
    index = read_index(tmp_path / "s3")
    assert sorted(index["models"]) == ["ctr/1/manifest.json", "ctr/1/model.bin"]
    assert len(list((tmp_path / "s3" / "objects").iterdir())) == 2
    manifest = index["models"]["ctr/1/manifest.json"]["file"]
    assert (tmp_path / "s3" / "objects" / manifest).read_bytes() == b'{"v": 2}'
