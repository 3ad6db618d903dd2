"""The MLflow model registry beside the model store: which published versions are registered, and which one
the `champion` alias names.

- Each daily export registers its model (the pyfunc it logs, serving.pyfunc: SavedModel and manifest, with a
  signature and an input example) as a version of the registered model `ctr`, tagged with its store version
  (`ctr.store_version`) and store URI, and moves the alias `challenger` to it.
- `champion` follows the store's `stable` label (components.model_store): `ctr-pipeline promote` and
  `ctr-pipeline rollback` move it to the registered version of the store's stable version. Minute deltas are not
  registered (1,440 a day); when the stable version is one of them, `champion` stays where it was, and the command
  says so.

The registry is a side channel like the rest of tracking: a failure is logged and the store stays the truth,
unless `tracking.strict` is set.
"""

from __future__ import annotations

import logging
from typing import Any

from components.config import PipelineConfig

log = logging.getLogger(__name__)

REGISTERED_MODEL = "ctr"
CHALLENGER = "challenger"
CHAMPION = "champion"
STORE_VERSION_TAG = "ctr.store_version"
STORE_URI_TAG = "ctr.store_uri"
DESCRIPTION = ("CTR models published to the model store by the daily pipeline. Alias challenger: the newest; "
               "champion: the store's stable version (ctr-pipeline promote / ctr-pipeline rollback).")


def _client(config: PipelineConfig) -> Any:
    from mlflow.tracking import MlflowClient

    from components.mlflow_settings import apply_http_limits

    if config.tracking_uri.startswith(("http://", "https://")):
        apply_http_limits(config)
    return MlflowClient(tracking_uri=config.tracking_uri)


def _guarded(config: PipelineConfig, what: str, fn, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - the registry must not break a pipeline step unless strict
        if config.tracking.strict:
            raise
        log.warning("MLflow registry: %s failed (the model store is unaffected): %s", what, err)
        return None


def register(config: PipelineConfig, run_id: str, store_version: str, store_uri: str,
             model_uri: str | None = None, model_id: str | None = None) -> str | None:
    """Registers the run's logged model (`model_uri`, `model_id`: serving.pyfunc.log_model; else the run's
    `model` artifact) as a version of `ctr` and points `challenger` at it. Returns the registered version, or
    None if the registry is unreachable."""

    def do() -> str:
        from mlflow.exceptions import MlflowException

        client = _client(config)
        try:
            client.create_registered_model(REGISTERED_MODEL, description=DESCRIPTION)
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        from components.mlflow_settings import using_tracking_uri

        with using_tracking_uri(config.tracking_uri):  # a models:/ source is looked up through it
            version = client.create_model_version(
                REGISTERED_MODEL, source=model_uri or f"runs:/{run_id}/model", run_id=run_id, model_id=model_id,
                tags={STORE_VERSION_TAG: store_version, STORE_URI_TAG: store_uri},
                description=f"model store version {store_version} ({store_uri})",
            ).version
        client.set_registered_model_alias(REGISTERED_MODEL, CHALLENGER, str(version))
        return str(version)

    return _guarded(config, f"registering store version {store_version}", do)


def registered_version(client: Any, store_version: str) -> str | None:
    """The registered version of a store version, or None if it is not registered."""
    found = client.search_model_versions(
        f"name='{REGISTERED_MODEL}' and tags.`{STORE_VERSION_TAG}` = '{store_version}'")
    return str(max(int(v.version) for v in found)) if found else None


def follow_stable(config: PipelineConfig, stable: str | None) -> str:
    """Moves `champion` to the registered version of the store's stable version; returns a sentence saying
    what it did, for the command line."""

    def do() -> str:
        from mlflow.exceptions import MlflowException

        client = _client(config)
        try:
            client.get_registered_model(REGISTERED_MODEL)
        except MlflowException:
            return f"MLflow has no registered model {REGISTERED_MODEL!r} yet; alias {CHAMPION!r} not set"
        if stable is None:
            if CHAMPION in client.get_registered_model(REGISTERED_MODEL).aliases:
                client.delete_registered_model_alias(REGISTERED_MODEL, CHAMPION)
            return f"no version is stable: MLflow alias {CHAMPION!r} names none"
        registered = registered_version(client, stable)
        if registered is None:
            return (f"store version {stable} is not registered in MLflow (minute deltas are not); alias "
                    f"{CHAMPION!r} left where it was")
        client.set_registered_model_alias(REGISTERED_MODEL, CHAMPION, registered)
        return f"MLflow: {REGISTERED_MODEL} version {registered} (store version {stable}) is now {CHAMPION!r}"

    return _guarded(config, f"moving {CHAMPION!r} to store version {stable}", do) or \
        f"MLflow alias {CHAMPION!r} not moved: the registry did not answer (see the warning above)"
