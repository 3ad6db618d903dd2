"""The step worker's side of things that need no minute chain: finding it, errors that cross the wire, and
starting over when its memory grows. tests/pipelines/test_incremental_pipeline.py runs a whole minute on it."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from components.config import load_config
from pipelines import step_worker

pytestmark = pytest.mark.integration  # a real worker on a loopback port

REQUEST = {"pipeline": "daily", "step": "train", "run_id": "r", "start": "2026-01-01T00:00:00+00:00",
           "end": "2026-01-02T00:00:00+00:00", "overrides": {}, "environ": {}}


def start_worker(config):
    stop, up, result = threading.Event(), threading.Event(), {}

    def run() -> None:
        result["again"] = step_worker.serve(config, ready=lambda _: up.set(), stop=stop)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert up.wait(120), "the step worker did not come up"
    return stop, thread, result


def test_without_a_worker_answering_the_task_is_told_so(tmp_path):
    with pytest.raises(step_worker.WorkerUnavailable, match="step-worker.json is absent"):
        step_worker.run_on_worker(tmp_path, REQUEST, lambda *_: None)
    with socket.socket() as closed:  # a worker that died and left its address behind
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    path = step_worker.address_file(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"host": "127.0.0.1", "port": port, "pid": 1}))
    with pytest.raises(step_worker.WorkerUnavailable, match=f"127.0.0.1:{port} does not answer"):
        step_worker.run_on_worker(tmp_path, REQUEST, lambda *_: None)


def test_an_error_comes_back_with_its_type_and_the_workers_traceback(tmp_path):
    config = load_config(overrides={"paths.data_root": str(tmp_path)}, environ={})
    stop, thread, result = start_worker(config)
    try:
        with pytest.raises(step_worker.StepWorkerError,
                           match=r"(?s)^ValueError: the step worker runs the steps of \['incremental'\], not of "
                                 r"'daily'.*--- on the step worker at 127\.0\.0\.1:\d+:.*Traceback"):
            step_worker.run_on_worker(tmp_path, REQUEST, lambda *_: None)
    finally:
        stop.set()
        thread.join(30)
    assert result == {"again": False}
    assert not step_worker.address_file(tmp_path).exists()


def test_a_worker_over_its_memory_limit_stops_taking_steps_and_starts_over(tmp_path):
    config = load_config(overrides={"paths.data_root": str(tmp_path), "incremental.step_worker_max_rss_mib": 1},
                         environ={})
    stop, thread, result = start_worker(config)
    address = step_worker.worker_address(tmp_path)
    try:
        with pytest.raises(step_worker.StepWorkerError):  # one step ends: the worker is over 1 MiB
            step_worker.run_on_worker(tmp_path, REQUEST, lambda *_: None)
        thread.join(30)
    finally:
        stop.set()
    assert result == {"again": True}  # ctr worker then re-executes itself
    assert not step_worker.address_file(tmp_path).exists()
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=1).close()
