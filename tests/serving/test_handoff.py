"""Full versions taken over by a new server process (serving.handoff), over real HTTP and real processes:
`python -m serving.server` as a supervisor, its children, and a client that keeps sending requests."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from components.manifest import write_manifest
from components.model_store import LocalModelStore
from serving.handoff import Link
from tests.serving.fixture_model import MODEL_NAME, NEW_VERSION, OLD_VERSION

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BODY = json.dumps({"instances": [{"I1": 3.0, "I2": 2.5, "C1": "abc"}]}).encode()  # dense sum 5.5
# old: sigmoid(0.1 * 5.5 + 0.5); new: sigmoid(-0.3 * 5.5 + 2.0)
VALUES = {OLD_VERSION: 0.7407749, NEW_VERSION: 0.5866176}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, store: LocalModelStore, tmp_path: Path) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        self.log = tmp_path / "server.log"
        command = [sys.executable, "-m", "serving.server", "--set", f"paths.data_root={tmp_path}",
                   "--set", f"paths.model_store={store.root}", "--set", f"serving.port={self.port}",
                   "--set", f"serving.grpc_port={self.grpc_port}", "--set", "serving.poll_seconds=0.2"]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)

    def health(self) -> dict:
        return httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=2.0).json()

    def wait(self, condition, what: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process.poll() is None, f"the server exited with {self.process.returncode}:\n{self.text()}"
            try:
                if condition():
                    return
            except (httpx.HTTPError, ValueError):
                pass
            assert time.monotonic() < deadline, f"{what} not within {timeout_s} s:\n{self.text()[-4000:]}"
            time.sleep(0.1)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        self.process.terminate()
        return self.process.wait(60)


class Client(threading.Thread):
    """One request in flight, on one keep-alive connection (http.client opens a new one after `Connection:
    close`); every answer's status and version kept, every exception counted as a failure."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.answers: list[tuple[int, str | None, float | None]] = []
        self.failures: list[str] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        while not self.stopping.is_set():
            try:
                connection.request("POST", f"/v1/models/{MODEL_NAME}:predict", BODY,
                                   {"Content-Type": "application/json"})
                response = connection.getresponse()
                body = response.read()
                value = json.loads(body)["predictions"][0] if response.status == 200 else None
                self.answers.append((response.status, response.getheader("X-Model-Version"), value))
            except Exception as err:  # noqa: BLE001 - what a client would see as a failed request
                self.failures.append(repr(err))
                connection.close()
            time.sleep(0.005)


class GrpcClient(threading.Thread):
    """TF Serving's stub on one channel (with `options`: serving.grpc_server.client_channel_options, or none),
    calls one after another without wait_for_ready: a call the server side drops fails."""

    def __init__(self, port: int, options: list | None = None) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.options = options or []
        self.versions: list[str] = []
        self.failures: list[str] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        import grpc
        import tensorflow as tf
        from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

        request = predict_pb2.PredictRequest()
        request.model_spec.name = MODEL_NAME
        for name, value in (("I1", [3.0]), ("I2", [2.5]), ("C1", ["abc"])):
            request.inputs[name].CopyFrom(tf.make_tensor_proto(value))
        with grpc.insecure_channel(f"127.0.0.1:{self.port}", options=self.options) as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            while not self.stopping.is_set():
                try:
                    answer = stub.Predict(request, timeout=10)
                    self.versions.append(str(answer.model_spec.version.value))
                except grpc.RpcError as err:
                    self.failures.append(f"{err.code().name}: {err.details()}")
                time.sleep(0.005)


@pytest.fixture
def server(store: LocalModelStore, tmp_path: Path):
    running = Server(store, tmp_path)
    try:
        running.wait(lambda: running.health().get("standby") == "ready", "a model served and a standby ready")
        yield running
    finally:
        if running.process.poll() is None:
            running.stop()


def test_a_new_full_version_is_taken_over_by_a_new_process_without_a_failed_rest_or_retried_grpc_call(
    server: Server, store: LocalModelStore, exported: dict[str, Path]
) -> None:
    from components.config import ServingConfig
    from serving.grpc_server import client_channel_options

    client, grpc_client = Client(server.port), GrpcClient(server.grpc_port)
    retrying = GrpcClient(server.grpc_port, client_channel_options(ServingConfig().max_body_bytes))
    for running in (client, grpc_client, retrying):
        running.start()
    server.wait(lambda: len(client.answers) >= 20 and min(len(grpc_client.versions), len(retrying.versions)) >= 20,
                "answers from the first version")
    store.publish(MODEL_NAME, NEW_VERSION, exported[NEW_VERSION])
    server.wait(lambda: any(version == NEW_VERSION for _, version, _ in client.answers), "the new version")
    server.wait(lambda: "drained and exited (0)" in server.text(), "the old process's exit")
    seen = len(client.answers)
    server.wait(lambda: len(client.answers) >= seen + 20, "answers after the hand-off")
    server.wait(lambda: server.health().get("standby") == "ready", "a new standby")
    server.wait(lambda: grpc_client.versions[-1] == retrying.versions[-1] == NEW_VERSION,
                "the new version over gRPC")
    for running in (client, grpc_client, retrying):
        running.stopping.set()
        running.join(15)
    status = server.stop()

    # A plain gRPC client can lose the one call that crosses the old server's stop (grpc_server's docstring);
    # one with client_channel_options loses none.
    assert client.failures == [] and retrying.failures == []
    assert len(grpc_client.failures) <= 1 and all(f.startswith("CANCELLED") for f in grpc_client.failures)
    for answered in (grpc_client.versions, retrying.versions):
        grpc_first_new = answered.index(NEW_VERSION)
        assert set(answered[:grpc_first_new]) == {OLD_VERSION}
        assert set(answered[grpc_first_new:]) == {NEW_VERSION}
    assert {status for status, _, _ in client.answers} == {200}
    versions = [version for _, version, _ in client.answers]
    first_new = versions.index(NEW_VERSION)
    assert set(versions[:first_new]) == {OLD_VERSION} and set(versions[first_new:]) == {NEW_VERSION}
    for _, version, value in client.answers:
        assert value == pytest.approx(VALUES[version], rel=1e-6)
    text = server.text()
    assert f"needs a full load: handed off to a new server process; version {OLD_VERSION} serves" in text
    assert f"serves version {NEW_VERSION}" in text and "drains" in text
    assert status == 0


def test_a_version_the_new_process_cannot_load_leaves_the_old_one_serving(
    server: Server, store: LocalModelStore, exported: dict[str, Path], tmp_path: Path
) -> None:
    broken = tmp_path / "broken"  # whole by its manifest, not a SavedModel
    shutil.copytree(exported[NEW_VERSION], broken)
    (broken / "saved_model" / "saved_model.pb").write_bytes(b"not a SavedModel")
    files = [str(path.relative_to(broken)) for path in (broken / "saved_model").rglob("*") if path.is_file()]
    write_manifest(broken, kind="full_model", version=NEW_VERSION, files=files)
    store.publish(MODEL_NAME, NEW_VERSION, broken)
    server.wait(lambda: f"could not serve version {NEW_VERSION}" in server.text(), "the failed hand-off")
    server.wait(lambda: server.health().get("standby") == "ready", "a new standby")
    answer = httpx.post(f"http://127.0.0.1:{server.port}/v1/models/{MODEL_NAME}:predict", content=BODY)
    status = server.stop()

    assert (answer.status_code, answer.headers["x-model-version"]) == (200, OLD_VERSION)
    assert f"version {NEW_VERSION} of '{MODEL_NAME}' failed to load in a new server process (failure 1)" in \
        server.text()
    assert status == 0


def test_the_control_link_keeps_what_arrived_with_the_message_it_returns() -> None:
    ours, theirs = socket.socketpair()
    sender, receiver = Link(ours), Link(theirs)
    sender.send("serve", version=None)
    sender.send("drain")  # both arrive in one read
    first, rest = receiver.receive_one(), receiver.receive()
    theirs.sendall(b'{"kind": "hand_off", ')  # a message in two pieces
    theirs.sendall(b'"version": "202601010100"}\n')
    split = sender.receive_one()
    theirs.close()
    assert first == {"kind": "serve", "version": None}
    assert rest == [{"kind": "drain"}]
    assert split == {"kind": "hand_off", "version": "202601010100"}
    assert sender.receive_one() is None


def test_a_stop_during_a_childs_start_stops_that_child_too(monkeypatch, tmp_path) -> None:
    """SIGTERM arriving while the supervisor starts a child (here: right after the fork, before the child is
    recorded) is handled once the child is recorded, so the stop that follows reaches it; before, the child was
    left running with the REST socket it inherited, which kept answering after the supervisor exited."""
    import signal

    from components.config import PipelineConfig
    from components.stopping import StopRequested, stop_on_signals
    from serving import handoff

    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen_then_stop(command, **kwargs):
        process = real_popen([sys.executable, "-c", "import time; time.sleep(60)"], **kwargs)
        started.append(process)
        os.kill(os.getpid(), signal.SIGTERM)  # the stop arrives while the child starts
        for _ in range(50):
            time.sleep(0.01)
        return process

    monkeypatch.setattr(handoff.subprocess, "Popen", popen_then_stop)
    config = PipelineConfig().with_overrides({"serving.port": "0", "serving.host": "127.0.0.1",
                                              "paths.data_root": str(tmp_path)})
    supervisor = handoff.Supervisor(config)
    try:
        with stop_on_signals((signal.SIGTERM, signal.SIGINT)), pytest.raises(StopRequested):
            supervisor.spawn()
        # Recorded before the stop was handled: the supervisor's stop (run's `finally`) signals it.
        assert [child.process for child in supervisor.children] == started
    finally:
        for process in started:
            process.kill()
            process.wait()
        supervisor.rest.close()
