from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from components.config import (
    ConfigError,
    PipelineConfig,
    load_config,
    parse_override_args,
)

pytestmark = pytest.mark.unit


def test_defaults_are_the_documented_values():
    config = PipelineConfig()
    assert config.paths.data_root == "var"
    assert config.generate.rows_per_minute == 5000
    assert config.generate.new_value_rate == 0.01
    assert config.spark.master == "local[2]"
    assert config.features.min_count == 0  # chosen from the rows at the daily run
    assert (config.train.batch_size, config.train.epochs, config.train.early_stopping_patience) == (0, 20, 2)
    assert config.gate.min_lift_auc == 0.0
    assert config.baseline.enabled is True
    assert config.features.block_rows == 1024
    assert config.train.mlp_units == (512, 256, 128)
    assert config.train.jit_compile is False
    assert config.gate.min_auc == 0.60
    assert config.gate.max_logloss == 0.69
    assert config.tracking.strict is False
    assert config.serving.port == 8501
    assert config.serving.max_body_bytes == 4 * 1024 * 1024


def test_derived_paths_fall_back_under_the_data_root(tmp_path):
    config = PipelineConfig().with_overrides({"paths.data_root": str(tmp_path)})
    assert config.paths.model_store_uri == str(tmp_path / "model_store")
    assert config.tracking_uri == f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}"
    explicit = config.with_overrides(
        {"paths.model_store": "s3://bucket/models", "tracking.tracking_uri": "http://m:5000"}
    )
    assert explicit.paths.model_store_uri == "s3://bucket/models"
    assert explicit.tracking_uri == "http://m:5000"


def test_with_overrides_parses_strings_to_each_field_type():
    config = PipelineConfig().with_overrides(
        {
            "generate.minutes": "15",
            "train.learning_rate": "0.125",
            "train.jit_compile": "on",
            "train.mixed_precision": "YES",
            "train.mlp_units": "64, 32",
            "spark.master": "local[1]",
        }
    )
    assert config.generate.minutes == 15
    assert config.train.learning_rate == 0.125
    assert config.train.jit_compile is True
    assert config.train.mixed_precision is True
    assert config.train.mlp_units == (64, 32)
    assert config.spark.master == "local[1]"
    # A list as YAML writes it, as a config file holds it.
    assert PipelineConfig().with_overrides({"train.mlp_units": "[64, 32]"}).train.mlp_units == (64, 32)
    assert PipelineConfig().with_overrides({"train.attention_units": "[]"}).train.attention_units == ()
    # Untouched sections and keys keep their defaults.
    assert config.train.epochs == 20
    assert config.gate == PipelineConfig().gate


def test_with_overrides_accepts_native_values_from_yaml():
    config = PipelineConfig().with_overrides(
        {"train.mlp_units": [8, 4], "train.jit_compile": True, "gate.min_auc": 1, "train.epochs": 2.0}
    )
    assert config.train.mlp_units == (8, 4)
    assert config.train.jit_compile is True
    assert config.gate.min_auc == 1.0 and isinstance(config.gate.min_auc, float)
    assert config.train.epochs == 2 and isinstance(config.train.epochs, int)


def test_with_overrides_returns_a_copy():
    base = PipelineConfig()
    changed = base.with_overrides({"train.epochs": "9"})
    assert base.train.epochs == 20
    assert changed.train.epochs == 9


def test_unknown_section_names_the_key_and_the_sections():
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer\.epochs'.*'train'"):
        PipelineConfig().with_overrides({"trainer.epochs": "3"})


@pytest.mark.parametrize("key", ["train", "tracking_uri.x", "flat.x", ".epochs"])
def test_keys_that_are_not_section_dot_key_are_rejected(key):
    with pytest.raises(
        ConfigError, match=rf"unknown config key {key!r}: expected 'section.key'".replace(".", r"\.")
    ):
        PipelineConfig().with_overrides({key: "1"})


def test_unknown_key_names_the_key_and_lists_the_section_keys():
    with pytest.raises(
        ConfigError, match=r"unknown config key 'train\.epoch': section 'train' has keys \[.*'epochs'"
    ):
        PipelineConfig().with_overrides({"train.epoch": "3"})


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("train.epochs", "three", r"config key 'train\.epochs': cannot read 'three' as int"),
        ("train.epochs", 2.5, r"config key 'train\.epochs': cannot read 2\.5 as int: expected an integer"),
        ("gate.min_auc", "high", r"config key 'gate\.min_auc': cannot read 'high' as float"),
        (
            "train.jit_compile",
            "maybe",
            r"config key 'train\.jit_compile': cannot read 'maybe' as bool: expected true or false",
        ),
        (
            "paths.model_store",
            None,
            r"config key 'paths\.model_store': cannot read None as str: expected a string",
        ),
        (
            "train.mlp_units",
            "64,x",
            r"config key 'train\.mlp_units': cannot read '64,x' as tuple: invalid literal for int\(\)",
        ),
    ],
)
def test_bad_values_name_the_key_and_the_value(key, value, message):
    with pytest.raises(ConfigError, match=message):
        PipelineConfig().with_overrides({key: value})


def test_load_config_precedence_yaml_then_environment_then_overrides(tmp_path):
    yaml_file = tmp_path / "pipeline.yaml"
    yaml_file.write_text(
        "paths:\n"
        "  data_root: /from/yaml\n"
        "  model_store: /store/from/yaml\n"
        "train:\n"
        "  epochs: 7\n"
        "  mlp_units: [32, 16]\n"
        "tracking:\n"
        "  tracking_uri: http://yaml:5000\n"
    )
    environ = {
        "CTR_HOME": "/from/env",
        "MLFLOW_TRACKING_URI": "http://env:5000",
        "CTR_MODEL_STORE": "",  # empty variables are ignored
        "UNRELATED": "x",
    }
    config = load_config(
        overrides={"paths.data_root": "/from/override"}, yaml_path=yaml_file, environ=environ
    )
    assert config.paths.data_root == "/from/override"  # yaml < env < override
    assert config.tracking.tracking_uri == "http://env:5000"  # yaml < env
    assert config.paths.model_store == "/store/from/yaml"  # yaml, env empty
    assert config.train.epochs == 7
    assert config.train.mlp_units == (32, 16)
    assert config.train.batch_size == 0  # default: chosen from the rows

    only_yaml = load_config(yaml_path=yaml_file, environ={})
    assert only_yaml.paths.data_root == "/from/yaml"
    assert only_yaml.tracking.tracking_uri == "http://yaml:5000"


def test_load_config_reads_every_environment_key():
    environ = {
        "CTR_HOME": "/h",
        "CTR_MODEL_STORE": "s3://b/p",
        "CTR_S3_ENDPOINT_URL": "http://127.0.0.1:9000",
        "MLFLOW_TRACKING_URI": "http://mlflow",
        "SPARK_REMOTE": "sc://spark:15002",
    }
    config = load_config(environ=environ)
    assert (
        config.paths.data_root,
        config.paths.model_store,
        config.paths.s3_endpoint_url,
        config.tracking.tracking_uri,
        config.spark.remote,
    ) == ("/h", "s3://b/p", "http://127.0.0.1:9000", "http://mlflow", "sc://spark:15002")


def test_load_config_with_empty_environment_is_the_defaults():
    assert load_config(environ={}) == PipelineConfig()


def test_load_config_rejects_a_missing_yaml_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=re.escape(f"config file '{missing}' does not exist")):
        load_config(yaml_path=missing, environ={})


def test_load_config_rejects_yaml_that_is_not_sections(tmp_path):
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping of sections, got list"):
        load_config(yaml_path=listing, environ={})
    flat = tmp_path / "flat.yaml"
    flat.write_text("train: 3\n")
    with pytest.raises(ConfigError, match=r"section 'train' must be a mapping, got 3"):
        load_config(yaml_path=flat, environ={})


def test_an_empty_yaml_value_is_an_error_not_the_text_none(tmp_path):
    yaml_file = tmp_path / "empty.yaml"
    yaml_file.write_text("paths:\n  model_store:\n")
    with pytest.raises(
        ConfigError, match=r"'paths\.model_store': cannot read None as str: .*write '' for an empty one"
    ):
        load_config(yaml_path=yaml_file, environ={})
    yaml_file.write_text("paths:\n  model_store: ''\n")
    assert load_config(yaml_path=yaml_file, environ={}).paths.model_store == ""


def test_load_config_reports_unknown_yaml_keys(tmp_path):
    yaml_file = tmp_path / "typo.yaml"
    yaml_file.write_text("train:\n  epohcs: 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.epohcs'"):
        load_config(yaml_path=yaml_file, environ={})


def test_flat_has_every_field_as_a_string():
    config = PipelineConfig()
    flat = config.flat()
    expected_keys = {
        f"{section.name}.{item.name}"
        for section in dataclasses.fields(config)
        for item in dataclasses.fields(getattr(config, section.name))
    }
    assert set(flat) == expected_keys
    # One key of every section, spelled out, so a section dropped from flat() is caught.
    assert {
        k: flat[k]
        for k in (
            "paths.data_root",
            "generate.seed",
            "spark.shuffle_partitions",
            "features.eval_fraction",
            "train.model",
            "gate.max_calibration_error",
            "tracking.experiment",
            "serving.poll_seconds",
        )
    } == {
        "paths.data_root": "var",
        "generate.seed": "7",
        "spark.shuffle_partitions": "4",
        "features.eval_fraction": "0.1",
        "train.model": "dcnv2",
        "gate.max_calibration_error": "0.15",
        "tracking.experiment": "ctr",
        "serving.poll_seconds": "1.0",
    }
    assert all(isinstance(v, str) for v in flat.values())
    assert flat["train.mlp_units"] == "512,256,128"
    assert flat["train.jit_compile"] == "False"
    assert flat["gate.min_auc"] == "0.6"


def test_flat_round_trips_through_with_overrides():
    config = PipelineConfig().with_overrides(
        {"train.mlp_units": "8,4", "train.epochs": "2", "paths.data_root": "/x"}
    )
    assert PipelineConfig().with_overrides(config.flat()) == config


def test_config_is_frozen():
    config = PipelineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.train = None  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.train.epochs = 10  # type: ignore[misc]


def test_parse_override_args():
    assert parse_override_args(["train.epochs = 2", "paths.data_root=/a=b"]) == {
        "train.epochs": "2",
        "paths.data_root": "/a=b",
    }
    with pytest.raises(ConfigError, match=r"override 'train\.epochs' is not of the form section\.key=value"):
        parse_override_args(["train.epochs"])


def test_data_root_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = PipelineConfig().with_overrides({"paths.data_root": "relative"})
    assert config.paths.root == Path(tmp_path / "relative")


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("train.model", "dcn", "dcnv2, deepfm, dien, din, dlrm, wide_deep"),
        ("features.source", "kafka", "click_log, events"),
        ("features.samples_layout", "columnar", "block, row"),
        ("train.interest_cell", "lstm", "gru, sru"),
        ("incremental.catch_up", "skip_stale", "in_order, latest_only"),
    ],
)
def test_an_enum_like_value_is_checked_at_the_edge_naming_what_is_allowed(key, value, allowed):
    with pytest.raises(ConfigError, match=rf"config key '{key}': unknown value '{value}'; expected one of {allowed}$"):
        load_config(overrides={key: value}, environ={})
    assert load_config(overrides={key: allowed.split(", ")[-1]}, environ={}).flat()[key] == allowed.split(", ")[-1]


def test_the_model_names_the_config_accepts_are_the_registrys():
    import typing

    from trainer.models.registry import MODEL_BUILDERS

    hint = typing.get_type_hints(type(PipelineConfig().train))["model"]
    assert sorted(typing.get_args(hint)) == sorted(MODEL_BUILDERS)
