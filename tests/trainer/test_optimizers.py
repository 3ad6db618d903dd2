import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer.optimizers import EmbeddingAdagrad

pytestmark = pytest.mark.unit

INITIAL = np.arange(12, dtype="float32").reshape(6, 2) / 10


def test_row_sparse_update_equals_dense_adagrad_and_leaves_other_rows_alone():
    # Row 1 appears twice: its gradients must be summed before squaring, as dense Adagrad does.
    values = tf.constant([[0.5, -1.0], [2.0, 0.25], [0.1, 0.3]])
    indices = tf.constant([1, 4, 1])
    sparse_variable = keras.Variable(INITIAL, name="embeddings")
    dense_variable = keras.Variable(INITIAL, name="embeddings")
    sparse_optimizer, dense_optimizer = EmbeddingAdagrad(0.1, 0.3), EmbeddingAdagrad(0.1, 0.3)
    for _ in range(2):
        slices = tf.IndexedSlices(values, indices, dense_shape=tf.constant([6, 2]))
        sparse_optimizer.apply([slices], [sparse_variable])
        dense_optimizer.apply([tf.convert_to_tensor(slices)], [dense_variable])
    sparse, dense = sparse_variable.numpy(), dense_variable.numpy()
    np.testing.assert_allclose(sparse, dense, rtol=1e-6)
    untouched = [0, 2, 3, 5]
    np.testing.assert_array_equal(sparse[untouched], INITIAL[untouched])
    assert (sparse[[1, 4]] != INITIAL[[1, 4]]).all()


def test_dense_updates_give_the_sparse_values_but_move_every_accumulator():
    values = tf.constant([[0.5, -1.0], [2.0, 0.25], [0.1, 0.3]])
    slices = tf.IndexedSlices(values, tf.constant([1, 4, 1]), dense_shape=tf.constant([6, 2]))
    variables = [keras.Variable(INITIAL, name="embeddings") for _ in range(2)]
    optimizers = [EmbeddingAdagrad(0.1, 0.3), EmbeddingAdagrad(0.1, 0.3, row_sparse_updates=False)]
    for optimizer, variable in zip(optimizers, variables, strict=True):
        optimizer.apply([slices], [variable])
    np.testing.assert_allclose(variables[1].numpy(), variables[0].numpy(), rtol=1e-6)
    assert EmbeddingAdagrad.from_config(optimizers[1].get_config()).row_sparse_updates is False
    with pytest.raises(ValueError, match=re.escape("row_sparse_updates='no'")):
        EmbeddingAdagrad(row_sparse_updates="no")


def test_accumulated_micro_batch_gradients_give_one_big_batch_step():
    # Four micro-batches of row-sparse gradients (each of a mean loss) against the big batch's gradient, which
    # holds every micro-batch's rows scaled by 1/4; rows repeat within and between micro-batches.
    rng = np.random.default_rng(0)
    values = [tf.constant(rng.standard_normal((3, 2)), tf.float32) for _ in range(4)]
    indices = [tf.constant(rng.integers(0, 3, 3)) for _ in range(4)]  # rows 0..2 only
    kernel_gradients = [tf.constant(rng.standard_normal((2, 2)), tf.float32) for _ in range(4)]
    shape = tf.constant([6, 2])

    def variables():
        return [keras.Variable(INITIAL, name="embeddings"), keras.Variable(INITIAL[:2], name="kernel")]

    big_variables, micro_variables = variables(), variables()
    big_gradient = tf.IndexedSlices(tf.concat(values, 0) / 4, tf.concat(indices, 0), dense_shape=shape)
    EmbeddingAdagrad(0.1, 0.3).apply([big_gradient, sum(kernel_gradients) / 4], big_variables)
    accumulating = EmbeddingAdagrad(0.1, 0.3, gradient_accumulation_steps=4)
    for step in range(4):
        np.testing.assert_array_equal(micro_variables[0].numpy(), INITIAL)  # no update before the 4th
        gradient = tf.IndexedSlices(values[step], indices[step], dense_shape=shape)
        accumulating.apply([gradient, kernel_gradients[step]], micro_variables)
    for big, accumulated in zip(big_variables, micro_variables, strict=True):
        np.testing.assert_allclose(accumulated.numpy(), big.numpy(), rtol=1e-5, atol=1e-6)
    moved = micro_variables[0].numpy() != INITIAL
    assert moved[:3].all() and not moved[3:].any()


def test_embedding_tables_get_their_own_learning_rate():
    embeddings = keras.Variable(np.zeros((1, 1), "float32"), name="embeddings")
    kernel = keras.Variable(np.zeros((1, 1), "float32"), name="kernel")
    optimizer = EmbeddingAdagrad(0.01, embedding_learning_rate=0.5, initial_accumulator_value=0.0)
    optimizer.apply([tf.ones((1, 1)), tf.ones((1, 1))], [embeddings, kernel])
    # First Adagrad step with a zero accumulator: -lr * g / sqrt(g^2 + epsilon) = -lr (g = 1).
    np.testing.assert_allclose(embeddings.numpy(), [[-0.5]], rtol=1e-6)
    np.testing.assert_allclose(kernel.numpy(), [[-0.01]], rtol=1e-6)


@pytest.mark.parametrize("embedding_learning_rate", [0, -0.1, "0.1", True])
def test_invalid_embedding_learning_rate(embedding_learning_rate):
    with pytest.raises(ValueError, match=re.escape(f"embedding_learning_rate={embedding_learning_rate!r}")):
        EmbeddingAdagrad(embedding_learning_rate=embedding_learning_rate)


def test_config_round_trip():
    optimizer = EmbeddingAdagrad(0.02, 0.3, initial_accumulator_value=0.5, gradient_accumulation_steps=2)
    config = optimizer.get_config()
    assert config["embedding_learning_rate"] == 0.3 and config["initial_accumulator_value"] == 0.5
    restored = EmbeddingAdagrad.from_config(config)
    assert restored.get_config() == config


def test_adam_for_dense_weights_steps_like_keras_adam_and_leaves_tables_to_adagrad():
    rng = np.random.default_rng(1)
    kernel_gradients = [tf.constant(rng.standard_normal((2, 2)), tf.float32) for _ in range(3)]
    table_gradient = tf.IndexedSlices(tf.constant([[0.5, -1.0]]), tf.constant([3]), dense_shape=tf.constant([6, 2]))
    mixed = [keras.Variable(INITIAL, name="embeddings"), keras.Variable(INITIAL[:2], name="kernel")]
    adagrad_table = keras.Variable(INITIAL, name="embeddings")
    adam_kernel = keras.Variable(INITIAL[:2], name="kernel")
    optimizer = EmbeddingAdagrad(0.01, 0.3, dense_optimizer="adam")
    reference_adagrad, reference_adam = EmbeddingAdagrad(0.01, 0.3), keras.optimizers.Adam(0.01)
    for kernel_gradient in kernel_gradients:
        optimizer.apply([table_gradient, kernel_gradient], mixed)
        reference_adagrad.apply([table_gradient], [adagrad_table])
        reference_adam.apply([kernel_gradient], [adam_kernel])
    np.testing.assert_allclose(mixed[1].numpy(), adam_kernel.numpy(), rtol=1e-6)
    np.testing.assert_array_equal(mixed[0].numpy(), adagrad_table.numpy())
    # Adam moves a weight by at most about the learning rate a step, whatever the gradient's size.
    moved = np.abs(mixed[1].numpy() - INITIAL[:2])
    assert (moved > 0).all() and moved.max() <= 3 * 0.01 + 1e-6
    # Moments for the kernel only: two variables more than Adagrad's, none the table's size.
    extra = {tuple(v.shape) for v in optimizer.variables} - {tuple(v.shape) for v in reference_adagrad.variables}
    assert len(optimizer.variables) == len(reference_adagrad.variables) + 1 + 2 and extra == {(2, 2)}
    assert EmbeddingAdagrad.from_config(optimizer.get_config()).dense_optimizer == "adam"
    with pytest.raises(ValueError, match=re.escape("dense_optimizer='sgd'")):
        EmbeddingAdagrad(dense_optimizer="sgd")
