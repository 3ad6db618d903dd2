"""The trigger form's fields: typed run params, each overriding one config key.

A DAG's params are built here from the config's own types (a `Literal` is a choice, an int an integer field, a
float a number), so the form offers exactly what the pipeline accepts. Every field is empty by default, which
means "the configured value" (shown in its description): scheduled runs send nothing and run on the config as
it is. The free-form `config` object stays, for any other key.

Pure: `airflow_params` needs `airflow.sdk.Param` only when called by a DAG file; `overrides_from_params` turns a
run's params into the config overrides the steps run with.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from components.config import ConfigError, PipelineConfig

CONFIG_PARAM = "config"


@dataclass(frozen=True)
class RunParam:
    name: str  # the field's name in the form and in the run's params
    key: str  # the config key it overrides, "section.key"
    title: str
    description: str
    section: str
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: float | None = None


DAILY: tuple[RunParam, ...] = (
    RunParam("model", "train.model", "Model", "The ranking model to train.", "Training"),
    RunParam("epochs", "train.epochs", "Epochs", "Passes over the day's training rows (early stopping may end "
             "sooner).", "Training", minimum=1),
    RunParam("learning_rate", "train.learning_rate", "Learning rate", "Adam's rate for the dense layers.",
             "Training", exclusive_minimum=0),
    RunParam("embedding_learning_rate", "train.embedding_learning_rate", "Embedding learning rate",
             "Adagrad's rate for the row-sparse embedding updates.", "Training", exclusive_minimum=0),
    RunParam("batch_size", "train.batch_size", "Batch size", "Rows per optimizer step; 0 chooses it from the "
             "training rows.", "Training", minimum=0),
    RunParam("embedding_dim", "train.embedding_dim", "Embedding dimension",
             "Width of every embedding the spec leaves unset.", "Training", minimum=1),
    RunParam("spec", "features.spec", "Feature spec", "The columns and their kinds: a preset, or the configured "
             "YAML file.", "Data"),
    RunParam("source", "features.source", "Source", "click_log: labelled minute slices; events: impressions and "
             "clicks joined in the attribution window.", "Data"),
    RunParam("min_count", "features.min_count", "Admission count", "A value gets its own embedding row after "
             "this many occurrences; 0 chooses it from the training rows.", "Data", minimum=0),
    RunParam("min_auc", "gate.min_auc", "Gate: minimum AUC", "The model is published only above it.",
             "Quality gate", minimum=0, maximum=1),
    RunParam("max_logloss", "gate.max_logloss", "Gate: maximum logloss", "The model is published only below it.",
             "Quality gate", exclusive_minimum=0),
)

INCREMENTAL: tuple[RunParam, ...] = (
    RunParam("epochs", "incremental.epochs", "Epochs", "Passes over the minute's training rows.", "Training",
             minimum=1),
    RunParam("catch_up", "incremental.catch_up", "Catch-up after an outage",
             "in_order: learn every missed minute, oldest first; latest_only: skip them (logged).", "Training"),
    RunParam("max_logloss_increase", "incremental.max_logloss_increase", "Gate: logloss increase",
             "A delta is published only if its holdout logloss is at most this much worse than its parent's.",
             "Delta gate", minimum=0),
    RunParam("max_embedding_norm", "incremental.max_embedding_norm", "Gate: embedding norm",
             "No changed embedding row may be longer than this (L2).", "Delta gate", exclusive_minimum=0),
)

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}


def _field_type(key: str) -> Any:
    section, _, name = key.partition(".")
    cls = type(getattr(PipelineConfig(), section))
    if name not in {f.name for f in dataclasses.fields(cls)}:
        raise ConfigError(f"run param for unknown config key {key!r}")
    return typing.get_type_hints(cls)[name]


def choices(param: RunParam, config: PipelineConfig) -> tuple[str, ...] | None:
    """The values a choice field offers: a Literal's values; for the spec, the presets and the configured one."""
    if param.key == "features.spec":
        from components.feature_spec import preset_names

        names = preset_names()
        return names if config.features.spec in names else (*names, config.features.spec)
    hint = _field_type(param.key)
    return tuple(typing.get_args(hint)) if typing.get_origin(hint) is Literal else None


def configured(config: PipelineConfig, key: str) -> Any:
    section, _, name = key.partition(".")
    return getattr(getattr(config, section), name)


def schema(param: RunParam, config: PipelineConfig) -> dict[str, Any]:
    """The field's JSON schema (what Airflow validates and renders), with null for "the configured value"."""
    hint = _field_type(param.key)
    current = configured(config, param.key)
    options = choices(param, config)
    out: dict[str, Any] = {"title": param.title, "section": param.section,
                           "description": f"{param.description} Empty: the configured value ({current})."}
    if options is not None:
        out.update(type=["null", "string"], enum=[None, *options],
                   values_display={None: f"configured ({current})", **{o: o for o in options}})
        return out
    if hint not in _JSON_TYPES:
        raise ConfigError(f"run param {param.name!r}: config key {param.key!r} has type {hint!r}, which a form "
                          "field cannot hold")
    out["type"] = ["null", _JSON_TYPES[hint]]
    for name, value in (("minimum", param.minimum), ("maximum", param.maximum),
                        ("exclusiveMinimum", param.exclusive_minimum)):
        if value is not None:
            out[name] = value
    return out


def airflow_params(fields: Sequence[RunParam], config: PipelineConfig) -> dict[str, Any]:
    """A DAG's `params`: one typed field per RunParam, then the free-form `config` object."""
    from airflow.sdk import Param

    params: dict[str, Any] = {p.name: Param(None, **schema(p, config)) for p in fields}
    params[CONFIG_PARAM] = Param({}, type="object", title="Other config overrides", section="Other config keys",
                                 description="Any config key as {\"section.key\": value}, e.g. "
                                             "{\"features.num_shards\": 8}.")
    return params


def overrides_from_params(params: Mapping[str, Any], fields: Sequence[RunParam]) -> dict[str, Any]:
    """The config overrides a run's params ask for: the `config` object, and every field that is set. A key
    set both ways to different values is an error (which one was meant cannot be guessed)."""
    overrides = dict(params.get(CONFIG_PARAM) or {})
    for param in fields:
        value = params.get(param.name)
        if value is None:
            continue
        if param.key in overrides and overrides[param.key] != value:
            raise ConfigError(f"param {param.name!r} = {value!r} and config[{param.key!r}] = "
                              f"{overrides[param.key]!r} disagree: set one of them")
        overrides[param.key] = value
    return overrides


def params_from_overrides(overrides: Mapping[str, Any], fields: Sequence[RunParam]) -> dict[str, Any]:
    """A run's params (what a trigger sends as `conf`) for config overrides: each key with a field goes into
    that field, parsed to the field's type (the form's schema would refuse the text "1" for an integer); the
    rest into the `config` object. Unknown keys or values fail here, before anything is triggered."""
    by_key = {p.key: p for p in fields}
    typed = PipelineConfig().with_overrides(overrides)  # parses and checks every key
    params: dict[str, Any] = {CONFIG_PARAM: {}}
    for key, raw in overrides.items():
        if key in by_key:
            params[by_key[key].name] = configured(typed, key)
        else:
            params[CONFIG_PARAM][key] = raw
    return params


def fields_for(pipeline: str) -> tuple[RunParam, ...]:
    if pipeline == "daily":
        return DAILY
    if pipeline == "incremental":
        return INCREMENTAL
    raise ValueError(f"unknown pipeline {pipeline!r}; expected daily or incremental")
