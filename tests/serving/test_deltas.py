"""Serving follows a chain of deltas: exactness, corrupt and missing deltas, branches, rollback, hot swaps."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
from starlette.testclient import TestClient

from components.config import PipelineConfig, ServingConfig
from components.delta import DELTA_FILE
from components.model_store import LocalModelStore, rollback
from serving.app import create_app, predict_body
from serving.model import WARM_UP_SIZES, InvalidInput, LoadedModel, StaleModel
from serving.server import build_server, warm_up_http
from serving.watcher import ModelWatcher
from tests.serving.delta_chain import MODEL_NAME, build_chain, load_weights, predictions, raw_rows
from tests.serving.fixture_model import FixedSource
from tests.serving.running import http_running
from trainer.export import APPLY_DELTA_ENDPOINT

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory):
    model, steps = build_chain(tmp_path_factory.mktemp("chain"), num_deltas=3)
    columns = raw_rows(steps[-1].state, 200, seed=99)
    expected = {}
    for step in steps:  # the trainer's own predictions at each step, from the Keras model
        load_weights(model, step)
        expected[step.version] = predictions(model, step.state, columns)
    return steps, columns, expected


def store_with(tmp_path: Path, steps, versions=None) -> LocalModelStore:
    store = LocalModelStore(tmp_path / "store")
    for step in steps:
        if versions is None or step.version in versions:
            store.publish(MODEL_NAME, step.version, step.directory)
    return store


def watcher_for(store: LocalModelStore, tmp_path: Path) -> ModelWatcher:
    return ModelWatcher(store, MODEL_NAME, tmp_path / "cache", poll_seconds=60)


def served(watcher: ModelWatcher, columns) -> np.ndarray:
    return watcher.current().predict_columns(columns)


def test_full_model_plus_deltas_serves_the_trainers_predictions(chain, tmp_path):
    steps, columns, expected = chain
    store = store_with(tmp_path, steps[:1])
    watcher = watcher_for(store, tmp_path)
    assert watcher.poll_once()
    np.testing.assert_allclose(served(watcher, columns), expected[steps[0].version], rtol=0, atol=1e-6)
    for step in steps[1:]:  # one delta at a time, as the minutes come
        store.publish(MODEL_NAME, step.version, step.directory)
        assert watcher.poll_once()
        assert watcher.version == step.version
        assert watcher.current().parent == str(int(step.version) - 1)
        np.testing.assert_allclose(served(watcher, columns), expected[step.version], rtol=0, atol=1e-6)
    # The steps really differ, so the equality above says something.
    assert np.abs(expected[steps[-1].version] - expected[steps[0].version]).max() > 1e-3


def test_a_delta_writes_the_weights_with_dense_assigns_and_no_sparse_op(chain):
    """A sparse write (ResourceScatterUpdate) switches the variable it writes into TensorFlow's copy-on-read mode
    for good: every serving call after a model's first delta then copied its embedding tables (0.4 ms a
    100-candidate call in bench-serving's model). apply_delta writes each weight with AssignVariableOp of a
    scattered copy (trainer.export.dense_rows_update); the test above checks the values it writes."""
    steps, _, _ = chain
    model = LoadedModel.load(steps[0].directory)
    graph = getattr(model.root, APPLY_DELTA_ENDPOINT).concrete_functions[0].graph.as_graph_def()
    ops = {node.op for node in graph.node} | {node.op for f in graph.library.function for node in f.node_def}
    assert "AssignVariableOp" in ops and "TensorScatterUpdate" in ops, sorted(ops)
    assert not {op for op in ops if op.startswith("ResourceScatter") or op.startswith("ResourceSparse")}, sorted(ops)


def row_form(columns) -> list[dict]:
    """The columns as TF-Serving instances: a missing number left out, or (every third instance) null; a
    missing id "" (every third instance: null)."""
    instances = []
    for index in range(len(next(iter(columns.values())))):
        instance = {}
        for name, values in columns.items():
            value = values[index]
            if isinstance(value, float) and np.isnan(value):
                if index % 3 == 0:
                    instance[name] = None
            elif value == "" and index % 3 == 0:
                instance[name] = None
            else:
                instance[name] = value
        instances.append(instance)
    return instances


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_row_form_requests_follow_the_chain_in_either_precision(chain, tmp_path, precision):
    """The packed endpoint answers row-form requests (read a row at a time) with the trainer's predictions
    through the deltas; bfloat16 within 5e-3 of them, far closer than the steps are to each other."""
    steps, columns, expected = chain
    watcher = ModelWatcher(store_with(tmp_path, steps), MODEL_NAME, tmp_path / "cache", poll_seconds=60,
                           precision=precision)
    assert watcher.poll_once() and watcher.version == steps[-1].version
    model = watcher.current()
    assert model.precision == precision
    assert model.packed is not None and model.packed.row_readers == ("floats", "strings")
    got = model.predict(row_form(columns))
    last, first = expected[steps[-1].version], expected[steps[0].version]
    if precision == "float32":
        np.testing.assert_allclose(got, last, rtol=0, atol=1e-6)
    else:
        error = np.abs(got - last)
        assert error.max() < 5e-3 and 0 < error.mean() < np.abs(last - first).mean() / 50, (
            error.max(), error.mean(), np.abs(last - first).mean())


def test_the_packed_endpoint_runs_its_graph_function_directly_and_answers_as_the_endpoint(chain, tmp_path):
    """PackedCall.call runs the endpoint's graph function on the arguments and the captured variables, past the
    ConcreteFunction's binding of arguments to its signature; its answer is the endpoint's own, to the bit, on
    the full model and after a delta has rewritten the variables."""
    steps, columns, expected = chain
    store = store_with(tmp_path, steps[:1])
    watcher = watcher_for(store, tmp_path)
    assert watcher.poll_once()
    for step, following in ((steps[0], steps[1]), (steps[1], None)):
        model = watcher.current()
        assert model.version == step.version and model.packed is not None
        assert model.packed.call is not model.packed.function  # the direct call, not the fallback
        arguments = model.packed.arguments({name: convert(list(columns[name])) for name, convert in
                                            model.column_converters.items()}, len(columns["I1"]),
                                            model.input_specs)
        direct = model.packed.call(*arguments).numpy()
        np.testing.assert_array_equal(direct, model.packed.function(*arguments).numpy())
        np.testing.assert_allclose(direct, expected[step.version], rtol=0, atol=1e-6)
        if following is not None:
            store.publish(MODEL_NAME, following.version, following.directory)
            assert watcher.poll_once()


def test_typed_row_decoding_answers_as_the_general_path_does(chain, tmp_path):
    """decode_rows + predict_records (msgspec's typed records) give the very predictions of `predict` on the
    same instances: numbers left out, null or sent as integers; ids left out, null or ""."""
    steps, columns, _ = chain
    model = LoadedModel.load(steps[0].directory)
    instances = row_form(columns)
    dense = next(name for name in instances[0] if name.startswith("I"))
    for index in range(0, len(instances), 4):  # JSON integers in float inputs
        if isinstance(instances[index].get(dense), float):
            instances[index][dense] = round(instances[index][dense])
    records = model.decode_rows(orjson.dumps({"instances": instances}))
    assert records is not None and len(records) == len(instances)
    typed = model.predict_records(records)
    np.testing.assert_array_equal(typed, model.predict(instances))
    assert len(set(typed.round(6).tolist())) > len(instances) // 2  # the rows really differ


@pytest.mark.parametrize("body", [
    b'{"instances": [{"I1": true}]}',  # a bool is not a number
    b'{"instances": [{"I1": "1.5"}]}',
    b'{"instances": [{"C1": 7}]}',  # a number is not a string id
    b'{"instances": [{"I1": NaN}]}',  # not strict JSON: the general path reads it
    b'{"instances": [{"I1": 1e999}]}',
    b'{"instances": [{"not_a_feature": 1}]}',
    b'{"instances": [[1, 2]]}',
    b'{"instances": {"I1": 1}}',
    b'{"inputs": {"I1": [1]}}',
    b'{"instances": [{"I1": 1}], "signature_name": "other"}',
    b'{"instances": [{"I1": 1}], "extra": 1}',
    b'{"instances": [{"C1": "\\ud800"}]}',  # a lone surrogate
    b'[]',
    b'\xff{"instances": [{"I1": 1}]}',  # not UTF-8
    b'{"instances": [{"I1": ' + b'[' * 100_000 + b']' * 100_000 + b'}]}',  # nested too deeply
])
def test_typed_row_decoding_leaves_every_other_body_to_the_general_path(chain, body):
    steps, _, _ = chain
    model = LoadedModel.load(steps[0].directory)
    assert model.decode_rows(body) is None


def test_typed_records_with_a_number_outside_float32_are_left_to_the_general_path(chain):
    steps, _, _ = chain
    model = LoadedModel.load(steps[0].directory)
    records = model.decode_rows(b'{"instances": [{"I1": 1.0}, {"I1": 1e39}]}')
    assert records is not None and len(records) == 2
    assert model.predict_records(records) is None
    with pytest.raises(InvalidInput, match=r"instance 1: feature 'I1' is 1e\+39, outside the range of float32"):
        model.predict([{"I1": 1.0}, {"I1": 1e39}])


def test_the_rest_api_answers_row_form_requests_through_typed_records(chain):
    """Over HTTP, a packed model answers well-formed requests from typed records, with `predict`'s values, and
    a bad value with the general path's message."""
    steps, columns, _ = chain
    model = LoadedModel.load(steps[0].directory)
    client = TestClient(create_app(FixedSource(model), ServingConfig(model_name=MODEL_NAME)))
    instances = row_form(columns)[:50]
    answered = client.post(f"/v1/models/{MODEL_NAME}:predict", json={"instances": instances})
    assert answered.status_code == 200
    np.testing.assert_allclose(answered.json()["predictions"], model.predict(instances), rtol=0, atol=0)
    bad = client.post(f"/v1/models/{MODEL_NAME}:predict", json={"instances": [{"I1": True}]})
    assert bad.status_code == 400
    assert bad.json()["error"] == "instance 0: feature 'I1' must be a number or null (missing), got True"


def test_the_native_row_reader_answers_as_the_general_path_through_the_chain(chain, tmp_path):
    """predict_native (serving/native/rows.c) gives the very predictions of `predict` on the same instances, on
    the full model and after each delta, strings with escapes included (Python's json writes non-ASCII text as
    \\uXXXX); a body it does not read (an escape in a key) goes the typed records' way in predict_body, with the
    same answer."""
    steps, columns, expected = chain
    watcher = watcher_for(store_with(tmp_path, steps[:1]), tmp_path)
    assert watcher.poll_once()
    instances = row_form(columns)
    body = orjson.dumps({"instances": instances})
    for step in steps:
        if step is not steps[0]:
            watcher.store.publish(MODEL_NAME, step.version, step.directory)
            assert watcher.poll_once() and watcher.version == step.version
        model = watcher.current()
        assert model.native_rows is not None
        native = model.predict_native(body, 1000)
        np.testing.assert_array_equal(native, model.predict(instances))
        np.testing.assert_allclose(native, expected[step.version], rtol=0, atol=1e-6)
    model = watcher.current()
    escaped = [{**instance, "C1": "café 🙂"} for instance in instances[:20]]
    escaped_body = json.dumps({"instances": escaped}).encode()
    assert b"caf\\u00e9 \\ud83d\\ude42" in escaped_body
    np.testing.assert_array_equal(model.predict_native(escaped_body, 1000), model.predict(escaped))
    key_escaped = escaped_body.replace(b'"C1"', b'"C\\u0031"')
    assert model.predict_native(key_escaped, 1000) is None
    key, answered = predict_body(model, key_escaped, 1000)
    assert key == "predictions"
    np.testing.assert_array_equal(answered, model.predict(escaped))
    assert model.predict_native(body, len(instances) - 1) is None  # over the limit: the general path refuses it
    off = LoadedModel.load(steps[0].directory, native_rows=False)  # serving.native_rows=false
    assert off.native_rows is None and off.predict_native(body, 1000) is None


def test_several_new_deltas_are_applied_in_one_poll_and_the_standby_catches_up(chain, tmp_path):
    steps, columns, expected = chain
    store = store_with(tmp_path, steps[:2])
    watcher = watcher_for(store, tmp_path)
    watcher.poll_once()
    assert watcher.version == steps[1].version
    for step in steps[2:]:
        store.publish(MODEL_NAME, step.version, step.directory)
    assert watcher.poll_once()
    np.testing.assert_allclose(served(watcher, columns), expected[steps[3].version], rtol=0, atol=1e-6)


def test_a_corrupt_delta_is_rejected_and_serving_stays_on_the_last_good_version(chain, tmp_path):
    steps, columns, expected = chain
    store = store_with(tmp_path, steps[:2])
    watcher = watcher_for(store, tmp_path)
    watcher.poll_once()
    store.publish(MODEL_NAME, steps[2].version, steps[2].directory)
    published = store.root / MODEL_NAME / steps[2].version / DELTA_FILE
    data = bytearray(published.read_bytes())
    data[len(data) // 2] ^= 0xFF
    published.write_bytes(bytes(data))
    assert not watcher.poll_once()
    assert watcher.version == steps[1].version
    assert "does not match its manifest checksum" in watcher.last_error
    np.testing.assert_allclose(served(watcher, columns), expected[steps[1].version], rtol=0, atol=1e-6)


def test_a_missing_delta_leaves_serving_on_the_last_good_version(chain, tmp_path):
    steps, columns, expected = chain
    store = store_with(tmp_path, steps, versions={steps[0].version, steps[2].version})  # steps[1] never arrived
    watcher = watcher_for(store, tmp_path)
    assert not watcher.poll_once()
    assert watcher.current() is None
    assert f"has a gap: version {steps[1].version}" in watcher.last_error
    shutil.rmtree(store.root / MODEL_NAME / steps[2].version)
    assert watcher.poll_once()  # once the broken chain is gone, the full model serves
    np.testing.assert_allclose(served(watcher, columns), expected[steps[0].version], rtol=0, atol=1e-6)


def test_a_delta_whose_parent_is_not_the_served_version_reloads_its_chain(chain, tmp_path):
    steps, columns, expected = chain
    store = store_with(tmp_path, steps[:3])
    watcher = watcher_for(store, tmp_path)
    watcher.poll_once()
    assert watcher.version == steps[2].version
    rollback(store, MODEL_NAME, steps[1].version, "test")  # serving at steps[2]; the store now ends at steps[1]
    assert watcher.poll_once()
    assert watcher.version == steps[1].version
    np.testing.assert_allclose(served(watcher, columns), expected[steps[1].version], rtol=0, atol=1e-6)
    # A delta on steps[2] (not the served steps[1]): its chain is reloaded from the full model.
    shutil.rmtree(store.root / MODEL_NAME / "_retracted")
    store.publish(MODEL_NAME, steps[3].version, steps[3].directory)
    assert watcher.poll_once()
    np.testing.assert_allclose(served(watcher, columns), expected[steps[3].version], rtol=0, atol=1e-6)


def test_rollback_retracts_newer_versions_and_refuses_unknown_ones(chain, tmp_path):
    steps, _, _ = chain
    store = store_with(tmp_path, steps)
    assert rollback(store, MODEL_NAME, steps[1].version, "bad minute") == [steps[2].version, steps[3].version]
    assert store.latest(MODEL_NAME) == steps[1].version
    assert store.retracted(MODEL_NAME) == {steps[2].version, steps[3].version}
    with pytest.raises(Exception, match="it was retracted itself"):
        rollback(store, MODEL_NAME, steps[2].version, "again")
    with pytest.raises(Exception, match="is not in"):
        rollback(store, MODEL_NAME, "209901010000", "typo")


def test_a_stale_snapshot_refuses_to_predict(chain, tmp_path):
    steps, columns, _ = chain
    model = LoadedModel.load(steps[0].directory)
    from components.delta import read_delta

    newer = model.apply_delta(*read_delta(steps[1].directory))
    with pytest.raises(StaleModel, match=f"moved from version {steps[0].version} to {steps[1].version}"):
        model.predict_columns(columns)
    assert newer.predict_columns(columns).shape == (200,)


def test_hot_swaps_under_concurrent_requests_never_fail_or_mix_versions(chain, tmp_path):
    steps, columns, expected = chain
    store = store_with(tmp_path, steps[:1])
    watcher = watcher_for(store, tmp_path)
    watcher.poll_once()
    stop = threading.Event()
    answers: list[tuple[str, np.ndarray]] = []
    errors: list[BaseException] = []

    def client() -> None:
        while not stop.is_set():
            for _ in range(3):  # what the HTTP layer does: a stale snapshot is retried on the current one
                model = watcher.current()
                try:
                    answers.append((model.version, model.predict_columns(columns)))
                    break
                except StaleModel:
                    continue
                except BaseException as err:  # noqa: BLE001 - the test counts every failure
                    errors.append(err)
                    break

    threads = [threading.Thread(target=client) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        for step in steps[1:]:
            store.publish(MODEL_NAME, step.version, step.directory)
            assert watcher.poll_once()
        rollback(store, MODEL_NAME, steps[0].version, "swap back under load")
        assert watcher.poll_once()
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert errors == []
    seen = {version for version, _ in answers}
    assert len(answers) > 20 and len(seen) >= 2
    for version, values in answers:  # every answer is exactly one version's predictions
        np.testing.assert_allclose(values, expected[version], rtol=0, atol=1e-6)


def test_a_new_replica_is_warmed_up_at_each_size_by_the_requests_path(chain, tmp_path, monkeypatch):
    """The watcher's warm-up runs the typed-record path (as a row-form request does) at every WARM_UP_SIZES,
    so that the first requests of those sizes find their kernels built."""
    steps, _, _ = chain
    calls: list[int] = []
    run_packed = LoadedModel.run_packed

    def counting(self, arguments, num_instances):
        calls.append(num_instances)
        return run_packed(self, arguments, num_instances)

    monkeypatch.setattr(LoadedModel, "run_packed", counting)
    watcher = watcher_for(store_with(tmp_path, steps[:1]), tmp_path)
    assert watcher.poll_once()
    # two replicas (active and standby), each: one empty instance by `predict`, then each size by records
    assert calls == [1, *WARM_UP_SIZES] * 2


def test_the_rest_path_is_warmed_up_by_one_request_on_uvicorns_loop(chain, tmp_path):
    steps, _, _ = chain
    store = store_with(tmp_path, steps[:1])
    config = PipelineConfig().with_overrides({"paths.data_root": str(tmp_path), "paths.model_store": str(store.root),
                                              "serving.port": 0, "serving.grpc_port": -1})
    servers = build_server(config)
    servers.watcher.start()
    try:
        with http_running(servers) as port:
            status = warm_up_http(servers)
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        servers.watcher.stop()
    assert status == 200
    assert 'ctr_requests_total{code="200",endpoint="predict"} 1.0' in metrics
