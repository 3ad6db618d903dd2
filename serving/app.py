"""The TF-Serving REST API for one model name: predict, classify, regress, status, metadata, and a health check.

    POST /v1/models/{name}[/versions/{v}|/labels/{label}]:predict
                                     {"instances": [...]} -> {"predictions": [...]}
                                     {"inputs": {...}} -> {"outputs": [...]} (TF Serving's columnar form)
    POST /v1/models/{name}[...]:classify   {"examples": [...], "context": {...}} -> {"result": [[["0", p0],
                                     ["1", p1]], ...]}
    POST /v1/models/{name}[...]:regress    {"examples": [...], "context": {...}} -> {"result": [p, ...]}
    GET  /v1/models/{name}[...]      TF-Serving's model_version_status (every loaded version, or the one asked
                                     for), plus the answering version, its parent, chain_root, data_end and
                                     freshness_s (seconds from data_end to now)
    GET  /v1/models/{name}[...]/metadata   the signature (GetModelMetadata) and the feature spec
    GET  /healthz                    200 once a model is loaded, else 503
    GET  /metrics                    Prometheus text (see serving/metrics.py)

A version (`/versions/{v}`) or label (`/labels/stable`, `/labels/canary`) picks the model; without either the
newest version answers (serving.service). Every response from a model carries the version that answered it in
the `X-Model-Version` header (TF-Serving's bodies have no field for it). The HTTP layer only parses and checks
the request; values are checked against the model's own input signature by `LoadedModel`.

Every response is counted in `ctr_requests_total` by endpoint (the route's name: predict, classify, regress,
status, metadata, health, metrics; "unmatched" for a path no route serves) and status code, errors included;
every predict, classify and regress response, whatever its status, is also timed in
`ctr_request_duration_seconds`, so its count equals the sum of those endpoints' request counters.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import orjson
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.convertors import StringConvertor, register_url_convertor
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from components.config import ServingConfig
from serving.errors import (
    BadRequest,
    NoModelLoaded,
    PayloadTooLarge,
    ServingError,
    http_error_handler,
    serving_error_handler,
    unexpected_error_handler,
)
from serving.metrics import APP_TIMING, CONTENT_TYPE, ModelInfo, RowCacheCounts, ServerMetrics, describe_model
from serving.model import SIGNATURE_NAME, LoadedModel
from serving.service import ModelSource, PredictionService, classes, merge_context

MODEL_VERSION_HEADER = "X-Model-Version"
# The W3C Server Timing header: `read;dur=0.021, queue;dur=0.104, compute;dur=2.310, return;dur=0.048,
# app;dur=2.701` (ms): the request's stages, then APP_TIMING, the whole request in the app until its answer
# starts (what the stages leave of it is routing and building the answer).
SERVER_TIMING_HEADER = "Server-Timing"
EXPECTED_BODY = 'JSON {"instances": [{"feature": value, ...}, ...]} or {"inputs": {"feature": [...]}}'
EXPECTED_EXAMPLES = 'JSON {"examples": [{"feature": value, ...}, ...]}, optionally with "context": {"feature": value}'
_BODY_KEYS = {"instances", "inputs", "signature_name"}
_EXAMPLES_KEYS = {"examples", "context", "signature_name"}
PREDICT_ENDPOINT = "predict"
CLASSIFY_ENDPOINT = "classify"
REGRESS_ENDPOINT = "regress"
UNMATCHED_ENDPOINT = "unmatched"
TIMED_ENDPOINTS = (PREDICT_ENDPOINT, CLASSIFY_ENDPOINT, REGRESS_ENDPOINT)
# A model name, version or label never holds ":" (as in TF Serving): it starts the verb. Without this,
# GET /v1/models/ctr:predict would ask for the status of a model "ctr:predict" (404, not 405) and
# POST /v1/models/ctr:explode would be a POST to that status (405, not 404).
_MODEL_PATHS = ("/v1/models/{name:part}", "/v1/models/{name:part}/versions/{version:part}",
                "/v1/models/{name:part}/labels/{label:part}")


class PathPartConvertor(StringConvertor):
    """`{param:part}`: a path segment without ":"."""

    regex = "[^/:]+"


register_url_convertor("part", PathPartConvertor())


def server_timing(stages: Mapping[str, float]) -> str:
    """A Server-Timing header's value for a request's stages (seconds): each stage's name and its duration in
    milliseconds, in the order given."""
    return ", ".join(f"{name};dur={seconds * 1000:.3f}" for name, seconds in stages.items())


def create_app(source: ModelSource, config: ServingConfig, clock: Callable[[], float] = time.time,
               metrics: ServerMetrics | None = None, closing: Callable[[], bool] | None = None,
               health_fields: Callable[[], dict[str, Any]] | None = None) -> Starlette:
    """The app serving `source`'s models; `clock` (seconds since the epoch) is "now" for freshness; `metrics`
    is shared with the gRPC server when both run (serving.server). While `closing()` is true, every response
    asks its client to close the connection (a server process handing its traffic over: serving.handoff).
    `health_fields()`: more fields for /healthz's answer (the standby process's state)."""
    metrics = metrics or ServerMetrics(timed_endpoints=TIMED_ENDPOINTS)
    service = PredictionService(source, config)

    def model_info(model: LoadedModel) -> ModelInfo:
        return describe_model(model.version, model.manifest, clock())

    def served_model(request: Request) -> LoadedModel:
        """The one model that answers this request: read once, so a swap mid-request cannot mix versions."""
        params = request.path_params
        return service.model(params["name"], params.get("version"), params.get("label"))

    async def run(request: Request, endpoint: str,
                  call: Callable[[LoadedModel, bytes], Any]) -> tuple[LoadedModel, Any]:
        """`call` on the request's model and body in a worker thread; an answered request's stages are timed
        (ctr_request_stage_seconds)."""
        served_model(request)  # a request for a model that is not served is refused before its body is read
        started = time.perf_counter()
        body = await read_body(request, config.max_body_bytes)
        params = request.path_params
        clock: list[float] = [0.0, 0.0]  # the last try's start and end, in the worker thread

        def timed(model: LoadedModel) -> Any:
            clock[0] = time.perf_counter()
            result = call(model, body)
            clock[1] = time.perf_counter()
            return result

        submitted = time.perf_counter()
        answered = await run_in_threadpool(
            service.run, params["name"], params.get("version"), params.get("label"), timed)
        stages = {"read": submitted - started, "queue": clock[0] - submitted, "compute": clock[1] - clock[0],
                  "return": time.perf_counter() - clock[1]}
        metrics.observe_stages(endpoint, stages)
        if config.server_timing:
            request.state.server_timing = server_timing(stages)
        return answered

    def answer(model: LoadedModel, payload: dict[str, Any], request: Request) -> Response:
        headers = {MODEL_VERSION_HEADER: model.version}
        timing = getattr(request.state, "server_timing", None)
        if timing is not None:
            headers[SERVER_TIMING_HEADER] = timing
        return Response(orjson.dumps(payload), media_type="application/json", headers=headers)

    async def predict(request: Request) -> Response:
        model, (key, predictions) = await run(
            request, PREDICT_ENDPOINT, lambda m, body: predict_body(m, body, config.max_instances))
        metrics.count_predictions(len(predictions))
        return answer(model, {key: predictions.tolist()}, request)

    async def classify(request: Request) -> Response:
        model, probabilities = await run(request, CLASSIFY_ENDPOINT,
                                         lambda m, body: m.predict(examples_body(service, body)))
        metrics.count_predictions(len(probabilities))
        return answer(model, {"result": classes(probabilities)}, request)

    async def regress(request: Request) -> Response:
        model, probabilities = await run(request, REGRESS_ENDPOINT,
                                         lambda m, body: m.predict(examples_body(service, body)))
        metrics.count_predictions(len(probabilities))
        return answer(model, {"result": probabilities.tolist()}, request)

    async def model_status(request: Request) -> JSONResponse:
        model = served_model(request)
        asked = "version" in request.path_params or "label" in request.path_params
        status = {"error_code": "OK", "error_message": ""}
        listed = [model] if asked else source.models()
        return JSONResponse(
            {
                "model_version_status": [{"version": m.version, "state": "AVAILABLE", "status": status}
                                         for m in listed],
                "labels": dict(source.labels()),
                **model_info(model).as_json(),
            },
            headers={MODEL_VERSION_HEADER: model.version},
        )

    async def model_metadata(request: Request) -> JSONResponse:
        """TF-Serving's GET /v1/models/{name}[/versions/{v}]/metadata: the serving signature's inputs (names,
        dtypes, shapes) and output, and the feature spec the model was trained under."""
        model = served_model(request)
        return JSONResponse(
            {"model_spec": {"name": config.model_name, "signature_name": "", "version": model.version},
             "metadata": model.signature_metadata()},
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
                **(health_fields() if health_fields is not None else {}),
            },
            headers={MODEL_VERSION_HEADER: model.version},
        )

    async def metrics_text(request: Request) -> Response:
        model = source.current()
        tiered = None if model is None else model.tiered
        row_cache = None if tiered is None else RowCacheCounts(tiered.counters(), tiered.load_calls,
                                                                  tiered.loaded_answers)
        text = metrics.render(None if model is None else model_info(model), row_cache)
        return Response(text, headers={"content-type": CONTENT_TYPE})

    verbs = {PREDICT_ENDPOINT: predict, CLASSIFY_ENDPOINT: classify, REGRESS_ENDPOINT: regress}
    routes = [
        *(Route(f"{path}:{verb}", handler, methods=["POST"], name=verb)
          for verb, handler in verbs.items() for path in _MODEL_PATHS),
        *(Route(f"{path}/metadata", model_metadata, methods=["GET"], name="metadata") for path in _MODEL_PATHS),
        *(Route(path, model_status, methods=["GET"], name="status") for path in _MODEL_PATHS),
        Route("/healthz", health, methods=["GET"], name="health"),
        Route("/metrics", metrics_text, methods=["GET"], name="metrics"),
    ]
    handlers = {
        ServingError: serving_error_handler,
        HTTPException: http_error_handler,
        Exception: unexpected_error_handler,
    }
    middleware = [Middleware(RequestMetrics, routes=routes, metrics=metrics)]
    if closing is not None:
        middleware.append(Middleware(CloseConnections, closing=closing))
    return Starlette(routes=routes, middleware=middleware, exception_handlers=handlers)


class RequestMetrics:
    """ASGI middleware counting every response by endpoint and status code, and timing predict responses.

    It runs outside the handlers of ServingError and HTTPException, so those are counted with the status they
    were answered with. Any other exception passes through it to Starlette's outermost middleware, which
    answers 500: it is counted as 500 on its way out. An answer with a Server-Timing header (its stages) gets
    one more entry, APP_TIMING: from this middleware's start to the answer's start, the request's whole time in
    the app but for writing the answer, so that a client can tell the app's time from the rest of its wait.
    """

    def __init__(self, app: ASGIApp, routes: Sequence[Route], metrics: ServerMetrics) -> None:
        self.app = app
        self.routes = routes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = endpoint_name(self.routes, scope)
        status_code: int | None = None

        async def send_and_note_status(message: Message) -> None:
            nonlocal status_code
            if message["type"] == "http.response.start":
                status_code = message["status"]
                message = with_app_timing(message, time.perf_counter() - start)
            await send(message)

        start = time.perf_counter()
        try:
            await self.app(scope, receive, send_and_note_status)
        except Exception:
            status_code = status_code or 500
            raise
        finally:
            # None only when cancelled (client gone) before any response: there is nothing to count.
            if status_code is not None:
                self.record(endpoint, status_code, time.perf_counter() - start)

    def record(self, endpoint: str, status_code: int, seconds: float) -> None:
        self.metrics.count_request(endpoint, status_code)
        if endpoint in self.metrics.timed_endpoints:
            self.metrics.observe_duration(endpoint, seconds)


def with_app_timing(start: Message, seconds: float) -> Message:
    """An `http.response.start` message with APP_TIMING (`seconds` in the app) added to its Server-Timing header;
    the message as it is when it has none (a refused request, `serving.server_timing=false`)."""
    name = SERVER_TIMING_HEADER.lower().encode()
    headers = start.get("headers", [])
    if not any(key.lower() == name for key, _ in headers):
        return start
    entry = f", {APP_TIMING};dur={seconds * 1000:.3f}".encode()
    return {**start, "headers": [(key, value + entry if key.lower() == name else value) for key, value in headers]}


class CloseConnections:
    """ASGI middleware adding `Connection: close` to every response while `closing()` is true: the client sends
    its next request on a new connection, which another process accepts (serving.handoff). uvicorn closes the
    connection once such a response is sent."""

    def __init__(self, app: ASGIApp, closing: Callable[[], bool]) -> None:
        self.app = app
        self.closing = closing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start" and self.closing():
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, send_closing)


def endpoint_name(routes: Sequence[Route], scope: Scope) -> str:
    """The name of the route that answers this request, chosen as the router does: the first route matching
    path and method, else the first matching the path alone (it answers 405). Label values stay few."""
    path_only = None
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return route.name
        if match is Match.PARTIAL and path_only is None:
            path_only = route.name
    return path_only or UNMATCHED_ENDPOINT


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


def predict_body(model: LoadedModel, body: bytes, max_instances: int) -> tuple[str, np.ndarray]:
    """Parses and checks a predict request body and runs the model on it (in a worker thread). Returns the
    response's key with the probabilities: TF Serving answers the row form ("instances") with "predictions"
    and the columnar form ("inputs") with "outputs" (a list, the signature having one output).

    A row-form request of values that fit is read by native code straight into the model's arguments
    (LoadedModel.predict_native), or, where that does not read it, decoded into typed records
    (LoadedModel.decode_rows); any other request, or one over `max_instances`, is parsed and checked here."""
    probabilities = model.predict_native(body, max_instances)
    if probabilities is not None:
        return "predictions", probabilities
    records = model.decode_rows(body)
    if records and len(records) <= max_instances:
        probabilities = model.predict_records(records)
        if probabilities is not None:
            return "predictions", probabilities
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
    probabilities = model.predict(data) if key == "instances" else model.predict_columns(data)
    return ("outputs" if key == "inputs" else "predictions"), probabilities


def examples_body(service: PredictionService, body: bytes) -> list[Any]:
    """The examples of a classify or regress request, each with the context's features (TF Serving's
    example form)."""
    payload = load_json(body, EXPECTED_EXAMPLES)
    check_keys(payload, _EXAMPLES_KEYS, EXPECTED_EXAMPLES)
    if "examples" not in payload:
        raise BadRequest(f'request body has no "examples"; expected {EXPECTED_EXAMPLES}')
    examples, context = payload["examples"], payload.get("context")
    if not isinstance(examples, list):
        raise BadRequest(f'"examples" must be an array of objects, one per example, got {_json_type(examples)}')
    if context is not None and not isinstance(context, dict):
        raise BadRequest(f'"context" must be an object of feature values, got {_json_type(context)}')
    service.check_count(len(examples), "examples")
    return merge_context(examples, context)


def parse_body(body: bytes) -> dict[str, Any]:
    """The predict request's JSON object, checked for its top-level shape."""
    payload = load_json(body, EXPECTED_BODY)
    check_keys(payload, _BODY_KEYS, EXPECTED_BODY)
    present = [key for key in ("instances", "inputs") if key in payload]
    if len(present) != 1:
        raise BadRequest(
            f'request body must hold exactly one of "instances" or "inputs", got {present or "neither"}; '
            f"expected {EXPECTED_BODY}"
        )
    return payload


def load_json(body: bytes, expected: str) -> dict[str, Any]:
    """The request body's JSON object."""
    if not body.strip():
        raise BadRequest(f"request body is empty; expected {expected}")
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        payload = None  # not strict JSON: the standard parser says why, or reads NaN and Infinity
    except RecursionError:
        raise BadRequest(f"request body is nested too deeply; expected {expected}") from None
    try:
        if payload is None:
            payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadRequest(f"request body is not valid JSON ({err}); expected {expected}") from None
    except RecursionError:
        raise BadRequest(f"request body is nested too deeply; expected {expected}") from None
    if not isinstance(payload, dict):
        raise BadRequest(f"request body is {_json_type(payload)}; expected {expected}")
    return payload


def check_keys(payload: dict[str, Any], allowed: set[str], expected: str) -> None:
    unknown = sorted(set(payload) - allowed)
    if unknown:
        raise BadRequest(f'request body has unknown keys {unknown}; expected {expected}, optionally with '
                         '"signature_name"')
    signature = payload.get("signature_name", SIGNATURE_NAME)
    if signature != SIGNATURE_NAME:
        raise BadRequest(f"signature_name {signature!r} is not served; the only one is {SIGNATURE_NAME!r}")


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
