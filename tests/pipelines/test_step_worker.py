"""The step worker's side of things that need no minute chain: finding it, errors that cross the wire, and
starting over when its memory grows. tests/pipelines/test_incremental_pipeline.py runs a whole minute on it."""

from __future__ import annotations

import gc
import json
import logging
import socket
import struct
import threading
import time

import pytest

from components.config import load_config
from pipelines import step_client, step_worker

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
    with pytest.raises(step_client.WorkerUnavailable, match="step-worker.json is absent"):
        step_client.run_on_worker(tmp_path, REQUEST, lambda *_: None)
    with socket.socket() as closed:  # a worker that died and left its address behind
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    path = step_client.address_file(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"host": "127.0.0.1", "port": port, "pid": 1}))
    with pytest.raises(step_client.WorkerUnavailable, match=f"127.0.0.1:{port} does not answer"):
        step_client.run_on_worker(tmp_path, REQUEST, lambda *_: None)


def test_an_error_comes_back_with_its_type_and_the_workers_traceback(tmp_path):
    config = load_config(overrides={"paths.data_root": str(tmp_path)}, environ={})
    stop, thread, result = start_worker(config)
    try:
        with pytest.raises(step_client.StepWorkerError,
                           match=r"(?s)^ValueError: the step worker runs the steps of \['incremental'\], not of "
                                 r"'daily'.*--- on the step worker at 127\.0\.0\.1:\d+:.*Traceback"):
            step_client.run_on_worker(tmp_path, REQUEST, lambda *_: None)
    finally:
        stop.set()
        thread.join(30)
    assert result == {"again": False}
    assert not step_client.address_file(tmp_path).exists()


def test_health_checks_and_tasks_that_go_away_leave_the_worker_answering(tmp_path):
    """A connect-and-close (the stack's health check) and a task killed before its step's answer (the worker's
    reply and log lines then go nowhere) must not stall the steps that follow."""
    config = load_config(overrides={"paths.data_root": str(tmp_path)}, environ={})
    stop, thread, _ = start_worker(config)
    address = step_client.worker_address(tmp_path)
    try:
        for _ in range(3):
            socket.create_connection(address, timeout=5).close()
        # A task that sends a step, then is killed (its connection reset) while the step runs: the step's log
        # lines and its answer then go nowhere.
        plan = {**REQUEST, "pipeline": "incremental", "step": "plan", "end": "2026-01-01T00:01:00+00:00",
                "overrides": {"paths.data_root": str(tmp_path)}}
        with socket.create_connection(address, timeout=5) as gone:
            gone.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
            gone.sendall((json.dumps(plan) + "\n").encode())
        answered = threading.Event()

        def ask() -> None:
            with pytest.raises(step_client.StepWorkerError, match="ValueError"):
                step_client.run_on_worker(tmp_path, REQUEST, lambda *_: None)
            answered.set()

        threading.Thread(target=ask, daemon=True).start()
        assert answered.wait(30), "the worker stopped answering"
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive(), "the worker did not stop"


def test_a_worker_over_its_memory_limit_stops_taking_steps_and_starts_over(tmp_path):
    config = load_config(overrides={"paths.data_root": str(tmp_path), "incremental.step_worker_max_rss_mib": 1},
                         environ={})
    stop, thread, result = start_worker(config)
    address = step_client.worker_address(tmp_path)
    try:
        with pytest.raises(step_client.StepWorkerError):  # one step ends: the worker is over 1 MiB
            step_client.run_on_worker(tmp_path, REQUEST, lambda *_: None)
        thread.join(30)
    finally:
        stop.set()
    assert result == {"again": True}  # ctr worker then re-executes itself
    assert not step_client.address_file(tmp_path).exists()
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=1).close()


@pytest.mark.parametrize("idle_gc", [True, False])
def test_the_worker_collects_garbage_after_warming_up_and_after_a_failed_step_when_idle(tmp_path, monkeypatch,
                                                                                        caplog, idle_gc):
    from pipelines import idle_gc as collections

    monkeypatch.setattr(collections, "IDLE_DELAY_S", 0.2)
    enabled = gc.isenabled()
    config = load_config(overrides={"paths.data_root": str(tmp_path), "incremental.worker_idle_gc": idle_gc},
                         environ={})
    with caplog.at_level(logging.INFO, logger="pipelines.idle_gc"):
        stop, thread, _ = start_worker(config)
        try:
            assert gc.isenabled() is not idle_gc  # CPython's own collections are off while the worker serves
            with pytest.raises(step_client.StepWorkerError):  # a step that fails ends its run: nothing follows it
                step_client.run_on_worker(tmp_path, REQUEST, lambda *_: None)
            deadline = time.monotonic() + 30
            while idle_gc and "idle (after a run)" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            stop.set()
            thread.join(30)
    idle = [r.getMessage() for r in caplog.records if r.getMessage().startswith("idle (")]
    if idle_gc:
        assert idle[0].startswith("idle (warmed up): full garbage collection in")
        assert idle[1].startswith("idle (after a run): full garbage collection in"), idle
    else:
        assert idle == []
    assert gc.isenabled() == enabled  # a stopped worker leaves CPython's collector as it found it


def test_a_run_ends_with_its_pipelines_last_step():
    server = step_worker._Server(("127.0.0.1", 0), None)
    try:
        assert server._ends_run({"pipeline": "incremental", "step": "publish"})
        assert not server._ends_run({"pipeline": "incremental", "step": "train"})
        assert not server._ends_run({"pipeline": "nope", "step": "publish"})
    finally:
        server.server_close()
