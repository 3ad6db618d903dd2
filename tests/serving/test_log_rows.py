"""A row as the log holds it is a valid predict request: the spec's timestamp column (which a model whose spec
derives nothing from it does not take) and a multi-valued or sequence feature as one string joined by the spec's
separator. A real model exported from a spec of that shape, served in-process and over HTTP."""

from __future__ import annotations

import json

import numpy as np
import pytest

from components.config import TrainConfig
from components.feature_spec import spec_from_dict
from components.feature_state import DenseTransform, FeatureState, Vocabulary
from components.manifest import write_manifest
from serving.model import InvalidInput, LoadedModel
from trainer.export import export_serving_model
from trainer.models import build_model

pytestmark = pytest.mark.integration

# A team's own log: a timestamp nothing is derived from, tags joined by '|', a history joined by '^'.
SPEC = spec_from_dict({
    "name": "team_log",
    "source": {"format": "csv", "header": True},
    "label": "click",
    "features": [
        {"name": "timestamp", "kind": "timestamp", "format": "unix_seconds"},
        {"name": "price", "kind": "dense"},
        {"name": "item", "kind": "categorical"},
        {"name": "tags", "kind": "multi_categorical", "separator": "|", "max_length": 3},
        {"name": "history", "kind": "sequence", "separator": "^", "max_length": 2, "shares": "item"},
    ],
})

AS_LISTS = [
    {"price": 3.5, "item": "i1", "tags": ["a", "b"], "history": ["i2", "i1"]},
    {"price": None, "item": "i3", "tags": ["c", "a", "b"], "history": ["i1"]},
    {"price": 0.0, "item": "never-seen", "tags": [], "history": []},
]
# The same rows as the log holds them: the timestamp column, lists as joined strings (with an empty value, and
# more values than max_length: the newest kept, as the Spark jobs read them).
AS_LOGGED = [
    {"timestamp": 1767225600, "price": 3.5, "item": "i1", "tags": "a|b", "history": "i2^i1"},
    {"timestamp": "1767225661", "price": None, "item": "i3", "tags": "zz|c||a|b", "history": "i1"},
    {"timestamp": 1767225722, "price": 0.0, "item": "never-seen", "tags": "", "history": ""},
]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> LoadedModel:
    state = FeatureState(version="team", min_count=1, vocabularies={
        "item": Vocabulary.of(("i1", "i2", "i3")), "tags": Vocabulary.of(("a", "b", "c"))},
        dense=(DenseTransform("price", 0.0, 10.0, 1.0, 2.0),))
    model = build_model(TrainConfig(model="din", embedding_dim=4, mlp_units=(8,), attention_units=(4,)),
                        state.table_sizes(), SPEC)
    directory = tmp_path_factory.mktemp("team_log")
    files = export_serving_model(model, state, directory, SPEC)
    write_manifest(directory, kind="full_model", version="1", files=files,
                   extra={"feature_spec": {**SPEC.as_dict(), "hash": SPEC.hash()}})
    return LoadedModel.load(directory)


def test_the_model_does_not_take_the_timestamp_yet_a_request_may_send_it(served):
    assert "timestamp" not in served.input_specs
    assert served.ignored_names == {"timestamp"}
    expected = served.predict(AS_LISTS)
    np.testing.assert_array_equal(served.predict(AS_LOGGED), expected)
    columns = {name: [row[name] for row in AS_LOGGED] for name in AS_LOGGED[0]}
    np.testing.assert_array_equal(served.predict_columns(columns), expected)
    # The server's first try, typed records, reads the same body.
    records = served.decode_rows(json.dumps({"instances": AS_LOGGED}).encode())
    assert records is not None
    np.testing.assert_array_equal(served.predict_records(records), expected)


def test_a_joined_string_is_the_list_of_its_values(served):
    one = served.predict([{"item": "i1", "tags": ["a", "b"]}])
    assert served.predict([{"item": "i1", "tags": "a|b"}]) == pytest.approx(one)
    assert served.predict([{"item": "i1", "tags": " |a||b|"}]) == pytest.approx(one)
    assert served.predict([{"item": "i1", "tags": "a|b"}]) != pytest.approx(served.predict([{"item": "i1",
                                                                                             "tags": "a"}]))


@pytest.mark.parametrize("instance, message", [
    ({"tags": 7}, r"instance 0: feature 'tags' must be a list of at most 3 values, newest last or one string of "
                  r"values joined by '\|', got 7"),
    ({"tags": ["a", "b", "c", "d"]}, r"feature 'tags' has 4 values, over its max_length of 3"),
    ({"timestamp_hour_of_day": "3"}, r"unknown features \['timestamp_hour_of_day'\]"),
    ({"click": 1}, r"unknown features \['click'\]"),
])
def test_what_is_still_refused(served, instance, message):
    with pytest.raises(InvalidInput, match=message):
        served.predict([instance])


def test_the_http_api_answers_a_row_as_the_log_holds_it(served):
    from starlette.testclient import TestClient

    from components.config import ServingConfig
    from serving.app import create_app
    from tests.serving.fixture_model import FixedSource

    client = TestClient(create_app(FixedSource(served), ServingConfig()))
    answer = client.post("/v1/models/ctr:predict", json={"instances": AS_LOGGED})
    assert answer.status_code == 200, answer.text
    np.testing.assert_allclose(answer.json()["predictions"], served.predict(AS_LISTS), rtol=1e-6)
