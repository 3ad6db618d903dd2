from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from spark_jobs.standalone import cluster_state, executor_tasks, master_ready

pytestmark = pytest.mark.unit

MASTER = {"status": "ALIVE", "aliveworkers": 2, "cores": 4, "coresused": 2,
          "activeapps": [{"id": "app-1", "name": "ctr-spark-connect", "cores": 2, "state": "RUNNING"}],
          "completedapps": []}
EXECUTORS = [{"id": "driver", "completedTasks": 0}, {"id": "0", "completedTasks": 17}, {"id": "1"}]


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = {"/json/": MASTER, "/api/v1/applications/app-1/allexecutors": EXECUTORS}.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write(json.dumps(body).encode() if body is not None else b"no such page")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def spark_ui() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_masters_json_and_the_drivers_executors_are_read(spark_ui):
    state = cluster_state(spark_ui + "/")
    assert (state.status, state.alive_workers, state.cores, state.cores_used) == ("ALIVE", 2, 4, 2)
    assert state.applications == [{"id": "app-1", "name": "ctr-spark-connect", "cores": 2, "state": "RUNNING"}]
    assert executor_tasks(spark_ui, "app-1") == {"driver": 0, "0": 17, "1": 0}
    assert master_ready(spark_ui) is None


def test_an_error_status_or_no_answer_is_an_os_error(spark_ui):
    with pytest.raises(OSError, match="allexecutors: HTTP 404"):
        executor_tasks(spark_ui, "app-2")
    closed = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = closed.server_address[1]
    closed.server_close()
    with pytest.raises(OSError, match="ConnectError"):
        cluster_state(f"http://127.0.0.1:{port}", timeout_s=1)
    assert master_ready(f"http://127.0.0.1:{port}") == f"http://127.0.0.1:{port}/json/ (OSError)"
