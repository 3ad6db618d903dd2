"""The server process wiring, over real HTTP: config -> store -> watcher -> app -> uvicorn."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import httpx
import pytest
import tensorflow as tf

from components.config import PipelineConfig
from components.model_store import LocalModelStore
from serving.server import build_server, freeze_imports
from tests.serving.fixture_model import MODEL_NAME, NEW_VERSION, OLD_VERSION
from tests.serving.running import http_running

pytestmark = pytest.mark.integration


def test_serves_over_http_and_swaps_to_a_newly_published_version(
    store: LocalModelStore, exported: dict[str, Path], tmp_path: Path
) -> None:
    config = PipelineConfig().with_overrides(
        {
            "paths.data_root": str(tmp_path),
            "paths.model_store": str(store.root),
            "serving.port": 0,  # any free port
            "serving.poll_seconds": 0.05,
            "serving.grpc_port": -1,
        }
    )
    servers = build_server(config)
    watcher = servers.watcher
    watcher.start()
    deadline = time.monotonic() + 20
    try:
        with http_running(servers) as port:
            url = f"http://127.0.0.1:{port}/v1/models/{MODEL_NAME}:predict"
            body = {"instances": [{"I1": 2, "I2": 3.5, "C1": "abc"}]}

            before = httpx.post(url, json=body)
            store.publish(MODEL_NAME, NEW_VERSION, exported[NEW_VERSION])
            while watcher.version != NEW_VERSION:
                assert time.monotonic() < deadline + 20, "the new version was not loaded within 20 s"
                time.sleep(0.01)
            after = httpx.post(url, json=body)
            bad = httpx.post(url, content=b"{")
    finally:
        watcher.stop()

    assert (before.status_code, before.headers["x-model-version"]) == (200, OLD_VERSION)
    # old: sigmoid(0.1 * 5.5 + 0.5); new: sigmoid(-0.3 * 5.5 + 2.0)
    assert before.json()["predictions"] == pytest.approx([0.7407749], rel=1e-6)
    assert (after.status_code, after.headers["x-model-version"]) == (200, NEW_VERSION)
    assert after.json()["predictions"] == pytest.approx([0.5866176], rel=1e-6)
    assert bad.status_code == 400
    assert bad.json()["error"].startswith("request body is not valid JSON")


def test_rest_and_grpc_share_one_watcher_and_one_set_of_metrics(store: LocalModelStore, tmp_path: Path) -> None:
    import grpc
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    config = PipelineConfig().with_overrides(
        {"paths.data_root": str(tmp_path), "paths.model_store": str(store.root), "serving.port": 0,
         "serving.grpc_port": 0}
    )
    servers = build_server(config)
    assert servers.grpc is not None and servers.grpc_port
    servers.watcher.start()
    servers.grpc.start()
    try:
        with http_running(servers) as port:
            rest = httpx.post(f"http://127.0.0.1:{port}/v1/models/{MODEL_NAME}:predict",
                              json={"instances": [{"I1": 2, "I2": 3.5, "C1": "abc"}]})
            request = predict_pb2.PredictRequest()
            request.model_spec.name = MODEL_NAME
            request.inputs["I1"].CopyFrom(tf.make_tensor_proto([2.0]))
            request.inputs["I2"].CopyFrom(tf.make_tensor_proto([3.5]))
            request.inputs["C1"].CopyFrom(tf.make_tensor_proto(["abc"]))
            with grpc.insecure_channel(f"127.0.0.1:{servers.grpc_port}") as channel:
                answer = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=20)
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        servers.grpc.stop(None)
        servers.watcher.stop()

    assert rest.json()["predictions"] == pytest.approx([0.7407749], rel=1e-6)
    assert tf.make_ndarray(answer.outputs["probability"]).tolist() == pytest.approx([0.7407749], rel=1e-6)
    assert answer.model_spec.version.value == int(OLD_VERSION)
    assert 'ctr_requests_total{code="200",endpoint="predict"} 1.0' in metrics
    assert 'ctr_requests_total{code="200",endpoint="grpc_predict"} 1.0' in metrics
    assert "ctr_predictions_total 2" in metrics


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_freezing_the_imports_takes_them_out_of_collections_and_later_cycles_are_still_freed() -> None:
    try:
        frozen = freeze_imports()
        assert frozen > 100_000  # TensorFlow's modules alone hold more
        # Frozen objects are still freed when their last reference goes, so the count may have moved since.
        assert gc.get_freeze_count() > frozen - 1000
        assert len(gc.get_objects()) < frozen // 10  # what a collection walks now
        cycles = [_Cycle() for _ in range(1000)]  # made after the freeze, as a loaded model is
        del cycles
        assert gc.collect() >= 1000
    finally:
        gc.unfreeze()


def test_the_row_cache_policy_comes_from_the_config_and_a_share_without_room_is_refused(
        store: LocalModelStore, tmp_path: Path) -> None:
    settings = {"paths.data_root": str(tmp_path), "paths.model_store": str(store.root), "serving.port": 0,
                "serving.grpc_port": -1}
    assert build_server(PipelineConfig().with_overrides(settings)).watcher.row_cache_protected_share == 0.8
    plain = PipelineConfig().with_overrides({**settings, "serving.row_cache_protected_share": "0"})
    assert build_server(plain).watcher.row_cache_protected_share == 0.0  # a plain LRU cache
    for share in ("1", "-0.1"):
        with pytest.raises(ValueError, match=r"serving.row_cache_protected_share must be at least 0 .* got "):
            build_server(PipelineConfig().with_overrides({**settings, "serving.row_cache_protected_share": share}))
