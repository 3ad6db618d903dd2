"""A Spark standalone cluster from the pyspark wheel: one master and its workers, each a JVM in the foreground.

The wheel carries Spark's jars and `bin/spark-class`, not the `sbin/start-master.sh` family of a Spark
distribution; `spark-class` runs the same daemons (org.apache.spark.deploy.master.Master and ...worker.Worker)
without daemonizing, so a supervisor (`ctr-pipeline stack`, a container) owns their processes. The Spark
Connect server is then the cluster's driver (`--master spark://host:port`): its tasks run in the executors the
workers start, and the executors' Python workers run the same interpreter, so they import this project.

    master:  spark-class org.apache.spark.deploy.master.Master --host H --port 7077 --webui-port 8081
    worker:  spark-class org.apache.spark.deploy.worker.Worker --host H --cores C --memory M spark://H:7077

The master's web UI answers `/json/` with its workers and applications (`cluster_state`); the driver's UI
answers `/api/v1/applications/<id>/executors` with what each executor ran (`executor_tasks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
# What a worker's log says once the master accepted it.
WORKER_REGISTERED = "Successfully registered with master"


def spark_class(spark_home: Path) -> str:
    return str(spark_home / "bin" / "spark-class")


def master_command(spark_home: Path, host: str, port: int, webui_port: int) -> list[str]:
    return [spark_class(spark_home), MASTER_CLASS, "--host", host, "--port", str(port),
            "--webui-port", str(webui_port)]


def worker_command(spark_home: Path, master_url: str, host: str, cores: int, memory: str, webui_port: int,
                   work_dir: Path) -> list[str]:
    """A worker offering `cores` cores and `memory` (e.g. "3g") to the master's applications; its executors'
    files (stdout, stderr, the application's jars) go under `work_dir`. `webui_port` 0: any free port."""
    return [spark_class(spark_home), WORKER_CLASS, "--host", host, "--cores", str(cores), "--memory", memory,
            "--webui-port", str(webui_port), "--work-dir", str(work_dir), master_url]


@dataclass(frozen=True)
class ClusterState:
    status: str  # the master's: ALIVE once it accepts workers
    alive_workers: int
    cores: int  # offered by the alive workers
    cores_used: int
    applications: list[dict]  # running ones: {"id", "name", "cores", "state"}
    completed_applications: list[dict]


def cluster_state(master_webui: str, timeout_s: float = 3.0) -> ClusterState:
    """The master's view of its cluster, from its web UI's JSON (`master_webui` like http://127.0.0.1:8081).
    Raises OSError when it does not answer."""
    doc = _get_json(f"{master_webui.rstrip('/')}/json/", timeout_s)

    def apps(key: str) -> list[dict]:
        return [{"id": a["id"], "name": a["name"], "cores": a.get("cores", 0), "state": a.get("state")}
                for a in doc.get(key, [])]

    return ClusterState(status=doc.get("status", ""), alive_workers=int(doc.get("aliveworkers", 0)),
                        cores=int(doc.get("cores", 0)), cores_used=int(doc.get("coresused", 0)),
                        applications=apps("activeapps"), completed_applications=apps("completedapps"))


def master_ready(master_webui: str) -> str | None:
    """None once the master answers and is ALIVE, else what it waits for (a stack health check)."""
    try:
        state = cluster_state(master_webui)
    except (OSError, ValueError) as err:
        return f"{master_webui}/json/ ({type(err).__name__})"
    return None if state.status == "ALIVE" else f"the master's status ({state.status})"


def executor_tasks(driver_ui: str, application_id: str, timeout_s: float = 5.0) -> dict[str, int]:
    """Tasks each executor of the application completed, from the driver's REST API (executor id ->
    completed tasks; "driver" is the driver itself, which runs no task on a cluster)."""
    url = f"{driver_ui.rstrip('/')}/api/v1/applications/{application_id}/allexecutors"
    return {e["id"]: int(e.get("completedTasks", 0)) for e in _get_json(url, timeout_s)}


def _get_json(url: str, timeout_s: float) -> Any:
    """The JSON at `url` (httpx, as the stack's other health checks); OSError when it does not answer or
    answers with an error status."""
    import httpx

    try:
        response = httpx.get(url, timeout=timeout_s)
        response.raise_for_status()
    except httpx.HTTPStatusError as err:
        raise OSError(f"{url}: HTTP {err.response.status_code}") from err
    except httpx.HTTPError as err:
        raise OSError(f"{url}: {type(err).__name__}: {err}") from err
    return response.json()
