import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer.layers.multi_hash_embedding import HASH_PARAMETERS, HASH_PRIME, MultiHashEmbedding

pytestmark = pytest.mark.unit

to_numpy = keras.ops.convert_to_numpy


def reference_bucket(ids: np.ndarray, function: int, num_buckets: int) -> np.ndarray:
    """((A x + b) mod P) mod buckets in Python integers, which never overflow."""
    first, second, offset = HASH_PARAMETERS[function]
    return np.array([(first * second * int(x) + offset) % HASH_PRIME % num_buckets for x in ids])


def hand_layer(combiner: str) -> MultiHashEmbedding:
    layer = MultiHashEmbedding(num_buckets=5, embedding_dim=2, num_hash_functions=2, combiner=combiner)
    layer.build((None,))
    table_dim = 2 if combiner == "sum" else 1
    layer.set_weights([np.arange(10 * table_dim, dtype="float32").reshape(10, table_dim)])
    return layer


def test_buckets_match_the_formula_in_int64_and_int32():
    ids = np.array([0, 1, 7, 12_345, 999_999, 2**31 - 2], dtype="int64")
    layer = MultiHashEmbedding(num_buckets=1000, embedding_dim=4, num_hash_functions=len(HASH_PARAMETERS))
    for function in range(len(HASH_PARAMETERS)):
        expected = reference_bucket(ids, function, 1000)
        np.testing.assert_array_equal(to_numpy(layer.bucket(tf.constant(ids), function)), expected)
        # No intermediate passes 2**31, so int32 ids (JAX without x64) land in the same buckets.
        np.testing.assert_array_equal(to_numpy(layer.bucket(tf.constant(ids.astype("int32")), function)), expected)


def test_sum_adds_the_rows_of_each_table():
    # Ids 0, 1, 7 -> hash 0 buckets [1, 4, 2], hash 1 buckets [4, 0, 4]; hash 1's table starts at row 5.
    assert reference_bucket(np.array([0, 1, 7]), 0, 5).tolist() == [1, 4, 2]
    assert reference_bucket(np.array([0, 1, 7]), 1, 5).tolist() == [4, 0, 4]
    out = to_numpy(hand_layer("sum")(np.array([[0, 1, 7]], dtype="int64")))
    # Row r of the table is [2r, 2r + 1]: rows 1 + 9, 4 + 5, 2 + 9.
    np.testing.assert_array_equal(out, [[[20, 22], [18, 20], [22, 24]]])


def test_concat_joins_the_rows_of_each_table():
    out = to_numpy(hand_layer("concat")(np.array([0, 1, 7], dtype="int64")))
    # Row r of the table is [r]: [row of hash 0, row of hash 1].
    np.testing.assert_array_equal(out, [[1, 9], [4, 5], [2, 9]])


def test_ids_that_share_a_bucket_in_one_table_rarely_share_all():
    ids = np.arange(200_000)
    first, second = reference_bucket(ids, 0, 1000), reference_bucket(ids, 1, 1000)
    # One table of 1000 rows: every id shares its row with 197 to 204 others (the loads are even).
    assert np.bincount(first).min() >= 198 and np.bincount(first).max() <= 205
    # Two tables: 81.6% of the ids have a pair of rows of their own, as independent uniform hashes would give
    # (e ** -(200 K / 1000 ** 2) = 81.9%).
    _, which, counts = np.unique(first * 1000 + second, return_inverse=True, return_counts=True)
    assert 0.81 < (counts[which] == 1).mean() < 0.83


@pytest.mark.parametrize(
    ("kwargs", "expected_shape"),
    [
        ({"num_hash_functions": 2, "combiner": "sum"}, (2 * 7, 6)),
        ({"num_hash_functions": 3, "combiner": "sum"}, (3 * 7, 6)),
        ({"num_hash_functions": 3, "combiner": "concat"}, (3 * 7, 2)),
    ],
)
def test_weight_shapes(kwargs, expected_shape):
    layer = MultiHashEmbedding(num_buckets=7, embedding_dim=6, **kwargs)
    out = layer(np.zeros((4, 5), dtype="int64"))
    assert [tuple(w.shape) for w in layer.weights] == [expected_shape]
    assert tuple(out.shape) == (4, 5, 6)


def test_gradient_is_row_sparse():
    layer = hand_layer("sum")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(np.array([7], dtype="int64")))
    (gradient,) = tape.gradient(loss, layer.trainable_variables)
    assert isinstance(gradient, tf.IndexedSlices)
    assert sorted(gradient.indices.numpy().tolist()) == [2, 9]


def test_mixed_precision_keeps_the_tables_float32():
    layer = MultiHashEmbedding(5, 4, dtype="mixed_bfloat16")
    out = layer(np.array([3], dtype="int64"))
    assert layer.embeddings.dtype == "float32"
    assert keras.backend.standardize_dtype(out.dtype) == "bfloat16"


@pytest.mark.parametrize("num_buckets", [0, -1, 2.0, None])
def test_invalid_num_buckets(num_buckets):
    with pytest.raises(ValueError, match=re.escape(f"num_buckets={num_buckets!r}")):
        MultiHashEmbedding(num_buckets, 4)


@pytest.mark.parametrize("num_hash_functions", [0, 9, 1.5, True])
def test_invalid_num_hash_functions(num_hash_functions):
    with pytest.raises(ValueError, match=r"integer from 1 to 8.*" + re.escape(f"={num_hash_functions!r}")):
        MultiHashEmbedding(5, 4, num_hash_functions=num_hash_functions)


def test_invalid_combiner():
    with pytest.raises(ValueError, match=re.escape("one of ['sum', 'concat']. Received: combiner='mean'")):
        MultiHashEmbedding(5, 4, combiner="mean")


def test_concat_needs_a_dim_the_tables_can_split():
    expected = "use combiner='sum'. Received: embedding_dim=4, num_hash_functions=3"
    with pytest.raises(ValueError, match=re.escape(expected)):
        MultiHashEmbedding(5, 4, num_hash_functions=3, combiner="concat")


def test_config_round_trip():
    layer = MultiHashEmbedding(
        9, 4, num_hash_functions=4, combiner="concat", embeddings_initializer="ones",
        embeddings_regularizer="l2", name="hashed",
    )
    config = layer.get_config()
    arguments = {
        "num_buckets", "embedding_dim", "num_hash_functions", "combiner", "embeddings_initializer",
        "embeddings_regularizer",
    }
    assert arguments <= set(config)
    restored = MultiHashEmbedding.from_config(config)
    assert restored.get_config() == config
    assert (restored.num_buckets, restored.table_dim, restored.combiner) == (9, 1, "concat")


def test_save_and_load_round_trip(tmp_path):
    ids = keras.Input((3,), dtype="int64")
    model = keras.Model(ids, MultiHashEmbedding(11, 4, num_hash_functions=3)(ids))
    data = np.array([[0, 5, 123_456], [7, 7, 2]], dtype="int64")
    model.save(tmp_path / "hashed.keras")
    loaded = keras.saving.load_model(tmp_path / "hashed.keras")
    np.testing.assert_array_equal(loaded.predict(data, verbose=0), model.predict(data, verbose=0))
