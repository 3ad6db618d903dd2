import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer.layers.hot_table import HotTable

pytestmark = pytest.mark.unit


def test_slot_ids_read_their_rows_with_a_row_sparse_gradient():
    layer = HotTable(3, 2)
    layer.build()
    assert [(w.name, tuple(w.shape)) for w in layer.weights] == [("embeddings", (3, 2))]
    np.testing.assert_array_equal(np.asarray(layer.embeddings), np.zeros((3, 2)))  # no random draws
    layer.embeddings.assign(np.arange(6, dtype="float32").reshape(3, 2))
    out = keras.ops.convert_to_numpy(layer(np.array([[2, 0], [2, 2]])))
    np.testing.assert_array_equal(out, [[[4, 5], [0, 1]], [[4, 5], [4, 5]]])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(np.array([1, 1])))
    gradient = tape.gradient(loss, layer.embeddings.value)
    assert isinstance(gradient, tf.IndexedSlices) and gradient.indices.numpy().tolist() == [1, 1]


def test_mixed_precision_keeps_the_slots_float32():
    layer = HotTable(3, 2, dtype="mixed_bfloat16")
    layer.build()
    assert layer.embeddings.dtype == "float32"
    assert keras.backend.standardize_dtype(layer(np.array([1])).dtype) == "float32"  # the caller casts the rows


@pytest.mark.parametrize(("name", "value"), [("hot_rows", 0), ("embedding_dim", 2.0)])
def test_invalid_arguments(name, value):
    arguments = {"hot_rows": 3, "embedding_dim": 2, name: value}
    with pytest.raises(ValueError, match=re.escape(f"{name}={value!r}")):
        HotTable(**arguments)


def test_config_and_save_round_trip(tmp_path):
    layer = HotTable(4, 3, name="slots")
    assert HotTable.from_config(layer.get_config()).get_config() == layer.get_config()
    ids = keras.Input((2,), dtype="int64")
    model = keras.Model(ids, layer(ids))
    layer.embeddings.assign(np.arange(12, dtype="float32").reshape(4, 3))
    model.save(tmp_path / "hot.keras")
    loaded = keras.saving.load_model(tmp_path / "hot.keras")
    data = np.array([[3, 0]])
    np.testing.assert_array_equal(loaded.predict(data, verbose=0), model.predict(data, verbose=0))
