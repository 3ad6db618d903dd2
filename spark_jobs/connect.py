"""A long-lived Spark Connect server, started from the pyspark wheel's own script.

A local SparkSession costs ~11 s to start and ~6 s for its first query here; every Airflow task and every
minute run would pay that. A Connect server pays it once: clients connect in under a second and warm jobs run
in about one. Jobs pick the server up through SPARK_REMOTE (spark.remote), with no code change.

    ctr spark-connect --port 15002        # foreground, until SIGTERM, SIGINT (Ctrl-C) or SIGHUP

The server's script and JVM run in a session of their own, so that a Ctrl-C meant for a client does not stop
it; the flip side is that no signal sent to the Python process that started them reaches them, so that
process stops them itself (ConnectServer.stop), on every stop signal (`run_in_foreground`).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from components.config import SparkConfig
from components.stopping import StopRequested, stop_on_signals, stop_process_group
from spark_jobs.session import (
    CODEGEN_CACHE_ENTRIES,
    CODEGEN_CACHE_KEY,
    LISTING_THRESHOLD,
    LISTING_THRESHOLD_KEY,
    with_project_path,
)

log = logging.getLogger(__name__)

DEFAULT_PORT = 15002
SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
# How long a stop gives the JVM after SIGTERM (it takes about 2 s; it keeps no state worth a longer wait) before
# SIGKILL: `ctr spark-connect` stops within docker stop's default grace of 10 s.
STOP_TIMEOUT_S = 8.0


class ConnectServerError(RuntimeError):
    """The server cannot start: its port is taken, or it exited or did not answer in time."""


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

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stops the script, the JVM it runs and the JVM's Python workers: SIGTERM to the script's process group,
        SIGKILL to what is left after `timeout_s`. Returns once none of them is left. Safe to call again, and
        after the script has exited: the JVM may outlive it (a SIGTERM to the script alone ends only the script)."""
        stop_process_group(self.process.pid, timeout_s)
        self.process.wait()  # reaps the script, which has exited with its group

    def __enter__(self) -> ConnectServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


APP_NAME = "ctr-spark-connect"  # the application's name on a cluster master's page


def server_command(config: SparkConfig, port: int) -> list[str]:
    """The server on `config.master`: local[N] runs the tasks in its own JVM; spark://host:port makes it the
    driver of a standalone cluster's executors (spark_jobs/standalone.py), each `config.executor_memory`."""
    ui = (["--conf", "spark.ui.enabled=true", "--conf", f"spark.ui.port={config.ui_port}"] if config.ui_port
          else ["--conf", "spark.ui.enabled=false"])
    cluster = ["--executor-memory", config.executor_memory] if config.master.startswith("spark://") else []
    return [
        str(spark_home() / "sbin" / "start-connect-server.sh"),
        "--master", config.master,
        "--name", APP_NAME,
        "--driver-memory", config.driver_memory,
        *cluster,
        "--conf", f"spark.connect.grpc.binding.port={port}",
        "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
        "--conf", f"spark.sql.shuffle.partitions={config.shuffle_partitions}",
        "--conf", "spark.sql.session.timeZone=UTC",
        *ui,
        "--conf", f"{LISTING_THRESHOLD_KEY}={LISTING_THRESHOLD}",
        "--conf", f"{CODEGEN_CACHE_KEY}={CODEGEN_CACHE_ENTRIES}",
    ]


def start_connect_server(config: SparkConfig, port: int = DEFAULT_PORT, log_dir: Path | str = ".",
                         timeout_s: float = 120.0) -> ConnectServer:
    """Starts a Spark Connect server on 127.0.0.1:`port` and returns once it answers a query.

    Its Python workers run this interpreter, so they import this project and its dependencies. The server's
    output goes to `log_dir`/spark-connect-<port>.log. Raises ConnectServerError if its port is taken, or, with
    the log's tail, if it exits or does not answer within `timeout_s`. A KeyboardInterrupt (StopRequested)
    while it waits stops the server before going on up.
    """
    if _port_open(port):
        raise ConnectServerError(_port_taken_message(port))
    log_path = Path(log_dir) / f"spark-connect-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**with_project_path(os.environ), "SPARK_HOME": str(spark_home()), "SPARK_NO_DAEMONIZE": "1",
           "PYSPARK_PYTHON": sys.executable, "SPARK_LOG_DIR": str(log_path.parent),
           "SPARK_PID_DIR": str(log_path.parent)}
    with open(log_path, "ab") as handle:
        process = subprocess.Popen(server_command(config, port), env=env, stdout=handle, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    server = ConnectServer(process, port, log_path)
    deadline = time.monotonic() + timeout_s
    try:
        while not _port_open(port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise ConnectServerError(f"Spark Connect server on port {port} did not come up; its log "
                                         f"({log_path}):\n{log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
    except BaseException:  # a failed start, or a stop (StopRequested, KeyboardInterrupt) while it starts
        server.stop()
        raise
    log.info("Spark Connect server listening on %s (log: %s)", server.url, log_path)
    return server


def run_in_foreground(config: SparkConfig, port: int, log_dir: Path | str) -> int:
    """`ctr spark-connect`: starts a server and keeps it until SIGTERM, SIGINT or SIGHUP, then stops it (SIGKILL
    after STOP_TIMEOUT_S) and returns 0. Returns 1, with the reason on stderr, if the server cannot start or
    exits on its own. Every way out stops the JVM first: nothing else would (module docstring).
    """
    with stop_on_signals():
        try:
            server = start_connect_server(config, port, log_dir=log_dir)
        except StopRequested as early:
            log.info("%s while the Spark Connect server was starting: stopped it", early)
            return 0
        except ConnectServerError as err:
            print(f"ctr spark-connect: {err}", file=sys.stderr, flush=True)
            return 1
        print(f"Spark Connect server on {server.url} (log: {server.log_path}); use it with "
              f"SPARK_REMOTE={server.url}. Ctrl-C or SIGTERM stops it.", flush=True)
        stop = None
        try:
            status = server.process.wait()
        except StopRequested as requested:
            stop = requested
        finally:
            started = time.monotonic()
            server.stop()
        if stop is not None:
            log.info("%s: stopped the Spark Connect server on port %d in %.1f s", stop, port,
                     time.monotonic() - started)
            return 0
    print(f"ctr spark-connect: the Spark Connect server on port {port} exited on its own (status {status}); its log "
          f"({server.log_path}) ends:\n{server.log_path.read_text(errors='replace')[-3000:]}", file=sys.stderr,
          flush=True)
    return 1


def _port_taken_message(port: int) -> str:
    owner = _listener_pid(port)
    if owner is None:
        return (f"port {port} on 127.0.0.1 is already in use: is a Spark Connect server already running? Use it "
                f"with SPARK_REMOTE=sc://127.0.0.1:{port}, or pick another port")
    pid, command = owner
    if SERVER_CLASS in command:
        return (f"port {port} on 127.0.0.1 is already in use by a Spark Connect server (pid {pid}), perhaps left "
                f"running by a `ctr spark-connect` that was killed: use it with SPARK_REMOTE=sc://127.0.0.1:{port}, "
                f"stop it with `kill {pid}`, or pick another port")
    return (f"port {port} on 127.0.0.1 is already in use by pid {pid} ({command[:200]}): pick another port, or "
            "stop that process")


def _listener_pid(port: int) -> tuple[int, str] | None:
    """(pid, command line) of a process of this user listening on TCP `port` (psutil); None if none is found
    (another user's process, whose pid is hidden)."""
    import psutil

    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    for connection in connections:
        if connection.status == psutil.CONN_LISTEN and connection.laddr and connection.laddr.port == port \
                and connection.pid:
            try:
                return connection.pid, " ".join(psutil.Process(connection.pid).cmdline()).strip()
            except (psutil.Error, OSError):
                return connection.pid, ""
    return None


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0
