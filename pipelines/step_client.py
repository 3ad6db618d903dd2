"""The task's side of the step worker (pipelines/step_worker.py): finding the worker of a data root, proving the
shared secret to it (pipelines/step_auth.py), sending it one step and relaying what comes back (log lines as they
come, then the output or the error)."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pipelines.step_auth import SECRET_VARIABLE, Refused, prove_to_worker

ADDRESS_FILE = "step-worker.json"
CONNECT_TIMEOUT_S = 2.0
PIPELINES = ("incremental",)  # the pipelines whose steps the worker runs (daily steps are minutes long anyway)


class StepWorkerError(RuntimeError):
    """A step failed on the step worker with an error this side cannot rebuild; the message is the remote
    error's type and text, and the remote traceback follows it."""


class WorkerUnavailable(ConnectionError):
    """No step worker answers for this data root, or none that this task may use."""


class WorkerRefused(WorkerUnavailable):
    """The worker and the task do not share the secret (CTR_STEP_WORKER_SECRET): the message says which side
    refused."""


def address_file(data_root: Path) -> Path:
    return Path(data_root) / "worker" / ADDRESS_FILE


def error_types() -> dict[str, type[BaseException]]:
    """Errors that keep their type across the wire: the ones Airflow's tasks map to a skip or a failure without
    retries (pipelines.airflow_tasks.run_step_task)."""
    from components.evaluation import DeltaGateError, QualityGateError
    from components.validation import DataValidationError, SpecColumnsError
    from pipelines.incremental import NothingToLearn

    return {cls.__name__: cls for cls in (NothingToLearn, DataValidationError, SpecColumnsError, QualityGateError,
                                          DeltaGateError)}


def send_message(stream, message: dict[str, Any]) -> None:
    stream.write((json.dumps(message, default=str) + "\n").encode())
    stream.flush()


def worker_address(data_root: Path) -> tuple[str, int] | None:
    """(host, port) from the worker's address file, or None when no worker has announced itself."""
    path = address_file(data_root)
    try:
        data = json.loads(path.read_text())
        return str(data["host"]), int(data["port"])
    except (OSError, ValueError, KeyError):
        return None


def _connect(data_root: Path, secret: bytes | None) -> tuple[socket.socket, tuple[str, int]]:
    """A connection to the worker of `data_root` once both sides proved they hold `secret`."""
    address = worker_address(data_root)
    if address is None:
        raise WorkerUnavailable(f"no step worker for {data_root} ({address_file(data_root)} is absent)")
    where = f"the step worker at {address[0]}:{address[1]}"
    if secret is None:
        raise WorkerRefused(f"{SECRET_VARIABLE} is not set in this task's environment, so {where} would refuse it; "
                            "set it to the worker's")
    try:
        connection = socket.create_connection(address, timeout=CONNECT_TIMEOUT_S)
    except OSError as err:
        raise WorkerUnavailable(f"{where} does not answer: {err}") from err
    try:
        prove_to_worker(connection, secret)
    except Refused as err:
        connection.close()
        raise WorkerRefused(f"{where}: {err}") from err
    except (OSError, EOFError) as err:
        connection.close()
        raise WorkerUnavailable(f"{where} does not answer: {type(err).__name__}: {err}") from err
    return connection, address


def notify_done(data_root: Path, request: Mapping[str, Any], secret: bytes | None) -> None:
    """Tells the worker of `data_root` that the request's step (a sensor, run by its task) ended with a yes, so
    it starts the steps after it (pipelines/run_ahead.py); returns once the worker has taken the notice."""
    connection, address = _connect(data_root, secret)
    with connection:
        stream = connection.makefile("rwb")
        send_message(stream, {**request, "notice": "done"})
        try:
            json.loads(stream.readline())
        except (OSError, ValueError) as err:
            raise WorkerUnavailable(f"the step worker at {address[0]}:{address[1]} did not take the notice") from err


def run_on_worker(data_root: Path, request: Mapping[str, Any], on_log: Callable[[int, str], None],
                  secret: bytes | None) -> Any:
    """Sends one step to the worker of `data_root` and waits for it: log records go to `on_log(level, text)`
    as they come; returns the step's output or raises its error (WorkerUnavailable when none answers, WorkerRefused
    when it and this task do not share `secret`). Where the step ran ahead of this task (pipelines/run_ahead.py),
    its lines and its end come from that run."""
    connection, address = _connect(data_root, secret)
    with connection:
        connection.settimeout(None)  # a step takes as long as it takes; Airflow's task timeout bounds it
        stream = connection.makefile("rwb")
        send_message(stream, dict(request))
        for line in stream:
            message = json.loads(line)
            if "log" in message:
                on_log(int(message.get("level", logging.INFO)), str(message["log"]))
            elif message.get("ok"):
                return message.get("output")
            else:
                error_type, text = str(message.get("error_type", "")), str(message.get("error", ""))
                if error_type == WorkerUnavailable.__name__:  # it is starting over: the step was not run
                    raise WorkerUnavailable(f"the step worker at {address[0]}:{address[1]}: {text}")
                known = error_types().get(error_type)
                if known is not None:
                    raise known(text)
                raise StepWorkerError(f"{error_type}: {text}\n--- on the step worker at {address[0]}:{address[1]}:\n"
                                      f"{message.get('traceback', '')}")
    raise StepWorkerError(f"the step worker at {address[0]}:{address[1]} closed the connection before the step "
                          "ended (it stopped or was killed); the task's retry runs the step again")
