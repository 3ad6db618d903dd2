"""docker-compose.yml: valid for docker-compose 1.29.2 (no engine needed) and shaped as its header and
docs/production.md say.

Properties are read from `docker-compose config` (interpolated with the defaults, anchors and merges
resolved), run in an environment cleared of the file's variables, so a developer's shell or .env cannot
change what is checked.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
PRODUCTION_REQUIREMENTS = ROOT / "docker" / "requirements-production.txt"

AIRFLOW_LONG_RUNNING = {
    "airflow-api-server", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer", "airflow-worker",
}
ONE_SHOT = {"airflow-init", "minio-init"}
EXPECTED_SERVICES = AIRFLOW_LONG_RUNNING | ONE_SHOT | {
    "postgres", "redis", "minio", "mlflow", "spark-master", "spark-worker", "spark-connect", "serving", "step-worker",
}
# Services whose processes run pipeline tasks, by executor.
TASK_RUNNERS = {"airflow-scheduler", "airflow-worker"}
CTR_HOME = "/var/lib/ctr"

# Variables without a default, which `config` and `up` refuse to go without, and the value the checks give them.
REQUIRED = {"CTR_STEP_WORKER_SECRET": "step-worker-secret-of-the-checks"}
REQUIRED_DEFAULT = "none; required"  # what the header says of a required variable's default

# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}; `$${NAME}` is an escaped literal for the container's
# shell.
VARIABLE = re.compile(r"(?<!\$)\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<default>[^}]*))?\}")
HEADER_NAME = re.compile(r"^# (?P<name>_?[A-Z][A-Z0-9_]*)\s+- ")
HEADER_DEFAULT = re.compile(r"^#\s+Default: (?P<default>.*)$")


def split_header(text: str) -> tuple[list[str], str]:
    """The leading comment block and the rest of the file."""
    lines = text.splitlines()
    end = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    return lines[:end], "\n".join(lines[end:])


def documented_variables(header: list[str]) -> dict[str, str]:
    """Variable -> documented default, from the header's `NAME - text` ... `Default: value` entries."""
    documented: dict[str, str] = {}
    current = None
    for line in header:
        if match := HEADER_NAME.match(line):
            current = match["name"]
            if current in documented:
                raise AssertionError(f"{current} is documented twice in the header of {COMPOSE_FILE.name}")
            documented[current] = ""
        elif (match := HEADER_DEFAULT.match(line)) and current:
            documented[current] = match["default"].strip()
            current = None
    return documented


def compose_command() -> str:
    path = shutil.which("docker-compose")
    if path is None:
        pytest.fail(
            "docker-compose is not on PATH, so docker-compose.yml cannot be validated. Install Debian's "
            "docker-compose 1.29.2 (validates without a Docker engine): `apt-get install docker-compose` "
            "(.ci/run installs it in CI)."
        )
    return path


def run_compose(tmp_path_factory: pytest.TempPathFactory, *args: str, **variables: str | None):
    """Runs docker-compose on the file with only `variables` and the REQUIRED ones set (None unsets one), ignoring
    the caller's shell and .env."""
    documented = documented_variables(split_header(COMPOSE_FILE.read_text())[0])
    env = {
        key: value for key, value in os.environ.items()
        if key not in documented and not key.startswith("COMPOSE_")
    }
    env.update(REQUIRED)
    env.update(variables)
    env = {key: value for key, value in env.items() if value is not None}
    empty_env_file = tmp_path_factory.mktemp("compose") / "empty.env"
    empty_env_file.write_text("")
    return subprocess.run(
        [compose_command(), "--env-file", str(empty_env_file), "--project-directory", str(ROOT),
         "-f", str(COMPOSE_FILE), *args],
        env=env, capture_output=True, text=True, timeout=120,
    )


def resolved_config(tmp_path_factory: pytest.TempPathFactory, **variables: str) -> dict:
    result = run_compose(tmp_path_factory, "config", **variables)
    assert result.returncode == 0, f"docker-compose config failed:\n{result.stderr}"
    return yaml.safe_load(result.stdout)


@pytest.fixture(scope="module")
def services(tmp_path_factory) -> dict:
    """The services as docker-compose resolves them with every variable at its default."""
    return resolved_config(tmp_path_factory)["services"]


def published_ports(service: dict) -> dict[int, int]:
    """Container port -> host port, from either port syntax; a port without a fixed host port is left out."""
    ports: dict[int, int] = {}
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            if entry.get("published"):
                ports[int(entry["target"])] = int(entry["published"])
        else:
            host, _, container = str(entry).rpartition(":")
            if host:
                ports[int(container.split("/")[0])] = int(host.rpartition(":")[2])
    return ports


def exact_pins(path: Path) -> dict[str, str]:
    """package -> version for every `name==version` line of a requirements file."""
    pins = {}
    for line in path.read_text().splitlines():
        name, sep, version = line.split("#")[0].partition("==")
        if sep:
            pins[name.strip().lower()] = version.strip()
    return pins


def test_compose_file_validates_with_docker_compose(tmp_path_factory):
    result = run_compose(tmp_path_factory, "config", "-q")
    assert result.returncode == 0, (
        f"`docker-compose config -q` rejected {COMPOSE_FILE.name}:\n{result.stderr}"
    )


def test_expected_services_exist(services):
    missing = EXPECTED_SERVICES - set(services)
    assert not missing, f"services missing from {COMPOSE_FILE.name}: {sorted(missing)}"


def test_every_long_running_service_has_healthcheck_and_restart_policy(services):
    for name, service in services.items():
        if name in ONE_SHOT:
            assert service.get("restart", "no") == "no", f"one-shot {name} must not restart"
            continue
        healthcheck = service.get("healthcheck", {})
        test = healthcheck.get("test")
        assert test and test[0] in {"CMD", "CMD-SHELL"}, f"{name} has no healthcheck: {healthcheck}"
        restart = service.get("restart")
        assert restart in {"always", "unless-stopped"}, f"{name} is long-running but restart={restart!r}"


def test_dependencies_wait_for_health_or_completion(services):
    for name, service in services.items():
        for dependency, spec in service.get("depends_on", {}).items():
            expected = "service_completed_successfully" if dependency in ONE_SHOT else "service_healthy"
            assert spec.get("condition") == expected, f"{name} -> {dependency}: {spec}, expected {expected}"
            if dependency not in ONE_SHOT:
                assert "healthcheck" in services[dependency], (
                    f"{name} waits on {dependency} being healthy, but {dependency} has no healthcheck"
                )


def test_airflow_services_wait_for_healthy_postgres_and_init(services):
    assert services["airflow-init"]["depends_on"]["postgres"] == {"condition": "service_healthy"}
    for name in AIRFLOW_LONG_RUNNING:
        depends_on = services[name]["depends_on"]
        assert depends_on["postgres"] == {"condition": "service_healthy"}, name
        assert depends_on["airflow-init"] == {"condition": "service_completed_successfully"}, name
    # Tasks call the execution API, Spark Connect and MLflow, and write to the buckets.
    needed = {"airflow-api-server", "spark-connect", "mlflow", "minio-init"}
    for name in TASK_RUNNERS:
        assert needed <= set(services[name]["depends_on"]), name


def test_the_step_worker_runs_steps_as_the_task_runners_would_and_is_found_by_its_service_name(services):
    worker = services["step-worker"]
    for name in TASK_RUNNERS:
        for key in ("CTR_HOME", "CTR_MODEL_STORE", "SPARK_REMOTE", "MLFLOW_TRACKING_URI", "AWS_ACCESS_KEY_ID",
                    "CTR_STEP_WORKER_SECRET"):
            assert worker["environment"][key] == services[name]["environment"][key], (name, key)
    assert worker["environment"]["CTR_STEP_WORKER_SECRET"] == REQUIRED["CTR_STEP_WORKER_SECRET"]
    assert "ports" not in worker  # reached on the stack's network only, by clients that hold the secret
    assert f"ctr-home:{CTR_HOME}:rw" in worker["volumes"]
    command = worker["command"]
    assert command[:2] == ["ctr-pipeline", "worker"] and command[command.index("--advertise") + 1] == "step-worker"
    assert {"spark-connect", "mlflow", "minio-init"} <= set(worker["depends_on"])


def test_service_ports_are_published_on_their_documented_defaults(services):
    assert published_ports(services["serving"]) == {8501: 8501, 8500: 8500}
    assert published_ports(services["spark-connect"])[15002] == 15002
    assert published_ports(services["airflow-api-server"]) == {8080: 8080}
    assert published_ports(services["mlflow"]) == {5000: 5000}
    assert published_ports(services["minio"]) == {9000: 9000, 9001: 9001}


def test_host_ports_follow_their_variables(tmp_path_factory):
    services = resolved_config(tmp_path_factory, SERVING_PORT="18501", SERVING_GRPC_PORT="18500",
                               SPARK_CONNECT_PORT="25002")["services"]
    assert published_ports(services["serving"]) == {8501: 18501, 8500: 18500}
    assert published_ports(services["spark-connect"])[15002] == 25002


def test_airflow_version_and_default_executor_are_as_documented(services):
    header = "\n".join(split_header(COMPOSE_FILE.read_text())[0])
    documented = re.search(r"Airflow (\d+\.\d+\.\d+)", header)
    assert documented, "the header must name the Airflow version"
    version = documented[1]
    assert exact_pins(ROOT / "requirements.lock")["apache-airflow"] == version
    dockerfile_default = re.search(r"^ARG AIRFLOW_VERSION=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert dockerfile_default and dockerfile_default[1] == version
    for name in AIRFLOW_LONG_RUNNING | {"airflow-init"}:
        service = services[name]
        assert service["build"]["args"]["AIRFLOW_VERSION"] == version, name
        assert service["build"]["dockerfile"] == "docker/Dockerfile", name
        environment = service["environment"]
        assert environment["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor", name
        assert environment["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg2://"), name


def test_celery_profile_switches_the_executor_and_adds_broker_and_worker(services, tmp_path_factory):
    assert services["redis"]["profiles"] == ["celery"]
    assert services["airflow-worker"]["profiles"] == ["celery"]
    assert services["airflow-worker"]["depends_on"]["redis"] == {"condition": "service_healthy"}
    celery = resolved_config(tmp_path_factory, AIRFLOW_EXECUTOR="CeleryExecutor")["services"]
    for name in AIRFLOW_LONG_RUNNING | {"airflow-init"}:
        assert celery[name]["environment"]["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor", name
    for name, service in services.items():
        if name not in {"redis", "airflow-worker"}:
            assert "celery" not in service.get("profiles", []), f"{name} must run without the celery profile"


def test_task_runners_share_fast_storage_with_spark_connect(services):
    for name in TASK_RUNNERS | {"spark-connect"}:
        environment = services[name]["environment"]
        assert environment["CTR_HOME"] == CTR_HOME, name
        assert f"ctr-home:{CTR_HOME}:rw" in services[name]["volumes"], name
    for name in TASK_RUNNERS:
        environment = services[name]["environment"]
        assert environment["SPARK_REMOTE"] == "sc://spark-connect:15002", name
        assert environment["MLFLOW_TRACKING_URI"] == "http://mlflow:5000", name
        assert environment["AIRFLOW__CORE__DAGS_FOLDER"] == "/opt/ctr/dags", name


def test_serving_reads_the_s3_model_store_that_minio_init_creates(services):
    environment = services["serving"]["environment"]
    assert environment["CTR_MODEL_STORE"] == "s3://models/"
    assert environment["CTR_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert environment["AWS_ACCESS_KEY_ID"] == services["minio"]["environment"]["MINIO_ROOT_USER"]
    assert environment["AWS_SECRET_ACCESS_KEY"] == services["minio"]["environment"]["MINIO_ROOT_PASSWORD"]
    buckets = set(re.findall(r"stack/([a-z0-9.-]+)", services["minio-init"]["command"][0]))
    store_bucket = environment["CTR_MODEL_STORE"].removeprefix("s3://").split("/")[0]
    artifact_bucket = services["mlflow"]["environment"]["MLFLOW_ARTIFACTS_DESTINATION"].removeprefix("s3://").split("/")[0]
    assert {store_bucket, artifact_bucket} <= buckets


def test_mlflow_needs_a_login_and_its_clients_have_one(services):
    mlflow = services["mlflow"]
    assert mlflow["command"] == ["mlflow-server.sh"]
    script = (ROOT / "docker" / "mlflow-server.sh").read_text()
    assert "--app-name basic-auth" in script and "MLFLOW_AUTH_CONFIG_PATH" in script
    targets = [v["target"] if isinstance(v, dict) else v.split(":")[1] for v in mlflow["volumes"]]
    assert "/var/lib/mlflow-auth" in targets
    admin = (mlflow["environment"]["MLFLOW_AUTH_ADMIN_USERNAME"], mlflow["environment"]["MLFLOW_AUTH_ADMIN_PASSWORD"])
    for name, service in services.items():
        environment = service.get("environment") or {}
        if environment.get("MLFLOW_TRACKING_URI"):
            assert (environment["MLFLOW_TRACKING_USERNAME"], environment["MLFLOW_TRACKING_PASSWORD"]) == admin, name


def test_an_empty_s3_endpoint_selects_aws(tmp_path_factory):
    services = resolved_config(tmp_path_factory, S3_ENDPOINT_URL="")["services"]
    assert services["serving"]["environment"]["CTR_S3_ENDPOINT_URL"] == ""
    assert services["mlflow"]["environment"]["MLFLOW_S3_ENDPOINT_URL"] == ""


def test_without_the_step_workers_secret_compose_stops_and_says_which_variable(tmp_path_factory):
    result = run_compose(tmp_path_factory, "config", "-q", CTR_STEP_WORKER_SECRET=None)
    assert result.returncode != 0
    assert "set CTR_STEP_WORKER_SECRET, the step worker's shared secret" in result.stderr


def test_every_variable_is_documented_in_the_header_with_its_default():
    header, body = split_header(COMPOSE_FILE.read_text())
    documented = documented_variables(header)
    used: dict[str, set[str]] = {}
    for match in VARIABLE.finditer(body):
        assert match["op"], f"${{{match['name']}}} has no default; give it one and document it"
        if match["op"].endswith("?"):
            assert match["name"] in REQUIRED, f"${{{match['name']}}} is required; add it to REQUIRED"
            assert match["name"] in match["default"], f"the error of ${{{match['name']}}} must name it"
            used.setdefault(match["name"], set()).add(REQUIRED_DEFAULT)
            continue
        used.setdefault(match["name"], set()).add(match["default"])
    undocumented = set(used) - set(documented)
    assert not undocumented, f"variables used but not listed in the header: {sorted(undocumented)}"
    unused = set(documented) - set(used)
    assert not unused, f"variables listed in the header but never used: {sorted(unused)}"
    for name, defaults in used.items():
        assert defaults == {documented[name]}, (
            f"{name}: the header documents default {documented[name]!r}, the file uses {sorted(defaults)}"
        )


def test_image_copies_the_packages_dags_and_entry_scripts(services):
    dockerfile = DOCKERFILE.read_text()
    copied = set(re.findall(r"^COPY (\S+) \./\S+$", dockerfile, re.MULTILINE))
    packages = set(re.findall(r'"(\w+)\*"', (ROOT / "pyproject.toml").read_text()))
    assert packages, "pyproject.toml lists no packages to include"
    missing = (packages | {"dags"}) - copied
    assert not missing, f"docker/Dockerfile does not copy {sorted(missing)}"
    for name, service in services.items():
        command = service.get("command") or []
        if isinstance(command, list) and command and command[0].endswith(".sh"):
            script = ROOT / "docker" / command[0]
            assert script.is_file() and os.access(script, os.X_OK), (
                f"{name} runs {command[0]}, which is not an executable file in docker/"
            )
            assert f"docker/{command[0]}" in dockerfile, f"docker/Dockerfile does not install {command[0]}"


def test_bind_mounted_host_paths_exist(services):
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("/"):
                assert Path(source).exists(), f"{name} mounts {source}, which does not exist"


def test_production_requirements_do_not_move_any_locked_pin():
    locked = exact_pins(ROOT / "requirements.lock")
    for name, version in exact_pins(PRODUCTION_REQUIREMENTS).items():
        assert locked.get(name, version) == version, (
            f"{PRODUCTION_REQUIREMENTS.name} pins {name}=={version}, "
            f"requirements.lock pins {name}=={locked[name]}: re-resolve it (command in its header)"
        )


def test_every_airflow_service_loads_the_plugin_that_registers_the_minute_dags_timetable(services):
    airflow = {name for name, service in services.items()
               if "AIRFLOW__CORE__DAGS_FOLDER" in (service.get("environment") or {})}
    assert TASK_RUNNERS <= airflow
    for name in airflow:  # the scheduler and the API server deserialize the DAG's LeadingCronTimetable
        folder = services[name]["environment"]["AIRFLOW__CORE__PLUGINS_FOLDER"]
        assert folder == "/opt/ctr/pipelines/airflow_plugins", name
        assert (ROOT / folder.removeprefix("/opt/ctr/") / "ctr_timetables.py").exists()


def test_the_compose_spark_connect_server_has_the_settings_the_project_sessions_get():
    """Static settings (the driver's listing, the compiled-class cache) are given when a server starts: the
    compose stack's server gets those that the servers the project starts get (spark_jobs.session)."""
    from components.config import SparkConfig
    from spark_jobs.connect import server_command
    from spark_jobs.session import CODEGEN_CACHE_ENTRIES, CODEGEN_CACHE_KEY, LISTING_THRESHOLD, LISTING_THRESHOLD_KEY

    script = (ROOT / "docker" / "spark-connect.sh").read_text()
    started = server_command(SparkConfig(), 15002)
    for setting in (f"{LISTING_THRESHOLD_KEY}={LISTING_THRESHOLD}", f"{CODEGEN_CACHE_KEY}={CODEGEN_CACHE_ENTRIES}"):
        assert setting in started
        assert f"--conf {setting} " in script, setting
