import dataclasses
import re

import keras
import numpy as np
import pytest

from components.config import TrainConfig
from components.schema import CATEGORICAL_FEATURES, DENSE_INPUT_DIM, NUM_CATEGORICAL
from trainer.models import MODEL_BUILDERS, DCNv2, build_model

pytestmark = pytest.mark.unit

to_numpy = keras.ops.convert_to_numpy
SMALL = TrainConfig(embedding_dim=4, num_cross_layers=2, mlp_units=(8, 4))
TABLE_SIZES = {name: 5 + i for i, name in enumerate(CATEGORICAL_FEATURES)}


def inputs(num_rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    rows = np.stack([rng.integers(0, TABLE_SIZES[name], num_rows) for name in CATEGORICAL_FEATURES], axis=1)
    dense = rng.standard_normal((num_rows, DENSE_INPUT_DIM)).astype("float32")
    return {"dense": dense, "categorical": rows.astype("int64")}


def test_builds_the_blocks_from_the_config():
    model = build_model(SMALL, TABLE_SIZES)
    width = NUM_CATEGORICAL * 4 + DENSE_INPUT_DIM
    assert isinstance(model, DCNv2) and model.built
    assert tuple(model.embedding.embeddings.shape) == (sum(TABLE_SIZES.values()), 4)
    rank = TrainConfig().cross_projection_dim  # low-rank by default
    assert [(tuple(c.down_kernel.shape), tuple(c.up_kernel.shape)) for c in model.cross_layers] == [
        ((width, rank), (rank, width))] * 2
    assert [tuple(d.kernel.shape) for d in model.deep_network.layers] == [(width, 8), (8, 4)]
    full = build_model(dataclasses.replace(SMALL, cross_projection_dim=0), TABLE_SIZES)
    assert [tuple(c.kernel.shape) for c in full.cross_layers] == [(width, width)] * 2
    assert tuple(model.head.kernel.shape) == (4, 1)


def test_cross_projection_dim_makes_the_cross_layers_low_rank():
    width = NUM_CATEGORICAL * 4 + DENSE_INPUT_DIM
    model = build_model(dataclasses.replace(SMALL, cross_projection_dim=3), TABLE_SIZES)
    assert [(tuple(c.down_kernel.shape), tuple(c.up_kernel.shape)) for c in model.cross_layers] == [
        ((width, 3), (3, width))] * 2
    assert not any(hasattr(c, "kernel") for c in model.cross_layers)
    assert to_numpy(model(inputs(5))).shape == (5, 1)
    with pytest.raises(ValueError, match=r"train.cross_projection_dim must be 0 .* got -1"):
        build_model(dataclasses.replace(SMALL, cross_projection_dim=-1), TABLE_SIZES)


def test_output_is_a_probability_per_row():
    probability = to_numpy(build_model(SMALL, TABLE_SIZES)(inputs(7)))
    assert probability.shape == (7, 1) and probability.dtype == np.float32
    assert ((probability > 0) & (probability < 1)).all()


def test_call_reads_the_blocks_in_order():
    model = build_model(SMALL, TABLE_SIZES)
    features = inputs(3)
    x0 = model.feature_input(features)
    by_hand = model.head(model.deep_network(model.cross_network(x0)))
    np.testing.assert_array_equal(to_numpy(model(features)), to_numpy(by_hand))
    # Embeddings first, in feature order, then the dense input.
    np.testing.assert_array_equal(to_numpy(x0)[:, -DENSE_INPUT_DIM:], features["dense"])
    first_embedding = to_numpy(model.embedding.embeddings)[features["categorical"][:, 0]]
    np.testing.assert_array_equal(to_numpy(x0)[:, :4], first_embedding)


def test_head_stays_float32_under_mixed_precision():
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = build_model(SMALL, TABLE_SIZES)
    finally:
        keras.config.set_dtype_policy(previous)
    assert model.cross_layers[0].compute_dtype == "bfloat16"
    assert model.embedding.embeddings.dtype == "float32"
    assert model.head.compute_dtype == "float32"
    assert keras.backend.standardize_dtype(model(inputs(2)).dtype) == "float32"


def test_unknown_model_names_the_choices():
    expected = "unknown model 'xdeepfm' (train.model); expected one of ['dcnv2', 'deepfm', 'dien', 'din', 'dlrm',"
    with pytest.raises(ValueError, match=re.escape(expected)):
        build_model(TrainConfig(model="xdeepfm"), TABLE_SIZES)


def test_missing_table_sizes_are_named():
    sizes = {name: 3 for name in CATEGORICAL_FEATURES[:-2]}
    with pytest.raises(ValueError, match=re.escape("no entry for ['C25', 'C26']")):
        build_model(SMALL, sizes)


def test_registry_lists_every_model():
    assert set(MODEL_BUILDERS) == {"dcnv2", "deepfm", "dien", "din", "dlrm", "wide_deep"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"num_cross_layers": -1}, "num_cross_layers=-1"), ({"mlp_units": []}, "mlp_units=[]"),
     ({"mlp_units": [8, 0]}, "mlp_units=[8, 0]")],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        DCNv2([3] * NUM_CATEGORICAL, **kwargs)


def test_config_round_trip():
    model = DCNv2([3] * NUM_CATEGORICAL, embedding_dim=2, num_cross_layers=1, projection_dim=2, mlp_units=[4])
    config = model.get_config()
    assert {"table_sizes", "embedding_dim", "num_cross_layers", "projection_dim", "mlp_units"} <= set(config)
    assert DCNv2.from_config(config).get_config() == config


def test_save_and_load_round_trip(tmp_path):
    model = build_model(SMALL, TABLE_SIZES)
    features = inputs(5)
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert isinstance(loaded, DCNv2)
    np.testing.assert_array_equal(to_numpy(loaded(features)), to_numpy(model(features)))
