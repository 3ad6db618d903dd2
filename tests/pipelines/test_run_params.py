"""The trigger form's typed fields: their schemas follow the config's types, and a run's params become the
config overrides its steps run with."""

from __future__ import annotations

import pytest

from components.config import ConfigError, PipelineConfig, load_config
from pipelines.run_params import DAILY, INCREMENTAL, RunParam, overrides_from_params, schema


def by_name(fields, name):
    return next(p for p in fields if p.name == name)


def test_every_field_names_a_config_key_and_renders():
    config = PipelineConfig()
    for field in (*DAILY, *INCREMENTAL):
        rendered = schema(field, config)
        assert "null" in rendered["type"], field.name  # empty = the configured value
        section, _, key = field.key.partition(".")
        assert hasattr(getattr(config, section), key)


def test_schema_states_the_configured_value_and_limits():
    config = load_config(overrides={"train.epochs": 5, "features.spec": "avazu"}, environ={})
    epochs = schema(by_name(DAILY, "epochs"), config)
    assert epochs["type"] == ["null", "integer"] and epochs["minimum"] == 1
    assert epochs["description"].endswith("Empty: the configured value (5).")
    spec = schema(by_name(DAILY, "spec"), config)
    assert spec["enum"] == [None, "avazu", "criteo", "events", "movielens", "obd", "taobao"]
    assert spec["values_display"][None] == "configured (avazu)"
    rate = schema(by_name(DAILY, "learning_rate"), config)
    assert rate["type"] == ["null", "number"] and rate["exclusiveMinimum"] == 0


def test_a_spec_file_in_the_config_is_one_of_the_choices(tmp_path):
    config = PipelineConfig().with_overrides({"features.spec": str(tmp_path / "mine.yaml")})
    assert schema(by_name(DAILY, "spec"), config)["enum"][-1] == str(tmp_path / "mine.yaml")


def test_params_become_overrides_and_empty_fields_leave_the_config():
    params = {"model": "deepfm", "epochs": 2, "learning_rate": None, "spec": None,
              "config": {"features.num_shards": 8}}
    overrides = overrides_from_params(params, DAILY)
    assert overrides == {"train.model": "deepfm", "train.epochs": 2, "features.num_shards": 8}
    config = load_config(overrides=overrides, environ={})
    assert (config.train.model, config.train.epochs, config.train.learning_rate) == ("deepfm", 2, 0.02)
    assert overrides_from_params({}, DAILY) == {}
    assert overrides_from_params({"catch_up": "latest_only"}, INCREMENTAL) == {"incremental.catch_up": "latest_only"}


def test_a_key_set_twice_with_different_values_is_refused():
    with pytest.raises(ConfigError, match="'epochs' = 2 and config\\['train.epochs'\\] = 4 disagree"):
        overrides_from_params({"epochs": 2, "config": {"train.epochs": 4}}, DAILY)
    assert overrides_from_params({"epochs": 2, "config": {"train.epochs": 2}}, DAILY) == {"train.epochs": 2}


def test_a_field_on_an_unknown_or_unrenderable_key_is_an_error():
    with pytest.raises(ConfigError, match="unknown config key 'train.nope'"):
        schema(RunParam("x", "train.nope", "X", "x", "S"), PipelineConfig())
    with pytest.raises(ConfigError, match="a form field cannot hold"):
        schema(RunParam("units", "train.mlp_units", "Units", "x", "S"), PipelineConfig())


def test_trigger_overrides_go_into_their_typed_fields():
    from pipelines.run_params import params_from_overrides

    params = params_from_overrides({"train.epochs": "2", "train.model": "din", "features.num_shards": "8"}, DAILY)
    assert params == {"epochs": 2, "model": "din", "config": {"features.num_shards": "8"}}
    assert overrides_from_params(params, DAILY) == {"train.epochs": 2, "train.model": "din",
                                                    "features.num_shards": "8"}
    with pytest.raises(ConfigError, match="unknown value 'nope'"):
        params_from_overrides({"train.model": "nope"}, DAILY)
