"""A long-lived Spark Connect server, started from the pyspark wheel's own script.

A local SparkSession costs ~11 s to start and ~6 s for its first query here; every Airflow task and every
minute run would pay that. A Connect server pays it once: clients connect in under a second and warm jobs run
in about one. Jobs pick the server up through SPARK_REMOTE (spark.remote), with no code change.

    ctr spark-connect --port 15002        # foreground, until Ctrl-C
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from components.config import SparkConfig

log = logging.getLogger(__name__)

DEFAULT_PORT = 15002
SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


@dataclass
class ConnectServer:
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process.poll() is not None:
            return
        # The script execs spark-submit in its own process group; stop the whole group.
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout_s)

    def __enter__(self) -> ConnectServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def server_command(config: SparkConfig, port: int) -> list[str]:
    return [
        str(spark_home() / "sbin" / "start-connect-server.sh"),
        "--master", config.master,
        "--driver-memory", config.driver_memory,
        "--conf", f"spark.connect.grpc.binding.port={port}",
        "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
        "--conf", f"spark.sql.shuffle.partitions={config.shuffle_partitions}",
        "--conf", "spark.sql.session.timeZone=UTC",
        "--conf", "spark.ui.enabled=false",
    ]


def start_connect_server(config: SparkConfig, port: int = DEFAULT_PORT, log_dir: Path | str = ".",
                         timeout_s: float = 120.0) -> ConnectServer:
    """Starts a Spark Connect server on 127.0.0.1:`port` and returns once it answers a query.

    Its Python workers run this interpreter, so they import this project and its dependencies. The server's
    output goes to `log_dir`/spark-connect-<port>.log. Raises RuntimeError, with the log's tail, if it exits
    or does not answer within `timeout_s`.
    """
    if _port_open(port):
        raise RuntimeError(
            f"port {port} on 127.0.0.1 is already in use: is a Spark Connect server already running? Use it with "
            f"SPARK_REMOTE=sc://127.0.0.1:{port}, or pick another port"
        )
    log_path = Path(log_dir) / f"spark-connect-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SPARK_HOME": str(spark_home()), "SPARK_NO_DAEMONIZE": "1",
           "PYSPARK_PYTHON": sys.executable, "SPARK_LOG_DIR": str(log_path.parent),
           "SPARK_PID_DIR": str(log_path.parent)}
    with open(log_path, "ab") as handle:
        process = subprocess.Popen(server_command(config, port), env=env, stdout=handle, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    server = ConnectServer(process, port, log_path)
    deadline = time.monotonic() + timeout_s
    while not _port_open(port):
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"Spark Connect server on port {port} did not come up; its log ({log_path}):\n{tail}")
        time.sleep(0.5)
    log.info("Spark Connect server listening on %s (log: %s)", server.url, log_path)
    return server


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0
