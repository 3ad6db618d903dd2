"""The model server process: a model store, a watcher keeping its newest good version loaded, and uvicorn.

    python -m serving.server [--config pipeline.yaml] [--set serving.port=8501 ...]
"""

from __future__ import annotations

import argparse
import logging

import uvicorn

from components.config import PipelineConfig, load_config, parse_override_args
from components.model_store import open_model_store
from serving.app import create_app
from serving.watcher import ModelWatcher

logger = logging.getLogger(__name__)


def build_server(config: PipelineConfig) -> tuple[uvicorn.Server, ModelWatcher]:
    """The uvicorn server and the (not yet started) watcher behind it."""
    store = open_model_store(config.paths.model_store_uri, config.paths.s3_endpoint_url)
    serving = config.serving
    watcher = ModelWatcher(
        store, serving.model_name, config.paths.root / "serving_cache", poll_seconds=serving.poll_seconds
    )
    app = create_app(watcher, serving)
    server = uvicorn.Server(uvicorn.Config(app, host=serving.host, port=serving.port, log_level="info"))
    return server, watcher


def serve(config: PipelineConfig) -> None:
    """Loads the latest model version, then serves until interrupted, swapping in newer versions."""
    server, watcher = build_server(config)
    model = watcher.start()
    if model is None:
        logger.warning(
            "no loadable version of %r in %s yet; answering 503 until one is published",
            config.serving.model_name, watcher.store.uri,
        )
    else:
        logger.info(
            "serving version %s of %r from %s on http://%s:%d", model.version, config.serving.model_name,
            watcher.store.uri, config.serving.host, config.serving.port,
        )
    try:
        server.run()
    finally:
        watcher.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m serving.server", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML file of config sections")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(load_config(parse_override_args(args.set), yaml_path=args.config))


if __name__ == "__main__":
    main()
