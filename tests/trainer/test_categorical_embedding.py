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


def lookup_ops(layer, width: int) -> list[str]:
    function = tf.function(layer).get_concrete_function(tf.TensorSpec([None, width], tf.int64))
    return [op.type for op in function.graph.get_operations()]


def test_the_lookup_gathers_rows_from_the_variable_without_reading_the_whole_table():
    """Once the row-sparse optimizer has written the table (a sparse op), TensorFlow copies the whole variable
    on every read of it (copy-on-read mode): a lookup through such a read made a step of a 41.6 M-parameter
    table 3.5x slower. ResourceGather reads the rows alone (trainer.layers.embedding_rows)."""
    layer = hand_layer()
    layer.embeddings.value.scatter_update(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([4])))  # as a step does
    ops = lookup_ops(layer, 2)
    assert "ResourceGather" in ops and "ReadVariableOp" not in ops, ops
    out = keras.ops.convert_to_numpy(layer(np.array([[1, 2]], dtype="int64")))
    np.testing.assert_array_equal(out, [[[2, 3], [1, 1]]])
    hashed = CategoricalEmbedding([2, 3], embedding_dim=2, hashed_features=[1], num_hash_buckets=4)
    hashed.build((None, 2))
    ops = lookup_ops(hashed, 2)
    assert ops.count("ResourceGather") == 2 and "ReadVariableOp" not in ops, ops


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
    with pytest.raises(ValueError, match=r"reads 2 columns.*\[batch, 2\].*\(None, 3\)"):
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


def hashed_layer() -> CategoricalEmbedding:
    # Feature 1 is hashed into 2 tables of 3 rows; features 0 and 2 keep rows 0-1 and 2-5 of the table.
    layer = CategoricalEmbedding([2, 1000, 4], embedding_dim=2, hashed_features=[1], num_hash_buckets=3)
    layer.build((None, 3))
    table = np.arange(12, dtype="float32").reshape(6, 2)
    layer.set_weights([table, 100 + table])
    return layer


def test_hashed_features_read_their_multi_hash_tables_in_feature_order():
    layer = hashed_layer()
    assert [tuple(w.shape) for w in layer.weights] == [(6, 2), (6, 2)]
    assert layer.offsets.tolist() == [0, -1, 2] and layer.num_rows == 6
    out = keras.ops.convert_to_numpy(layer(np.array([[1, 7, 3]], dtype="int64")))
    np.testing.assert_array_equal(out[0, 0], [2, 3])  # table row 1
    np.testing.assert_array_equal(out[0, 2], [10, 11])  # table row 2 + 3
    # Id 7 hashes to bucket 1 of the first hash table and bucket 2 of the second (hashed rows 1 and 3 + 2).
    np.testing.assert_array_equal(out[0, 1], [102 + 110, 103 + 111])


def test_embed_feature_reads_the_rows_call_reads():
    layer = hashed_layer()
    ids = np.array([[0, 5, 1], [1, 123_456, 3]], dtype="int64")
    out = keras.ops.convert_to_numpy(layer(ids))
    for feature in range(3):
        by_feature = keras.ops.convert_to_numpy(layer.embed_feature(ids[:, feature], feature))
        np.testing.assert_array_equal(by_feature, out[:, feature])
    # Any shape: a [batch, length] sequence of feature 2's row ids.
    sequence = keras.ops.convert_to_numpy(layer.embed_feature(np.array([[3, 0]], dtype="int64"), 2))
    np.testing.assert_array_equal(sequence, [[[10, 11], [4, 5]]])


def test_every_feature_hashed_leaves_no_table():
    layer = CategoricalEmbedding([10, 20], 4, hashed_features=[1, 0], num_hash_buckets=3, num_hash_functions=3)
    out = layer(np.array([[1, 2]], dtype="int64"))
    assert [tuple(w.shape) for w in layer.weights] == [(9, 4), (9, 4)]
    assert tuple(out.shape) == (1, 2, 4)


@pytest.mark.parametrize("hashed_features", [[3], [-1], [0, 0], [1.0], "0", 1])
def test_invalid_hashed_features(hashed_features):
    with pytest.raises(ValueError, match=r"distinct feature indices in \[0, 3\).*" + re.escape(repr(hashed_features))):
        CategoricalEmbedding([2, 3, 4], 2, hashed_features=hashed_features, num_hash_buckets=3)


def test_hashed_features_need_a_bucket_count():
    with pytest.raises(ValueError, match=re.escape("num_hash_buckets=None")):
        CategoricalEmbedding([2, 3], 2, hashed_features=[1])


def test_embed_feature_rejects_unknown_features():
    with pytest.raises(ValueError, match=re.escape("in [0, 3). Received: feature=3")):
        hashed_layer().embed_feature(np.array([1]), 3)


def test_hashed_config_and_save_round_trip(tmp_path):
    layer = CategoricalEmbedding(
        [2, 50, 3], 4, hashed_features=[1], num_hash_buckets=5, num_hash_functions=2, hash_combiner="concat"
    )
    config = layer.get_config()
    assert {"hashed_features", "num_hash_buckets", "num_hash_functions", "hash_combiner"} <= set(config)
    assert CategoricalEmbedding.from_config(config).get_config() == config

    ids = keras.Input((3,), dtype="int64")
    model = keras.Model(ids, layer(ids))
    data = np.array([[0, 49, 2], [1, 7, 0]], dtype="int64")
    model.save(tmp_path / "hashed.keras")
    loaded = keras.saving.load_model(tmp_path / "hashed.keras")
    np.testing.assert_array_equal(loaded.predict(data, verbose=0), model.predict(data, verbose=0))


def test_row_l2_penalizes_the_rows_a_training_batch_reads_with_a_row_sparse_gradient():
    layer = CategoricalEmbedding([5, 3], 2, row_l2=0.5, embeddings_initializer="ones")
    ids = np.array([[0, 1], [2, 0]])
    layer(ids, training=False)
    assert layer.losses == []  # inference adds nothing
    with tf.GradientTape() as tape:
        layer(ids, training=True)
        (loss,) = layer.losses
    # Each row reads 2 rows of squared norm 2 (dim 2, ones): 0.5 * mean([4, 4]).
    assert float(loss) == pytest.approx(2.0)
    gradient = tape.gradient(loss, layer.embeddings)
    assert isinstance(gradient, tf.IndexedSlices)
    dense = tf.convert_to_tensor(gradient).numpy()
    # Rows read: 0 and 2 of table 0 (rows 0, 2) and row 1 and 0 of table 1 (rows 6, 5); the rest untouched.
    assert sorted(np.flatnonzero(np.abs(dense).sum(axis=1))) == [0, 2, 5, 6]
    assert CategoricalEmbedding.from_config(layer.get_config()).row_l2 == 0.5


def test_row_l2_must_be_a_non_negative_number():
    with pytest.raises(ValueError, match=re.escape("`row_l2` must be a number >= 0. Received: row_l2=-0.1")):
        CategoricalEmbedding([5], 2, row_l2=-0.1)


def test_rare_row_rate_reads_values_as_the_rare_row_in_training_only():
    layer = CategoricalEmbedding([10, 10], 2, rare_row_rate=0.25, rare_row=0, missing_row=1, seed=3)
    ids = np.tile(np.array([[5, 1]]), (4000, 1))  # a value in column 0, the missing row in column 1
    first = np.asarray(layer(ids, training=True))
    table = np.asarray(layer.embeddings)
    as_rare = np.all(first[:, 0] == table[0], axis=1)
    assert 0.22 < as_rare.mean() < 0.28  # about a quarter of the values
    assert np.all(first[~as_rare, 0] == table[5])
    assert np.all(first[:, 1] == table[11])  # a missing value stays missing (row 1 of table 1)
    second = np.asarray(layer(ids, training=True))
    assert not np.array_equal(np.all(second[:, 0] == table[0], axis=1), as_rare)  # drawn anew every batch
    assert np.all(np.asarray(layer(ids, training=False))[:, 0] == table[5])  # evaluation and serving: as is
    assert np.all(np.asarray(layer(ids))[:, 0] == table[5])
    copy = CategoricalEmbedding.from_config(layer.get_config())
    assert (copy.rare_row_rate, copy.rare_row, copy.missing_row, copy.seed) == (0.25, 0, 1, 3)
    # The generator's state is not a weight: deltas, warm starts and checkpoints see the same weights as before.
    assert [w.name for w in layer.weights] == ["embeddings"]


def test_rare_row_rate_trains_the_row_unseen_values_read():
    """Every training value is admitted (rows 2 and 3): without the rate the rare row never moves, so a value
    first seen at serving reads its random initial value; with it, the rare row learns."""
    import keras

    from components.config import TrainConfig
    from components.schema import CATEGORICAL_FEATURES
    from trainer.models import build_model
    from trainer.train import compile_model

    rng = np.random.default_rng(0)
    features = {"dense": rng.standard_normal((512, 26)).astype("float32"),
                "categorical": rng.integers(2, 4, (512, 26)).astype("int64")}
    labels = rng.integers(0, 2, 512).astype("float32")
    moved = {}
    for rate in (0.0, 0.2):
        config = TrainConfig(mlp_units=(16, 8), rare_row_rate=rate)
        keras.utils.set_random_seed(0)
        model = build_model(config, {name: 10 for name in CATEGORICAL_FEATURES})
        compile_model(model, config)
        before = np.asarray(model.embedding.embeddings)[model.embedding.offsets]  # row 0 of every table
        model.fit(features, labels, batch_size=64, verbose=0)
        after = np.asarray(model.embedding.embeddings)[model.embedding.offsets]
        moved[rate] = int((after != before).any(axis=1).sum())
        assert model.embedding.rare_row_rate == rate
    assert moved == {0.0: 0, 0.2: 26}


def test_rare_row_rate_per_column():
    layer = CategoricalEmbedding([10, 10, 10], 2, rare_row_rate=[0.5, 0.0, 0.1], seed=1)
    out = np.asarray(layer(np.tile(np.array([[5, 5, 5]]), (4000, 1)), training=True))
    table = np.asarray(layer.embeddings)
    shares = [np.all(out[:, column] == table[10 * column], axis=1).mean() for column in range(3)]
    assert 0.47 < shares[0] < 0.53 and shares[1] == 0.0 and 0.08 < shares[2] < 0.12
    assert CategoricalEmbedding.from_config(layer.get_config()).rare_row_rate == [0.5, 0.0, 0.1]
    assert not CategoricalEmbedding([10], 2, rare_row_rate=[0.0]).draws_rare_rows


@pytest.mark.parametrize("rate", [1.0, -0.1, [0.1, 0.2], True])
def test_rare_row_rate_must_be_below_one_and_one_per_column(rate):
    with pytest.raises(ValueError, match=re.escape("`rare_row_rate` must be a number in [0, 1), or one per input "
                                                   f"column. Received: rare_row_rate={rate!r}")):
        CategoricalEmbedding([5, 5, 5], 2, rare_row_rate=rate)
