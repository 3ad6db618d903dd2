"""serving/tensorflow_internals.py: the private names of TensorFlow serving reads. These fail loudly when a
TensorFlow upgrade drops or changes one (serving would then fall back to the slower public call)."""

import numpy as np
import pytest
import tensorflow as tf

from serving.tensorflow_internals import preflattened_call

pytestmark = pytest.mark.unit


def test_a_concrete_functions_graph_function_takes_flat_inputs_and_its_captures():
    weight = tf.Variable([[1.0], [2.0]])

    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32), tf.TensorSpec([None], tf.int64)])
    def predict(dense, ids):
        return {"p": tf.matmul(dense, weight)[:, 0] + tf.cast(ids, tf.float32)}

    concrete = predict.get_concrete_function()
    call = preflattened_call(concrete)
    assert call is not None, ("ConcreteFunction._inference_function.call_preflattened is gone: rewrite "
                              "serving/tensorflow_internals.preflattened_call")
    dense, ids = tf.constant([[1.0, 1.0], [0.5, 0.0]]), tf.constant([10, 20], tf.int64)
    out = call([dense, ids, *concrete.captured_inputs])
    flat = out if isinstance(out, tf.Tensor) else tf.nest.flatten(out)[0]
    np.testing.assert_allclose(flat.numpy(), concrete(dense, ids)["p"].numpy())
    np.testing.assert_allclose(flat.numpy(), [13.0, 20.5])


def test_anything_else_gets_none_so_the_caller_uses_the_public_call():
    assert preflattened_call(lambda x: x) is None
    assert preflattened_call(tf.function(lambda x: x)) is None  # not concrete


def test_a_direct_call_takes_nested_arguments_in_the_signatures_order():
    from serving.tensorflow_internals import direct_call

    offset = tf.Variable(100.0)

    vector = tf.TensorSpec([None], tf.float32)

    @tf.function(input_signature=[{"zeta": vector, "alpha": vector}, {"m": vector}])
    def combine(first, second):
        return first["zeta"] * 10.0 + first["alpha"] - second["m"] + offset

    concrete = combine.get_concrete_function()
    call = direct_call(concrete)
    assert call is not concrete, "the graph function was not found: see preflattened_call"
    first = {"zeta": tf.constant([1.0, 2.0]), "alpha": tf.constant([3.0, 4.0])}  # not in sorted order
    second = {"m": tf.constant([0.5, 0.25])}
    expected = [1.0 * 10 + 3 - 0.5 + 100, 2.0 * 10 + 4 - 0.25 + 100]
    np.testing.assert_allclose(call(first, second).numpy(), expected)
    np.testing.assert_allclose(concrete(first, second).numpy(), expected)
    # Plain tensors pass as they are.
    plain = direct_call(tf.function(lambda x: x + offset).get_concrete_function(tf.TensorSpec([None], tf.float32)))
    np.testing.assert_allclose(plain(tf.constant([1.0])).numpy(), [101.0])
