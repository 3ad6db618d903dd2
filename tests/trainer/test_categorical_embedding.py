import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer.layers.categorical_embedding import CategoricalEmbedding

pytestmark = pytest.mark.unit


def hand_layer() -> CategoricalEmbedding:
    layer = CategoricalEmbedding([2, 3], embedding_dim=2)
    layer.build((None, 2))
    layer.set_weights([np.arange(10, dtype="float32").reshape(5, 2)])
    return layer


def test_lookup_uses_per_feature_offsets():
    # Feature 0 owns table rows 0-1, feature 1 rows 2-4.
    ids = np.array([[1, 0], [0, 2]], dtype="int64")
    out = keras.ops.convert_to_numpy(hand_layer()(ids))
    np.testing.assert_array_equal(out, [[[2, 3], [4, 5]], [[0, 1], [8, 9]]])


def test_one_table_of_all_rows():
    layer = CategoricalEmbedding([3, 1, 4], embedding_dim=8)
    layer.build((None, 3))
    assert [tuple(w.shape) for w in layer.weights] == [(8, 8)]
    assert layer.offsets.tolist() == [0, 3, 4]


def test_gradient_is_row_sparse():
    layer = hand_layer()
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(np.array([[1, 2]], dtype="int64")))
    (gradient,) = tape.gradient(loss, layer.trainable_variables)
    assert isinstance(gradient, tf.IndexedSlices)
    assert sorted(gradient.indices.numpy().tolist()) == [1, 4]


def test_mixed_precision_keeps_the_table_float32():
    layer = CategoricalEmbedding([2, 3], embedding_dim=2, dtype="mixed_bfloat16")
    out = layer(np.array([[1, 0]], dtype="int64"))
    assert layer.embeddings.dtype == "float32"
    assert keras.backend.standardize_dtype(out.dtype) == "bfloat16"


@pytest.mark.parametrize("table_sizes", [[], [0], [2, -1], [1.5], [True], "abc", 7])
def test_invalid_table_sizes(table_sizes):
    with pytest.raises(ValueError, match=re.escape(f"table_sizes={table_sizes!r}")):
        CategoricalEmbedding(table_sizes, embedding_dim=4)


@pytest.mark.parametrize("embedding_dim", [0, -2, 2.0, None])
def test_invalid_embedding_dim(embedding_dim):
    with pytest.raises(ValueError, match=re.escape(f"embedding_dim={embedding_dim!r}")):
        CategoricalEmbedding([2], embedding_dim=embedding_dim)


def test_input_width_must_match_the_number_of_tables():
    with pytest.raises(ValueError, match=r"has 2 tables.*\[batch, 2\].*\(None, 3\)"):
        CategoricalEmbedding([2, 3], embedding_dim=2).build((None, 3))


def test_config_round_trip():
    layer = CategoricalEmbedding(
        [2, 3], 4, embeddings_initializer="ones", embeddings_regularizer="l2", name="embedding"
    )
    config = layer.get_config()
    assert {"table_sizes", "embedding_dim", "embeddings_initializer", "embeddings_regularizer"} <= set(config)
    restored = CategoricalEmbedding.from_config(config)
    assert restored.get_config() == config
    assert restored.table_sizes == [2, 3] and restored.embedding_dim == 4


def test_save_and_load_round_trip(tmp_path):
    ids = keras.Input((2,), dtype="int64")
    model = keras.Model(ids, CategoricalEmbedding([2, 3], embedding_dim=3)(ids))
    data = np.array([[0, 2], [1, 1]], dtype="int64")
    model.save(tmp_path / "embedding.keras")
    loaded = keras.saving.load_model(tmp_path / "embedding.keras")
    np.testing.assert_array_equal(loaded.predict(data, verbose=0), model.predict(data, verbose=0))
