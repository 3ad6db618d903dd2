"""Full model versions loaded by a new server process, which takes the traffic over (serving.full_loads=process).

A Python process that drops a loaded SavedModel leaves tens of thousands of objects in reference cycles, and the
garbage collection that frees them stops every thread, requests included: 0.05-0.35 s under bench-serving, the
one thing that kept a full swap's p99 above twice the steady one (docs/serving.md). So a serving process never
drops a model here: deltas are applied in place, as before, and a new full version goes to a new process.

    supervisor (this module, no TensorFlow)
      |- holds the REST listening socket; every child accepts from it (one kernel queue, nothing is refused)
      |- active child: serves; its watcher names a version that needs a full load (hand_off)
      |- standby child: imports done, below the requests' priority, waiting for `serve`
      `- draining child: the previous active one, finishing its requests

A hand-off: the supervisor tells the standby to serve; it loads the newest version (a thread at nice 19, as
in-process loads run), starts gRPC on the same port (SO_REUSEPORT, gRPC's default) and REST on the shared
socket, and reports `serving`. Then the supervisor tells the active child to drain: it stops accepting REST
connections, answers each request on the ones it has with `Connection: close`, gives gRPC's calls
GRPC_GRACE_SECONDS (its clients reconnect on GOAWAY), and exits once its connections are gone or after
DRAIN_SECONDS. A new standby is started. If the new process cannot serve the version, it says so and exits;
the active child keeps serving and retries the version after a failed load's backoff. A child that dies is
replaced (the standby takes over at once).

Messages are JSON lines on a socket pair per child: child -> supervisor `standing_by`, `serving` (version),
`hand_off` (version), `failed` (version, error); supervisor -> child `serve` (version: serve it or a newer
one), `drain`, `hand_off_failed` (version, error).
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from components.config import PipelineConfig
from components.stopping import StopRequested, signals_held, stop_on_signals

logger = logging.getLogger(__name__)

CONFIG_ENV = "CTR_SERVING_CHILD_CONFIG"  # the supervisor's config, as PipelineConfig.flat() JSON
LISTEN_FD_ENV = "CTR_SERVING_LISTEN_FD"
CONTROL_FD_ENV = "CTR_SERVING_CONTROL_FD"
DRAIN_SECONDS = 6.0  # uvicorn closes keep-alive connections idle for 5 s; a draining child is done by then
CHILD_STOP_SECONDS = 12.0  # a child's own SIGTERM stop takes at most 9 s (serving.server)
REST_BACKLOG = 2048
# The nice value of the threads that load full models while a version is serving (serving.watcher) and of a
# standby's imports. Linux gives each thread its own; a thread started by one inherits it.
LOADER_NICE = 19


def lower_this_threads_priority() -> None:
    """The calling thread to LOADER_NICE; where that is not possible (not Linux, not allowed) it runs on at the
    process's priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOADER_NICE)
    except (AttributeError, OSError) as err:
        logger.info("loads run at the process's priority (%s)", err)


class Link:
    """One end of a child's control socket: JSON lines out, JSON lines in."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = b""
        self._kept: list[dict[str, Any]] = []  # received by receive_one, not returned yet
        self._sending = threading.Lock()  # a child sends from its watcher's thread and its main thread

    def send(self, kind: str, **fields: Any) -> None:
        data = json.dumps({"kind": kind, **fields}).encode() + b"\n"
        with self._sending:
            self.sock.sendall(data)

    def receive(self) -> list[dict[str, Any]] | None:
        """The messages that arrived (blocking until at least one byte does, unless some are kept from
        `receive_one`); None once the other end closed."""
        if self._kept:
            kept, self._kept = self._kept, []
            return kept
        data = self.sock.recv(65536)
        if not data:
            return None
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def receive_one(self) -> dict[str, Any] | None:
        """The next message; any that arrived with it are kept for the next call of this or `receive`. None
        once the other end closed."""
        while not self._kept:
            messages = self.receive()
            if messages is None:
                return None
            self._kept = messages
        return self._kept.pop(0)


@dataclass
class Child:
    process: subprocess.Popen
    link: Link
    role: str  # "standby", "starting" (told to serve), "active", "draining", "failed" (could not serve; exits)
    wanted: str | None = None  # the version it was told to serve (or newer)
    version: str | None = None  # the version it served first
    since: float = field(default_factory=time.monotonic)
    standing_by: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid


def child_link() -> tuple[Link, socket.socket] | None:
    """In a child: its control link and the shared REST socket; None in a process the supervisor did not start."""
    if CONTROL_FD_ENV not in os.environ:
        return None
    control = socket.socket(fileno=int(os.environ.pop(CONTROL_FD_ENV)))
    listening = socket.socket(fileno=int(os.environ.pop(LISTEN_FD_ENV)))
    return Link(control), listening


def child_config() -> PipelineConfig:
    return PipelineConfig().with_overrides(json.loads(os.environ.pop(CONFIG_ENV)))


def bind_rest_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise SystemExit(f"cannot listen on {host}:{port} for the REST API: {err}; set serving.port to a free "
                         "port") from err
    sock.listen(REST_BACKLOG)
    sock.set_inheritable(True)
    return sock


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class Supervisor:
    def __init__(self, config: PipelineConfig) -> None:
        serving = config.serving
        self.rest = bind_rest_socket(serving.host, serving.port)
        overrides = {"serving.port": str(self.rest.getsockname()[1])}
        if serving.grpc_port == 0:  # every child binds the same one
            overrides["serving.grpc_port"] = str(free_port(serving.host))
        self.config = config.with_overrides(overrides)
        self.selector = selectors.DefaultSelector()
        self.children: list[Child] = []
        self.wanted: str | None = None  # a version handed off that no standby was ready to take yet
        self.handoffs = 0

    def child(self, role: str) -> Child | None:
        return next((c for c in self.children if c.role == role), None)

    def spawn(self, role: str = "standby") -> Child:
        """A new server process, recorded among the children before a stop signal that arrived meanwhile is
        handled: one started but not recorded would not be stopped, and would keep the REST socket it inherited
        answering after this process exited."""
        with signals_held((signal.SIGTERM, signal.SIGINT)):
            ours, theirs = socket.socketpair()
            env = {**os.environ, CONFIG_ENV: json.dumps(self.config.flat()),
                   LISTEN_FD_ENV: str(self.rest.fileno()), CONTROL_FD_ENV: str(theirs.fileno())}
            process = subprocess.Popen([sys.executable, "-m", "serving.server"], env=env,
                                       pass_fds=(self.rest.fileno(), theirs.fileno()))
            theirs.close()
            child = Child(process, Link(ours), role)
            self.children.append(child)
            self.selector.register(ours, selectors.EVENT_READ, child)
        logger.info("started server process %d (%s)", child.pid, role)
        return child

    def run(self) -> int:
        """Serves until SIGTERM or SIGINT (then stops every child) or until the first child cannot start."""
        with stop_on_signals((signal.SIGTERM, signal.SIGINT)):
            try:
                first = self.spawn("starting")
                first.link.send("serve", version=None)
                while True:
                    code = self._step()
                    if code is not None:
                        return code
            except StopRequested as stop:
                logger.info("%s: stopping the server processes", stop)
                self._stop_all(stop.signum)
                return 0
            finally:
                self._stop_all(signal.SIGTERM)

    def _step(self) -> int | None:
        for key, _ in self.selector.select(timeout=0.2):
            child: Child = key.data
            try:
                messages = child.link.receive()
            except (ConnectionError, json.JSONDecodeError) as err:
                logger.warning("server process %d: its control socket broke (%s)", child.pid, err)
                messages = None
            if messages is None:
                self.selector.unregister(child.link.sock)
                continue
            for message in messages:
                code = self._on_message(child, message)
                if code is not None:
                    return code
        for child in list(self.children):
            if child.process.poll() is not None:
                code = self._on_exit(child)
                if code is not None:
                    return code
        self._keep_a_standby()
        return None

    def _on_message(self, child: Child, message: dict[str, Any]) -> int | None:
        kind = message.get("kind")
        if kind == "standing_by":
            child.standing_by = True
            self._tell_active_about(child)
            if child.role == "standby" and self.wanted is not None and self.child("starting") is None:
                self._start_hand_off(child, self.wanted)
        elif kind == "hand_off" and child.role == "active":
            version = str(message["version"])
            if self.child("starting") is not None:
                return None  # the process starting now serves the newest version it finds: this one or newer
            standby = self.child("standby")
            if standby is not None and standby.standing_by:
                self._start_hand_off(standby, version)
            else:
                self.wanted = version
        elif kind == "serving" and child.role == "starting":
            previous = self.child("active")
            child.role, child.version = "active", message.get("version")
            if previous is None:
                logger.info("server process %d serves version %s", child.pid, message.get("version"))
            else:
                self.handoffs += 1
                logger.info("server process %d serves version %s, %.2f s after it was asked to; process %d (version "
                            "%s) drains", child.pid, message.get("version"), time.monotonic() - child.since,
                            previous.pid, previous.version)
                previous.role, previous.since = "draining", time.monotonic()
                self._send(previous, "drain")
        elif kind == "failed" and child.role == "starting":
            error = str(message.get("error"))
            active = self.child("active")
            if active is None:
                logger.error("server process %d could not start serving: %s", child.pid, error)
                return 1
            logger.error("server process %d could not serve version %s: %s; process %d keeps serving", child.pid,
                         child.wanted, error, active.pid)
            child.role = "failed"  # it exits; _on_exit only reaps it
            self._send(active, "hand_off_failed", version=child.wanted, error=error)
        return None

    def _start_hand_off(self, standby: Child, version: str | None) -> None:
        self.wanted = None
        standby.role, standby.wanted, standby.since = "starting", version, time.monotonic()
        logger.info("server process %d loads version %s (or newer) to take the traffic over", standby.pid, version)
        self._send(standby, "serve", version=version)

    def _on_exit(self, child: Child) -> int | None:
        self.children.remove(child)
        try:
            self.selector.unregister(child.link.sock)
        except (KeyError, ValueError):
            pass
        child.link.sock.close()
        code = child.process.returncode
        if child.role == "failed":
            return None
        if child.role == "draining":
            logger.info("server process %d drained and exited (%s) after %.1f s", child.pid, code,
                        time.monotonic() - child.since)
            return None
        active = self.child("active")
        if child.role == "starting" and active is None and self.handoffs == 0 and not self.children:
            logger.error("server process %d exited with %s before serving", child.pid, code)
            return code or 1
        logger.error("server process %d (%s) exited with %s", child.pid, child.role, code)
        if child.role == "starting" and active is not None and child.wanted is not None:
            self._send(active, "hand_off_failed", version=child.wanted, error=f"its process exited with {code}")
        if child.role in ("active", "starting") and self.child("active") is None and self.child("starting") is None:
            standby = self.child("standby")
            if standby is not None and standby.standing_by:
                self._start_hand_off(standby, None)
            else:
                replacement = standby or self.spawn()
                replacement.role = "starting"
                self._send(replacement, "serve", version=None)
        return None

    def _keep_a_standby(self) -> None:
        """Starts a standby once one serves and none stands by, starts or drains: a process's start-up takes a
        moment of the cores at full priority before it lowers its own."""
        if self.child("active") is not None and not any(c.role in ("standby", "starting", "draining", "failed")
                                                         for c in self.children):
            self._tell_active_about(self.spawn())

    def _tell_active_about(self, standby: Child) -> None:
        active = self.child("active")
        if active is not None and standby.role == "standby":
            self._send(active, "standby", state="ready" if standby.standing_by else "starting")

    def _send(self, child: Child, kind: str, **fields: Any) -> None:
        try:
            child.link.send(kind, **fields)
        except OSError as err:  # it is exiting: _on_exit handles it
            logger.warning("cannot reach server process %d: %s", child.pid, err)

    def _stop_all(self, signum: int) -> None:
        """Passes `signum` on to every child and waits for them (a child stops on SIGTERM and SIGINT alike)."""
        for child in self.children:
            if child.process.poll() is None:
                child.process.send_signal(signum)
        deadline = time.monotonic() + CHILD_STOP_SECONDS
        for child in self.children:
            try:
                child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("server process %d still runs %.0f s after SIGTERM: killed", child.pid,
                               CHILD_STOP_SECONDS)
                child.process.kill()
                child.process.wait()
        self.children.clear()
        self.rest.close()


def supervise(config: PipelineConfig) -> int:
    return Supervisor(config).run()
