"""The TF-Serving REST API for one model name: predict, version status, and a health check.

    POST /v1/models/{name}:predict                     {"instances": [...]} or {"inputs": {...}}
                                                       -> {"predictions": [...]}
    POST /v1/models/{name}/versions/{version}:predict  the same, answered only by that version
    GET  /v1/models/{name}[/versions/{version}]        TF-Serving's model_version_status
    GET  /healthz                                      200 once a model is loaded, else 503

Every response from a model carries the version that answered it in the `X-Model-Version` header (TF-Serving's
bodies have no field for it). The HTTP layer only parses and checks the request; values are checked against
the model's own input signature by `LoadedModel`.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import numpy as np
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from components.config import ServingConfig
from serving.errors import (
    BadRequest,
    ModelNotFound,
    NoModelLoaded,
    PayloadTooLarge,
    ServingError,
    http_error_handler,
    serving_error_handler,
    unexpected_error_handler,
)
from serving.model import SIGNATURE_NAME, InvalidInput, LoadedModel

MODEL_VERSION_HEADER = "X-Model-Version"
EXPECTED_BODY = 'JSON {"instances": [{"feature": value, ...}, ...]} or {"inputs": {"feature": [...]}}'
_BODY_KEYS = {"instances", "inputs", "signature_name"}


class ModelSource(Protocol):
    def current(self) -> LoadedModel | None:
        """The model serving now, or None before the first version is loaded."""
        ...


def create_app(source: ModelSource, config: ServingConfig) -> Starlette:
    def served_model(request: Request) -> LoadedModel:
        """The one model that answers this request: read once, so a swap mid-request cannot mix versions."""
        name = request.path_params["name"]
        if name != config.model_name:
            raise ModelNotFound(f"model {name!r} is not served here; it serves {config.model_name!r}")
        model = source.current()
        if model is None:
            raise NoModelLoaded(
                f"model {name!r} has no version loaded yet: none is published in the model store or none "
                "has loaded cleanly; retry later"
            )
        version = request.path_params.get("version")
        if version is not None and not (version == model.version or _same_number(version, model.version)):
            raise ModelNotFound(
                f"version {version} of model {name!r} is not loaded; the loaded version is {model.version}"
            )
        return model

    async def predict(request: Request) -> JSONResponse:
        model = served_model(request)
        body = await read_body(request, config.max_body_bytes)
        predictions = await run_in_threadpool(predict_body, model, body, config.max_instances)
        return JSONResponse(
            {"predictions": predictions.tolist()}, headers={MODEL_VERSION_HEADER: model.version}
        )

    async def model_status(request: Request) -> JSONResponse:
        model = served_model(request)
        status = {"error_code": "OK", "error_message": ""}
        return JSONResponse(
            {"model_version_status": [{"version": model.version, "state": "AVAILABLE", "status": status}]},
            headers={MODEL_VERSION_HEADER: model.version},
        )

    async def health(request: Request) -> JSONResponse:
        model = source.current()
        if model is None:
            raise NoModelLoaded(f"model {config.model_name!r} has no version loaded yet")
        return JSONResponse(
            {
                "status": "ok",
                "model_name": config.model_name,
                "model_version": model.version,
                "loaded_at": model.loaded_at.isoformat(),
            },
            headers={MODEL_VERSION_HEADER: model.version},
        )

    routes = [
        Route("/v1/models/{name}:predict", predict, methods=["POST"]),
        Route("/v1/models/{name}/versions/{version}:predict", predict, methods=["POST"]),
        Route("/v1/models/{name}", model_status, methods=["GET"]),
        Route("/v1/models/{name}/versions/{version}", model_status, methods=["GET"]),
        Route("/healthz", health, methods=["GET"]),
    ]
    handlers = {
        ServingError: serving_error_handler,
        HTTPException: http_error_handler,
        Exception: unexpected_error_handler,
    }
    return Starlette(routes=routes, exception_handlers=handlers)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to be over `max_bytes`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLarge(
            f"request body is {int(declared)} bytes, over the limit of {max_bytes} bytes "
            "(serving.max_body_bytes); send fewer instances per request"
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLarge(
                f"request body is over the limit of {max_bytes} bytes (serving.max_body_bytes): "
                f"{size} bytes received so far; send fewer instances per request"
            )
        chunks.append(chunk)
    return b"".join(chunks)


def predict_body(model: LoadedModel, body: bytes, max_instances: int) -> np.ndarray:
    """Parses and checks a predict request body and runs the model on it (in a worker thread)."""
    payload = parse_body(body)
    key = "instances" if "instances" in payload else "inputs"
    data = payload[key]
    if key == "instances" and not isinstance(data, list):
        raise BadRequest(f'"instances" must be an array of objects, one per instance, got {_json_type(data)}')
    if key == "inputs" and not isinstance(data, dict):
        raise BadRequest(f'"inputs" must be an object of feature name to value array, got {_json_type(data)}')
    if key == "instances":
        num_instances = len(data)
    else:
        num_instances = max((len(v) for v in data.values() if isinstance(v, list)), default=0)
    if num_instances == 0:
        raise BadRequest(f'"{key}" holds no instances; expected at least one, as in {EXPECTED_BODY}')
    if num_instances > max_instances:
        raise PayloadTooLarge(
            f"request has {num_instances} instances, over the limit of {max_instances} "
            "(serving.max_instances); split it into smaller requests"
        )
    try:
        return model.predict(data) if key == "instances" else model.predict_columns(data)
    except InvalidInput as err:
        raise BadRequest(str(err)) from None


def parse_body(body: bytes) -> dict[str, Any]:
    """The request's JSON object, checked for its top-level shape."""
    if not body.strip():
        raise BadRequest(f"request body is empty; expected {EXPECTED_BODY}")
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadRequest(f"request body is not valid JSON ({err}); expected {EXPECTED_BODY}") from None
    except RecursionError:
        raise BadRequest(f"request body is nested too deeply; expected {EXPECTED_BODY}") from None
    if not isinstance(payload, dict):
        raise BadRequest(f"request body is {_json_type(payload)}; expected {EXPECTED_BODY}")
    unknown = sorted(set(payload) - _BODY_KEYS)
    if unknown:
        raise BadRequest(
            f"request body has unknown keys {unknown}; expected {EXPECTED_BODY}, "
            'optionally with "signature_name"'
        )
    signature = payload.get("signature_name", SIGNATURE_NAME)
    if signature != SIGNATURE_NAME:
        raise BadRequest(f"signature_name {signature!r} is not served; the only one is {SIGNATURE_NAME!r}")
    present = [key for key in ("instances", "inputs") if key in payload]
    if len(present) != 1:
        raise BadRequest(
            f'request body must hold exactly one of "instances" or "inputs", got {present or "neither"}; '
            f"expected {EXPECTED_BODY}"
        )
    return payload


def _same_number(left: str, right: str) -> bool:
    return left.isdigit() and right.isdigit() and int(left) == int(right)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({json.dumps(value)})"
    if isinstance(value, int | float):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"
