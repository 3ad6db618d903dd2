"""The step worker's side of things that need no minute chain: finding it, who it refuses, errors that cross the
wire, and starting over when its memory grows. tests/pipelines/test_incremental_pipeline.py runs a whole minute on
it."""

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
from pipelines import cli, step_auth, step_client, step_worker

pytestmark = pytest.mark.integration  # a real worker on a loopback port

SECRET = b"step-worker-secret-of-the-tests"
REQUEST = {"pipeline": "daily", "step": "train", "run_id": "r", "start": "2026-01-01T00:00:00+00:00",
           "end": "2026-01-02T00:00:00+00:00", "overrides": {}, "environ": {}}


def start_worker(config):
    stop, up, result = threading.Event(), threading.Event(), {}

    def run() -> None:
        result["again"] = step_worker.serve(config, ready=lambda _: up.set(), stop=stop, secret=SECRET)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert up.wait(120), "the step worker did not come up"
    return stop, thread, result


def test_without_a_worker_answering_the_task_is_told_so(tmp_path):
    with pytest.raises(step_client.WorkerUnavailable, match="step-worker.json is absent"):
        step_client.run_on_worker(tmp_path, REQUEST, lambda *_: None, SECRET)
    with socket.socket() as closed:  # a worker that died and left its address behind
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    path = step_client.address_file(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"host": "127.0.0.1", "port": port, "pid": 1}))
    with pytest.raises(step_client.WorkerUnavailable, match=f"127.0.0.1:{port} does not answer"):
        step_client.run_on_worker(tmp_path, REQUEST, lambda *_: None, SECRET)


def test_the_worker_listens_on_loopback_unless_told_otherwise(tmp_path):
    config = load_config(overrides={"paths.data_root": str(tmp_path)}, environ={})
    stop, thread, _ = start_worker(config)
    try:
        assert step_client.worker_address(tmp_path)[0] == "127.0.0.1"
    finally:
        stop.set()
        thread.join(30)
    assert cli.build_parser().parse_args(["worker"]).host == "127.0.0.1"


def test_a_client_without_the_secret_is_refused_before_its_request_is_read_and_nothing_runs(tmp_path, caplog):
    """A client that connects and sends a step, as a task did before the handshake, hears the worker's challenge
    and then the connection closes: no answer, no step; the worker's log says whom it refused and why. A task
    with the right secret is served as before."""
    config = load_config(overrides={"paths.data_root": str(tmp_path)}, environ={})
    plan = {**REQUEST, "pipeline": "incremental", "step": "plan", "end": "2026-01-01T00:01:00+00:00",
            "overrides": {"paths.data_root": str(tmp_path)}}
    caplog.set_level(logging.INFO, logger="pipelines.step_worker")
    stop, thread, _ = start_worker(config)
    address = step_client.worker_address(tmp_path)
    try:
        sent = (json.dumps(plan) + "\n").encode()
        with socket.create_connection(address, timeout=30) as stranger:
            port = stranger.getsockname()[1]
            stranger.sendall(sent)
            heard = b""
            while chunk := stranger.recv(4096):
                heard += chunk
        assert heard[4:].startswith(b"#CHALLENGE#") and len(heard) == 4 + len(b"#CHALLENGE#") + 20  # then closed
        refused = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused the client at")]
        # The request's first 4 bytes, read as the length of an answer.
        assert refused == [f"refused the client at 127.0.0.1:{port}: it sent something other than an answer to the "
                           f"challenge (a message of {int.from_bytes(sent[:4], 'big')} bytes where the handshake "
                           "sends at most 256): a client without CTR_STEP_WORKER_SECRET or the handshake; nothing "
                           "of its request runs"]
        assert not any(": started" in r.getMessage() for r in caplog.records)
        # The worker goes on serving those that hold the secret.
        with pytest.raises(step_client.StepWorkerError, match="ValueError: the step worker runs the steps of"):
            step_client.run_on_worker(tmp_path, REQUEST, lambda *_: None, SECRET)
    finally:
        stop.set()
        thread.join(30)


def test_a_task_with_another_secret_or_none_is_refused_and_told_why(tmp_path, caplog):
    config = load_config(overrides={"paths.data_root": str(tmp_path)}, environ={})
    caplog.set_level(logging.INFO, logger="pipelines.step_worker")
    stop, thread, _ = start_worker(config)
    try:
        with pytest.raises(step_client.WorkerRefused,
                           match=r"127\.0\.0\.1:\d+: it refused this task's CTR_STEP_WORKER_SECRET \(the worker "
                                 r"holds another secret\)"):
            step_client.run_on_worker(tmp_path, REQUEST, lambda *_: None, b"another-secret-of-the-tests")
        # The worker logs the refusal once it sent it, which may be just after the task heard it.
        deadline = time.monotonic() + 10
        while not any("does not match CTR_STEP_WORKER_SECRET: the client holds another secret" in r.getMessage()
                      for r in caplog.records):
            assert time.monotonic() < deadline, "the worker did not log why it refused the task"
            time.sleep(0.05)
        with pytest.raises(step_client.WorkerRefused, match="CTR_STEP_WORKER_SECRET is not set in this task's"):
            step_client.notify_done(tmp_path, {**REQUEST, "step": "wait_for_data"}, None)
        assert not any(": started" in r.getMessage() for r in caplog.records)
    finally:
        stop.set()
        thread.join(30)


def test_a_worker_without_the_secret_does_not_start_and_says_how_to_set_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("CTR_HOME", str(tmp_path))
    monkeypatch.delenv("CTR_STEP_WORKER_SECRET", raising=False)
    assert cli.main(["worker"]) == 2
    assert "configuration error: CTR_STEP_WORKER_SECRET is not set: the step worker refuses every task without " \
           "it; set it, the same, in the worker's environment and in the Airflow tasks'" in capsys.readouterr().err
    monkeypatch.setenv("CTR_STEP_WORKER_SECRET", "short")
    assert cli.main(["worker"]) == 2
    assert "CTR_STEP_WORKER_SECRET is 5 characters long, expected at least 16" in capsys.readouterr().err
    assert not step_client.address_file(tmp_path).exists()


def test_the_handshake_proves_the_secret_both_ways_without_sending_it():
    sent: list[bytes] = []

    class Recording(socket.socket):
        def sendall(self, data, *args) -> None:
            sent.append(bytes(data))
            super().sendall(data, *args)

    worker_side, task_side = socket.socketpair()
    task = Recording(fileno=task_side.detach())
    outcome: dict[str, bool] = {}
    thread = threading.Thread(target=lambda: outcome.update(ok=step_auth.verify_client(worker_side, SECRET)))
    thread.start()
    try:
        step_auth.prove_to_worker(task, SECRET)  # raises Refused if the worker's answer were wrong
        thread.join(10)
    finally:
        worker_side.close()
        task.close()
    assert outcome == {"ok": True}
    # Its answer, its own challenge, its welcome of the worker's answer: none holds the secret.
    assert [data[4:14] for data in sent[1:]] == [b"#CHALLENGE", b"#WELCOME#"] and len(sent) == 3
    assert not any(SECRET in data for data in sent)


def test_an_error_comes_back_with_its_type_and_the_workers_traceback(tmp_path):
    config = load_config(overrides={"paths.data_root": str(tmp_path)}, environ={})
    stop, thread, result = start_worker(config)
    try:
        with pytest.raises(step_client.StepWorkerError,
                           match=r"(?s)^ValueError: the step worker runs the steps of \['incremental'\], not of "
                                 r"'daily'.*--- on the step worker at 127\.0\.0\.1:\d+:.*Traceback"):
            step_client.run_on_worker(tmp_path, REQUEST, lambda *_: None, SECRET)
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
            step_auth.prove_to_worker(gone, SECRET)
            gone.sendall((json.dumps(plan) + "\n").encode())
        answered = threading.Event()

        def ask() -> None:
            with pytest.raises(step_client.StepWorkerError, match="ValueError"):
                step_client.run_on_worker(tmp_path, REQUEST, lambda *_: None, SECRET)
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
            step_client.run_on_worker(tmp_path, REQUEST, lambda *_: None, SECRET)
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
                step_client.run_on_worker(tmp_path, REQUEST, lambda *_: None, SECRET)
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
    server = step_worker.StepServer(("127.0.0.1", 0), None, secret=SECRET)
    try:
        assert server.ends_run({"pipeline": "incremental", "step": "spans"})
        assert not server.ends_run({"pipeline": "incremental", "step": "publish"})
        assert not server.ends_run({"pipeline": "incremental", "step": "train"})
        assert not server.ends_run({"pipeline": "nope", "step": "spans"})
    finally:
        server.server_close()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_worker_catching_up_collects_at_every_second_runs_end():
    """Runs one after another leave no idle time: at a run's end (here a failed step, which ends its run) the
    worker collects when the run before ended with no collection after it; a run followed by idle time leaves
    its collection to that time (`due`)."""
    from pipelines.idle_gc import IdleCollector
    from pipelines.run_ahead import Outcome

    now = [1000.0]
    collector = IdleCollector(clock=lambda: now[0])
    collector.install()
    server = step_worker.StepServer(("127.0.0.1", 0), None, collector, secret=SECRET)
    failing = {**REQUEST, "pipeline": "nope"}  # fails at once: the end of its run
    try:
        collector.collect_idle("test")
        now[0] += 5
        server.execute(Outcome(failing, ahead=False))
        assert collector.last_collection == 1000.0 and collector.ended_at == 1005.0  # left to the idle time
        for _ in range(3000):
            _Cycle()
        now[0] += 5  # the next run came at once
        outcome = Outcome(failing, ahead=False)
        server.execute(outcome)
        assert outcome.ended["error_type"] == "ValueError"
        assert collector.last_collection == 1010.0 and collector.ended_at is None
        assert gc.get_count()[0] < 3000  # the cycles went with that collection
        now[0] += 5
        server.execute(Outcome(failing, ahead=False))
        assert collector.last_collection == 1010.0 and collector.ended_at == 1015.0
    finally:
        server.server_close()
        collector.uninstall()


def test_every_validation_error_keeps_its_type_across_the_wire():
    """A subclass of DataValidationError left out of error_types would reach the task as a StepWorkerError,
    which Airflow retries, instead of a failure that waits for a person."""
    import inspect

    from components import validation
    from pipelines.step_client import error_types

    raised = {name for name, cls in inspect.getmembers(validation, inspect.isclass)
              if issubclass(cls, validation.DataValidationError)}
    assert raised == {"DataValidationError", "SpecColumnsError"}
    assert all(error_types()[name] is getattr(validation, name) for name in raised)
