"""TF Serving's gRPC API, called with TF Serving's own Python stubs over a real channel on loopback."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import numpy as np
import pytest
import tensorflow as tf
from starlette.testclient import TestClient
from tensorflow.core.framework.tensor_pb2 import TensorProto
from tensorflow_serving.apis import (
    classification_pb2,
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
    regression_pb2,
)

from components.config import ServingConfig
from serving.app import create_app
from serving.grpc_server import (
    GRPC_TIMED_ENDPOINTS,
    add_warm_up_port,
    build_grpc_server,
    client_channel_options,
    tensor_array,
    warm_up_grpc,
)
from serving.metrics import ServerMetrics
from serving.model import LoadedModel
from tests.serving.fixture_model import MODEL_NAME, OLD_VERSION, FixedSource

pytestmark = pytest.mark.integration

CONFIG = ServingConfig(model_name=MODEL_NAME, max_instances=4, max_body_bytes=4096)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


class Client:
    """TF Serving's stubs on a channel to an in-process server."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.predictions = prediction_service_pb2_grpc.PredictionServiceStub(self.channel)
        self.models = model_service_pb2_grpc.ModelServiceStub(self.channel)


def serve(source: Any, metrics: ServerMetrics | None = None) -> Iterator[Client]:
    metrics = metrics or ServerMetrics(timed_endpoints=GRPC_TIMED_ENDPOINTS)
    server, port = build_grpc_server(source, CONFIG, metrics, port=0, workers=2)
    server.start()
    client = Client(port)
    try:
        yield client
    finally:
        client.channel.close()
        server.stop(None)


@pytest.fixture
def metrics() -> ServerMetrics:
    return ServerMetrics(timed_endpoints=GRPC_TIMED_ENDPOINTS)


@pytest.fixture
def client(old_model: LoadedModel, metrics: ServerMetrics) -> Iterator[Client]:
    yield from serve(FixedSource(old_model), metrics)


def predict_request(inputs: dict[str, Any], **spec: Any) -> Any:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = spec.pop("name", MODEL_NAME)
    for key, value in spec.items():
        if key == "version":
            request.model_spec.version.value = value
        else:
            setattr(request.model_spec, key, value)
    for name, value in inputs.items():
        request.inputs[name].CopyFrom(value if isinstance(value, TensorProto) else tf.make_tensor_proto(value))
    return request


def example(**features: Any) -> tf.train.Example:
    out = tf.train.Example()
    for name, value in features.items():
        values = value if isinstance(value, list) else [value]
        feature = out.features.feature[name]
        if all(isinstance(v, str) for v in values):
            feature.bytes_list.value.extend(v.encode() for v in values)
        elif all(isinstance(v, int) for v in values):
            feature.int64_list.value.extend(values)
        else:
            feature.float_list.value.extend(values)
    return out


def error_of(call: Any, request: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call(request)
    return caught.value.code(), caught.value.details()


def test_predict_answers_tensors_with_the_probability_and_the_version(client: Client) -> None:
    request = predict_request({
        "I1": np.array([2.0, np.nan, 1.0], dtype=np.float32),
        "I2": np.array([3.5, 0.0, 1.0], dtype=np.float64),  # any float dtype is converted
        "C1": ["abc", "x", "abc"],
    })

    response = client.predictions.Predict(request)

    probabilities = tf.make_ndarray(response.outputs["probability"])
    assert probabilities.dtype == np.float32
    # sigmoid(0.1 * dense sum + 0.5 * (C1 == "abc")); a NaN is missing, absent features are missing
    assert probabilities.tolist() == pytest.approx([sigmoid(1.05), sigmoid(0.0), sigmoid(0.7)], rel=1e-6)
    assert (response.model_spec.name, response.model_spec.version.value) == (MODEL_NAME, int(OLD_VERSION))
    assert response.model_spec.signature_name == "serving_default"


def test_predict_equals_the_rest_api_on_the_same_rows(old_model: LoadedModel, client: Client) -> None:
    rows = [{"I1": 2.0, "I5": -1.5, "C1": "abc", "C7": "q"}, {"I3": 4.0, "C1": "zz"}]
    rest = TestClient(create_app(FixedSource(old_model), CONFIG)).post(
        f"/v1/models/{MODEL_NAME}:predict", json={"instances": rows}).json()["predictions"]
    columns = {name: [row.get(name) for row in rows] for name in ("I1", "I3", "I5", "C1", "C7")}
    inputs = {name: np.array([math.nan if v is None else v for v in values], dtype=np.float32)
              if name.startswith("I") else ["" if v is None else v for v in values]
              for name, values in columns.items()}

    response = client.predictions.Predict(predict_request(inputs))

    assert tf.make_ndarray(response.outputs["probability"]).tolist() == pytest.approx(rest, rel=1e-6)


def test_classify_and_regress_take_examples_with_a_shared_context(client: Client) -> None:
    def fill(request: Any) -> Any:
        request.model_spec.name = MODEL_NAME
        examples = request.input.example_list_with_context
        examples.context.CopyFrom(example(C1="abc", I2=1.0))
        examples.examples.extend([example(I1=2.0), example(I1=-1.0, C1="other"), example()])
        return request

    classified = client.predictions.Classify(fill(classification_pb2.ClassificationRequest()))
    regressed = client.predictions.Regress(fill(regression_pb2.RegressionRequest()))

    expected = [sigmoid(0.3 + 0.5), sigmoid(0.0), sigmoid(0.1 + 0.5)]  # an example's own C1 wins over the context's
    assert [c.label for c in classified.result.classifications[0].classes] == ["0", "1"]
    assert [c.classes[1].score for c in classified.result.classifications] == pytest.approx(expected, rel=1e-6)
    assert [c.classes[0].score for c in classified.result.classifications] == pytest.approx(
        [1 - p for p in expected], rel=1e-5)
    assert [r.value for r in regressed.result.regressions] == pytest.approx(expected, rel=1e-6)
    assert regressed.model_spec.version.value == int(OLD_VERSION)


def test_metadata_and_status_describe_the_served_signature(client: Client) -> None:
    request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    request.model_spec.name = MODEL_NAME
    status_request = get_model_status_pb2.GetModelStatusRequest()
    status_request.model_spec.name = MODEL_NAME

    metadata = client.predictions.GetModelMetadata(request)
    status = client.models.GetModelStatus(status_request)

    signatures = get_model_metadata_pb2.SignatureDefMap()
    assert metadata.metadata["signature_def"].Unpack(signatures)
    signature = signatures.signature_def["serving_default"]
    assert signature.method_name == "tensorflow/serving/predict"
    assert len(signature.inputs) == 39
    assert signature.inputs["I1"].dtype == tf.float32.as_datatype_enum
    assert signature.inputs["C1"].dtype == tf.string.as_datatype_enum
    assert [d.size for d in signature.inputs["C1"].tensor_shape.dim] == [-1]
    assert signature.outputs["probability"].dtype == tf.float32.as_datatype_enum
    assert [(s.version, s.state) for s in status.model_version_status] == [
        (int(OLD_VERSION), get_model_status_pb2.ModelVersionStatus.AVAILABLE)]


@pytest.mark.parametrize(
    ("inputs", "spec", "code", "message"),
    [
        ({"I1": [1.0]}, {"name": "other"}, grpc.StatusCode.NOT_FOUND,
         "model 'other' is not served here; it serves 'ctr'"),
        ({"I1": [1.0]}, {"version": 7}, grpc.StatusCode.NOT_FOUND,
         f"version 7 of model 'ctr' is not loaded; the loaded versions are ['{OLD_VERSION}']"),
        ({"I1": [1.0]}, {"version_label": "stable"}, grpc.StatusCode.NOT_FOUND,
         "label 'stable' of model 'ctr' names no loaded version: no version is promoted yet"),
        ({"I1": [1.0]}, {"version_label": "beta"}, grpc.StatusCode.NOT_FOUND, "label 'beta' of model 'ctr' is not "
         "served; the labels are 'stable'"),
        ({"I1": [1.0]}, {"signature_name": "predict"}, grpc.StatusCode.INVALID_ARGUMENT,
         "signature_name 'predict' is not served; the only one is 'serving_default'"),
        ({"I1": [1.0], "I99": [1.0]}, {}, grpc.StatusCode.INVALID_ARGUMENT, "inputs has unknown features ['I99']"),
        ({"I1": [1.0, 2.0], "C1": ["a"]}, {}, grpc.StatusCode.INVALID_ARGUMENT,
         "inputs must all hold the same number of values"),
        ({"I1": ["high"]}, {}, grpc.StatusCode.INVALID_ARGUMENT, "inputs['I1'][0] must be a number or null"),
        ({"I1": np.array([1.0, math.inf])}, {}, grpc.StatusCode.INVALID_ARGUMENT,
         "inputs['I1'][1] is inf, outside the range of float32; send a finite number"),
        ({"I1": np.array([1, 2], dtype=np.int64)}, {}, grpc.StatusCode.OK, ""),  # integers are numbers too
        ({"I1": [1.0] * 5}, {}, grpc.StatusCode.RESOURCE_EXHAUSTED,
         "request has 5 instances, over the limit of 4 (serving.max_instances)"),
        ({"I1": [b"\xff"]}, {}, grpc.StatusCode.INVALID_ARGUMENT, "inputs['I1'] holds a string that is not UTF-8"),
        ({"I1": 1.0}, {}, grpc.StatusCode.INVALID_ARGUMENT, "inputs['I1'] is a scalar"),
    ],
)
def test_predict_checks_tensors_with_the_rest_apis_messages(
    client: Client, metrics: ServerMetrics, inputs: dict[str, Any], spec: dict[str, Any], code: grpc.StatusCode,
    message: str,
) -> None:
    request = predict_request({name: tf.make_tensor_proto(value) for name, value in inputs.items()}, **spec)
    if code == grpc.StatusCode.OK:
        answer = client.predictions.Predict(request)
        assert tf.make_ndarray(answer.outputs["probability"]).tolist() == pytest.approx(
            [sigmoid(0.1), sigmoid(0.2)], rel=1e-6)
        return

    got_code, details = error_of(client.predictions.Predict, request)

    assert got_code == code
    assert details.startswith(message), details
    assert re.search(r'ctr_requests_total\{code="\d+",endpoint="grpc_predict"\}', metrics.render(None))


def float_proto(values: list[float], shape: list[int]) -> TensorProto:
    proto = TensorProto(dtype=tf.float32.as_datatype_enum, float_val=values)
    proto.tensor_shape.dim.extend([TensorProto().tensor_shape.Dim(size=size) for size in shape])
    return proto


@pytest.mark.parametrize("proto", [
    tf.make_tensor_proto(np.array([1.5, np.nan, -2.0], dtype=np.float32)),  # tensor_content, as clients send
    float_proto([1.5, 2.5], [2]),  # float_val, one value per element
    float_proto([7.0], [3]),  # one value for the whole shape: make_ndarray repeats it
    tf.make_tensor_proto(["9f3c2a71", "", "4be05d18"]),
    tf.make_tensor_proto(np.array([b"\xff", b"a"], dtype=object)),  # not UTF-8: left to the checks after
    tf.make_tensor_proto([["a", "b"], ["", "c"]]),  # a list per instance
    tf.make_tensor_proto(np.array([1, 2], dtype=np.int64)),
    tf.make_tensor_proto(np.array([], dtype=np.float32)),
])
def test_tensors_are_read_as_make_ndarray_reads_them(proto: TensorProto) -> None:
    """tensor_array reads 1-D float32 and string tensors straight from their fields, and the rest with
    tf.make_ndarray: the same values, dtype and shape either way."""
    got, expected = tensor_array("I1", proto), tf.make_ndarray(proto)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype.kind == "f":
        np.testing.assert_array_equal(got, expected)
    else:
        assert got.tolist() == expected.tolist()


def test_a_message_over_the_body_limit_is_refused_by_grpc(client: Client) -> None:
    request = predict_request({"C1": tf.make_tensor_proto(["x" * 5000])})

    code, _ = error_of(client.predictions.Predict, request)

    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_examples_with_several_values_for_a_single_valued_input_are_refused(client: Client) -> None:
    request = regression_pb2.RegressionRequest()
    request.model_spec.name = MODEL_NAME
    request.input.example_list.examples.extend([example(I1=1.0), example(C1=["a", "b"])])
    empty = regression_pb2.RegressionRequest()
    empty.model_spec.name = MODEL_NAME

    assert error_of(client.predictions.Regress, request) == (
        grpc.StatusCode.INVALID_ARGUMENT, "example 1: feature 'C1' holds 2 values; the model takes one")
    assert error_of(client.predictions.Regress, empty) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "input holds no examples; set input.example_list or input.example_list_with_context")


def test_before_any_version_is_loaded_calls_are_unavailable() -> None:
    for client in serve(FixedSource(None)):
        code, details = error_of(client.predictions.Predict, predict_request({"I1": [1.0]}))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert details.startswith("model 'ctr' has no version loaded yet")


def test_calls_are_counted_and_timed_with_the_http_status_rest_would_answer(
    client: Client, metrics: ServerMetrics
) -> None:
    client.predictions.Predict(predict_request({"I1": [1.0, 2.0]}))
    error_of(client.predictions.Predict, predict_request({"I99": [1.0]}))

    text = metrics.render(None)

    assert 'ctr_requests_total{code="200",endpoint="grpc_predict"} 1.0' in text
    assert 'ctr_requests_total{code="400",endpoint="grpc_predict"} 1.0' in text
    assert 'ctr_request_duration_seconds_count{endpoint="grpc_predict"} 2.0' in text
    assert "ctr_predictions_total 2" in text


def test_the_warm_up_call_reaches_the_model_through_a_loopback_port_of_the_servers_own(
    old_model: LoadedModel, metrics: ServerMetrics
) -> None:
    server, port = build_grpc_server(FixedSource(old_model), CONFIG, metrics, port=0, workers=2)
    warm_up_port = add_warm_up_port(server)
    server.start()
    try:
        version = warm_up_grpc(warm_up_port, MODEL_NAME, old_model, rows=CONFIG.max_instances)
    finally:
        server.stop(None)
    text = metrics.render(None)

    assert warm_up_port not in (0, port)
    assert version == OLD_VERSION
    assert 'ctr_requests_total{code="200",endpoint="grpc_predict"} 1.0' in text
    assert f"ctr_predictions_total {CONFIG.max_instances}" in text


def test_a_client_with_the_channel_options_sends_a_cancelled_call_again() -> None:
    """How a call that crossed a server's stop fails (CANCELLED, before any answer) is what gRPC itself sends
    again under client_channel_options; without them, the client sees it."""
    calls: list[str] = []

    class CancelledFirst(prediction_service_pb2_grpc.PredictionServiceServicer):
        def Predict(self, request: predict_pb2.PredictRequest, context: grpc.ServicerContext
                    ) -> predict_pb2.PredictResponse:
            calls.append(request.model_spec.name)
            if len(calls) % 2 == 1:
                context.abort(grpc.StatusCode.CANCELLED, "server shutting down")
            response = predict_pb2.PredictResponse()
            response.model_spec.name = request.model_spec.name
            return response

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(CancelledFirst(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    request = predict_pb2.PredictRequest()
    request.model_spec.name = MODEL_NAME
    request.inputs["C1"].CopyFrom(tf.make_tensor_proto(["x" * 1000] * 1000))  # over gRPC's default retry buffer
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=client_channel_options(4 << 20)) as channel:
            answer = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=10)
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 4 << 20)]
                                   ) as channel, pytest.raises(grpc.RpcError) as plain:
            prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=10)
    finally:
        server.stop(None)

    assert answer.model_spec.name == MODEL_NAME
    assert plain.value.code() == grpc.StatusCode.CANCELLED
    assert calls == [MODEL_NAME] * 3
