"""Embeddings of one very-high-cardinality feature, compressed by several hash functions into small tables."""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from trainer.arguments import is_integer, require_integer
from trainer.layers.embedding_rows import take_rows

HASH_PRIME = 2**31 - 1
# Per hash function: two multipliers and an offset. Hash k maps a row id x to ((A x + b) mod P) mod buckets
# with A = a1 * a2. Both multipliers are below sqrt(P), so Schrage's method computes a * x mod P with every
# intermediate below 2**31: the same buckets in int32 (JAX without x64) and in int64 (TensorFlow).
# The multipliers are odd and prime to 3, 5 and 7, so bucket counts like 2**k or 10**k see no common factor.
HASH_PARAMETERS: tuple[tuple[int, int, int], ...] = (
    (12931, 10733, 639597101),
    (12373, 27347, 597850609),
    (27617, 33167, 1338610528),
    (31363, 45841, 731453688),
    (31769, 38419, 2004302251),
    (31651, 42377, 1295213400),
    (12143, 23203, 1437960055),
    (15679, 23861, 1506642549),
)
COMBINERS = ("sum", "concat")


@keras.saving.register_keras_serializable(package="ctr")
class MultiHashEmbedding(keras.layers.Layer):
    """Looks up the row ids of one feature in `num_hash_functions` small tables of `num_buckets` rows each, one
    table per hash function, and combines the vectors found: their sum, or their concatenation.

    Input: integer row ids in [0, 2**31 - 1), any shape. Output: [..., embedding_dim].

    Two ids that share a bucket in one table rarely share it in the others, so most ids still get a vector of
    their own (hash embeddings, Svenstrup et al. 2017, without the importance weights). With "sum" each table
    is [num_buckets, embedding_dim]; with "concat" it is [num_buckets, embedding_dim / num_hash_functions],
    which keeps the output width at `embedding_dim` for 1 / num_hash_functions of the parameters.

    The tables are one variable named "embeddings" (function k owns rows k * num_buckets onwards), looked up
    with `ops.take` and never cast under mixed precision, like CategoricalEmbedding's: row-sparse gradients,
    and the optimizer's embedding learning rate.
    """

    def __init__(
        self,
        num_buckets: int,
        embedding_dim: int,
        num_hash_functions: int = 2,
        combiner: str = "sum",
        embeddings_initializer: str | keras.initializers.Initializer = "uniform",
        embeddings_regularizer: str | keras.regularizers.Regularizer | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        require_integer("num_buckets", num_buckets)
        require_integer("embedding_dim", embedding_dim)
        if not is_integer(num_hash_functions) or not 1 <= num_hash_functions <= len(HASH_PARAMETERS):
            raise ValueError(
                f"`num_hash_functions` must be an integer from 1 to {len(HASH_PARAMETERS)}. "
                f"Received: num_hash_functions={num_hash_functions!r}"
            )
        if combiner not in COMBINERS:
            raise ValueError(f"`combiner` must be one of {list(COMBINERS)}. Received: combiner={combiner!r}")
        if combiner == "concat" and embedding_dim % num_hash_functions:
            raise ValueError(
                f"`embedding_dim` must be a multiple of `num_hash_functions` with combiner='concat', which "
                f"splits it between the tables; change either or use combiner='sum'. Received: "
                f"embedding_dim={embedding_dim}, num_hash_functions={num_hash_functions}"
            )
        self.num_buckets = int(num_buckets)
        self.embedding_dim = int(embedding_dim)
        self.num_hash_functions = int(num_hash_functions)
        self.combiner = combiner
        self.table_dim = self.embedding_dim // num_hash_functions if combiner == "concat" else self.embedding_dim
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.embeddings_regularizer = keras.regularizers.get(embeddings_regularizer)

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(self.num_hash_functions * self.num_buckets, self.table_dim),
            initializer=self.embeddings_initializer,
            regularizer=self.embeddings_regularizer,
            autocast=False,
        )

    def call(self, inputs: Any) -> Any:
        if not keras.backend.is_int_dtype(inputs.dtype):
            inputs = ops.cast(inputs, "int64")
        rows = ops.stack(
            [ops.add(self.bucket(inputs, k), k * self.num_buckets) for k in range(self.num_hash_functions)],
            axis=-1,
        )
        vectors = ops.cast(take_rows(self.embeddings, rows), self.compute_dtype)  # [..., hashes, dim]
        if self.combiner == "sum":
            return ops.sum(vectors, axis=-2)
        return ops.concatenate(ops.unstack(vectors, self.num_hash_functions, axis=-2), axis=-1)

    def bucket(self, ids: Any, function: int) -> Any:
        """Bucket of each id under hash function `function`: ((a1 a2 x + b) mod P) mod num_buckets."""
        first, second, offset = HASH_PARAMETERS[function]
        hashed = _add_mod_prime(_multiply_mod_prime(_multiply_mod_prime(ids, first), second), offset)
        return ops.mod(hashed, self.num_buckets)

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        return (*input_shape, self.embedding_dim)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            {
                "num_buckets": self.num_buckets,
                "embedding_dim": self.embedding_dim,
                "num_hash_functions": self.num_hash_functions,
                "combiner": self.combiner,
                "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer),
                "embeddings_regularizer": keras.regularizers.serialize(self.embeddings_regularizer),
            }
        )
        return config


def _multiply_mod_prime(x: Any, multiplier: int) -> Any:
    """multiplier * x mod HASH_PRIME for 0 <= x < HASH_PRIME and multiplier < sqrt(HASH_PRIME) (Schrage)."""
    quotient, remainder = divmod(HASH_PRIME, multiplier)
    product = ops.subtract(
        ops.multiply(ops.mod(x, quotient), multiplier), ops.multiply(ops.floor_divide(x, quotient), remainder)
    )
    return _wrap_negative(product)


def _add_mod_prime(x: Any, offset: int) -> Any:
    """x + offset mod HASH_PRIME for 0 <= x, offset < HASH_PRIME, without passing 2**31 - 1."""
    return _wrap_negative(ops.add(x, offset - HASH_PRIME))


def _wrap_negative(x: Any) -> Any:
    return ops.add(x, ops.multiply(ops.cast(ops.less(x, 0), x.dtype), HASH_PRIME))
