"""A real HTTP server on loopback that answers like the model server, for the load generators' tests."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


@dataclass
class FakeModelServer:
    """Answers 500 to every 5th request it receives; version "7" for its first 10 requests, "8" after."""

    url: str = ""
    delay_s: float = 0.0
    bodies: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, body: dict) -> tuple[int, str]:
        with self.lock:
            self.bodies.append(body)
            count = len(self.bodies)
        time.sleep(self.delay_s)
        return (500 if count % 5 == 0 else 200), ("7" if count <= 10 else "8")


@pytest.fixture
def model_server() -> Iterator[FakeModelServer]:
    fake = FakeModelServer()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the real server
        disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK stall

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status, version = fake.answer(body)
            payload = json.dumps({"predictions": [0.5] * len(body["instances"])}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("X-Model-Version", version)
            if status == 200:
                self.send_header("Server-Timing", f'compute;dur={len(body["instances"])}.5;desc="model", cache')
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    fake.url = f"http://127.0.0.1:{server.server_address[1]}/v1/models/ctr:predict"
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def closing_server() -> Iterator[str]:
    """The URL of a server that ends every keep-alive connection 0.1 s after its answer (uvicorn does after 5 s
    idle), answering 200 with {} to every POST."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 0.1  # the idle connection's socket times out and the handler closes it

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, format: str, *args: object) -> None:
            pass

    class Server(ThreadingHTTPServer):
        def handle_error(self, request: object, client_address: object) -> None:
            pass  # the idle connection's timeout, expected

    with Server(("127.0.0.1", 0), Handler) as server:
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/"
        finally:
            server.shutdown()
            thread.join(timeout=5)
