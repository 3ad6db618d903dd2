"""The model server process: a model store, a watcher keeping its newest good version (and the stable one)
loaded, uvicorn for the REST API and a gRPC server for TF Serving's PredictionService, both over one watcher.

    python -m serving.server [--config pipeline.yaml] [--set serving.port=8501 ...]

With serving.full_loads=process (the default) this process is a supervisor (serving.handoff): it holds the
REST socket and runs the servers as child processes of this same module, so that a new full model version is
loaded by a new process instead of this one. With serving.full_loads=thread it serves itself.

SIGTERM and SIGINT stop a server: REST requests in flight get HTTP_GRACE_SECONDS to finish, then gRPC requests
GRPC_GRACE_SECONDS and a version load in progress WATCHER_STOP_SECONDS, side by side; it exits with status 0
within their sum and about a second (9 s), under docker stop's default grace of 10 s. A supervisor passes the
signal on to its children and exits once they have.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from components.config import PipelineConfig, load_config, parse_override_args
from components.stopping import StopRequested, stop_on_signals
from serving import handoff

if TYPE_CHECKING:  # imported where used: a supervisor never imports TensorFlow
    import grpc
    import uvicorn

    from serving.metrics import GcPauses
    from serving.watcher import ModelWatcher

logger = logging.getLogger(__name__)
# REST stops first (uvicorn owns SIGTERM and SIGINT while it runs), then gRPC and the watcher side by side.
HTTP_GRACE_SECONDS = 4
GRPC_GRACE_SECONDS = 4.0
WATCHER_STOP_SECONDS = 4.0
WARM_UP_ROWS = 100  # the instances of the requests a new server sends itself through REST and gRPC


@dataclass
class Servers:
    http: uvicorn.Server
    watcher: ModelWatcher
    grpc: grpc.Server | None  # None when serving.grpc_port is -1
    grpc_port: int | None  # the port gRPC bound (serving.grpc_port, or a free one for 0)
    grpc_warm_up_port: int | None  # a loopback port of this process's gRPC server (grpc_server.add_warm_up_port)
    warm_up_rows: int  # the instances of each warm-up request: WARM_UP_ROWS, or serving.max_instances if lower
    gc_pauses: GcPauses  # installed while serve() runs: /metrics' ctr_gc_pause_seconds


def build_server(config: PipelineConfig, *, hand_off: Callable[[str], None] | None = None,
                 low_priority_loads: bool = False, closing: Callable[[], bool] | None = None,
                 health_fields: Callable[[], dict] | None = None) -> Servers:
    """The REST and gRPC servers and the (not yet started) watcher behind them, sharing one set of metrics.
    `hand_off`, `low_priority_loads`: the watcher's (serving.watcher); `closing`, `health_fields`: the app's
    (serving.app)."""
    import uvicorn

    from components.model_store import open_model_store
    from serving.app import TIMED_ENDPOINTS, create_app
    from serving.grpc_server import GRPC_TIMED_ENDPOINTS, add_warm_up_port, build_grpc_server
    from serving.metrics import GcPauses, ServerMetrics
    from serving.model import bfloat16_native
    from serving.watcher import ModelWatcher

    store = open_model_store(config.paths.model_store_uri, config.paths.s3_endpoint_url)
    serving = config.serving
    watcher = ModelWatcher(store, serving.model_name, config.paths.root / "serving_cache",
                           poll_seconds=serving.poll_seconds, precision=serving.precision,
                           watch_seconds=serving.watch_seconds, hand_off=hand_off,
                           low_priority_loads=low_priority_loads, native_rows=serving.native_rows,
                           row_cache_protected_share=serving.row_cache_protected_share)
    if serving.precision == "bfloat16" and not bfloat16_native():
        logger.warning("serving.precision is bfloat16 but this CPU has neither AVX512_BF16 nor AMX: its bfloat16 "
                       "matrix products are emulated and slower than float32; set serving.precision=float32")
    gc_pauses = GcPauses()
    metrics = ServerMetrics(timed_endpoints=[*TIMED_ENDPOINTS, *GRPC_TIMED_ENDPOINTS], gc_pauses=gc_pauses,
                            staged_endpoints=TIMED_ENDPOINTS)
    app = create_app(watcher, serving, metrics=metrics, closing=closing, health_fields=health_fields)
    http = uvicorn.Server(uvicorn.Config(app, host=serving.host, port=serving.port, log_level="info",
                                         timeout_graceful_shutdown=HTTP_GRACE_SECONDS))
    grpc_server, grpc_port, warm_up_port = None, None, None
    if serving.grpc_port != -1:
        grpc_server, grpc_port = build_grpc_server(watcher, serving, metrics, serving.grpc_port)
        warm_up_port = add_warm_up_port(grpc_server)
    return Servers(http=http, watcher=watcher, grpc=grpc_server, grpc_port=grpc_port,
                   grpc_warm_up_port=warm_up_port, warm_up_rows=min(WARM_UP_ROWS, serving.max_instances),
                   gc_pauses=gc_pauses)


def freeze_imports() -> int:
    """Moves every object alive now into CPython's permanent generation, which collections skip, and returns
    how many. Called once the server's modules are imported and before any model loads: TensorFlow's modules
    hold about 420 K objects, which every full collection walked, 0.2-0.25 s with every thread stopped
    (docs/serving.md). After it, a full collection walks the loaded models and what the server made since:
    0.003-0.02 s with one to four replicas in-process, 0.03-0.14 s near a full load under bench-serving. Models
    load after it, so a dropped replica's cycles are still collected."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def serve(config: PipelineConfig) -> None:
    """Serves the latest model version until SIGTERM or SIGINT, swapping in newer versions: through server
    processes of its own (serving.full_loads=process) or itself. Returns once everything has stopped."""
    if config.serving.full_loads == "process":
        code = handoff.supervise(config)
        if code:
            raise SystemExit(code)
        return
    serve_here(config)


def serve_here(config: PipelineConfig) -> None:
    """Loads the latest model version, then serves until SIGTERM or SIGINT, swapping in newer versions; returns
    once REST, gRPC and the watcher have stopped (module docstring: how long that takes at most)."""
    servers = build_server(config)
    serving = config.serving
    # uvicorn takes SIGTERM and SIGINT over while it runs, and after its own graceful stop raises the signal again
    # for the handler it found: this one, which makes that (or a signal before uvicorn runs) a StopRequested.
    # Python's default for SIGTERM would end the process there, skipping the gRPC and watcher stops below.
    with stop_on_signals((signal.SIGTERM, signal.SIGINT)):
        logger.info("%d objects of the imports frozen out of garbage collections", freeze_imports())
        servers.gc_pauses.install()
        try:
            model = servers.watcher.start()
            if model is None:
                logger.warning(
                    "no loadable version of %r in %s yet; answering 503 until one is published",
                    serving.model_name, servers.watcher.store.uri,
                )
            else:
                logger.info("serving version %s of %r from %s", model.version, serving.model_name,
                            servers.watcher.store.uri)
            logger.info("REST API on http://%s:%d; gRPC API %s", serving.host, serving.port,
                        f"on {serving.host}:{servers.grpc_port}" if servers.grpc else "off (serving.grpc_port=-1)")
            if servers.grpc is not None:
                servers.grpc.start()
            threading.Thread(target=_warm_up_once_started, args=(servers,), name="warm-up", daemon=True).start()
            servers.http.run()
        except StopRequested as stop:
            logger.info("%s: REST is down; stopping gRPC and the model watcher", stop)
        finally:
            _stop_grpc_and_watcher(servers)
            servers.gc_pauses.uninstall()


def _stop_grpc_and_watcher(servers: Servers) -> None:
    grpc_stopped = servers.grpc.stop(GRPC_GRACE_SECONDS) if servers.grpc is not None else None
    if not servers.watcher.stop(WATCHER_STOP_SECONDS):
        logger.warning("the model watcher is still busy (loading a version?) %.0f s after the stop; it ends with "
                       "the process", WATCHER_STOP_SECONDS)
    if grpc_stopped is not None:
        grpc_stopped.wait(GRPC_GRACE_SECONDS)


def serve_child(link: handoff.Link, listening: socket.socket) -> int:
    """A server process started by the supervisor (serving.handoff): imports below the requests' priority, stands
    by, and on `serve` loads the newest version and serves on the shared REST socket until told to drain or
    stopped. Returns the exit status."""
    config = handoff.child_config()
    with stop_on_signals((signal.SIGTERM, signal.SIGINT)):
        try:
            _below_requests(_import_server_modules)
            link.send("standing_by")
            command = link.receive_one()
            if command is None or command.get("kind") != "serve":
                return 0
            return _serve_child(config, link, listening, command.get("version"))
        except StopRequested as stop:
            logger.info("%s: stopping", stop)
            return 0


def _serve_child(config: PipelineConfig, link: handoff.Link, listening: socket.socket, wanted: str | None) -> int:
    import tensorflow as tf

    # TensorFlow's runtime (its thread pools) starts on this thread, at the process's priority; the load then
    # runs below it (low_priority_loads), beside the process serving now.
    tf.constant(1.0) + 1.0
    draining = threading.Event()
    standby = {"standby": "none"}  # the supervisor's standby process: none, starting, ready
    servers = build_server(config, hand_off=lambda version: link.send("hand_off", version=version),
                           low_priority_loads=True, closing=draining.is_set, health_fields=lambda: dict(standby))
    servers.gc_pauses.install()
    try:
        model = servers.watcher.start()
        if wanted is not None and (model is None or int(model.version) < int(wanted)):
            error = servers.watcher.last_error or f"it found version {model.version if model else None} newest"
            link.send("failed", version=wanted, error=error)
            return 1
        # This process never drops what it loaded (full loads are handed off), so its replicas can leave the
        # collections too: a full collection then walks what deltas and requests make.
        gc.collect()
        gc.freeze()
        if servers.grpc is not None:
            servers.grpc.start()
        threading.Thread(target=_report_serving, args=(servers, link), name="report-serving", daemon=True).start()
        threading.Thread(target=_follow_commands, args=(servers, link, draining, standby), name="commands",
                         daemon=True).start()
        servers.http.run(sockets=[listening])
    except StopRequested as stop:
        logger.info("%s: REST is down; stopping gRPC and the model watcher", stop)
    finally:
        _stop_grpc_and_watcher(servers)
        servers.gc_pauses.uninstall()
    return 0


def _report_serving(servers: Servers, link: handoff.Link) -> None:
    if _warm_up_once_started(servers):
        link.send("serving", version=servers.watcher.version)


def _warm_up_once_started(servers: Servers) -> bool:
    """Waits for uvicorn to listen, then warms the REST and gRPC paths up if a model is loaded; says whether it
    listens."""
    from serving.grpc_server import warm_up_grpc

    while not servers.http.started and not servers.http.should_exit:
        time.sleep(0.01)
    if not servers.http.started:
        return False
    model = servers.watcher.current()
    if model is not None:
        try:
            warm_up_http(servers, servers.warm_up_rows)
        except Exception:  # noqa: BLE001 - a slower first request, not a reason not to serve
            logger.exception("the warm-up request through the REST app failed")
        if servers.grpc_warm_up_port is not None:
            try:
                warm_up_grpc(servers.grpc_warm_up_port, servers.watcher.model_name, model, servers.warm_up_rows)
            except Exception:  # noqa: BLE001 - as above
                logger.exception("the warm-up call through the gRPC server failed")
    return True


def warm_up_http(servers: Servers, rows: int = WARM_UP_ROWS) -> int:
    """One predict request of `rows` instances with no values through the REST app (uvicorn's wrappers, the
    middleware, the route, the worker-thread hop, the model), on uvicorn's own event loop, and returns its
    status. A fresh process answered its first HTTP request in 20-29 ms against 3-5 ms for the next ones, with the
    model already warmed up (docs/serving.md); the first client of a new process would pay that. It is counted
    in /metrics as any request."""
    import asyncio

    http = servers.http
    body = b'{"instances":[' + b",".join([b"{}"] * rows) + b"]}"
    path = f"/v1/models/{servers.watcher.model_name}:predict"
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": [(b"content-type", b"application/json"),
                                     (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {},
    }
    status: list[int] = []

    async def request() -> None:
        delivered = asyncio.Event()

        async def receive() -> dict:
            if not delivered.is_set():
                delivered.set()
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # no disconnect: the app has its whole body
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])

        await http.config.loaded_app(scope, receive, send)

    loop = http.servers[0].get_loop()
    asyncio.run_coroutine_threadsafe(request(), loop).result(60)
    return status[0]


def _follow_commands(servers: Servers, link: handoff.Link, draining: threading.Event, standby: dict[str, str]
                     ) -> None:
    while True:
        try:
            messages = link.receive()
        except OSError:
            messages = None
        if messages is None:  # the supervisor is gone: stop as on SIGTERM
            os.kill(os.getpid(), signal.SIGTERM)
            return
        for message in messages:
            if message.get("kind") == "drain":
                _drain(servers, draining)
            elif message.get("kind") == "standby":
                standby["standby"] = str(message.get("state"))
            elif message.get("kind") == "hand_off_failed":
                servers.watcher.hand_off_failed(str(message["version"]), str(message.get("error")))


def _drain(servers: Servers, draining: threading.Event) -> None:
    """Hands the traffic over: no new REST connections, `Connection: close` on every response, gRPC's calls given
    their grace (its clients move on GOAWAY); then the usual stop, once the connections are gone or after
    handoff.DRAIN_SECONDS (idle keep-alive connections are closed by then)."""
    draining.set()
    logger.info("draining: the traffic goes to the new server process")
    if servers.grpc is not None:
        servers.grpc.stop(GRPC_GRACE_SECONDS)
    http = servers.http
    if http.servers:
        loop = http.servers[0].get_loop()
        loop.call_soon_threadsafe(lambda: [server.close() for server in http.servers])
    deadline = time.monotonic() + handoff.DRAIN_SECONDS
    while http.server_state.connections and time.monotonic() < deadline:
        time.sleep(0.05)
    http.should_exit = True


def _import_server_modules() -> None:
    import serving.app  # noqa: F401 - TensorFlow, through serving.model
    import serving.grpc_server  # noqa: F401

    logger.info("%d objects of the imports frozen out of garbage collections", freeze_imports())


def _below_requests(work: Callable[[], None]) -> None:
    """Runs `work` on a thread at handoff.LOADER_NICE (as serving.watcher's loads): a standby's start-up
    takes seconds of CPU beside the process serving on the same cores."""
    failure: list[BaseException] = []

    def run() -> None:
        handoff.lower_this_threads_priority()
        try:
            work()
        except BaseException as err:  # noqa: BLE001 - raised again on the calling thread
            failure.append(err)

    thread = threading.Thread(target=run, name="standby-imports", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


def main(argv: list[str] | None = None) -> None:
    child = handoff.child_link()
    if child is not None:
        logging.basicConfig(level=logging.INFO,
                            format=f"%(asctime)s %(levelname)s [{os.getpid()}] %(name)s: %(message)s")
        code = serve_child(*child)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # TensorFlow's teardown would take the core from the process serving now
    parser = argparse.ArgumentParser(prog="python -m serving.server", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML file of config sections")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(load_config(parse_override_args(args.set), yaml_path=args.config))


if __name__ == "__main__":
    main()
