"""Model builders by name: `TrainConfig.model` picks one. A new model is one entry in MODEL_BUILDERS."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import keras

from components.config import TrainConfig
from components.schema import CATEGORICAL_FEATURES
from trainer.model_inputs import INPUT_SHAPES
from trainer.models.dcnv2 import build_dcnv2
from trainer.models.deepfm import build_deepfm
from trainer.models.dien import build_dien
from trainer.models.din import build_din
from trainer.models.dlrm import build_dlrm
from trainer.models.wide_deep import build_wide_deep

ModelBuilder = Callable[[TrainConfig, Sequence[int]], keras.Model]

MODEL_BUILDERS: dict[str, ModelBuilder] = {
    "dcnv2": build_dcnv2,
    "deepfm": build_deepfm,
    "dien": build_dien,
    "din": build_din,
    "dlrm": build_dlrm,
    "wide_deep": build_wide_deep,
}


def build_model(config: TrainConfig, table_sizes: Mapping[str, int]) -> keras.Model:
    """The built (weights created) model named by `config.model`, with one table per categorical feature.

    `table_sizes` maps every name in components.schema.CATEGORICAL_FEATURES to its number of rows
    (FeatureState.table_sizes()). Models that read a behaviour sequence (DIN, DIEN) are built with the
    history input too (trainer.model_inputs.sequence_input_shapes).
    """
    builder = MODEL_BUILDERS.get(config.model)
    if builder is None:
        raise ValueError(
            f"unknown model {config.model!r} (train.model); expected one of {sorted(MODEL_BUILDERS)}"
        )
    missing = [name for name in CATEGORICAL_FEATURES if name not in table_sizes]
    if missing:
        raise ValueError(
            f"table_sizes has no entry for {missing}; expected one per categorical feature "
            f"(FeatureState.table_sizes())"
        )
    model = builder(config, [int(table_sizes[name]) for name in CATEGORICAL_FEATURES])
    if not model.built:  # the sequence models' builders build with the history's shape
        model.build(INPUT_SHAPES)
    return model
