"""The model server process: a model store, a watcher keeping its newest good version (and the stable one)
loaded, uvicorn for the REST API and a gRPC server for TF Serving's PredictionService, both over one watcher.

    python -m serving.server [--config pipeline.yaml] [--set serving.port=8501 ...]

SIGTERM and SIGINT stop it: REST requests in flight get HTTP_GRACE_SECONDS to finish, then gRPC requests
GRPC_GRACE_SECONDS and a version load in progress WATCHER_STOP_SECONDS, side by side; the process exits with
status 0 within their sum and about a second (9 s), under docker stop's default grace of 10 s. It starts no
child process.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
from dataclasses import dataclass

import grpc
import uvicorn

from components.config import PipelineConfig, load_config, parse_override_args
from components.model_store import open_model_store
from components.stopping import StopRequested, stop_on_signals
from serving.app import TIMED_ENDPOINTS, create_app
from serving.grpc_server import GRPC_TIMED_ENDPOINTS, build_grpc_server
from serving.metrics import GcPauses, ServerMetrics
from serving.model import bfloat16_native
from serving.watcher import ModelWatcher

logger = logging.getLogger(__name__)
# REST stops first (uvicorn owns SIGTERM and SIGINT while it runs), then gRPC and the watcher side by side.
HTTP_GRACE_SECONDS = 4
GRPC_GRACE_SECONDS = 4.0
WATCHER_STOP_SECONDS = 4.0


@dataclass
class Servers:
    http: uvicorn.Server
    watcher: ModelWatcher
    grpc: grpc.Server | None  # None when serving.grpc_port is -1
    grpc_port: int | None  # the port gRPC bound (serving.grpc_port, or a free one for 0)
    gc_pauses: GcPauses  # installed while serve() runs: /metrics' ctr_gc_pause_seconds


def build_server(config: PipelineConfig) -> Servers:
    """The REST and gRPC servers and the (not yet started) watcher behind them, sharing one set of metrics."""
    store = open_model_store(config.paths.model_store_uri, config.paths.s3_endpoint_url)
    serving = config.serving
    watcher = ModelWatcher(store, serving.model_name, config.paths.root / "serving_cache",
                           poll_seconds=serving.poll_seconds, precision=serving.precision,
                           watch_seconds=serving.watch_seconds)
    if serving.precision == "bfloat16" and not bfloat16_native():
        logger.warning("serving.precision is bfloat16 but this CPU has neither AVX512_BF16 nor AMX: its bfloat16 "
                       "matrix products are emulated and slower than float32; set serving.precision=float32")
    gc_pauses = GcPauses()
    metrics = ServerMetrics(timed_endpoints=[*TIMED_ENDPOINTS, *GRPC_TIMED_ENDPOINTS], gc_pauses=gc_pauses)
    app = create_app(watcher, serving, metrics=metrics)
    http = uvicorn.Server(uvicorn.Config(app, host=serving.host, port=serving.port, log_level="info",
                                         timeout_graceful_shutdown=HTTP_GRACE_SECONDS))
    grpc_server, grpc_port = None, None
    if serving.grpc_port != -1:
        grpc_server, grpc_port = build_grpc_server(watcher, serving, metrics, serving.grpc_port)
    return Servers(http=http, watcher=watcher, grpc=grpc_server, grpc_port=grpc_port, gc_pauses=gc_pauses)


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m serving.server", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML file of config sections")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(load_config(parse_override_args(args.set), yaml_path=args.config))


if __name__ == "__main__":
    main()
