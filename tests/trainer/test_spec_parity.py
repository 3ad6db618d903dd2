"""Parity for every kind a feature spec declares: the sample writer's transforms (components.feature_state, what
the Spark tasks run) and the exported model's serving signature, fed the same raw values through serving's
JSON conversion, give the same model inputs and so the same predictions. Also serving's per-instance checks
(400s naming the feature) and the metadata it reports."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from components.config import TrainConfig
from components.feature_spec import derive_time, spec_from_dict
from components.feature_state import (
    DenseTransform,
    FeatureState,
    Vocabulary,
    bucket_values,
    categorical_rows,
    list_rows,
    transform_dense,
)
from components.manifest import write_manifest
from serving.model import InvalidInput, LoadedModel
from trainer.export import export_serving_model
from trainer.model_inputs import CATEGORICAL_INPUT, DENSE_INPUT, model_inputs
from trainer.models import build_model

pytestmark = pytest.mark.integration

SPEC = spec_from_dict({
    "name": "kinds",
    "source": {"format": "csv", "header": True},
    "label": "click",
    "features": [
        {"name": "ts", "kind": "timestamp", "format": "%Y-%m-%d %H:%M:%S", "derive": ["hour_of_day", "day_of_week"]},
        {"name": "price", "kind": "dense", "transform": "standardize", "missing_indicator": False},
        {"name": "clicks", "kind": "dense"},
        {"name": "bid", "kind": "dense", "transform": "buckets", "num_buckets": 4},
        {"name": "user", "kind": "categorical"},
        {"name": "item", "kind": "categorical", "dtype": "int"},
        {"name": "last_item", "kind": "categorical", "dtype": "int", "table": "item"},
        {"name": "tags", "kind": "multi_categorical", "separator": "|", "max_length": 3, "pooling": "sum"},
        {"name": "history", "kind": "sequence", "separator": "^", "max_length": 4, "shares": "item"},
    ],
})

# Raw rows as a client sends them (JSON): missing values left out or null.
INSTANCES = [
    {"ts": "2026-01-05 13:20:00", "price": 12.5, "clicks": 3, "bid": 0.5, "user": "u1", "item": 7, "last_item": "9",
     "tags": ["a", "b"], "history": [9, 7, 8, 7]},
    {"ts": "2026-01-10 02:00:59", "price": None, "bid": 5.0, "user": "never-seen", "item": "8",
     "tags": ["c", "zz", "a"], "history": ["7"]},
    {"ts": "2026-01-06 23:59:59", "clicks": -40, "bid": None, "user": "", "item": 123456, "tags": [], "history": []},
    {"ts": "2026-01-07 00:00:00", "price": 0.0, "clicks": 0, "bid": 1e9, "user": "u2", "item": 9, "last_item": 7,
     "tags": ["b"], "history": [8, 123, 9]},
]


def _state() -> FeatureState:
    vocabularies = {
        "user": Vocabulary.of(("u1", "u2")),
        # Rows out of value order, as after an eviction.
        "item": Vocabulary(("7", "8", "9"), (4, 2, 3), (5, 5, 5), (0, 0, 0), 6, (5,)),
        "tags": Vocabulary.of(("a", "b", "c")),
        "ts_hour_of_day": Vocabulary.of(tuple(str(h) for h in range(24))),
        "ts_day_of_week": Vocabulary.of(tuple(str(d) for d in range(7))),
        "bid_bucket": Vocabulary.of(("0", "1", "2", "3")),
    }
    dense = (DenseTransform("price", 0.0, 20.0, 10.0, 4.0, log=False, indicator=False),
             DenseTransform("clicks", -2.0, 3.0, 0.5, 1.5),
             DenseTransform("bid", 0.0, 0.0, 0.0, 1.0, log=False, indicator=False, boundaries=(1.0, 5.0, 10.0)))
    return FeatureState(version="kinds", min_count=1, vocabularies=vocabularies, dense=dense)


def _reference_inputs(state: FeatureState) -> dict[str, np.ndarray]:
    """What the sample writer writes for INSTANCES (its functions, on the values Spark's parse gives)."""
    def column(name: str) -> list:
        return [None if row.get(name) is None else str(row[name]) for row in INSTANCES]

    seconds = np.array([SPEC.timestamp.epoch_seconds(row["ts"]) for row in INSTANCES])
    dense_raw = np.array([[np.nan if row.get(n) is None else row[n] for n in ("price", "clicks", "bid")]
                          for row in INSTANCES], dtype=np.float64)
    categorical = []
    for feature in SPEC.categorical:
        if feature.derivation == "buckets":
            values = bucket_values(dense_raw[:, SPEC.dense_names.index(feature.derived_from)],
                                   state.boundaries(feature.derived_from))
        else:
            values = pa.array([str(v) for v in derive_time(seconds, feature.derivation)] if feature.derived_from
                              else column(feature.name), pa.string())
        categorical.append(categorical_rows(values, *state.lookup(SPEC.table_of(feature.name))))
    out = {DENSE_INPUT: transform_dense(dense_raw, state), CATEGORICAL_INPUT: np.stack(categorical, axis=1)}
    for feature in SPEC.lists:
        lists = pa.array([[str(v) for v in row.get(feature.name, [])] for row in INSTANCES], pa.list_(pa.string()))
        out[feature.name] = list_rows(lists, *state.lookup(SPEC.table_of(feature.name)), feature.max_length)
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    state = _state()
    config = TrainConfig(model="din", embedding_dim=4, mlp_units=(8,), attention_units=(4,))
    model = build_model(config, state.table_sizes(), SPEC)
    directory = tmp_path_factory.mktemp("kinds")
    files = export_serving_model(model, state, directory, SPEC)
    write_manifest(directory, kind="full_model", version="1", files=files,
                   extra={"feature_spec": {**SPEC.as_dict(), "hash": SPEC.hash()}})
    return model, state, LoadedModel.load(directory)


def test_the_reference_rows_are_what_the_spec_says():
    state = _state()
    inputs = _reference_inputs(state)
    # Columns: user, item, last_item (the item table), ts_hour_of_day, ts_day_of_week, bid_bucket (boundaries
    # 1, 5, 10: 0.5 -> bucket 0, 5.0 -> bucket 2 (a boundary opens its bucket), missing -> 1, 1e9 -> bucket 3).
    assert inputs[CATEGORICAL_INPUT].tolist() == [
        [2, 4, 3, 2 + 13, 2 + 0, 2 + 0],   # 2026-01-05 is a Monday
        [0, 2, 1, 2 + 2, 2 + 5, 2 + 2],    # unseen user -> rare; no last_item -> missing
        [1, 0, 1, 2 + 23, 2 + 1, 1],       # "" user -> missing; unseen item id -> rare
        [3, 3, 4, 2 + 0, 2 + 2, 2 + 3],
    ]
    assert inputs["tags"].tolist() == [[1, 2, 3], [4, 0, 2], [1, 1, 1], [1, 1, 3]]  # front-padded with 1
    assert inputs["history"].tolist() == [[3, 4, 2, 4], [1, 1, 1, 4], [1, 1, 1, 1], [1, 2, 0, 3]]
    # price (standardized, no flag), clicks (signed log1p, clipped to [-2, 3], standardized), clicks' flag.
    np.testing.assert_allclose(inputs[DENSE_INPUT], [[0.625, (np.log1p(3) - 0.5) / 1.5, 0.0],
                                                     [0.0, 0.0, 1.0],
                                                     [0.0, (-2.0 - 0.5) / 1.5, 0.0],
                                                     [-2.5, (0.0 - 0.5) / 1.5, 0.0]], rtol=1e-6)


def test_serving_raw_values_gives_the_models_predictions_on_the_written_rows(exported):
    model, state, served = exported
    expected = np.asarray(model(_reference_inputs(state), training=False)).reshape(-1)
    np.testing.assert_allclose(served.predict(INSTANCES), expected, rtol=1e-6, atol=1e-7)
    columns = {name: [row.get(name) for row in INSTANCES] for name in {k for row in INSTANCES for k in row}}
    np.testing.assert_allclose(served.predict_columns(columns), expected, rtol=1e-6, atol=1e-7)


def test_every_serving_path_gives_the_same_predictions(exported):
    """The packed float32 endpoint (what the server calls), the TF-Serving signature, and the packed bfloat16
    endpoint (serving.precision=bfloat16: within about 1e-3, and not the float32 graph again)."""
    model, state, served = exported
    expected = np.asarray(model(_reference_inputs(state), training=False)).reshape(-1)
    assert served.packed is not None and served.precision == "float32"
    assert served.packed.layout == ((True, ("price", "clicks", "bid")), (True, ("user", "item", "last_item")),
                                    (False, ("ts",)), (False, ("tags",)), (False, ("history",)))
    # Floats are read a row at a time; the categorical argument holds integer ids, which the converters read.
    assert served.packed.row_readers == ("floats", "", "", "", "")
    # A request body decoded into typed records (the server's first try): ids, timestamps and lists through
    # the same converters.
    records = served.decode_rows(json.dumps({"instances": INSTANCES}).encode())
    assert records is not None
    np.testing.assert_array_equal(served.predict_records(records), served.predict(INSTANCES))
    np.testing.assert_allclose(served.predict_records(records), expected, rtol=1e-6, atol=1e-7)
    signature_only = dataclasses.replace(served, packed=None)
    assert signature_only.precision == "float32"
    assert signature_only.decode_rows(json.dumps({"instances": INSTANCES}).encode()) is None
    np.testing.assert_allclose(signature_only.predict(INSTANCES), expected, rtol=1e-6, atol=1e-7)
    bfloat16 = LoadedModel.load(served.directory, precision="bfloat16")
    assert bfloat16.precision == "bfloat16"
    got = bfloat16.predict(INSTANCES)
    np.testing.assert_allclose(got, expected, atol=5e-3)
    assert not np.array_equal(got, served.predict(INSTANCES))


def test_the_model_reads_the_spec_inputs():
    inputs = model_inputs(SPEC)
    assert inputs.tables == ("user", "item", "tags", "ts_hour_of_day", "ts_day_of_week", "bid_bucket")
    assert inputs.feature_tables == (0, 1, 1, 3, 4, 5)
    assert inputs.dense_dim == 3  # price, clicks, clicks' flag: bid enters through its bucket's embedding
    assert (inputs.sequence, inputs.target_column) == ("history", 1)
    assert [bag["key"] for bag in inputs.bags(attended=True)] == ["tags"]
    assert [bag["key"] for bag in inputs.bags(attended=False)] == ["tags", "history"]


@pytest.mark.parametrize("instance, message", [
    ({"tags": ["a", "b", "c", "d"]}, r"instance 0: feature 'tags' has 4 values, over its max_length of 3"),
    ({"history": 7}, r"feature 'history' must be a list of at most 4 values, newest last or one string of values "
                     r"joined by '\^'"),
    ({"item": {"id": 7}}, r"feature 'item' must be an integer id"),
    ({"user": 5}, r"feature 'user' must be a string or null"),
    ({"price": "12"}, r"feature 'price' must be a number or null"),
    ({"ts": "yesterday"}, r"feature 'ts' is 'yesterday', not a timestamp in format '%Y-%m-%d %H:%M:%S'"),
    ({"ts_hour_of_day": "3"}, r"unknown features \['ts_hour_of_day'\]"),
])
def test_an_instance_that_does_not_fit_the_spec_is_refused_naming_the_feature(exported, instance, message):
    _, _, served = exported
    with pytest.raises(InvalidInput, match=message):
        served.predict([instance])
    # The typed records decline it, and the server goes the way that names it.
    records = served.decode_rows(json.dumps({"instances": [instance]}).encode())
    assert records is None or served.predict_records(records) is None


def test_metadata_lists_the_signature_in_tf_serving_form(exported):
    _, _, served = exported
    metadata = served.signature_metadata()
    inputs = metadata["signature_def"]["signature_def"]["serving_default"]["inputs"]
    assert {name: (info["dtype"], [d["size"] for d in info["tensor_shape"]["dim"]]) for name, info in
            inputs.items()} == {
        "price": ("DT_FLOAT", ["-1"]), "clicks": ("DT_FLOAT", ["-1"]), "bid": ("DT_FLOAT", ["-1"]),
        "user": ("DT_STRING", ["-1"]),
        "item": ("DT_STRING", ["-1"]), "last_item": ("DT_STRING", ["-1"]), "ts": ("DT_INT64", ["-1"]),
        "tags": ("DT_STRING", ["-1", "3"]), "history": ("DT_STRING", ["-1", "4"]),
    }
    assert metadata["feature_spec"]["hash"] == SPEC.hash()
    assert Path(served.directory).is_dir()


def test_the_http_api_answers_metadata_and_a_400_naming_the_feature(exported):
    from starlette.testclient import TestClient

    from components.config import ServingConfig
    from serving.app import create_app
    from tests.serving.fixture_model import FixedSource

    _, _, served = exported
    client = TestClient(create_app(FixedSource(served), ServingConfig()))
    metadata = client.get("/v1/models/ctr/metadata")
    assert metadata.status_code == 200
    body = metadata.json()
    assert body["model_spec"] == {"name": "ctr", "signature_name": "", "version": "1"}
    assert body["metadata"]["signature_def"]["signature_def"]["serving_default"]["inputs"]["tags"]["dtype"] == \
        "DT_STRING"
    assert client.get("/v1/models/ctr/versions/1/metadata").status_code == 200
    bad = client.post("/v1/models/ctr:predict", json={"instances": [{"tags": ["a", "b", "c", "d"]}]})
    assert bad.status_code == 400
    assert "feature 'tags' has 4 values, over its max_length of 3" in bad.json()["error"]
    good = client.post("/v1/models/ctr:predict", json={"instances": INSTANCES[:2]})
    assert good.status_code == 200 and len(good.json()["predictions"]) == 2
