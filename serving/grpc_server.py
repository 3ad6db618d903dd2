"""TF Serving's gRPC API (port 8500) over the same models, checks and limits as the REST API.

    tensorflow.serving.PredictionService   Predict, Classify, Regress, GetModelMetadata
    tensorflow.serving.ModelService        GetModelStatus

Existing clients work unchanged with TF Serving's own stubs (`tensorflow-serving-api`):

    stub = prediction_service_pb2_grpc.PredictionServiceStub(grpc.insecure_channel("localhost:8500"))
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "ctr"                    # optionally .version.value or .version_label = "stable"
    request.inputs["I1"].CopyFrom(tf.make_tensor_proto([3.0, 1.0], dtype=tf.float32))
    request.inputs["C1"].CopyFrom(tf.make_tensor_proto(["9f3c2a71", "4be05d18"]))
    stub.Predict(request).outputs["probability"]      # float [batch]

Predict takes one tensor per feature (absent features are missing), as the signature declares them (see
GetModelMetadata); numbers may come as any numeric dtype and ids as strings or integers, and are converted and
checked as the REST API's columnar form is. Classify and Regress take tf.Example lists, with or without a
shared context (`example_list_with_context`): a single-valued input reads the feature's one value (none:
missing), a list input (multi-valued and sequence features) reads them all, newest last.

Errors are gRPC status codes with the REST API's messages: INVALID_ARGUMENT (400), NOT_FOUND (404),
RESOURCE_EXHAUSTED (413: over serving.max_instances, or a message over serving.max_body_bytes) and
UNAVAILABLE (503: no version loaded yet). Calls are counted in the server's metrics under the endpoints
grpc_predict, grpc_classify, grpc_regress, grpc_metadata and grpc_status, with the HTTP status the REST API
would have answered.

A full version is taken over by a new server process (serving.handoff), whose gRPC server shares the port; the
old one then stops. gRPC's server fails a call that reaches it after its stop began and before the client read
its GOAWAY (CANCELLED; about 1 hand-off in 25 for a client calling every 5 ms, docs/serving.md). Predict,
Classify and Regress change nothing, so a client can have such a call sent again by gRPC itself:

    grpc.insecure_channel("localhost:8500", options=client_channel_options(max_body_bytes=4 << 20))
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any, TypeVar

import grpc
import numpy as np
import tensorflow as tf
from google.protobuf import json_format
from tensorflow.core.framework import types_pb2
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
from serving.errors import BadRequest, ModelNotFound, NoModelLoaded, PayloadTooLarge, ServingError
from serving.metrics import ServerMetrics
from serving.model import OUTPUT_NAME, SIGNATURE_NAME, LoadedModel
from serving.service import CLASSES, ModelSource, PredictionService, merge_context

logger = logging.getLogger(__name__)

GRPC_TIMED_ENDPOINTS = ("grpc_predict", "grpc_classify", "grpc_regress")
_CODES = {
    BadRequest: grpc.StatusCode.INVALID_ARGUMENT,
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
    PayloadTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NoModelLoaded: grpc.StatusCode.UNAVAILABLE,
}
_SIGNATURE_DEF = "signature_def"
# gRPC's own retries (gRFC A6) for the calls that change nothing: CANCELLED is how a call that crossed a
# server's stop fails, UNAVAILABLE a server with no version loaded yet or a connection being replaced.
CLIENT_SERVICE_CONFIG = json.dumps({"methodConfig": [{
    "name": [{"service": "tensorflow.serving.PredictionService"}, {"service": "tensorflow.serving.ModelService"}],
    "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.1s", "backoffMultiplier": 2,
                    "retryableStatusCodes": ["CANCELLED", "UNAVAILABLE"]},
}]})

T = TypeVar("T")


def _spec_of(model_spec: Any) -> tuple[str, str | None, str | None]:
    """(name, version, label) of a ModelSpec; an empty signature_name means serving_default."""
    if model_spec.signature_name not in ("", SIGNATURE_NAME):
        raise BadRequest(f"signature_name {model_spec.signature_name!r} is not served; the only one is "
                         f"{SIGNATURE_NAME!r}")
    choice = model_spec.WhichOneof("version_choice")
    version = str(model_spec.version.value) if choice == "version" else None
    label = model_spec.version_label if choice == "version_label" else None
    return model_spec.name, version, label


def _answered_spec(target: Any, model: LoadedModel, name: str) -> None:
    target.name = name
    target.version.value = int(model.version)
    target.signature_name = SIGNATURE_NAME


def tensor_array(name: str, proto: Any) -> np.ndarray:
    """A TensorProto as a numpy array of one value (or row) per instance; LoadedModel.predict_columns uses
    float and string arrays as they are and checks any other value by value.

    A 1-D float32 or string tensor holding one value per element (what TF Serving clients send per feature) is
    read straight from its field; anything else goes through tf.make_ndarray, which also expands a tensor
    given fewer values than its shape. The direct read takes about a quarter of make_ndarray's time, which
    was 0.5 ms of a 100-candidate request's 39 tensors."""
    dims = proto.tensor_shape.dim
    if len(dims) == 1 and not proto.tensor_shape.unknown_rank:
        size = dims[0].size
        if proto.dtype == types_pb2.DT_STRING and len(proto.string_val) == size:
            return np.array(proto.string_val, dtype=object).reshape(size)
        if proto.dtype == types_pb2.DT_FLOAT:
            if proto.tensor_content and len(proto.tensor_content) == 4 * size:
                return np.frombuffer(proto.tensor_content, dtype=np.float32)
            if not proto.tensor_content and len(proto.float_val) == size:
                return np.array(proto.float_val, dtype=np.float32)
    try:
        array = tf.make_ndarray(proto)
    except (KeyError, TypeError, ValueError) as err:  # a malformed proto: unknown dtype, wrong content size
        raise BadRequest(f"inputs[{name!r}] is not a readable tensor: {err}") from None
    if array.ndim == 0:
        raise BadRequest(f"inputs[{name!r}] is a scalar; it must hold one value per instance (shape [batch] or "
                         "[batch, length])")
    return array


def example_values(where: str, example: Any, model: LoadedModel) -> dict[str, Any]:
    """One tf.Example as the REST row form: single-valued inputs take the feature's one value, list inputs
    (rank 2) all of them."""
    values: dict[str, Any] = {}
    for name, feature in example.features.feature.items():
        kind = feature.WhichOneof("kind")
        raw = list(getattr(feature, kind).value) if kind else []
        if kind == "bytes_list":
            try:
                raw = [value.decode("utf-8") for value in raw]
            except UnicodeDecodeError as err:
                raise BadRequest(f"{where}: feature {name!r} holds a string that is not UTF-8: {err}") from None
        spec = model.input_specs.get(name)
        if spec is not None and spec.shape.rank == 2:
            values[name] = raw
        elif len(raw) > 1:
            raise BadRequest(f"{where}: feature {name!r} holds {len(raw)} values; the model takes one")
        else:
            values[name] = raw[0] if raw else None
    return values


def counted_call(metrics: ServerMetrics, endpoint: str, context: grpc.ServicerContext, work: Callable[[], T]) -> T:
    """Runs `work`, counting the call as the REST API would (its HTTP status) and turning a ServingError into
    the matching gRPC status with the same message."""
    start = time.perf_counter()
    code = 200
    try:
        return work()
    except ServingError as err:
        code = err.status_code
        context.abort(_CODES.get(type(err), grpc.StatusCode.INTERNAL), err.message)
    except Exception:
        code = 500
        logger.exception("unexpected error in gRPC %s", endpoint)
        context.abort(grpc.StatusCode.INTERNAL, "internal error; see the server's log")
    finally:
        metrics.count_request(endpoint, code)
        if endpoint in metrics.timed_endpoints:
            metrics.observe_duration(endpoint, time.perf_counter() - start)
    raise AssertionError("unreachable: context.abort raises")


class PredictionServicer(prediction_service_pb2_grpc.PredictionServiceServicer):
    def __init__(self, service: PredictionService, metrics: ServerMetrics) -> None:
        self.service = service
        self.metrics = metrics

    def _call(self, endpoint: str, context: grpc.ServicerContext, work: Callable[[], T]) -> T:
        return counted_call(self.metrics, endpoint, context, work)

    def Predict(self, request: Any, context: grpc.ServicerContext) -> Any:
        def work() -> Any:
            name, version, label = _spec_of(request.model_spec)
            unknown = sorted(set(request.output_filter) - {OUTPUT_NAME})
            if unknown:
                raise BadRequest(f"output_filter names {unknown}; the only output is {OUTPUT_NAME!r}")
            columns = {key: tensor_array(key, proto) for key, proto in request.inputs.items()}
            lengths = {len(values) for values in columns.values()}
            self.service.check_count(max(lengths, default=0), "instances")
            model, probabilities = self.service.run(name, version, label, lambda m: m.predict_columns(columns))
            self.metrics.count_predictions(len(probabilities))
            response = predict_pb2.PredictResponse()
            _answered_spec(response.model_spec, model, name)
            response.outputs[OUTPUT_NAME].CopyFrom(tf.make_tensor_proto(probabilities.astype(np.float32)))
            return response

        return self._call("grpc_predict", context, work)

    def _on_examples(self, endpoint: str, request: Any, context: grpc.ServicerContext,
                     respond: Callable[[Any, list[float]], None], response: Any) -> Any:
        """Classify and Regress: the request's examples (with their context) predicted by the model it names;
        `respond` fills `response` from the probabilities."""

        def work() -> Any:
            name, version, label = _spec_of(request.model_spec)
            kind = request.input.WhichOneof("kind")
            if kind is None:
                raise BadRequest("input holds no examples; set input.example_list or "
                                 "input.example_list_with_context")
            holder = getattr(request.input, kind)
            examples = list(holder.examples)
            self.service.check_count(len(examples), "examples")
            has_context = kind == "example_list_with_context" and holder.HasField("context")

            def predict(model: LoadedModel) -> Any:
                shared = example_values("context", holder.context, model) if has_context else None
                rows = [example_values(f"example {index}", example, model) for index, example in enumerate(examples)]
                return model.predict(merge_context(rows, shared))

            model, probabilities = self.service.run(name, version, label, predict)
            self.metrics.count_predictions(len(probabilities))
            _answered_spec(response.model_spec, model, name)
            respond(response.result, probabilities.astype(float).tolist())
            return response

        return self._call(endpoint, context, work)

    def Classify(self, request: Any, context: grpc.ServicerContext) -> Any:
        def respond(result: Any, probabilities: list[float]) -> None:
            for p in probabilities:
                classes = result.classifications.add().classes
                classes.add(label=CLASSES[0], score=1.0 - p)
                classes.add(label=CLASSES[1], score=p)

        return self._on_examples("grpc_classify", request, context, respond,
                                 classification_pb2.ClassificationResponse())

    def Regress(self, request: Any, context: grpc.ServicerContext) -> Any:
        def respond(result: Any, probabilities: list[float]) -> None:
            for p in probabilities:
                result.regressions.add(value=p)

        return self._on_examples("grpc_regress", request, context, respond, regression_pb2.RegressionResponse())

    def GetModelMetadata(self, request: Any, context: grpc.ServicerContext) -> Any:
        def work() -> Any:
            fields = set(request.metadata_field)
            if fields != {_SIGNATURE_DEF}:
                raise BadRequest(f"metadata_field must be [{_SIGNATURE_DEF!r}], the only metadata served; got "
                                 f"{sorted(fields)}")
            name, version, label = _spec_of(request.model_spec)
            model = self.service.model(name, version, label)
            signatures = json_format.ParseDict(model.signature_metadata()[_SIGNATURE_DEF],
                                               get_model_metadata_pb2.SignatureDefMap())
            response = get_model_metadata_pb2.GetModelMetadataResponse()
            _answered_spec(response.model_spec, model, name)
            response.metadata[_SIGNATURE_DEF].Pack(signatures)
            return response

        return self._call("grpc_metadata", context, work)


class ModelServicer(model_service_pb2_grpc.ModelServiceServicer):
    def __init__(self, service: PredictionService, metrics: ServerMetrics) -> None:
        self.service = service
        self.metrics = metrics

    def GetModelStatus(self, request: Any, context: grpc.ServicerContext) -> Any:
        def work() -> Any:
            name, version, label = _spec_of(request.model_spec)
            model = self.service.model(name, version, label)
            asked = request.model_spec.WhichOneof("version_choice") is not None
            response = get_model_status_pb2.GetModelStatusResponse()
            for loaded in [model] if asked else self.service.source.models():
                status = response.model_version_status.add()
                status.version = int(loaded.version)
                status.state = get_model_status_pb2.ModelVersionStatus.AVAILABLE
            return response

        return counted_call(self.metrics, "grpc_status", context, work)


def client_channel_options(max_body_bytes: int) -> list[tuple[str, Any]]:
    """A client channel's options for calls that cross a hand-off (module docstring): CLIENT_SERVICE_CONFIG, and
    a retry buffer as large as the largest request (serving.max_body_bytes; gRPC's default of 256 KiB would
    leave a 1,000-candidate Predict unretried)."""
    return [("grpc.service_config", CLIENT_SERVICE_CONFIG), ("grpc.per_rpc_retry_buffer_size", max_body_bytes),
            ("grpc.max_send_message_length", max_body_bytes)]


def build_grpc_server(source: ModelSource, config: ServingConfig, metrics: ServerMetrics,
                      port: int, workers: int = 8) -> tuple[grpc.Server, int]:
    """The (not yet started) gRPC server on `config.host`:`port` (0: any free port) and the port it bound."""
    service = PredictionService(source, config)
    options = [("grpc.max_receive_message_length", config.max_body_bytes),
               ("grpc.max_send_message_length", 64 * 1024 * 1024)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"),
                         options=options)
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(PredictionServicer(service, metrics), server)
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelServicer(service, metrics), server)
    bound = server.add_insecure_port(f"{config.host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen for gRPC on {config.host}:{port}; set serving.grpc_port to a free port "
                      "(or -1 to serve REST only)")
    return server, bound


def add_warm_up_port(server: grpc.Server) -> int:
    """A loopback port of the server's own, for warm_up_grpc: its public port may be shared with the process it
    takes over from (SO_REUSEPORT), which the kernel could hand a call to that port."""
    return server.add_insecure_port("127.0.0.1:0")


def warm_up_grpc(port: int, model_name: str, model: LoadedModel, rows: int) -> str:
    """One Predict of `rows` instances with no values (the first float or string input given as missing values,
    the others absent) through the server on `port`, from a new channel: its thread pool, the handler and the
    model, as a client's first call takes them. Returns the version that answered. A new server process answered
    its first gRPC call in 10 ms against about 4 ms for the next ones (docs/serving.md). Counted in /metrics as
    any call."""
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model_name
    for name in model.input_names:
        spec = model.input_specs[name]
        if spec.shape.rank == 1 and spec.dtype in (tf.float32, tf.string):
            missing = np.full(rows, np.nan, np.float32) if spec.dtype == tf.float32 else [b""] * rows
            request.inputs[name].CopyFrom(tf.make_tensor_proto(missing))
            break
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        answer = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=60)
    return str(answer.model_spec.version.value)
