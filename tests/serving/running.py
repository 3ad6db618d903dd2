"""A server's REST side run on a thread for the length of a test."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from serving.server import Servers


@contextmanager
def http_running(servers: Servers, timeout_s: float = 20.0) -> Iterator[int]:
    """uvicorn of `servers` on a daemon thread until the block ends (the caller starts and stops the watcher);
    yields the port it listens on, and checks that it stopped."""
    thread = threading.Thread(target=servers.http.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not servers.http.started:
            assert time.monotonic() < deadline, f"uvicorn did not start within {timeout_s} s"
            time.sleep(0.01)
        yield servers.http.servers[0].sockets[0].getsockname()[1]
    finally:
        servers.http.should_exit = True
        thread.join(timeout=20)
    assert not thread.is_alive(), "uvicorn did not stop within 20 s"
