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
