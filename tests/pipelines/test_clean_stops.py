"""Our long-running commands stop on SIGTERM (a service manager, `docker stop`) and on SIGINT (Ctrl-C) within a
bound, and leave no process of their tree and no port behind: `ctr spark-connect`, whose JVM runs in a session
of its own where no signal to the command reaches it; `ctr serve` (REST, gRPC and the model watcher); the
stack's S3 server. Each runs as the real command in a subprocess; its process tree is read from /proc before
the signal, because a child that outlives its parent is no longer found under it afterwards."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipelines.stack import port_answers

REPO = Path(__file__).resolve().parents[2]
# docker stop's default grace before SIGKILL; every command must be gone well within it.
STOP_BOUND_S = 10.0
SIGNALS = [pytest.param(signal.SIGTERM, id="SIGTERM"), pytest.param(signal.SIGINT, id="SIGINT")]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields from the state on (state, ppid, pgrp, ...), or None if there is no such pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _process_tree(root: int) -> dict[int, str]:
    """pid -> start time of `root` and all its live descendants."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) and fields[0] not in ("Z", "X"):
            parents[int(entry.name)] = (int(fields[1]), fields[19])
    tree = {root: parents[root][1]} if root in parents else {}
    grew = True
    while grew:
        grew = False
        for pid, (parent, start) in parents.items():
            if parent in tree and pid not in tree:
                tree[pid] = start
                grew = True
    return tree


def _alive(pid: int, start: str) -> bool:
    """Whether that very process (same pid and start time) still runs; an exited zombie does not."""
    fields = _stat(pid)
    return fields is not None and fields[19] == start and fields[0] not in ("Z", "X")


def _command_line(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return ""


def _port_bindable(port: int) -> bool:
    """Whether a new server could listen on `port` now (with SO_REUSEADDR, as uvicorn, gRPC and Netty do)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class Running:
    def __init__(self, process: subprocess.Popen, log_path: Path) -> None:
        self.process = process
        self.log_path = log_path
        self.seen: dict[int, str] = {}  # every process of its tree seen so far: killed at the end if still alive

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


@contextlib.contextmanager
def running(command: list[str], ports: list[int], log_path: Path, ready_timeout_s: float,
            ready_text: str = "") -> Iterator[Running]:
    """Starts `command` and yields once every one of `ports` answers and its output holds `ready_text`; at the
    end SIGKILLs whatever of its tree is still alive, so that a failing test leaks no JVM."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    handle = Running(process, log_path)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not (all(port_answers(port) for port in ports) and ready_text in handle.log_tail()):
            handle.seen.update(_process_tree(process.pid))
            assert process.poll() is None, f"{command[2:4]} exited with {process.returncode}:\n{handle.log_tail()}"
            assert time.monotonic() < deadline, f"{command[2:4]} not ready on {ports}:\n{handle.log_tail()}"
            time.sleep(0.2)
        handle.seen.update(_process_tree(process.pid))
        yield handle
    finally:
        for pid, start in handle.seen.items():
            if pid != process.pid and _alive(pid, start):
                os.kill(pid, signal.SIGKILL)
        process.kill()
        process.wait()


def stop_and_check(handle: Running, sig: signal.Signals, ports: list[int]) -> float:
    """Sends `sig` to the command alone (not its group, as a service manager's main-process stop does) and
    checks the clean stop; returns the seconds it took."""
    tree = _process_tree(handle.process.pid)
    handle.seen.update(tree)
    started = time.monotonic()
    handle.process.send_signal(sig)
    try:
        status = handle.process.wait(STOP_BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {STOP_BOUND_S:.0f} s after {sig.name}:\n{handle.log_tail()}")
    took = time.monotonic() - started
    assert status == 0, f"exit status {status} after {sig.name}:\n{handle.log_tail()}"
    left = {pid: _command_line(pid)[:160] for pid, start in tree.items() if _alive(pid, start)}
    assert left == {}, f"processes of its tree still alive after it exited on {sig.name}"
    for port in ports:
        assert not port_answers(port) and _port_bindable(port), f"port {port} still taken after {sig.name}"
    return took


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("sig", SIGNALS)
def test_spark_connect_stops_its_jvm_and_frees_its_port(sig: signal.Signals, tmp_path: Path) -> None:
    port = _free_port()
    command = [sys.executable, "-m", "pipelines.cli", "spark-connect", "--port", str(port),
               "--set", f"paths.data_root={tmp_path}", "--set", "spark.master=local[1]",
               "--set", "spark.driver_memory=1g"]
    # Ready once it says so: its port answers a little earlier, while it still counts as starting.
    with running(command, [port], tmp_path / "spark-connect.out", ready_timeout_s=180,
                 ready_text="Spark Connect server on") as handle:
        jvms = [pid for pid in _process_tree(handle.process.pid)
                if "SparkConnectServer" in _command_line(pid) and "java" in _command_line(pid).split()[0]]
        assert len(jvms) == 1, "the test must see the JVM in the command's tree, or it checks nothing"
        assert _stat(jvms[0])[3] != _stat(handle.process.pid)[3], "the JVM was expected in a session of its own"
        took = stop_and_check(handle, sig, [port])
    assert f"{sig.name}: stopped the Spark Connect server on port {port}" in handle.log_tail()
    print(f"ctr spark-connect stopped on {sig.name} in {took:.1f} s")


@pytest.mark.integration
@pytest.mark.parametrize("sig", SIGNALS)
def test_model_server_stops_rest_grpc_and_watcher_and_frees_both_ports(sig: signal.Signals, tmp_path: Path) -> None:
    rest, grpc = _free_port(), _free_port()
    # An empty model store: the server answers 503 until a version is published, which is all this needs.
    command = [sys.executable, "-m", "pipelines.cli", "serve", "--host", "127.0.0.1", "--port", str(rest),
               "--grpc-port", str(grpc), "--set", f"paths.data_root={tmp_path}"]
    with running(command, [rest, grpc], tmp_path / "serve.out", ready_timeout_s=120) as handle:
        took = stop_and_check(handle, sig, [rest, grpc])
    assert f"{sig.name}: REST is down; stopping gRPC and the model watcher" in handle.log_tail()
    print(f"ctr serve stopped on {sig.name} in {took:.1f} s")


@pytest.mark.integration
@pytest.mark.parametrize("sig", SIGNALS)
def test_s3_server_stops_after_its_last_snapshot_and_frees_its_port(sig: signal.Signals, tmp_path: Path) -> None:
    port = _free_port()
    command = [sys.executable, "-m", "pipelines.s3_server", "--port", str(port), "--snapshot", str(tmp_path / "s3"),
               "--every", "60", "--bucket", "models"]
    with running(command, [port], tmp_path / "s3.out", ready_timeout_s=60) as handle:
        # Its port answers before its buckets are restored; stop it once it serves them, as in the stack.
        deadline = time.monotonic() + 60
        while not (tmp_path / "s3" / "ready").exists():
            assert time.monotonic() < deadline, f"the S3 server did not restore its buckets:\n{handle.log_tail()}"
            time.sleep(0.1)
        took = stop_and_check(handle, sig, [port])
    assert "snapshot (at stop)" in handle.log_tail()
    print(f"s3_server stopped on {sig.name} in {took:.1f} s")


@pytest.mark.integration
@pytest.mark.parametrize("sig", SIGNALS)
def test_the_mlflow_ui_command_stops_its_server_and_frees_its_port(sig: signal.Signals, tmp_path: Path) -> None:
    port = _free_port()
    command = [sys.executable, "-m", "pipelines.cli", "ui", "mlflow", "--port", str(port),
               "--set", f"paths.data_root={tmp_path}"]
    with running(command, [port], tmp_path / "ui.out", ready_timeout_s=120) as handle:
        assert len(_process_tree(handle.process.pid)) > 1, "the server must run as a child, or this checks nothing"
        took = stop_and_check(handle, sig, [port])
    print(f"ctr ui mlflow stopped on {sig.name} in {took:.1f} s")


@pytest.mark.unit
def test_spark_connect_on_a_port_a_leftover_server_holds_names_its_pid(tmp_path: Path, capsys) -> None:
    from components.config import SparkConfig
    from spark_jobs.connect import SERVER_CLASS, run_in_foreground

    port = _free_port()
    # A stand-in for a JVM left running by a killed `ctr spark-connect`: it listens, and its command line names
    # the server class.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import socket, sys, time; s = socket.socket(); "
         f"s.bind(('127.0.0.1', {port})); s.listen(); print('up', flush=True); time.sleep(60)", SERVER_CLASS],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "up\n"
        status = run_in_foreground(SparkConfig(master="local[1]"), port, log_dir=tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert status == 1
    error = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is already in use by a Spark Connect server (pid {holder.pid})" in error
    assert f"stop it with `kill {holder.pid}`" in error
    assert not list(tmp_path.iterdir()), "nothing may start when the port is taken"
