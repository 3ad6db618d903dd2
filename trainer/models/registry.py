"""Model builders by name: `TrainConfig.model` picks one. A new model is a CTRModel subclass (its layers, its
`CONFIG_KEYS`, `call` and `build_layers`; trainer.models.base) and one entry in MODEL_BUILDERS."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import keras

from components.config import TrainConfig
from components.feature_spec import FeatureSpec
from trainer.model_inputs import model_inputs
from trainer.models.dcnv2 import build_dcnv2
from trainer.models.deepfm import build_deepfm
from trainer.models.dien import build_dien
from trainer.models.din import build_din
from trainer.models.dlrm import build_dlrm
from trainer.models.wide_deep import build_wide_deep

ModelBuilder = Callable[..., keras.Model]

MODEL_BUILDERS: dict[str, ModelBuilder] = {
    "dcnv2": build_dcnv2,
    "deepfm": build_deepfm,
    "dien": build_dien,
    "din": build_din,
    "dlrm": build_dlrm,
    "wide_deep": build_wide_deep,
}


def build_model(config: TrainConfig, table_sizes: Mapping[str, int], spec: FeatureSpec | None = None) -> keras.Model:
    """The built (weights created) model named by `config.model`, reading the inputs of the feature spec
    (`spec`, the criteo spec by default: trainer.model_inputs), one embedding table per spec table.

    `table_sizes` maps every table of the spec to its number of rows (FeatureState.table_sizes()). Models that
    read a behaviour sequence (DIN, DIEN) attend over the spec's first sequence feature, with the feature whose
    table it shares as the target (without one in the spec, over a synthetic `history` input).
    """
    from components.feature_spec import load_spec

    builder = MODEL_BUILDERS.get(config.model)
    if builder is None:
        raise ValueError(
            f"unknown model {config.model!r} (train.model); expected one of {sorted(MODEL_BUILDERS)}"
        )
    spec = spec or load_spec("criteo")
    inputs = model_inputs(spec)
    missing = [name for name in inputs.tables if name not in table_sizes]
    if missing:
        raise ValueError(
            f"table_sizes has no entry for {missing}; expected one per table of feature spec {spec.name!r} "
            f"(FeatureState.table_sizes())"
        )
    pinned = {f.name: f.embedding_dim for f in spec.features
              if getattr(f, "embedding_dim", None) not in (None, config.embedding_dim)}
    if pinned:
        raise ValueError(
            f"feature spec {spec.name!r} sets embedding_dim {pinned}, but the models give every table one width, "
            f"train.embedding_dim={config.embedding_dim}: remove embedding_dim from those features or set "
            f"train.embedding_dim to their value"
        )
    options = inputs.embedding_options(spec)
    if options.get("tiered_tables"):
        _check_tiered(config, spec)
    model = builder(config, [int(table_sizes[name]) for name in inputs.tables], inputs, options)
    if not model.built:  # the sequence models' builders build with the sequence's shape
        model.build(inputs.shapes)
    return model


def _check_tiered(config: TrainConfig, spec: FeatureSpec) -> None:
    """What a spec with tiered tables needs of the training, on either backend: no multi-hash compression of a
    tiered table, and one process. (Micro-batches work: the micro-batches of one optimizer step are planned as
    one batch. Models with a linear part work: a tiered table's store keeps each row's linear weight beside its
    values, trainer/tiered_tables.py.)"""
    tiered = [name for name, table in spec.tables().items() if table.tiered]
    problems = []
    if config.multi_hash_features and set(config.multi_hash_features) & set(tiered):
        problems.append(f"no train.multi_hash_features among the tiered tables {tiered}")
    if config.processes > 1:
        # Several devices of one host work (the hot slots sharded or replicated, trainer/devices.py); several
        # processes would each need the plans of the rows the others' batches read (docs/tiers.md).
        problems.append("one process (train.processes=1; several devices of one host work: train.devices)")
    if problems:
        raise ValueError(f"feature spec {spec.name!r} keeps tables {tiered} tiered (storage: tiered), which needs "
                         + "; ".join(problems) + ". Change those settings, or set storage: memory on those tables")
