"""`ctr-pipeline stack`: docker-compose.yml's production topology as real processes on one machine.

    ctr-pipeline stack up          start what is not running, in dependency order, each health-checked
    ctr-pipeline stack status      every service with its URL, process id and state
    ctr-pipeline stack logs [SERVICE] [-n N] [-f]
    ctr-pipeline stack env         the variables a shell needs to use the stack (`eval "$(ctr-pipeline stack env)"`)
    ctr-pipeline stack down        stop exactly the processes `up` started (by process id); data and databases stay

Services (docs/production.md has the compose counterparts):
- PostgreSQL and Redis are the machine's own servers (127.0.0.1:5432 and :6379); `up` creates the stack's roles
  and databases (`<name>_airflow`, `<name>_mlflow`) the first time;
- s3: moto's S3 server on loopback with buckets `models` (the model store) and `mlflow` (MLflow's artifacts),
  kept on disk across restarts (pipelines/s3_server.py);
- spark-master, spark-worker-1, -2: a Spark standalone cluster from the pyspark wheel (SPARK_MASTER=standalone,
  the default; SPARK_WORKERS workers), whose executors run the Spark steps' tasks;
- spark-connect: the Spark Connect server the Spark steps run on (SPARK_REMOTE), the cluster's driver;
- mlflow: the tracking server on PostgreSQL, artifacts proxied to s3://mlflow/, basic authentication on;
- airflow-api-server, -scheduler, -dag-processor, -triggerer and, with the CeleryExecutor (the default here), an
  airflow-worker on Redis; the simple auth manager, so the UI and the API need a login;
- serving: `ctr-pipeline serve` following s3://models/.

Configured by the variables docker-compose.yml reads (ports, executor, Spark, region), plus `CTR_STACK_*`
(`STACK_DEFAULTS`). Secrets come from the environment, else from a file outside the repository
(`CTR_STACK_SECRETS`, default ~/.config/ctr-pipeline/stack.env, mode 600), where `up` generates any that are
missing the first time. Everything the stack writes (data root, S3 snapshot, Airflow logs, process ids, service
logs) is under `CTR_STACK_HOME` (default var/stack).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from components.config import PipelineConfig, load_config
from pipelines import step_client
from pipelines.airflow_env import airflow_environment, prepare_database
from pipelines.step_auth import SECRET_VARIABLE

REPO_ROOT = Path(__file__).resolve().parent.parent

STACK_DEFAULTS: dict[str, str] = {
    "CTR_STACK_HOME": "var/stack",
    "CTR_STACK_NAME": "ctr",  # prefix of the PostgreSQL roles and databases
    "CTR_STACK_SECRETS": "~/.config/ctr-pipeline/stack.env",
    "CTR_STACK_POSTGRES": "postgresql://postgres@127.0.0.1:5432/postgres",  # a role that may create roles
    "CTR_STACK_REDIS": "redis://127.0.0.1:6379/0",
    "AIRFLOW_EXECUTOR": "CeleryExecutor",
    "AIRFLOW_API_PORT": "8080",
    "AIRFLOW_WORKER_LOG_PORT": "8793",
    "AIRFLOW_TRIGGERER_LOG_PORT": "8794",
    "MLFLOW_PORT": "5000",
    "S3_API_PORT": "9000",
    "S3_REGION": "us-east-1",
    "MODEL_STORE_URI": "s3://models/",
    "SPARK_CONNECT_PORT": "15002",
    # "standalone": the stack starts a Spark standalone master and SPARK_WORKERS workers (spark_jobs/standalone.py)
    # and the Connect server is their driver; local[N] runs Spark in the Connect server alone; spark://host:port
    # (or k8s://...) names a cluster the stack does not start.
    "SPARK_MASTER": "standalone",
    "SPARK_WORKERS": "2",
    "SPARK_WORKER_CORES": "0",  # 0: this machine's cores shared out between the workers (at least 1 each)
    "SPARK_WORKER_MEMORY": "3g",
    "SPARK_EXECUTOR_MEMORY": "2g",
    "SPARK_MASTER_PORT": "7077",
    "SPARK_MASTER_WEBUI_PORT": "8081",
    "SPARK_WORKER_WEBUI_PORT": "8082",  # the first worker's; the next ones count up (0: any free port)
    "SPARK_UI_PORT": "4040",  # the Connect server's Spark UI: its jobs, stages and executors
    "SPARK_DRIVER_MEMORY": "4g",
    "SERVING_PORT": "8501",
    "SERVING_GRPC_PORT": "8500",
}
# Generated once into the secrets file unless the environment sets them.
SECRET_KEYS = ("_AIRFLOW_WWW_USER_PASSWORD", "POSTGRES_PASSWORD", "MLFLOW_DB_PASSWORD", "S3_ACCESS_KEY_ID",
               "S3_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD", "AIRFLOW__CORE__FERNET_KEY",
               "AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__API__SECRET_KEY", "MLFLOW_FLASK_SERVER_SECRET_KEY",
               SECRET_VARIABLE)
USERS = {"_AIRFLOW_WWW_USER_USERNAME": "airflow", "MLFLOW_TRACKING_USERNAME": "admin"}
BUCKETS = ("models", "mlflow")
START_MARKER = "\n==== "  # begins the line `up` writes into a service's log before starting it


class StackError(RuntimeError):
    """The stack cannot start, or a service did not come up; the message says which and where its log is."""


@dataclass(frozen=True)
class StackSettings:
    values: Mapping[str, str]  # STACK_DEFAULTS, overridden by the environment
    secrets: Mapping[str, str]  # SECRET_KEYS and USERS: the environment, else the secrets file

    @property
    def home(self) -> Path:
        return Path(self.values["CTR_STACK_HOME"]).expanduser().absolute()

    @property
    def name(self) -> str:
        return self.values["CTR_STACK_NAME"]

    def port(self, key: str) -> int:
        return int(self.values[key])

    def url(self, key: str) -> str:
        return f"http://127.0.0.1:{self.port(key)}"

    @property
    def spark_standalone(self) -> bool:
        """Whether the stack runs its own Spark standalone master and workers."""
        return self.values["SPARK_MASTER"] == "standalone"

    @property
    def spark_master(self) -> str:
        """The master the Connect server is given."""
        if self.spark_standalone:
            return f"spark://127.0.0.1:{self.port('SPARK_MASTER_PORT')}"
        return self.values["SPARK_MASTER"]

    @property
    def spark_workers(self) -> list[str]:
        """The names of the stack's Spark workers, as services."""
        return [f"spark-worker-{i}" for i in range(1, int(self.values["SPARK_WORKERS"]) + 1)] \
            if self.spark_standalone else []

    @property
    def celery(self) -> bool:
        return self.values["AIRFLOW_EXECUTOR"] == "CeleryExecutor"

    def database_url(self, db: str, driver: str = "postgresql+psycopg2") -> str:
        """The URL of the stack's `db` database ("airflow" or "mlflow") as its own role."""
        admin = _parse_pg(self.values["CTR_STACK_POSTGRES"])
        password = self.secrets["POSTGRES_PASSWORD" if db == "airflow" else "MLFLOW_DB_PASSWORD"]
        role = f"{self.name}_{db}"
        return f"{driver}://{role}:{password}@{admin['host']}:{admin['port']}/{role}"


def load_settings(environ: Mapping[str, str] | None = None, create_secrets: bool = False,
                  require_secrets: bool = True) -> StackSettings:
    """The stack's settings. `create_secrets` generates missing secrets into the secrets file (`up`);
    without it a missing secret is an error when `require_secrets` (`env`), else left empty (`status`, `down`)."""
    environ = os.environ if environ is None else environ
    values = {key: environ.get(key) or default for key, default in STACK_DEFAULTS.items()}
    if not re.fullmatch(r"[a-z][a-z0-9_]{0,30}", values["CTR_STACK_NAME"]):
        raise StackError(f"CTR_STACK_NAME={values['CTR_STACK_NAME']!r}: use lower-case letters, digits and _ "
                         "(it prefixes PostgreSQL role and database names)")
    for key in STACK_DEFAULTS:
        if key.endswith("_PORT") and not values[key].isdigit():
            raise StackError(f"{key}={values[key]!r} is not a port number")
    for key in ("SPARK_WORKERS", "SPARK_WORKER_CORES"):
        if not values[key].isdigit():
            raise StackError(f"{key}={values[key]!r} is not a whole number")
    if values["SPARK_MASTER"] == "standalone" and int(values["SPARK_WORKERS"]) < 1:
        raise StackError("SPARK_WORKERS=0 leaves the standalone master without workers: use 1 or more, or "
                         "SPARK_MASTER=local[*] to run Spark in the Connect server alone")
    path = Path(values["CTR_STACK_SECRETS"]).expanduser()
    stored = _read_env_file(path)
    missing = [key for key in SECRET_KEYS if not environ.get(key) and not stored.get(key)]
    if missing and create_secrets:
        _inside_repository_check(path)
        stored.update({key: _new_secret(key) for key in missing})
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("# ctr-pipeline stack secrets, generated by `ctr-pipeline stack up`; the environment overrides "
                       "them\n"
                       + "".join(f"{key}={stored[key]}\n" for key in sorted(stored)))
        tmp.chmod(0o600)
        os.replace(tmp, path)
    elif missing and require_secrets:
        raise StackError(f"{path} lacks {', '.join(missing)}: run `ctr-pipeline stack up` once (it generates them) or "
                         "set them in the environment")
    resolved = {key: environ.get(key) or stored.get(key, "") for key in SECRET_KEYS}
    resolved.update({key: environ.get(key) or stored.get(key) or default for key, default in USERS.items()})
    return StackSettings(values, resolved)


def _new_secret(key: str) -> str:
    if key == "AIRFLOW__CORE__FERNET_KEY":
        from cryptography.fernet import Fernet

        return Fernet.generate_key().decode()
    return secrets.token_urlsafe(24)


def _inside_repository_check(path: Path) -> None:
    if path.absolute().is_relative_to(REPO_ROOT):
        raise StackError(f"CTR_STACK_SECRETS={path} is inside the repository; keep secrets outside it")


def _read_env_file(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
    return out


def _parse_pg(url: str) -> dict[str, str]:
    from urllib.parse import urlparse

    parsed = urlparse(url)
    return {"host": parsed.hostname or "127.0.0.1", "port": str(parsed.port or 5432)}


# ----------------------------------------------------------------------------------------------------------------
# What each process gets


def pipeline_config(settings: StackSettings) -> PipelineConfig:
    """The pipeline's config inside the stack: data under the stack's home, models in S3, MLflow and Spark
    Connect on loopback."""
    return load_config(overrides={
        "paths.data_root": str(settings.home / "data"),
        "paths.model_store": settings.values["MODEL_STORE_URI"],
        "paths.s3_endpoint_url": settings.url("S3_API_PORT"),
        "tracking.tracking_uri": settings.url("MLFLOW_PORT"),
        "spark.remote": f"sc://127.0.0.1:{settings.port('SPARK_CONNECT_PORT')}",
        "spark.master": settings.spark_master,
        "spark.driver_memory": settings.values["SPARK_DRIVER_MEMORY"],
        "spark.executor_memory": settings.values["SPARK_EXECUTOR_MEMORY"],
        "spark.ui_port": settings.port("SPARK_UI_PORT"),
        "serving.port": settings.port("SERVING_PORT"),
        "serving.grpc_port": settings.port("SERVING_GRPC_PORT"),
    }, environ={})


def client_environment(settings: StackSettings) -> dict[str, str]:
    """What a client of the stack needs (tasks, `ctr` commands, the model server): where everything is, and the
    credentials of S3, MLflow and the step worker (which the worker gets too). `ctr-pipeline stack env` prints
    it."""
    config = pipeline_config(settings)
    s = settings.secrets
    return {
        "CTR_HOME": str(config.paths.root),
        "CTR_MODEL_STORE": settings.values["MODEL_STORE_URI"],
        "CTR_S3_ENDPOINT_URL": settings.url("S3_API_PORT"),
        "AWS_ACCESS_KEY_ID": s["S3_ACCESS_KEY_ID"],
        "AWS_SECRET_ACCESS_KEY": s["S3_SECRET_ACCESS_KEY"],
        "AWS_DEFAULT_REGION": settings.values["S3_REGION"],
        "MLFLOW_TRACKING_URI": settings.url("MLFLOW_PORT"),
        "MLFLOW_TRACKING_USERNAME": s["MLFLOW_TRACKING_USERNAME"],
        "MLFLOW_TRACKING_PASSWORD": s["MLFLOW_TRACKING_PASSWORD"],
        "SPARK_REMOTE": config.spark.remote,
        "_AIRFLOW_WWW_USER_USERNAME": s["_AIRFLOW_WWW_USER_USERNAME"],
        "_AIRFLOW_WWW_USER_PASSWORD": s["_AIRFLOW_WWW_USER_PASSWORD"],
        "CTR_AIRFLOW_API_URL": settings.url("AIRFLOW_API_PORT"),
        "CTR_SERVING_URL": settings.url("SERVING_PORT"),
        SECRET_VARIABLE: s[SECRET_VARIABLE],
    }


def airflow_stack_environment(settings: StackSettings) -> dict[str, str]:
    """Every Airflow component's environment: PostgreSQL metadata, the executor, the shared secrets, the login."""
    api = settings.url("AIRFLOW_API_PORT")
    airflow_home = settings.home / "airflow"
    env = airflow_environment(pipeline_config(settings), base={**os.environ, **client_environment(settings)},
                              api_port=settings.port("AIRFLOW_API_PORT"))
    s = settings.secrets
    env.update({
        "AIRFLOW_HOME": str(airflow_home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": settings.database_url("airflow"),
        "AIRFLOW__CORE__EXECUTOR": settings.values["AIRFLOW_EXECUTOR"],
        "AIRFLOW__CELERY__BROKER_URL": settings.values["CTR_STACK_REDIS"],
        "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + settings.database_url("airflow"),
        "AIRFLOW__CELERY__WORKER_CONCURRENCY": "4",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{api}/execution/",
        "AIRFLOW__API__BASE_URL": api,
        "AIRFLOW__CORE__AUTH_MANAGER":
            "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{s['_AIRFLOW_WWW_USER_USERNAME']}:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(airflow_home / "passwords.json"),
        "AIRFLOW__CORE__FERNET_KEY": s["AIRFLOW__CORE__FERNET_KEY"],
        "AIRFLOW__API_AUTH__JWT_SECRET": s["AIRFLOW__API_AUTH__JWT_SECRET"],
        "AIRFLOW__API__SECRET_KEY": s["AIRFLOW__API__SECRET_KEY"],
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": settings.values["AIRFLOW_WORKER_LOG_PORT"],
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": settings.values["AIRFLOW_TRIGGERER_LOG_PORT"],
    })
    return env


# ----------------------------------------------------------------------------------------------------------------
# Services


@dataclass(frozen=True)
class Service:
    name: str
    command: list[str]
    env: dict[str, str]
    url: str
    ready: Callable[[], str | None]  # None once ready, else what it is waiting for
    port: int | None = None  # the port it listens on, which must be free before it starts
    timeout_s: float = 180.0
    after: tuple[str, ...] = field(default_factory=tuple)  # services that must be ready before it starts


def services(settings: StackSettings) -> list[Service]:
    """The stack's long-running processes, in start order."""
    python = sys.executable
    client = {**os.environ, **client_environment(settings)}
    airflow_env = airflow_stack_environment(settings)
    s3 = settings.url("S3_API_PORT")
    mlflow_url = settings.url("MLFLOW_PORT")
    api = settings.url("AIRFLOW_API_PORT")
    home = settings.home
    spark_env = {**{k: v for k, v in client.items() if k != "SPARK_REMOTE"}, **_spark_env(settings)}
    out = [
        Service("s3", [python, "-m", "pipelines.s3_server", "--port", str(settings.port("S3_API_PORT")),
                       "--snapshot", str(home / "s3"), *[a for b in BUCKETS for a in ("--bucket", b)]],
                client, s3, lambda: _s3_ready(s3, settings), port=settings.port("S3_API_PORT")),
        *_spark_cluster(settings, spark_env),
        Service("spark-connect", _spark_command(settings), spark_env,
                f"sc://127.0.0.1:{settings.port('SPARK_CONNECT_PORT')}",
                lambda: None if port_answers(settings.port("SPARK_CONNECT_PORT")) else "its port",
                port=settings.port("SPARK_CONNECT_PORT"), after=tuple(settings.spark_workers)),
        # The database URL (it holds a password) goes through the environment, not the command line.
        Service("mlflow", [python, "-m", "mlflow", "server", "--app-name", "basic-auth",
                           "--artifacts-destination", "s3://mlflow/", "--serve-artifacts", "--host", "127.0.0.1",
                           "--port", str(settings.port("MLFLOW_PORT")), "--workers", "2"],
                {**client, "MLFLOW_BACKEND_STORE_URI": settings.database_url("mlflow"),
                 "MLFLOW_S3_ENDPOINT_URL": s3, "MLFLOW_AUTH_CONFIG_PATH": str(home / "mlflow" / "basic_auth.ini"),
                 "MLFLOW_AUTH_ADMIN_PASSWORD": settings.secrets["MLFLOW_TRACKING_PASSWORD"],
                 "MLFLOW_FLASK_SERVER_SECRET_KEY": settings.secrets["MLFLOW_FLASK_SERVER_SECRET_KEY"]},
                mlflow_url, lambda: _http_ready(f"{mlflow_url}/health"), port=settings.port("MLFLOW_PORT"),
                after=("s3",)),
        Service("airflow-api-server", [python, "-m", "airflow", "api-server", "--port",
                                       str(settings.port("AIRFLOW_API_PORT"))],
                airflow_env, api, lambda: _http_ready(f"{api}/api/v2/monitor/health"),
                port=settings.port("AIRFLOW_API_PORT")),
    ]
    for component in ("scheduler", "dag-processor", "triggerer"):
        out.append(Service(f"airflow-{component}", [python, "-m", "airflow", component], airflow_env, api,
                           _airflow_component_ready(api, component.replace("-", "_")),
                           after=("airflow-api-server",)))
    if settings.celery:
        out.append(Service("airflow-worker", [python, "-m", "airflow", "celery", "worker"], airflow_env,
                           settings.values["CTR_STACK_REDIS"],
                           lambda: _log_says(home / "logs" / "airflow-worker.log", " ready."),
                           after=("airflow-api-server",)))
    # The minute DAG's steps, run warm for its tasks (pipelines/step_worker.py), with the tasks' environment and
    # so their CTR_STEP_WORKER_SECRET; on loopback, its default.
    data_root = pipeline_config(settings).paths.root
    out.append(Service("step-worker", [python, "-m", "pipelines.cli", "worker"], client,
                       f"{step_client.address_file(data_root)}", lambda: _step_worker_ready(data_root),
                       after=("s3", "spark-connect", "mlflow")))
    serving = settings.url("SERVING_PORT")
    out.append(Service("serving", [python, "-m", "pipelines.cli", "serve", "--host", "127.0.0.1", "--port",
                                   str(settings.port("SERVING_PORT")), "--grpc-port",
                                   str(settings.port("SERVING_GRPC_PORT"))], client,
                       f"{serving} (gRPC :{settings.port('SERVING_GRPC_PORT')})",
                       lambda: _http_answers(f"{serving}/healthz"), port=settings.port("SERVING_PORT"),
                       after=("s3",)))
    return out


def _spark_cluster(settings: StackSettings, env: dict[str, str]) -> list[Service]:
    """The standalone master and its workers (SPARK_MASTER=standalone), else none. The workers' executors get
    their environment: this interpreter and the repository on PYTHONPATH, so the jobs' Python functions import."""
    if not settings.spark_standalone:
        return []
    from spark_jobs.connect import spark_home
    from spark_jobs.standalone import WORKER_REGISTERED, master_command, master_ready, worker_command

    webui = settings.url("SPARK_MASTER_WEBUI_PORT")
    out = [Service("spark-master", master_command(spark_home(), "127.0.0.1", settings.port("SPARK_MASTER_PORT"),
                                                  settings.port("SPARK_MASTER_WEBUI_PORT")),
                   env, f"{settings.spark_master} (UI {webui})", lambda: master_ready(webui),
                   port=settings.port("SPARK_MASTER_PORT"))]
    workers = settings.spark_workers
    cores = int(settings.values["SPARK_WORKER_CORES"]) or max(1, (os.cpu_count() or 1) // max(1, len(workers)))
    first_ui = settings.port("SPARK_WORKER_WEBUI_PORT")
    worker_env = {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)}
    for index, name in enumerate(workers):
        ui_port = first_ui + index if first_ui else 0
        log = settings.home / "logs" / f"{name}.log"
        out.append(Service(
            name, worker_command(spark_home(), settings.spark_master, "127.0.0.1", cores,
                                 settings.values["SPARK_WORKER_MEMORY"], ui_port, settings.home / "spark" / name),
            worker_env, f"{cores} cores, {settings.values['SPARK_WORKER_MEMORY']}",
            lambda log=log: _log_says(log, WORKER_REGISTERED), after=("spark-master",)))
    return out


def _spark_command(settings: StackSettings) -> list[str]:
    from spark_jobs.connect import server_command

    return server_command(pipeline_config(settings).spark, settings.port("SPARK_CONNECT_PORT"))


def _spark_env(settings: StackSettings) -> dict[str, str]:
    from spark_jobs.connect import spark_home

    logs = settings.home / "logs"
    # SPARK_LOCAL_IP: the master, the workers, their executors and the driver listen on loopback, like the rest
    # of the stack (the driver would take the host's address otherwise).
    return {"SPARK_HOME": str(spark_home()), "SPARK_NO_DAEMONIZE": "1", "PYSPARK_PYTHON": sys.executable,
            "SPARK_LOG_DIR": str(logs), "SPARK_PID_DIR": str(logs), "SPARK_LOCAL_IP": "127.0.0.1"}


# ----------------------------------------------------------------------------------------------------------------
# Health checks: each returns None when ready, else a few words on what it waits for


def port_answers(port: int) -> bool:
    """Whether something listens on 127.0.0.1:`port`. A connect to a free port of the ephemeral range can take
    that very port as its own source and connect to itself (TCP's simultaneous open): that is no listener."""
    with socket.socket() as probe:
        probe.settimeout(0.5)
        if probe.connect_ex(("127.0.0.1", port)) != 0:
            return False
        return probe.getsockname() != probe.getpeername()


def _http_ready(url: str) -> str | None:
    import httpx

    try:
        response = httpx.get(url, timeout=3)
    except httpx.HTTPError as err:
        return f"{url} ({type(err).__name__})"
    return None if response.status_code == 200 else f"{url} ({response.status_code})"


def _http_answers(url: str) -> str | None:
    """Ready once it answers at all (the model server answers 503 until a model is published)."""
    import httpx

    try:
        httpx.get(url, timeout=3)
    except httpx.HTTPError as err:
        return f"{url} ({type(err).__name__})"
    return None


def _s3_ready(endpoint: str, settings: StackSettings) -> str | None:
    """Ready once it restored its snapshot (clients must never see half the store) and has the buckets."""
    from pipelines.s3_server import restored_by

    if restored_by(settings.home / "s3") != running_pid(settings, "s3"):
        return "its snapshot to be restored"
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    client = boto3.client("s3", endpoint_url=endpoint, region_name=settings.values["S3_REGION"],
                          aws_access_key_id=settings.secrets["S3_ACCESS_KEY_ID"],
                          aws_secret_access_key=settings.secrets["S3_SECRET_ACCESS_KEY"])
    try:
        names = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    except (BotoCoreError, ClientError) as err:
        return f"{endpoint} ({type(err).__name__})"
    missing = [b for b in BUCKETS if b not in names]
    return f"buckets {missing}" if missing else None


def _airflow_component_ready(api: str, key: str) -> Callable[[], str | None]:
    def check() -> str | None:
        import httpx

        try:
            health = httpx.get(f"{api}/api/v2/monitor/health", timeout=3).json()
        except (httpx.HTTPError, ValueError) as err:
            return f"the API server's health ({type(err).__name__})"
        status = (health.get(key) or {}).get("status")
        return None if status == "healthy" else f"{key} heartbeat ({status})"
    return check


def _step_worker_ready(data_root: Path) -> str | None:
    address = step_client.worker_address(data_root)
    if address is None:
        return "its address file"
    try:
        socket.create_connection(address, timeout=1).close()
    except OSError:
        return f"{address[0]}:{address[1]}"
    return None


def _log_says(path: Path, text: str) -> str | None:
    """Whether the log, since the service's last start, contains `text`."""
    try:
        since_start = path.read_text(errors="replace").rsplit(START_MARKER, 1)[-1]
    except FileNotFoundError:
        return f"{path.name}"
    return None if text in since_start else f"{text.strip()!r} in {path.name}"


def _check_postgres(settings: StackSettings) -> str | None:
    try:
        import psycopg2
    except ImportError:
        return "psycopg2 is not installed: run `tools/ensure_env.sh --stack` (make stack does)"
    try:
        psycopg2.connect(settings.values["CTR_STACK_POSTGRES"], connect_timeout=3).close()
    except psycopg2.Error as err:
        return str(err).strip()
    return None


def _check_redis(settings: StackSettings) -> str | None:
    from urllib.parse import urlparse

    parsed = urlparse(settings.values["CTR_STACK_REDIS"])
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 6379), timeout=3) as sock:
            sock.sendall(b"PING\r\n")
            reply = sock.recv(64)
    except OSError as err:
        return str(err)
    return None if reply.startswith((b"+PONG", b"-NOAUTH")) else f"unexpected reply {reply[:40]!r}"


# ----------------------------------------------------------------------------------------------------------------
# Bootstrap: roles, databases, config files


def bootstrap_postgres(settings: StackSettings) -> list[str]:
    """Creates (or sets the password of) the roles `<name>_airflow` and `<name>_mlflow` and their databases.
    Returns what it created."""
    import psycopg2
    from psycopg2 import sql

    created = []
    connection = psycopg2.connect(settings.values["CTR_STACK_POSTGRES"], connect_timeout=5)
    connection.autocommit = True
    try:
        with connection.cursor() as cursor:
            for db, secret in (("airflow", "POSTGRES_PASSWORD"), ("mlflow", "MLFLOW_DB_PASSWORD")):
                role = f"{settings.name}_{db}"
                cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,))
                verb = "ALTER" if cursor.fetchone() else "CREATE"
                cursor.execute(sql.SQL(verb + " ROLE {} LOGIN PASSWORD %s").format(sql.Identifier(role)),
                               (settings.secrets[secret],))
                cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", (role,))
                if not cursor.fetchone():
                    cursor.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(role),
                                                                               sql.Identifier(role)))
                    created.append(role)
    finally:
        connection.close()
    return created


def drop_postgres(settings: StackSettings) -> None:
    """Drops the stack's databases and roles (`ctr-pipeline stack down --purge`)."""
    import psycopg2
    from psycopg2 import sql

    connection = psycopg2.connect(settings.values["CTR_STACK_POSTGRES"], connect_timeout=5)
    connection.autocommit = True
    try:
        with connection.cursor() as cursor:
            for db in ("airflow", "mlflow"):
                role = sql.Identifier(f"{settings.name}_{db}")
                cursor.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(role))
                cursor.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(role))
    finally:
        connection.close()


def write_config_files(settings: StackSettings) -> None:
    """MLflow's auth config and Airflow's password file: in the stack's home, mode 600."""
    mlflow_dir = settings.home / "mlflow"
    mlflow_dir.mkdir(parents=True, exist_ok=True)
    _write_private(mlflow_dir / "basic_auth.ini", "\n".join([
        "[mlflow]",
        "default_permission = READ",
        f"database_uri = sqlite:///{mlflow_dir / 'basic_auth.db'}",
        f"admin_username = {settings.secrets['MLFLOW_TRACKING_USERNAME']}",
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth",
        "",
    ]))
    airflow_home = settings.home / "airflow"
    airflow_home.mkdir(parents=True, exist_ok=True)
    _write_private(airflow_home / "passwords.json", json.dumps(
        {settings.secrets["_AIRFLOW_WWW_USER_USERNAME"]: settings.secrets["_AIRFLOW_WWW_USER_PASSWORD"]}))


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.chmod(0o600)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------------------------
# Processes: started in their own session, recorded by pid and start time, stopped by process group


def _proc_start(pid: int) -> str | None:
    """The process's start time (psutil's create_time), which tells it from a later process given the same
    pid; None when it is gone or has exited and awaits its parent (a zombie)."""
    import psutil

    try:
        process = psutil.Process(pid)
        if process.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return None
        return f"{process.create_time():.2f}"
    except (psutil.Error, OSError):
        return None


def _pid_file(settings: StackSettings, name: str) -> Path:
    return settings.home / "run" / f"{name}.json"


def running_pid(settings: StackSettings, name: str) -> int | None:
    """The pid `up` recorded for `name`, if that very process (same start time) is still alive."""
    path = _pid_file(settings, name)
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return record["pid"] if _proc_start(record["pid"]) == record["start"] else None


def start_service(settings: StackSettings, service: Service) -> int:
    logs = settings.home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"{service.name}.log", "ab") as log:
        log.write(f"{START_MARKER}{time.strftime('%Y-%m-%d %H:%M:%S')} starting: {shlex.join(service.command)}\n"
                  .encode())
        log.flush()
        process = subprocess.Popen(service.command, env=service.env, cwd=REPO_ROOT, stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    path = _pid_file(settings, service.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": process.pid, "start": _proc_start(process.pid),
                                "command": service.command}))
    return process.pid


def stop_service(settings: StackSettings, name: str, timeout_s: float = 30.0) -> str:
    pid = running_pid(settings, name)
    path = _pid_file(settings, name)
    if pid is None:
        path.unlink(missing_ok=True)
        return "not running"
    os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _group_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    how = "stopped"
    if _group_alive(pid):
        os.killpg(pid, signal.SIGKILL)
        how = f"killed (still running {timeout_s:.0f} s after SIGTERM)"
    path.unlink(missing_ok=True)
    return how


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    # Zombies of our own children count as gone.
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def _log_tail(settings: StackSettings, name: str, lines: int = 30) -> str:
    path = settings.home / "logs" / f"{name}.log"
    try:
        tail = path.read_text(errors="replace").splitlines()[-lines:]
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(line if len(line) <= 400 else line[:400] + " ..." for line in tail)


# ----------------------------------------------------------------------------------------------------------------
# Commands


def up(settings: StackSettings, say: Callable[[str], None] = print) -> None:
    """Starts every service that is not running, in dependency order; returns once all are healthy."""
    problem = _check_postgres(settings)
    if problem:
        raise StackError(f"PostgreSQL at {settings.values['CTR_STACK_POSTGRES']} is not usable: {problem}")
    if settings.celery and (problem := _check_redis(settings)):
        raise StackError(f"Redis at {settings.values['CTR_STACK_REDIS']} is not usable ({problem}); start it, or "
                         "set AIRFLOW_EXECUTOR=LocalExecutor")
    created = bootstrap_postgres(settings)
    say(f"postgres: {'created ' + ', '.join(created) if created else 'databases present'}")
    write_config_files(settings)
    all_services = services(settings)
    by_name = {s.name: s for s in all_services}
    pending = [s for s in all_services if running_pid(settings, s.name) is None]
    for service in all_services:
        if service not in pending:
            say(f"{service.name}: already running (pid {running_pid(settings, service.name)})")
    busy = {s.name: s.url for s in pending if s.port and port_answers(s.port)}
    if busy:
        raise StackError("ports already taken by processes this stack did not start: "
                         + ", ".join(f"{n} ({u})" for n, u in busy.items())
                         + "; stop them, or move the stack with the *_PORT variables")
    started: dict[str, float] = {}
    ready = {s.name for s in all_services if s not in pending}
    migrated = False
    while pending or len(ready) < len(all_services):
        for service in list(pending):
            if all(dep in ready for dep in service.after):
                if service.name.startswith("airflow-") and not migrated:
                    _migrate_airflow(settings, say)
                    migrated = True
                pid = start_service(settings, service)
                started[service.name] = time.monotonic()
                pending.remove(service)
                say(f"{service.name}: started (pid {pid})")
        for name, since in list(started.items()):
            service = by_name[name]
            if running_pid(settings, name) is None:
                raise StackError(f"{name} exited while starting; the last lines of "
                                 f"{settings.home / 'logs' / (name + '.log')}:\n{_log_tail(settings, name)}\n"
                                 "What did start keeps running: `ctr-pipeline stack up` again starts the rest, "
                                 "`ctr-pipeline stack down` stops it")
            waiting = service.ready()
            if waiting is None:
                ready.add(name)
                del started[name]
                say(f"{name}: healthy after {time.monotonic() - since:.0f} s  {service.url}")
            elif time.monotonic() - since > service.timeout_s:
                raise StackError(f"{name} did not become healthy in {service.timeout_s:.0f} s (waiting for "
                                 f"{waiting}); the last lines of its log:\n{_log_tail(settings, name)}")
        if started or pending:
            time.sleep(1)


def _migrate_airflow(settings: StackSettings, say: Callable[[str], None]) -> None:
    say("airflow: db migrate, pools")
    log = settings.home / "logs" / "airflow-init.log"
    try:
        prepare_database(airflow_stack_environment(settings), log)
    except RuntimeError as err:
        raise StackError(f"{err}:\n{_log_tail(settings, 'airflow-init')}") from err


def down(settings: StackSettings, say: Callable[[str], None] = print) -> None:
    """Stops what `up` started, in reverse order (S3 last, after its final snapshot)."""
    known = [service.name for service in services(settings)]
    recorded = sorted(path.stem for path in (settings.home / "run").glob("*.json")) \
        if (settings.home / "run").is_dir() else []
    # A service started under other settings (e.g. the worker, before AIRFLOW_EXECUTOR changed) stops first.
    for name in [n for n in recorded if n not in known] + [n for n in reversed(known) if n in recorded]:
        say(f"{name}: {stop_service(settings, name)}")


def status(settings: StackSettings) -> list[dict[str, str]]:
    rows = [{"service": "postgres", "pid": "-", "url": settings.values["CTR_STACK_POSTGRES"],
             "state": "external, " + ("up" if _check_postgres(settings) is None else "DOWN")}]
    if settings.celery:
        rows.append({"service": "redis", "pid": "-", "url": settings.values["CTR_STACK_REDIS"],
                     "state": "external, " + ("up" if _check_redis(settings) is None else "DOWN")})
    for service in services(settings):
        pid = running_pid(settings, service.name)
        if pid is None:
            state = "exited" if _pid_file(settings, service.name).exists() else "stopped"
        else:
            waiting = service.ready()
            state = "healthy" if waiting is None else f"starting or unhealthy: {waiting}"
        rows.append({"service": service.name, "pid": str(pid or "-"), "url": service.url, "state": state})
    return rows


def format_status(rows: list[dict[str, str]]) -> str:
    widths = {key: max(len(key), *(len(row[key]) for row in rows)) for key in ("service", "pid", "url")}
    lines = [f"{'service':<{widths['service']}}  {'pid':>{widths['pid']}}  {'url':<{widths['url']}}  state"]
    lines += [f"{r['service']:<{widths['service']}}  {r['pid']:>{widths['pid']}}  {r['url']:<{widths['url']}}  "
              f"{r['state']}" for r in rows]
    return "\n".join(lines)


def log_path(settings: StackSettings, name: str) -> Path:
    names = [s.name for s in services(settings)] + ["airflow-init"]
    if name not in names:
        raise StackError(f"no service {name!r}; the services are {', '.join(names)}")
    return settings.home / "logs" / f"{name}.log"
