"""The TF-Serving REST API and /metrics, driven in-process: status codes, bodies and headers."""

from __future__ import annotations

import dataclasses
import gc
import logging
import re
import time
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from starlette.testclient import TestClient

from components.config import ServingConfig
from serving import metrics as metrics_module
from serving.app import create_app
from serving.metrics import SLOW_GC_S, GcPauses, RowCacheCounts, ServerMetrics, describe_model
from serving.model import LoadedModel
from tests.serving.fixture_model import MODEL_NAME, NEW_VERSION, OLD_VERSION, FixedSource

pytestmark = pytest.mark.unit

CONFIG = ServingConfig(model_name=MODEL_NAME, max_instances=4, max_body_bytes=2048)
PREDICT = f"/v1/models/{MODEL_NAME}:predict"
# Hand-computed with the old version: sigmoid(0.1 * dense sum + 0.5 * (C1 == "abc")).
INSTANCES = [
    {"I1": 2, "I2": 3.5, "I3": None, "C1": "abc", "C2": "x"},  # sigmoid(1.05)
    {},  # sigmoid(0)
    {"I13": -10, "C1": "abd", "C26": None},  # sigmoid(-1.0)
]
EXPECTED = [0.7407749, 0.5, 0.2689414]
# "Now" for freshness: 1h 1m 30.25s after the end of the fixture's first hour of data.
NOW = datetime(2026, 1, 1, 2, 1, 30, 250000, tzinfo=UTC).timestamp()
DATA_END = "2026-01-01T01:00:00+00:00"
# One exposition sample line: name, optional {labels}, value.
SAMPLE_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def assert_matches(pattern: str, text: str) -> None:
    assert re.search(pattern, text), f"{text!r} does not match {pattern!r}"


@pytest.fixture
def client(old_model: LoadedModel) -> TestClient:
    return TestClient(create_app(FixedSource(old_model), CONFIG, clock=lambda: NOW))


def with_manifest(model: LoadedModel, version: str, **fields: Any) -> LoadedModel:
    """The fixture model under another version, its manifest with `fields` added."""
    return dataclasses.replace(model, version=version, manifest={**model.manifest, "version": version, **fields})


def parse_metrics(text: str) -> Samples:
    """(name, labels) -> value of every sample, failing on any line that is not a comment or a sample.

    Label values are kept as written, escapes included."""
    assert text.endswith("\n"), "exposition text must end with a newline"
    samples: Samples = {}
    declared: set[str] = set()
    for line in text.splitlines():
        if line.startswith("#"):
            kind = re.match(r"^# (HELP|TYPE) (ctr_\w+) (.+)$", line)
            assert kind, f"comment {line!r} is neither # HELP nor # TYPE"
            if kind[1] == "TYPE":
                assert kind[3] in {"counter", "gauge", "histogram"}, line
                declared.add(kind[2])
            continue
        match = SAMPLE_LINE.match(line)
        assert match, f"{line!r} is not `name{{labels}} value`"
        name, labels, value = match.groups()
        pairs = LABEL_PAIR.findall(labels or "")
        assert ",".join(f'{k}="{v}"' for k, v in pairs) == (labels or ""), f"bad labels in {line!r}"
        assert re.sub(r"_(bucket|sum|count)$", "", name) in declared, f"{name} sampled before its # TYPE"
        key = (name, frozenset(pairs))
        assert key not in samples, f"{line!r} repeats a sample"
        samples[key] = float(value)
    return samples


def sample(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def scrape(client: TestClient) -> Samples:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return parse_metrics(response.text)


def test_predicts_instances(client: TestClient) -> None:
    response = client.post(PREDICT, json={"instances": INSTANCES})

    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-model-version"] == OLD_VERSION
    assert list(response.json()) == ["predictions"]
    np.testing.assert_allclose(response.json()["predictions"], EXPECTED, rtol=1e-6)


def test_predicts_columnar_inputs(client: TestClient) -> None:
    body = {"signature_name": "serving_default", "inputs": {"I1": [2, None, 1], "C1": ["abc", "", None]}}

    response = client.post(PREDICT, json=body)

    assert response.status_code == 200
    # TF Serving answers the columnar form with "outputs": sigmoid(0.2 + 0.5), sigmoid(0), sigmoid(0.1).
    assert list(response.json()) == ["outputs"]
    np.testing.assert_allclose(response.json()["outputs"], [0.6681878, 0.5, 0.5249792], rtol=1e-6)


def test_the_row_and_columnar_forms_agree_and_nan_reads_as_missing(client: TestClient) -> None:
    # Python's json.dumps writes NaN, which is not strict JSON: it is read, as a missing value.
    rows = b'{"instances": [{"I1": 2, "C1": "abc"}, {"I1": NaN, "C1": null}, {"I1": 1.0, "I2": -3}]}'
    columns = b'{"inputs": {"I1": [2, NaN, 1.0], "I2": [null, null, -3], "C1": ["abc", null, ""]}}'
    by_row = client.post(PREDICT, content=rows, headers={"content-type": "application/json"})
    by_column = client.post(PREDICT, content=columns, headers={"content-type": "application/json"})

    assert by_row.status_code == by_column.status_code == 200
    # sigmoid(0.1 * 2 + 0.5), sigmoid(0), sigmoid(0.1 * (1 - 3))
    np.testing.assert_allclose(by_row.json()["predictions"], [0.6681878, 0.5, 0.4501660], rtol=1e-6)
    assert by_column.json()["outputs"] == by_row.json()["predictions"]


def test_served_prediction_equals_the_signature_called_directly(
    client: TestClient, old_model: LoadedModel
) -> None:
    raw = {"I4": 17.0, "I9": -2.5, "C1": "abc", "C3": "9f3c2a71"}
    tensors = {
        name: tf.constant([raw.get(name, np.nan if spec.dtype == tf.float32 else "")], dtype=spec.dtype)
        for name, spec in old_model.input_specs.items()
    }
    direct = old_model.function(**tensors)["probability"].numpy()

    served = client.post(PREDICT, json={"instances": [raw]}).json()["predictions"]

    assert np.float32(served[0]) == direct[0]


def test_versioned_predict_answers_only_for_the_loaded_version(client: TestClient) -> None:
    loaded = client.post(f"/v1/models/{MODEL_NAME}/versions/{OLD_VERSION}:predict", json={"instances": [{}]})
    other = client.post(f"/v1/models/{MODEL_NAME}/versions/7:predict", json={"instances": [{}]})

    assert loaded.status_code == 200
    assert loaded.json() == {"predictions": [0.5]}
    assert other.status_code == 404
    assert other.json() == {
        "error": f"version 7 of model 'ctr' is not loaded; the loaded versions are ['{OLD_VERSION}']"
    }


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", r"^request body is empty; expected JSON \{\"instances\""),
        (
            b"{not json",
            r"^request body is not valid JSON \(Expecting property name .*\(char 1\)\); expected JSON",
        ),
        (b'{"instances": "\xff"}', r"^request body is not valid JSON \('utf-8' codec can't decode"),
        (b'{"instances": ' + b"[" * 1500, r"^request body is nested too deeply"),
        (b"[1, 2]", r"^request body is an array; expected JSON \{\"instances\""),
        (b'"hello"', r"^request body is a string; expected JSON"),
        (b'{"instance": [{}]}', r"^request body has unknown keys \['instance'\]; expected JSON"),
        (b"{}", r"^request body must hold exactly one of \"instances\" or \"inputs\", got neither"),
        (b'{"instances": [{}], "inputs": {}}', r"exactly one of .*, got \['instances', 'inputs'\]"),
        (
            b'{"instances": {"I1": 1}}',
            r'^"instances" must be an array of objects, one per instance, got an object',
        ),
        (b'{"inputs": [1]}', r'^"inputs" must be an object of feature name to value array, got an array'),
        (b'{"instances": []}', r'^"instances" holds no instances; expected at least one'),
        (b'{"inputs": {}}', r'^"inputs" holds no instances; expected at least one'),
        (
            b'{"instances": [{}], "signature_name": "predict"}',
            r"^signature_name 'predict' is not served; the only one is 'serving_default'$",
        ),
        (
            b'{"instances": [{}, {"I1": "x"}]}',
            r"^instance 1: feature 'I1' must be a number or null \(missing\), got 'x'$",
        ),
        (
            b'{"instances": [{"I99": 1}]}',
            r"^instance 0 has unknown features \['I99'\]; the model takes \['C1', ",
        ),
        (
            b'{"inputs": {"I1": [1, true]}}',
            r"^inputs\['I1'\]\[1\] must be a number or null \(missing\), got True$",
        ),
        (b'{"inputs": {"I1": [1, 1e39]}}', r"^inputs\['I1'\]\[1\] is 1e\+39, outside the range of float32"),
        (
            b'{"instances": [{"I1": 1}, {"I1": 10000000000000000000000000000000000000000000000000000000000000}]}',
            r"^instance 1: feature 'I1' is 1e\+61, outside the range of float32",
        ),
        (b'{"instances": [{"I1": 1}, {"C1": ["a"]}]}', r"^instance 1: feature 'C1' must be a string or null"),
    ],
)
def test_malformed_requests_get_400_saying_what_is_wrong(
    client: TestClient, body: bytes, message: str
) -> None:
    response = client.post(PREDICT, content=body, headers={"content-type": "application/json"})

    assert response.status_code == 400
    assert list(response.json()) == ["error"]
    assert_matches(message, response.json()["error"])


@pytest.mark.parametrize(
    "body",
    [{"instances": [{}] * 5}, {"inputs": {"I1": [1, 2, 3, 4, 5], "C1": ["a"] * 5}}],
)
def test_too_many_instances_get_413_with_the_limit(client: TestClient, body: dict[str, Any]) -> None:
    response = client.post(PREDICT, json=body)

    assert response.status_code == 413
    assert response.json() == {
        "error": "request has 5 instances, over the limit of 4 (serving.max_instances); "
        "split it into smaller requests"
    }


def test_too_large_body_gets_413_with_limit_and_size(client: TestClient) -> None:
    body = b'{"instances": [{}' + b", {}" * 1000 + b"]}"

    response = client.post(PREDICT, content=body)

    assert response.status_code == 413
    assert response.json() == {
        "error": f"request body is {len(body)} bytes, over the limit of 2048 bytes (serving.max_body_bytes); "
        "send fewer instances per request"
    }


def test_too_large_streamed_body_without_length_gets_413(client: TestClient) -> None:
    def chunks() -> Any:
        yield b'{"instances": [{}'
        for _ in range(10):
            yield b", {}" * 100

    response = client.post(PREDICT, content=chunks())

    assert response.status_code == 413
    assert "content-length" not in response.request.headers
    assert response.request.headers["transfer-encoding"] == "chunked"
    error = response.json()["error"]
    assert_matches(
        r"^request body is over the limit of 2048 bytes \(serving.max_body_bytes\): \d+ bytes", error
    )
    assert int(re.search(r"(\d+) bytes received so far", error)[1]) > 2048


def test_unknown_model_gets_404(client: TestClient) -> None:
    predict = client.post("/v1/models/other:predict", json={"instances": [{}]})
    status = client.get("/v1/models/other")

    assert (predict.status_code, status.status_code) == (404, 404)
    assert predict.json() == {"error": "model 'other' is not served here; it serves 'ctr'"}
    assert status.json() == predict.json()


def test_unknown_path_and_method_get_json_errors(client: TestClient) -> None:
    path = client.get("/v2/models")
    method = client.put("/healthz")

    assert path.status_code == 404
    assert path.json() == {"error": "Not Found: GET /v2/models"}
    assert method.status_code == 405
    assert method.json() == {"error": "Method Not Allowed: PUT /healthz"}
    assert set(method.headers["allow"].split(", ")) == {"GET", "HEAD"}


@pytest.mark.parametrize("prefix", ["/v1/models/ctr", "/v1/models/ctr/versions/1", "/v1/models/ctr/labels/stable"])
def test_a_verb_is_never_read_as_part_of_a_model_name_version_or_label(client: TestClient, prefix: str) -> None:
    get_predict = client.get(f"{prefix}:predict")
    unknown_verb = client.post(f"{prefix}:explode", json={"instances": [{}]})

    assert get_predict.status_code == 405
    assert get_predict.json() == {"error": f"Method Not Allowed: GET {prefix}:predict"}
    assert get_predict.headers["allow"] == "POST"
    assert unknown_verb.status_code == 404
    assert unknown_verb.json() == {"error": f"Not Found: POST {prefix}:explode"}


def test_no_model_loaded_gets_503_everywhere() -> None:
    client = TestClient(create_app(FixedSource(None), CONFIG))

    responses = [
        client.post(PREDICT, json={"instances": [{}]}),
        client.get("/v1/models/ctr"),
        client.get("/healthz"),
    ]

    assert [r.status_code for r in responses] == [503, 503, 503]
    assert responses[0].json() == {
        "error": "model 'ctr' has no version loaded yet: none is published in the model store "
        "or none has loaded cleanly; retry later"
    }
    assert responses[2].json() == {"error": "model 'ctr' has no version loaded yet"}
    assert "x-model-version" not in responses[0].headers


def test_model_status_is_tf_serving_json(client: TestClient) -> None:
    latest = client.get("/v1/models/ctr")
    pinned = client.get(f"/v1/models/ctr/versions/{OLD_VERSION}")
    missing = client.get("/v1/models/ctr/versions/1")

    expected = {
        "model_version_status": [
            {
                "version": OLD_VERSION,
                "state": "AVAILABLE",
                "status": {"error_code": "OK", "error_message": ""},
            }
        ],
        "labels": {},  # no version promoted
        # A full model without data_end: its own chain root, freshness unknown.
        "version": OLD_VERSION,
        "parent": None,
        "chain_root": OLD_VERSION,
        "data_end": None,
        "freshness_s": None,
    }
    assert (latest.status_code, latest.json()) == (200, expected)
    assert (pinned.status_code, pinned.json()) == (200, expected)
    assert latest.headers["x-model-version"] == OLD_VERSION
    assert missing.status_code == 404


@pytest.mark.parametrize(
    ("fields", "lineage"),
    [
        (
            {"parent": None, "data_end": DATA_END},
            {"parent": None, "chain_root": NEW_VERSION, "data_end": DATA_END, "freshness_s": 3690.25},
        ),
        (
            {"parent": OLD_VERSION, "chain_root": "202512310000", "data_end": "2026-01-01T02:00:00Z"},
            {"parent": OLD_VERSION, "chain_root": "202512310000", "data_end": "2026-01-01T02:00:00Z",
             "freshness_s": 90.25},
        ),
        (
            # Without an offset the time is taken as UTC; without chain_root a fine-tuned model's root is unknown.
            {"parent": OLD_VERSION, "data_end": "2026-01-01T02:01:00"},
            {"parent": OLD_VERSION, "chain_root": None, "data_end": "2026-01-01T02:01:00", "freshness_s": 30.25},
        ),
    ],
)
def test_model_status_names_lineage_and_freshness_at_the_pinned_clock(
    old_model: LoadedModel, fields: dict[str, Any], lineage: dict[str, Any]
) -> None:
    model = with_manifest(old_model, NEW_VERSION, **fields)
    client = TestClient(create_app(FixedSource(model), CONFIG, clock=lambda: NOW))

    body = client.get(f"/v1/models/ctr/versions/{NEW_VERSION}").json()

    assert body == {"model_version_status": body["model_version_status"], "labels": {}, "version": NEW_VERSION,
                    **lineage}
    assert [status["version"] for status in body["model_version_status"]] == [NEW_VERSION]


def test_unreadable_data_end_leaves_freshness_unknown_and_is_logged(
    old_model: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    model = with_manifest(old_model, NEW_VERSION, data_end="yesterday")
    client = TestClient(create_app(FixedSource(model), CONFIG, clock=lambda: NOW))

    with caplog.at_level(logging.WARNING, logger="serving.metrics"):
        body = client.get("/v1/models/ctr").json()
        samples = scrape(client)

    assert (body["data_end"], body["freshness_s"]) == ("yesterday", None)
    assert not [key for key in samples if key[0] == "ctr_model_freshness_seconds"]
    assert sample(samples, "ctr_model_loaded") == 1
    assert f"model version {NEW_VERSION} has data_end 'yesterday' in its manifest" in caplog.text


def test_metrics_count_every_response_by_endpoint_and_code(client: TestClient) -> None:
    for instances in (INSTANCES, [{}], [{}, {"I1": 1}]):
        assert client.post(PREDICT, json={"instances": instances}).status_code == 200
    assert client.post(PREDICT, json={"instances": [{"I1": "x"}]}).status_code == 400
    assert client.post(PREDICT, json={"instances": [{}] * 5}).status_code == 413
    assert client.get("/healthz").status_code == 200
    assert client.put("/healthz").status_code == 405
    assert client.get("/v1/models/other").status_code == 404
    assert client.get("/v2/models").status_code == 404

    first = scrape(client)
    second = scrape(client)

    requests = {
        (labels["endpoint"], labels["code"]): value
        for (name, pairs), value in first.items()
        if name == "ctr_requests_total"
        for labels in [dict(pairs)]
    }
    assert requests == {
        ("predict", "200"): 3,
        ("predict", "400"): 1,
        ("predict", "413"): 1,
        ("health", "200"): 1,
        ("health", "405"): 1,
        ("status", "404"): 1,
        ("unmatched", "404"): 1,
    }
    # The scrape is counted once its response is sent, so it shows in the next one.
    assert sample(second, "ctr_requests_total", endpoint="metrics", code="200") == 1
    # Only instances of answered requests: 3 + 1 + 2.
    assert sample(first, "ctr_predictions_total") == 6


def test_predict_duration_histogram_times_every_predict_response(client: TestClient) -> None:
    for _ in range(3):
        client.post(PREDICT, json={"instances": [{}]})
    client.post(PREDICT, content=b"{not json")
    client.get("/healthz")

    samples = scrape(client)

    buckets = [
        (float(dict(pairs)["le"]), value)
        for (name, pairs), value in samples.items()
        if name == "ctr_request_duration_seconds_bucket" and dict(pairs)["endpoint"] == "predict"
    ]
    bounds = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, float("inf")]
    assert sorted(bound for bound, _ in buckets) == bounds
    counts = [value for _, value in sorted(buckets)]
    assert counts == sorted(counts), f"buckets must be cumulative, got {counts}"
    # Every predict response (3 answered, 1 refused with 400), nothing else.
    assert counts[-1] == 4
    assert sample(samples, "ctr_request_duration_seconds_count", endpoint="predict") == 4
    assert 0 < sample(samples, "ctr_request_duration_seconds_sum", endpoint="predict") < 60
    assert sample(samples, "ctr_request_duration_seconds_count", endpoint="classify") == 0


def test_histogram_buckets_are_cumulative_with_inclusive_upper_bounds() -> None:
    metrics = ServerMetrics(timed_endpoints=["predict"], buckets=[0.01, 0.1, 1.0])
    for seconds in (0.01, 0.003, 0.3, 5.0):
        metrics.observe_duration("predict", seconds)

    samples = parse_metrics(metrics.render(None))

    assert {
        dict(pairs)["le"]: value for (name, pairs), value in samples.items()
        if name == "ctr_request_duration_seconds_bucket"
    } == {"0.01": 2, "0.1": 2, "1.0": 3, "+Inf": 4}
    assert sample(samples, "ctr_request_duration_seconds_count", endpoint="predict") == 4
    assert sample(samples, "ctr_request_duration_seconds_sum", endpoint="predict") == pytest.approx(5.313)
    with pytest.raises(ValueError, match=r"^endpoint 'status' is not timed; the timed ones are \['predict'\]$"):
        metrics.observe_duration("status", 0.1)


@pytest.fixture
def slow_model_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every predict's model call made at least 50 ms long (the work in the worker thread)."""
    from serving import app as serving_app

    answered = serving_app.predict_body

    def slow(model, body, max_instances):
        time.sleep(0.05)
        return answered(model, body, max_instances)

    monkeypatch.setattr(serving_app, "predict_body", slow)


def test_an_answered_requests_stages_are_timed_and_the_model_call_is_in_compute(
        old_model: LoadedModel, slow_model_call: None) -> None:
    """Each answered predict is timed in its four stages once; a refused one is not. The work in the worker
    thread (here the model's call made at least 50 ms long) lands in `compute` and nowhere else."""
    client = TestClient(create_app(FixedSource(old_model), CONFIG, clock=lambda: NOW))
    for _ in range(3):
        assert client.post(PREDICT, json={"instances": INSTANCES}).status_code == 200
    assert client.post(PREDICT, content=b"{not json").status_code == 400

    samples = scrape(client)

    for stage in ("read", "queue", "compute", "return"):
        assert sample(samples, "ctr_request_stage_seconds_count", endpoint="predict", stage=stage) == 3, stage
        assert sample(samples, "ctr_request_stage_seconds_count", endpoint="classify", stage=stage) == 0, stage
    assert sample(samples, "ctr_request_stage_seconds_sum", endpoint="predict", stage="compute") >= 0.15
    # No compute took under the sleep: none in the buckets up to 25 ms.
    assert sample(samples, "ctr_request_stage_seconds_bucket", endpoint="predict", stage="compute", le="0.025") == 0
    # The 400 was timed as a response, not in stages; the answered requests' stages fit inside their durations.
    assert sample(samples, "ctr_request_duration_seconds_count", endpoint="predict") == 4
    staged = sum(sample(samples, "ctr_request_stage_seconds_sum", endpoint="predict", stage=stage)
                 for stage in ("read", "queue", "compute", "return"))
    assert staged <= sample(samples, "ctr_request_duration_seconds_sum", endpoint="predict")


def test_an_answer_says_its_stages_in_a_server_timing_header(old_model: LoadedModel, slow_model_call: None) -> None:
    """Each answered predict and classify carries `Server-Timing: read;dur=..., queue;dur=..., compute;dur=...,
    return;dur=..., app;dur=...` in milliseconds, the model's call (made at least 50 ms long) in compute, the
    request's whole time in the app last; a refused request carries none, and `serving.server_timing=false`
    leaves it out."""
    from bench.loadgen import parse_server_timing

    client = TestClient(create_app(FixedSource(old_model), CONFIG, clock=lambda: NOW))
    response = client.post(PREDICT, json={"instances": INSTANCES})
    assert response.status_code == 200
    header = response.headers["Server-Timing"]
    assert re.fullmatch(r"read;dur=\d+\.\d{3}, queue;dur=\d+\.\d{3}, compute;dur=\d+\.\d{3}, "
                        r"return;dur=\d+\.\d{3}, app;dur=\d+\.\d{3}", header), header
    stages = parse_server_timing(header)
    assert list(stages) == ["read", "queue", "compute", "return", "app"]
    assert 50.0 <= stages["compute"] < 5_000.0 and stages["read"] < 50.0 and stages["return"] < 50.0
    # The app's whole time holds the stages, and not much more for a body this small.
    staged = sum(stages[stage] for stage in ("read", "queue", "compute", "return"))
    assert staged <= stages["app"] < staged + 50.0
    classified = client.post(f"/v1/models/{MODEL_NAME}:classify", json={"examples": INSTANCES})
    assert classified.status_code == 200 and "compute;dur=" in classified.headers["Server-Timing"]
    refused = client.post(PREDICT, content=b"{not json")
    assert refused.status_code == 400 and "Server-Timing" not in refused.headers

    quiet = TestClient(create_app(FixedSource(old_model), dataclasses.replace(CONFIG, server_timing=False),
                                  clock=lambda: NOW))
    response = quiet.post(PREDICT, json={"instances": INSTANCES})
    assert response.status_code == 200 and "Server-Timing" not in response.headers


def test_stages_are_all_four_and_only_for_the_staged_endpoints() -> None:
    metrics = ServerMetrics(timed_endpoints=["predict", "grpc_predict"], staged_endpoints=["predict"])
    metrics.observe_stages("predict", {"read": 0.0002, "queue": 0.0001, "compute": 0.002, "return": 0.00005})
    samples = parse_metrics(metrics.render(None))
    assert sample(samples, "ctr_request_stage_seconds_bucket", endpoint="predict", stage="return", le="0.0001") == 1
    assert sample(samples, "ctr_request_stage_seconds_bucket", endpoint="predict", stage="compute", le="0.001") == 0
    assert sample(samples, "ctr_request_stage_seconds_bucket", endpoint="predict", stage="compute", le="0.0025") == 1
    assert not any(dict(pairs).get("endpoint") == "grpc_predict" for name, pairs in samples
                   if name.startswith("ctr_request_stage_seconds"))
    with pytest.raises(ValueError, match=r"stages \['compute', 'read'\] given; a request's stages are "):
        metrics.observe_stages("predict", {"read": 0.1, "compute": 0.1})
    with pytest.raises(ValueError, match=r"endpoint 'grpc_predict' is not staged"):
        metrics.observe_stages("grpc_predict", {"read": 0, "queue": 0, "compute": 0, "return": 0})


def test_garbage_collections_are_timed_per_generation_while_installed() -> None:
    pauses = GcPauses()
    pauses.install()
    try:
        gc.collect()
        gc.collect(0)
    finally:
        pauses.uninstall()
    samples = parse_metrics(ServerMetrics(timed_endpoints=[], gc_pauses=pauses).render(None))
    counts = {generation: sample(samples, "ctr_gc_pause_seconds_count", generation=generation)
              for generation in ("0", "1", "2")}
    assert counts["2"] >= 1 and counts["0"] >= 1  # CPython may have collected by itself meanwhile as well
    assert sample(samples, "ctr_gc_pause_seconds_sum", generation="2") > 0
    assert sample(samples, "ctr_gc_pause_seconds_bucket", generation="2", le="+Inf") == counts["2"]
    gc.collect()  # uninstalled: not timed
    after = parse_metrics(ServerMetrics(timed_endpoints=[], gc_pauses=pauses).render(None))
    assert sample(after, "ctr_gc_pause_seconds_count", generation="2") == counts["2"]
    # Without GcPauses (a test app, not the server process) there is no such family.
    assert "ctr_gc_pause_seconds" not in ServerMetrics(timed_endpoints=[]).render(None)


def test_a_slow_garbage_collection_is_logged_with_its_generation(monkeypatch, caplog) -> None:
    ticks = iter([0.0, 0.05, 1.0, 1.0 + SLOW_GC_S + 0.4])
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: next(ticks))
    cpu = iter([0.0, 0.5, 0.62])  # this thread's CPU time: the long one was mostly off the CPU
    monkeypatch.setattr(metrics_module.time, "thread_time", lambda: next(cpu))
    pauses = GcPauses()
    with caplog.at_level(logging.WARNING, logger="serving.metrics"):
        pauses._callback("start", {"generation": 0})
        pauses._callback("stop", {"generation": 0, "collected": 3})  # 0.05 s: counted, not logged
        pauses._callback("start", {"generation": 2})
        pauses._callback("stop", {"generation": 2, "collected": 27771})
    assert caplog.text.count("garbage collection of generation") == 1
    assert ("generation 2 stopped every request for 0.500 s, 0.120 s of it on the CPU, on thread MainThread (27771 "
            "objects collected)") in caplog.text
    samples = parse_metrics(ServerMetrics(timed_endpoints=[], gc_pauses=pauses).render(None))
    assert sample(samples, "ctr_gc_pause_seconds_bucket", generation="2", le="0.25") == 0
    assert sample(samples, "ctr_gc_pause_seconds_bucket", generation="2", le="0.5") == 1
    assert sample(samples, "ctr_gc_pause_seconds_bucket", generation="0", le="0.05") == 1


def test_metrics_model_gauges_at_the_pinned_clock(old_model: LoadedModel) -> None:
    model = with_manifest(old_model, NEW_VERSION, parent=OLD_VERSION, chain_root="202512310000", data_end=DATA_END)
    client = TestClient(create_app(FixedSource(model), CONFIG, clock=lambda: NOW))

    samples = scrape(client)

    assert sample(samples, "ctr_model_loaded") == 1
    assert sample(samples, "ctr_model_version") == 202601010100
    assert sample(samples, "ctr_model_freshness_seconds") == 3690.25
    assert sample(
        samples, "ctr_model_info", version=NEW_VERSION, parent=OLD_VERSION, chain_root="202512310000"
    ) == 1
    # Before any request: zero counts, not missing series.
    assert sample(samples, "ctr_predictions_total") == 0
    assert sample(samples, "ctr_request_duration_seconds_count", endpoint="predict") == 0


def test_metrics_info_of_a_full_model_has_an_empty_parent(client: TestClient) -> None:
    samples = scrape(client)

    assert sample(samples, "ctr_model_info", version=OLD_VERSION, parent="", chain_root=OLD_VERSION) == 1
    assert sample(samples, "ctr_model_version") == 202601010000
    assert not [key for key in samples if key[0] == "ctr_model_freshness_seconds"]


def test_metrics_without_a_model_say_not_loaded_and_count_the_503s() -> None:
    client = TestClient(create_app(FixedSource(None), CONFIG))
    client.post(PREDICT, json={"instances": [{}]})
    client.get("/healthz")

    samples = scrape(client)

    assert sample(samples, "ctr_model_loaded") == 0
    assert {name for name, _ in samples if name.startswith("ctr_model_")} == {"ctr_model_loaded"}
    assert sample(samples, "ctr_requests_total", endpoint="predict", code="503") == 1
    assert sample(samples, "ctr_requests_total", endpoint="health", code="503") == 1


def test_metrics_of_a_row_cache_name_each_tiered_table_and_a_model_without_one_has_none(
        client: TestClient) -> None:
    counts = RowCacheCounts(tables={
        "C3": {"cache_rows": 4096, "cached": 1500, "rows_hit": 9000, "rows_loaded": 1700, "rows_preloaded": 1000,
               "delta_rows": 12, "protected": 900},
        "C12": {"cache_rows": 512, "cached": 512, "rows_hit": 30, "rows_loaded": 2048, "rows_preloaded": 0,
                "delta_rows": 0, "protected": 400},
    }, load_calls=41, loaded_answers=37)

    samples = parse_metrics(ServerMetrics(timed_endpoints=[]).render(None, counts))

    assert sample(samples, "ctr_row_cache_hits_total", table="C3") == 9000
    assert sample(samples, "ctr_row_cache_loads_total", table="C3") == 1700
    assert sample(samples, "ctr_row_cache_rows", table="C3") == 1500
    assert sample(samples, "ctr_row_cache_capacity_rows", table="C3") == 4096
    assert sample(samples, "ctr_row_cache_delta_rows", table="C3") == 12
    assert sample(samples, "ctr_row_cache_preloaded_rows", table="C3") == 1000
    assert sample(samples, "ctr_row_cache_protected_rows", table="C3") == 900
    assert sample(samples, "ctr_row_cache_loads_total", table="C12") == 2048  # more than it holds: evictions
    assert sample(samples, "ctr_row_cache_rows", table="C12") == 512
    assert sample(samples, "ctr_row_cache_load_calls_total") == 41
    assert sample(samples, "ctr_row_cache_loaded_answers_total") == 37
    assert len([key for key in samples if key[0].startswith("ctr_row_cache_")]) == 2 * 7 + 2
    # The fixture model has every table in memory: no row cache series at all.
    assert not [key for key in scrape(client) if key[0].startswith("ctr_row_cache_")]


def test_metrics_label_values_are_escaped() -> None:
    info = describe_model('7"\\x', {"parent": "a\nb"}, now=0.0)

    text = ServerMetrics(timed_endpoints=[]).render(info)

    assert 'ctr_model_info{chain_root="",parent="a\\nb",version="7\\"\\\\x"} 1.0\n' in text
    samples = parse_metrics(text)
    assert sample(samples, "ctr_model_info", version='7\\"\\\\x', parent="a\\nb", chain_root="") == 1
    # Not a number: no version gauge rather than a made-up one.
    assert not [key for key in samples if key[0] == "ctr_model_version"]


def test_healthz_names_the_version_and_its_load_time(client: TestClient, old_model: LoadedModel) -> None:
    response = client.get("/healthz")

    assert response.status_code == 200
    assert response.json() == {
        "status": "ok",
        "model_name": "ctr",
        "model_version": OLD_VERSION,
        "loaded_at": old_model.loaded_at.isoformat(),
    }
    assert datetime.fromisoformat(response.json()["loaded_at"]) <= datetime.now(UTC)


class _BrokenModel:
    version = "5"
    manifest: dict[str, Any] = {}
    loaded_at = datetime(2026, 1, 1, tzinfo=UTC)
    tiered = None  # every table in memory

    def predict_native(self, body: bytes, max_instances: int) -> None:
        return None  # no packed endpoint: requests go the general way

    def decode_rows(self, body: bytes) -> None:
        return None

    def predict(self, instances: list) -> Any:
        raise RuntimeError("disk on fire")


def test_unexpected_error_gets_500_and_is_logged_and_the_server_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = TestClient(create_app(FixedSource(_BrokenModel()), CONFIG), raise_server_exceptions=False)

    with caplog.at_level(logging.ERROR, logger="serving.errors"):
        response = client.post(PREDICT, json={"instances": [{}]})
    after = client.get("/healthz")

    assert response.status_code == 500
    assert response.json() == {
        "error": "internal error while handling POST /v1/models/ctr:predict: RuntimeError: disk on fire"
    }
    assert "unexpected error while handling POST /v1/models/ctr:predict" in caplog.text
    assert "RuntimeError: disk on fire" in caplog.text
    assert after.status_code == 200
    samples = scrape(client)
    assert sample(samples, "ctr_requests_total", endpoint="predict", code="500") == 1
    assert sample(samples, "ctr_request_duration_seconds_count", endpoint="predict") == 1


def test_classify_and_regress_take_examples_with_a_context(client: TestClient) -> None:
    body = {"context": {"C1": "abc", "I2": 1.5}, "examples": [{"I1": 2}, {"C1": "other"}, {}]}
    expected = [1 / (1 + np.exp(-x)) for x in (0.35 + 0.5, 0.15, 0.15 + 0.5)]  # an example's C1 wins

    classified = client.post(f"/v1/models/{MODEL_NAME}:classify", json=body)
    regressed = client.post(f"/v1/models/{MODEL_NAME}/versions/{OLD_VERSION}:regress", json=body)
    plain = client.post(f"/v1/models/{MODEL_NAME}:regress", json={"examples": [{"I1": 2}]})

    assert (classified.status_code, classified.headers["x-model-version"]) == (200, OLD_VERSION)
    result = classified.json()["result"]
    assert [[label for label, _ in classes] for classes in result] == [["0", "1"]] * 3
    assert [classes[1][1] for classes in result] == pytest.approx(expected, rel=1e-6)
    assert [classes[0][1] for classes in result] == pytest.approx([1 - p for p in expected], rel=1e-5)
    assert regressed.json() == {"result": pytest.approx(expected, rel=1e-6)}
    assert plain.json() == {"result": pytest.approx([1 / (1 + np.exp(-0.2))], rel=1e-6)}


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"instances": [{}]}, 400, "request body has unknown keys ['instances']; expected JSON {\"examples\""),
        ({"context": {}}, 400, 'request body has no "examples"'),
        ({"examples": {"I1": 1}}, 400, '"examples" must be an array of objects, one per example, got an object'),
        ({"examples": [{}], "context": [1]}, 400, '"context" must be an object of feature values, got an array'),
        ({"examples": []}, 400, "the request holds no examples; expected at least one"),
        ({"examples": [{}] * 5}, 413, "request has 5 examples, over the limit of 4 (serving.max_instances)"),
        ({"examples": [{}, 3]}, 400, "example 1 must be an object of feature values, got 3"),
        ({"examples": [{"I99": 1}]}, 400, "instance 0 has unknown features ['I99']"),
        ({"examples": [{}], "signature_name": "x"}, 400, "signature_name 'x' is not served"),
    ],
)
def test_regress_refuses_malformed_examples(client: TestClient, body: Any, status: int, message: str) -> None:
    response = client.post(f"/v1/models/{MODEL_NAME}:regress", json=body)

    assert response.status_code == status
    assert response.json()["error"].startswith(message), response.json()["error"]


def test_labels_name_no_version_until_one_is_promoted(client: TestClient) -> None:
    stable = client.post(f"/v1/models/{MODEL_NAME}/labels/stable:predict", json={"instances": [{}]})
    other = client.get(f"/v1/models/{MODEL_NAME}/labels/beta/metadata")

    assert stable.status_code == 404
    assert stable.json()["error"].startswith("label 'stable' of model 'ctr' names no loaded version: no version "
                                             "is promoted yet (`ctr-pipeline promote VERSION`)")
    assert other.status_code == 404
    assert other.json()["error"].startswith("label 'beta' of model 'ctr' is not served; the labels are 'stable'")
