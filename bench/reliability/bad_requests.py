"""Reliability, bad requests: malformed, oversized and misaddressed requests sent to the real model server while
good traffic runs, each expected to get its documented 4xx with a reason, never a 5xx, a dropped connection
or a 200; and the good traffic's p99 during them against its steady value.

    PYTHONPATH=. python bench/reliability/bad_requests.py --out /tmp/requests.json   # this group alone
    from bench.reliability.bad_requests import run_request_cases                      # bench/bench_reliability.py

What it sets up: the model of `make bench-serving` (a DCNv2 on the criteo spec, bench.bench_serving), published
to a local model store and served by `python -m serving.server` in its own process, REST and gRPC on free
ports. Good traffic is an open loop (bench.loadgen) of 10-candidate predict requests.

Phases:
- steady: the good traffic alone for `seconds_per_phase`, its p99 the reference;
- bad: the same good traffic again while every case below is sent REPEATS times over the same length of time
  (each case its own slot); a good request that fails during a case's slot is that case's lost request;
- after: a good request of fixed candidates answered as before the bad phase ("server_unaffected").

Each REST case is sent on a raw socket (so paths, bytes and headers go out exactly as written) with
`Connection: close`; a body the server refuses early is not sent further once its answer has arrived. A case
is as expected when every send got the documented status, and a 4xx carried a reason: the `error` text of
the JSON body (or the text of a non-JSON body), non-empty and at most MAX_REASON_CHARS (a reason, not an echo
of the request). gRPC cases use TF Serving's own stubs; a gRPC status counts as the HTTP status the server
documents for it (serving/grpc_server.py: INVALID_ARGUMENT 400, NOT_FOUND 404, RESOURCE_EXHAUSTED 413).

A few cases are requests a client may think bad that the API documents as good (`expected` starts with 200):
a missing feature or a NaN is a missing value, the Content-Type is not read (README's `curl -d` examples send
application/x-www-form-urlencoded), and an id is any string. They are here so that a change of those
behaviours shows up.
"""

from __future__ import annotations

import argparse
import json
import math
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_serving import (
    FIRST_VERSION,
    MODEL_NAME,
    build_models,
    candidates,
    free_port,
    start_server,
    stop_server,
    wait_healthy,
)
from bench.loadgen import LoadResult, run_load
from components.config import ServingConfig
from components.model_store import LocalModelStore

GROUP = "requests"
REPEATS = 3  # sends of each case
CANDIDATES_PER_REQUEST = 10
MAX_REASON_CHARS = 2000
TIMEOUT_S = 10.0  # per bad request; a request unanswered by then is recorded as such
STATE_ROWS = 2000  # generated rows the feature state is built from (the model's size does not matter here)
LIMITS = ServingConfig()  # the server runs with the default limits: max_instances, max_body_bytes
PREDICT = f"/v1/models/{MODEL_NAME}:predict"
# gRPC status codes as the HTTP status the server documents for them (serving/grpc_server.py); any code not
# listed is a server error.
GRPC_AS_HTTP = {"OK": 200, "INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400,
                "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 413, "UNIMPLEMENTED": 501, "UNAVAILABLE": 503}


@dataclass(frozen=True)
class Answer:
    status: int | None  # the HTTP status (a gRPC code's equivalent); None when no answer came
    reason: str  # the error text, the exception when no answer came, "" for a 200


@dataclass(frozen=True)
class Target:
    port: int  # REST
    grpc_port: int


@dataclass(frozen=True)
class Case:
    name: str
    status: int  # the documented status
    expected: str  # the documented outcome, in words
    request: str  # what is sent, for the report
    send: Callable[[Target], Answer]


# ---------------------------------------------------------------------------------------------------------
# REST on a raw socket

def http_exchange(port: int, method: str, path: str, body: bytes = b"", *, content_type: str | None =
                  "application/json", chunked: bool = False, raw: bytes | None = None,
                  timeout_s: float = TIMEOUT_S) -> Answer:
    """One request on a new connection, sent as written (`raw`: the whole request's bytes), and its answer.
    Sending stops when the server answers before the body is all sent, as it does for an oversized body."""
    if raw is None:
        headers = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: close"]
        if content_type is not None:
            headers.append(f"Content-Type: {content_type}")
        headers.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}")
        head = ("\r\n".join(headers) + "\r\n\r\n").encode("latin-1")
        parts = _chunked(body) if chunked else _pieces(body)
    else:
        head, parts = raw, iter(())
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    except OSError as err:
        return Answer(None, f"no connection: {type(err).__name__}: {err}")
    with sock:
        try:
            sock.sendall(head)
            for part in parts:
                if select.select([sock], [], [], 0)[0]:  # the server answered (or closed) mid-body
                    break
                sock.sendall(part)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed after answering; the answer is read below
        except TimeoutError:
            return Answer(None, f"no answer: sending took over {timeout_s} s")
        return _parse_response(_read_all(sock, timeout_s))


def _pieces(body: bytes, size: int = 256 * 1024) -> Iterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start:start + size]


def _chunked(body: bytes, size: int = 256 * 1024) -> Iterator[bytes]:
    for piece in _pieces(body, size):
        yield f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    yield b"0\r\n\r\n"


def _read_all(sock: socket.socket, timeout_s: float) -> bytes | str:
    """Everything the server sends until it closes; the error text when it sends nothing."""
    received = bytearray()
    deadline = time.monotonic() + timeout_s
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            data = sock.recv(65536)
        except TimeoutError:
            return bytes(received) if received else f"no answer within {timeout_s} s"
        except ConnectionResetError as err:
            return bytes(received) if received else f"connection dropped: {err}"
        if not data:
            return bytes(received) if received else "connection closed with no answer"
        received += data


def _parse_response(data: bytes | str) -> Answer:
    if isinstance(data, str):
        return Answer(None, data)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split(" ")[1])
    except (IndexError, ValueError):
        return Answer(None, f"not an HTTP response: {data[:100]!r}")
    headers = {key.strip().lower(): value.strip() for key, _, value in (line.partition(":") for line in lines[1:])}
    if headers.get("content-length", "").isdigit():
        body = body[:int(headers["content-length"])]
    if status == 200:
        return Answer(200, "")
    text = body.decode("utf-8", "replace")
    try:
        payload = json.loads(text)
    except json.JSONDecodeError:
        return Answer(status, text.strip())
    error = payload.get("error") if isinstance(payload, dict) else None
    return Answer(status, error if isinstance(error, str) else text.strip())


def rest(method: str, path: str, body: bytes = b"", **options: Any) -> Callable[[Target], Answer]:
    return lambda target: http_exchange(target.port, method, path, body, **options)


def _show(body: bytes, limit: int = 100) -> str:
    return repr(body) if len(body) <= limit else f"{body[:limit]!r}... ({len(body):,} bytes)"


def rest_case(name: str, status: int, expected: str, method: str, path: str, body: bytes = b"",
              **options: Any) -> Case:
    shown = options.get("raw")
    request = _show(shown) if shown is not None else f"{method} {path} {_show(body)}" + "".join(
        f" [{key}={value}]" for key, value in options.items())
    return Case(name, status, expected, request, rest(method, path, body, **options))


def body_of(payload: Any) -> bytes:
    return json.dumps(payload, allow_nan=True).encode()


def rest_cases(good: list[dict[str, Any]]) -> list[Case]:
    """The REST requests, each with its documented answer (serving/app.py, serving/model.py, README)."""
    one = good[:1]
    max_instances, max_bytes = LIMITS.max_instances, LIMITS.max_body_bytes
    megabyte = "7" * 1_000_000
    over_limit = b'{"instances": [{"C1": "' + b"a" * (max_bytes + 1024) + b'"}]}'
    nested = b"[" * 10_000 + b"]" * 10_000
    model_path = f"/v1/models/{MODEL_NAME}"
    return [
        rest_case("body_not_json", 400, "400: request body is not valid JSON", "POST", PREDICT, b"instances: 1"),
        rest_case("json_not_object", 400, "400: request body is an array; expected an object", "POST", PREDICT,
                  b"[1, 2, 3]"),
        rest_case("body_empty", 400, "400: request body is empty", "POST", PREDICT, b""),
        rest_case("instances_missing", 400, '400: exactly one of "instances" or "inputs", got neither', "POST",
                  PREDICT, body_of({"signature_name": "serving_default"})),
        rest_case("instances_and_inputs", 400, '400: exactly one of "instances" or "inputs"', "POST", PREDICT,
                  body_of({"instances": one, "inputs": {"I1": [1.0]}})),
        rest_case("instances_empty", 400, '400: "instances" holds no instances', "POST", PREDICT,
                  body_of({"instances": []})),
        rest_case("instances_null", 400, '400: "instances" must be an array, got null', "POST", PREDICT,
                  body_of({"instances": None})),
        rest_case("instances_not_objects", 400, "400: instance 0 must be a JSON object", "POST", PREDICT,
                  body_of({"instances": [1, "a"]})),
        rest_case("unknown_top_level_key", 400, "400: request body has unknown keys", "POST", PREDICT,
                  body_of({"instances": one, "examples": one})),
        rest_case("signature_unknown", 400, "400: signature_name is not served", "POST", PREDICT,
                  body_of({"instances": one, "signature_name": "predict"})),
        rest_case("feature_unknown", 400, "400: instance 0 has unknown features ['I99']", "POST", PREDICT,
                  body_of({"instances": [{**one[0], "I99": 1.0}]})),
        rest_case("feature_missing", 200, "200: a feature left out is a missing value (README)", "POST", PREDICT,
                  body_of({"instances": [{"I2": 1.0, "C3": "x"}]})),
        rest_case("number_for_string", 400, "400: feature 'C1' must be a string or null", "POST", PREDICT,
                  body_of({"instances": [{"C1": 123}]})),
        rest_case("string_for_number", 400, "400: feature 'I1' must be a number or null", "POST", PREDICT,
                  body_of({"instances": [{"I1": "3"}]})),
        rest_case("boolean_for_number", 400, "400: feature 'I1' must be a number or null", "POST", PREDICT,
                  body_of({"instances": [{"I1": True}]})),
        rest_case("list_for_number", 400, "400: feature 'I1' must be a number or null", "POST", PREDICT,
                  body_of({"instances": [{"I1": [1.0, 2.0]}]})),
        rest_case("number_out_of_range", 400, "400: feature 'I1' is outside the range of float32", "POST",
                  PREDICT, b'{"instances": [{"I1": 1e39}]}'),
        rest_case("infinity_literal", 400, "400: feature 'I1' is inf, outside the range of float32", "POST",
                  PREDICT, b'{"instances": [{"I1": Infinity}]}'),
        rest_case("nan_literal_for_string", 400, "400: feature 'C1' must be a string or null", "POST", PREDICT,
                  b'{"instances": [{"C1": NaN}]}'),
        rest_case("nan_literal_for_number", 200, "200: NaN is a missing number (serving/model.py)", "POST",
                  PREDICT, b'{"instances": [{"I1": NaN}]}'),
        rest_case("string_1mb_for_number", 400, "400: feature 'I1' must be a number, the value shown cut short",
                  "POST", PREDICT, body_of({"instances": [{"I1": megabyte}]})),
        rest_case("string_1mb_id", 200, "200: an id is any string; one never seen is out of vocabulary", "POST",
                  PREDICT, body_of({"instances": [{"C1": megabyte}]})),
        rest_case("body_over_limit", 413, f"413: body over serving.max_body_bytes ({max_bytes})", "POST", PREDICT,
                  over_limit),
        rest_case("body_over_limit_chunked", 413, "413: body over serving.max_body_bytes, no Content-Length",
                  "POST", PREDICT, over_limit, chunked=True),
        rest_case("candidates_10x_limit", 413, f"413: over serving.max_instances ({max_instances})", "POST",
                  PREDICT, body_of({"instances": [{"I1": 1.0}] * (10 * max_instances)})),
        rest_case("columns_10x_limit", 413, f"413: over serving.max_instances ({max_instances})", "POST",
                  PREDICT, body_of({"inputs": {"I1": [1.0] * (10 * max_instances)}})),
        rest_case("columns_ragged", 400, "400: inputs must all hold the same number of values", "POST", PREDICT,
                  body_of({"inputs": {"I1": [1.0, 2.0], "C1": ["a"]}})),
        rest_case("nested_10000_deep", 400, "400: request body is nested too deeply", "POST", PREDICT, nested),
        rest_case("nested_10000_deep_in_instances", 400, "400: request body is nested too deeply", "POST",
                  PREDICT, b'{"instances": ' + nested + b"}"),
        rest_case("invalid_utf8", 400, "400: request body is not valid JSON (not UTF-8)", "POST", PREDICT,
                  b'{"instances": [{"C1": "\xff\xfe"}]}'),
        rest_case("form_encoded", 400, "400: request body is not valid JSON", "POST", PREDICT,
                  b"instances=I1%3D1", content_type="application/x-www-form-urlencoded"),
        rest_case("content_type_not_json", 200, "200: the Content-Type is not read; the body is JSON (as curl -d "
                  "sends it in README)", "POST", PREDICT, body_of({"instances": one}), content_type="text/plain"),
        rest_case("get_on_predict", 405, "405: method not allowed", "GET", PREDICT, content_type=None),
        rest_case("delete_on_model", 405, "405: method not allowed", "DELETE", model_path, content_type=None),
        rest_case("model_unknown", 404, "404: model 'nope' is not served here", "POST", "/v1/models/nope:predict",
                  body_of({"instances": one})),
        rest_case("version_unknown", 404, "404: version 1 is not loaded; the loaded versions are listed", "POST",
                  f"{model_path}/versions/1:predict", body_of({"instances": one})),
        rest_case("version_not_a_number", 404, "404: version abc is not loaded", "POST",
                  f"{model_path}/versions/abc:predict", body_of({"instances": one})),
        rest_case("version_dot_segments", 404, "404: no such path", "POST", f"{model_path}/versions/../x:predict",
                  body_of({"instances": one})),
        rest_case("label_unknown", 404, "404: label 'beta' is not served; the labels are named", "POST",
                  f"{model_path}/labels/beta:predict", body_of({"instances": one})),
        rest_case("label_stable_unpromoted", 404, "404: label 'stable' names no loaded version (none promoted)",
                  "POST", f"{model_path}/labels/stable:predict", body_of({"instances": one})),
        rest_case("classify_with_instances", 400, '400: unknown keys [\'instances\']; expected "examples"', "POST",
                  f"{model_path}:classify", body_of({"instances": one})),
        rest_case("regress_examples_not_list", 400, '400: "examples" must be an array', "POST",
                  f"{model_path}:regress", body_of({"examples": one[0]})),
        rest_case("verb_unknown", 404, "404: no such path (:explode)", "POST", f"{model_path}:explode",
                  body_of({"instances": one})),
        rest_case("http_malformed", 400, "400: invalid HTTP request", "", "", raw=b"HELLO THERE\r\n\r\n"),
    ]


# ---------------------------------------------------------------------------------------------------------
# gRPC with TF Serving's stubs

def grpc_predict(inputs: dict[str, Any], *, name: str = MODEL_NAME, version: int | None = None,
                 signature: str = "") -> Callable[[Target], Answer]:
    """Predict with `inputs` (numpy arrays, lists or TensorProtos), answered as an HTTP status."""
    def send(target: Target) -> Answer:
        import grpc
        import tensorflow as tf
        from tensorflow.core.framework.tensor_pb2 import TensorProto
        from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

        request = predict_pb2.PredictRequest()
        request.model_spec.name = name
        request.model_spec.signature_name = signature
        if version is not None:
            request.model_spec.version.value = version
        for key, value in inputs.items():
            request.inputs[key].CopyFrom(value if isinstance(value, TensorProto) else tf.make_tensor_proto(value))
        with grpc.insecure_channel(f"127.0.0.1:{target.grpc_port}") as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            try:
                stub.Predict(request, timeout=TIMEOUT_S)
            except grpc.RpcError as err:
                code = err.code()
                return Answer(GRPC_AS_HTTP.get(code.name, 500) if code.name != "DEADLINE_EXCEEDED" else None,
                              f"{code.name}: {err.details()}")
        return Answer(200, "")

    return send


def grpc_case(case: str, status: int, expected: str, inputs: dict[str, Any], **spec: Any) -> Case:
    shown = {key: value if isinstance(value, list) else _describe(value) for key, value in inputs.items()}
    request = f"gRPC Predict model_spec {spec or {'name': MODEL_NAME}} inputs {shown}"
    return Case(case, status, expected, request, grpc_predict(inputs, **spec))


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray | np.generic):
        return f"{value.dtype} array of shape {list(np.shape(value))}"
    return f"TensorProto {str(value)[:80]!r}"


def grpc_cases() -> list[Case]:
    from tensorflow.core.framework import tensor_pb2, types_pb2

    malformed = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_content=b"\x00\x01\x02")
    malformed.tensor_shape.dim.add(size=2)
    max_instances = LIMITS.max_instances
    return [
        grpc_case("grpc_wrong_dtype_for_number", 400, "INVALID_ARGUMENT (400): inputs['I1'][0] must be a number",
                  {"I1": ["high"]}),
        grpc_case("grpc_wrong_dtype_for_id", 400, "INVALID_ARGUMENT (400): inputs['C1'][0] must be a string",
                  {"C1": np.array([1.5], dtype=np.float32)}),
        grpc_case("grpc_no_inputs", 400, "INVALID_ARGUMENT (400): the request holds no instances", {}),
        grpc_case("grpc_feature_missing", 200, "OK: an absent input is a missing feature (serving/grpc_server.py)",
                  {"I2": np.array([1.0], dtype=np.float32)}),
        grpc_case("grpc_input_unknown", 400, "INVALID_ARGUMENT (400): inputs has unknown features ['I99']",
                  {"I1": np.array([1.0], dtype=np.float32), "I99": np.array([1.0], dtype=np.float32)}),
        grpc_case("grpc_lengths_differ", 400, "INVALID_ARGUMENT (400): inputs must all hold the same number",
                  {"I1": np.array([1.0, 2.0], dtype=np.float32), "C1": ["a"]}),
        grpc_case("grpc_scalar_input", 400, "INVALID_ARGUMENT (400): inputs['I1'] is a scalar",
                  {"I1": np.float32(1.0)}),
        grpc_case("grpc_rank_2_for_rank_1", 400, "INVALID_ARGUMENT (400): inputs['I1'][0] must be a number",
                  {"I1": np.ones((2, 3), dtype=np.float32)}),
        grpc_case("grpc_malformed_tensor", 400, "INVALID_ARGUMENT (400): inputs['I1'] is not a readable tensor",
                  {"I1": malformed}),
        grpc_case("grpc_infinity", 400, "INVALID_ARGUMENT (400): inputs['I1'][0] is inf, outside float32",
                  {"I1": np.array([math.inf], dtype=np.float64)}),
        grpc_case("grpc_model_unknown", 404, "NOT_FOUND (404): model 'nope' is not served here",
                  {"I1": np.array([1.0], dtype=np.float32)}, name="nope"),
        grpc_case("grpc_version_unknown", 404, "NOT_FOUND (404): version 1 is not loaded",
                  {"I1": np.array([1.0], dtype=np.float32)}, version=1),
        grpc_case("grpc_signature_unknown", 400, "INVALID_ARGUMENT (400): signature_name is not served",
                  {"I1": np.array([1.0], dtype=np.float32)}, signature="predict"),
        grpc_case("grpc_batch_10x_limit", 413, f"RESOURCE_EXHAUSTED (413): over serving.max_instances "
                  f"({max_instances})", {"I1": np.ones(10 * max_instances, dtype=np.float32)}),
        grpc_case("grpc_message_over_limit", 413, "RESOURCE_EXHAUSTED (413): message over serving.max_body_bytes",
                  {"C1": np.array([b"a" * (LIMITS.max_body_bytes + 1024)], dtype=object)}),
    ]


# ---------------------------------------------------------------------------------------------------------
# Running the cases

def judge(case: Case, answers: list[Answer]) -> tuple[bool, str]:
    """(as expected, what was observed): every answer has the documented status, and a 4xx a reason."""
    def fits(answer: Answer) -> bool:
        if answer.status != case.status:
            return False
        return case.status < 400 or 0 < len(answer.reason.strip()) <= MAX_REASON_CHARS

    statuses = Counter("no answer" if a.status is None else str(a.status) for a in answers)
    shown = next((a for a in answers if not fits(a)), answers[0])
    status = "no answer" if shown.status is None else str(shown.status)
    reason = shown.reason.strip()
    reason = reason if len(reason) <= 160 else f"{reason[:157]}..."
    observed = f"{status}: {reason}" if reason else status
    if len(statuses) > 1:
        observed += f" ({', '.join(f'{k} x{v}' for k, v in statuses.items())})"
    return all(fits(a) for a in answers), observed


def lost_requests(records: list[Any], start: float, end: float) -> int:
    return sum(1 for r in records if start <= r.sent_at_s < end and r.status != 200)


def recovery_s(target: Target, good_body: bytes, timeout_s: float = 60.0) -> float | None:
    """None when a good request is answered at once; else the seconds until one is (or `timeout_s`)."""
    start = time.perf_counter()
    if http_exchange(target.port, "POST", PREDICT, good_body).status == 200:
        return None
    while time.perf_counter() - start < timeout_s:
        time.sleep(0.1)
        if http_exchange(target.port, "POST", PREDICT, good_body).status == 200:
            break
    return round(time.perf_counter() - start, 3)


def row(case: str, expected: str, observed: str, as_expected: bool, *, lost: int = 0,
        recover_s: float | None = None, detail: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"group": GROUP, "case": case, "expected": expected, "observed": observed, "as_expected": as_expected,
            "lost": {"rows": 0, "minutes": 0, "versions": 0, "requests": lost}, "manual_recovery": False,
            "recover_s": recover_s, "detail": detail or {}}


def send_cases(cases: list[Case], target: Target, good_body: bytes, slot_s: float, good_records: Callable[[], list],
               server: subprocess.Popen) -> list[dict[str, Any]]:
    """Each case REPEATS times, spread over its slot of `slot_s`; the good requests that failed in its slot."""
    windows = []
    for case in cases:
        start = time.time()
        answers = []
        for index in range(REPEATS):
            answers.append(case.send(target))
            time.sleep(max(0.0, start + slot_s * (index + 1) / REPEATS - time.time()))
        recover = recovery_s(target, good_body)
        windows.append((case, answers, start, time.time(), recover, server.poll()))
    records = good_records()
    out = []
    for case, answers, start, end, recover, exit_code in windows:
        as_expected, observed = judge(case, answers)
        if exit_code is not None:
            as_expected, observed = False, f"{observed}; the server process exited with {exit_code}"
        out.append(row(case.name, case.expected, observed, as_expected, lost=lost_requests(records, start, end),
                       recover_s=recover,
                       detail={"request": case.request, "sends": len(answers), "status": case.status,
                               "statuses": [a.status for a in answers],
                               "reason": answers[0].reason[:MAX_REASON_CHARS]}))
    return out


def predictions(port: int, body: bytes) -> tuple[int | None, list[float] | None, str]:
    import httpx

    try:
        response = httpx.post(f"http://127.0.0.1:{port}{PREDICT}", content=body,
                              headers={"Content-Type": "application/json"}, timeout=TIMEOUT_S)
    except httpx.HTTPError as err:
        return None, None, f"{type(err).__name__}: {err}"
    if response.status_code != 200:
        return response.status_code, None, response.text[:200]
    return 200, response.json()["predictions"], response.headers.get("X-Model-Version", "")


def unaffected(port: int, body: bytes, before: tuple[int | None, list[float] | None, str],
               server: subprocess.Popen) -> dict[str, Any]:
    status, values, version = predictions(port, body)
    _, expected_values, expected_version = before
    same = values is not None and expected_values is not None and len(values) == len(expected_values)
    difference = float(np.max(np.abs(np.subtract(values, expected_values)))) if same else None
    as_expected = (status == 200 and server.poll() is None and version == expected_version
                   and difference is not None and difference <= 1e-6)
    observed = (f"{status}: version {version}, max |difference| {difference:.1e}" if difference is not None
                else f"{status}: {version}")
    if server.poll() is not None:
        observed += f"; the server process exited with {server.returncode}"
    return row("server_unaffected", f"200 from version {expected_version} with the predictions of before the bad "
               "requests (max |difference| <= 1e-6)", observed, as_expected,
               detail={"predictions_before": expected_values, "predictions_after": values})


def p99_ms(records: list[Any]) -> float | None:
    latencies = [r.latency_s * 1000.0 for r in records if r.status == 200]
    return float(np.percentile(latencies, 99)) if latencies else None


def run_request_cases(work: Path, *, good_rate_per_s: float = 20.0, seconds_per_phase: float = 10.0) -> dict:
    """Starts the model server on the bench model in `work`, measures the good traffic's steady p99, sends
    the bad requests while the good traffic runs, and checks the server still answers as before; stops the
    server always.

    Returns {"cases": [case, ...], "good_traffic": {"steady_p99_ms", "during_p99_ms", "p99_ratio", "failed",
    "requests", ...}}: "failed" and "requests" are the good requests of the bad phase."""
    work.mkdir(parents=True, exist_ok=True)
    models = build_models(work, STATE_ROWS, swap_rounds=0)  # the first model is all it serves
    store_root = work / "store"
    LocalModelStore(store_root).publish(MODEL_NAME, FIRST_VERSION, models["first"])
    pool = candidates(500, seed=11)
    fixed_body = body_of({"instances": pool[:CANDIDATES_PER_REQUEST]})

    def make(index: int) -> list[dict[str, Any]]:
        offset = (index * CANDIDATES_PER_REQUEST) % (len(pool) - CANDIDATES_PER_REQUEST)
        return pool[offset:offset + CANDIDATES_PER_REQUEST]

    cases = rest_cases(pool) + grpc_cases()
    target = Target(free_port(), free_port())
    server = start_server(work, store_root, target.port, target.grpc_port)
    try:
        wait_healthy(target.port, server, work / "server.log")
        url = f"http://127.0.0.1:{target.port}{PREDICT}"
        run_load(url, make, rate_per_s=good_rate_per_s, duration_s=min(2.0, seconds_per_phase))  # warm-up
        before = predictions(target.port, fixed_body)
        if before[0] != 200:
            raise RuntimeError(f"the model server answered a good request with {before[0]}: {before[2]}; see "
                               f"{work / 'server.log'}")
        steady = run_load(url, make, rate_per_s=good_rate_per_s, duration_s=seconds_per_phase)
        stop = threading.Event()
        during: dict[str, LoadResult] = {}
        # The good traffic runs until the cases end (at least seconds_per_phase: each case has its slot).
        traffic = threading.Thread(target=lambda: during.setdefault("result", run_load(
            url, make, rate_per_s=good_rate_per_s, duration_s=3600.0, stop_event=stop)), daemon=True)
        traffic.start()

        def good_records() -> list[Any]:
            stop.set()
            traffic.join()
            return during["result"].records

        try:
            rows = send_cases(cases, target, fixed_body, seconds_per_phase / len(cases), good_records, server)
        finally:
            stop.set()
            traffic.join()
        rows.append(unaffected(target.port, fixed_body, before, server))
    finally:
        stop_server(server)
    records = during["result"].records
    steady_p99, during_p99 = p99_ms(steady.records), p99_ms(records)
    return {
        "cases": rows,
        "good_traffic": {
            "steady_p99_ms": steady_p99,
            "during_p99_ms": during_p99,
            "p99_ratio": during_p99 / steady_p99 if steady_p99 and during_p99 else None,
            "failed": sum(1 for r in records if r.status != 200),
            "requests": len(records),
            "steady_failed": steady.failed_requests,
            "steady_requests": steady.num_requests,
            "skipped": steady.skipped + during["result"].skipped,
            "rate_per_s": good_rate_per_s,
            "candidates_per_request": CANDIDATES_PER_REQUEST,
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    parser.add_argument("--rate", type=float, default=20.0, help="good requests per second")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the steady and the bad phase")
    parser.add_argument("--keep", metavar="DIR", help="work here and keep it (default: a temporary directory)")
    args = parser.parse_args()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-reliability-requests-"))
    try:
        result = run_request_cases(work, good_rate_per_s=args.rate, seconds_per_phase=args.seconds)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    width = max(len(case["case"]) for case in result["cases"])
    print(f"{'case':{width}}  {'ok':3}  {'lost':4}  expected | observed")
    for case in result["cases"]:
        observed = case["observed"] if len(case["observed"]) <= 100 else case["observed"][:97] + "..."
        print(f"{case['case']:{width}}  {'yes' if case['as_expected'] else 'NO':3}  "
              f"{case['lost']['requests']:4d}  {case['expected']} | {observed}")
    good = result["good_traffic"]
    ratio = "n/a" if good["p99_ratio"] is None else f"{good['p99_ratio']:.2f}"
    print(f"good traffic: steady p99 {good['steady_p99_ms']:.2f} ms, during p99 {good['during_p99_ms']:.2f} ms "
          f"(ratio {ratio}, goal <= 2), failed {good['failed']} of {good['requests']}")
    failed = [case["case"] for case in result["cases"] if not case["as_expected"]]
    print(f"{len(result['cases']) - len(failed)} of {len(result['cases'])} cases as expected"
          + (f"; not: {', '.join(failed)}" if failed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
