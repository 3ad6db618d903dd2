"""The TF-Serving REST API, driven in-process: status codes, bodies and headers."""

from __future__ import annotations

import logging
import re
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from starlette.testclient import TestClient

from components.config import ServingConfig
from serving.app import create_app
from serving.model import LoadedModel
from tests.serving.fixture_model import MODEL_NAME, OLD_VERSION, FixedSource

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


def assert_matches(pattern: str, text: str) -> None:
    assert re.search(pattern, text), f"{text!r} does not match {pattern!r}"


@pytest.fixture
def client(old_model: LoadedModel) -> TestClient:
    return TestClient(create_app(FixedSource(old_model), CONFIG))


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
    # sigmoid(0.2 + 0.5), sigmoid(0), sigmoid(0.1)
    np.testing.assert_allclose(response.json()["predictions"], [0.6681878, 0.5, 0.5249792], rtol=1e-6)


def test_served_prediction_equals_the_signature_called_directly(
    client: TestClient, old_model: LoadedModel
) -> None:
    raw = {"I4": 17.0, "I9": -2.5, "C1": "abc", "C3": "68fd1e64"}
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
        "error": f"version 7 of model 'ctr' is not loaded; the loaded version is {OLD_VERSION}"
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
        ]
    }
    assert (latest.status_code, latest.json()) == (200, expected)
    assert (pinned.status_code, pinned.json()) == (200, expected)
    assert latest.headers["x-model-version"] == OLD_VERSION
    assert missing.status_code == 404


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
    loaded_at = datetime(2026, 1, 1, tzinfo=UTC)

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
