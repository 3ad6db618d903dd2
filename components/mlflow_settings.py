"""MLflow's process-wide settings that tracking, the registry and the logged pyfunc share: the tracking URI for
one block, and the bounds of its HTTP retries. Apart from components.tracking so that the registry and
serving.pyfunc use them without importing the tracker (which calls both)."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

from components.config import PipelineConfig


@contextlib.contextmanager
def using_tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's fluent API (log_model) and the registry's resolution of `models:/` sources read the tracking URI
    from a process-wide global and MLFLOW_TRACKING_URI. This points both at `uri` for the block and puts back
    what was there, so the caller's process (and the config it reads from the environment) is left as it was."""
    import mlflow

    # mlflow.set_tracking_uri sets MLFLOW_TRACKING_URI too, so a URI set before this block is in `saved`; None
    # clears MLflow's global, and the environment put back then gives get_tracking_uri() what it gave before.
    saved = os.environ.get("MLFLOW_TRACKING_URI")
    try:
        mlflow.set_tracking_uri(uri)
        yield
    finally:
        mlflow.set_tracking_uri(None)
        if saved is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = saved


def apply_http_limits(config: PipelineConfig) -> None:
    """Bounds MLflow's HTTP retries and timeout for this process (MLflow reads them from the environment at each
    call): its default retries a refused connection for about 4 minutes, which would stall every minute run
    for as long as a tracking server is away."""
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = str(config.tracking.http_max_retries)
    os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] = "1"
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(int(math.ceil(config.tracking.http_timeout_s)))
