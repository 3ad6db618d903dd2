"""Embeddings of many categorical features kept in one concatenated table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from trainer.arguments import is_integer, require_integer, require_integer_list
from trainer.layers.embedding_rows import take_rows
from trainer.layers.hot_table import HotTable
from trainer.layers.multi_hash_embedding import MultiHashEmbedding


@keras.saving.register_keras_serializable(package="ctr")
class CategoricalEmbedding(keras.layers.Layer):
    """Looks up F categorical features in T tables kept as one table of sum(table_sizes) rows.

    Input: integers [batch, F], column f holding row ids of table `feature_tables[f]` (by default column f
    reads table f, F = T). Output: [batch, F, embedding_dim]. Table t owns rows offset[t] .. offset[t] +
    table_sizes[t] - 1. Features that share a table (a feature spec's `table:`) read the same rows, and
    `embed_table` reads a table for any other ids (multi-valued and sequence features).

    One table means one gather per batch and one variable for the optimizer. The lookup is `ops.take`, whose
    gradient on the TensorFlow backend is a `tf.IndexedSlices`, so a sparse-aware optimizer (Adagrad)
    updates only the rows a batch touched. The table is never cast under mixed precision (only the looked-up
    rows are), since casting would copy the whole table on every step.

    Row ids are not range-checked: an id past its feature's table reads the next feature's rows.

    `row_l2` > 0 adds `row_l2` times the mean over the batch of the squared norms of the rows a training batch
    read (`call`'s columns) as a loss: an L2 penalty on the rows in use, whose gradient touches only those rows,
    so updates stay row-sparse and the rows no batch reads keep their values (a regularizer on the whole table
    would move every row every step).

    `rare_row_rate` > 0 (one number, or one per input column): in training, each value of `call`'s columns
    other than `missing_row` is read as `rare_row` with this probability (its column's; drawn anew every batch).
    The rare row is what a value never seen in training reads at serving; without this it learns only from the
    few training values below the admission count, so on a log whose later rows bring many new users it is
    close to its random initial value and their predictions are arbitrary.
    With it the rare row learns the average effect of an unknown value, the way
    dropout trains a layer to work without some of its inputs. Evaluation and serving read every row as is.

    Tables listed in `hashed_features` (indices into `table_sizes`) have no rows in that table: each gets a
    MultiHashEmbedding of `num_hash_functions` tables of `num_hash_buckets` rows, combined by `hash_combiner`,
    for vocabularies too large to give every value a row of its own. Their `offsets` entry is -1.

    Tables in `tiered_tables` (table index -> hot_rows) live on disk (trainer/row_store.py) with a hot tier
    in memory (trainer/hot_tier.py): each gets a HotTable of `hot_rows` slots, a variable of its own named
    "embeddings" (the embedding learning rate and row-sparse updates, as for this table), and its input
    columns carry SLOT ids, remapped from row ids before each step (trainer/tiered_training.py). Their `offsets`
    entry is -1. A tiered table cannot also be hashed, and tiering refuses `rare_row_rate` (the rare row would
    be drawn by row id inside the step, where only slot ids are known) and `embeddings_regularizer` (it would
    penalise every slot, and the rows on disk not at all).

    `row_multiple` > 1 gives the table variable a multiple of that many rows (`num_rows` rounded up; the rows
    past `num_rows` are never read), so that it splits evenly when it is sharded row-wise across that many
    devices (trainer/devices.py); each HotTable likewise (`hot_rows` rounded up: the hot tier never hands out
    the slots past `hot_rows`).
    """

    def __init__(
        self,
        table_sizes: Sequence[int],
        embedding_dim: int,
        embeddings_initializer: str | keras.initializers.Initializer = "uniform",
        embeddings_regularizer: str | keras.regularizers.Regularizer | None = None,
        hashed_features: Sequence[int] = (),
        num_hash_buckets: int | None = None,
        num_hash_functions: int = 2,
        hash_combiner: str = "sum",
        feature_tables: Sequence[int] | None = None,
        row_l2: float = 0.0,
        rare_row_rate: float = 0.0,
        rare_row: int = 0,
        missing_row: int = 1,
        seed: int | None = None,
        row_multiple: int = 1,
        tiered_tables: Mapping[int | str, int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        require_integer("row_multiple", row_multiple)
        self.row_multiple = int(row_multiple)
        require_integer_list("table_sizes", table_sizes)
        if isinstance(row_l2, bool) or not isinstance(row_l2, int | float) or not row_l2 >= 0:
            raise ValueError(f"`row_l2` must be a number >= 0. Received: row_l2={row_l2!r}")
        self.row_l2 = float(row_l2)
        rates = list(rare_row_rate) if isinstance(rare_row_rate, list | tuple) else [rare_row_rate]
        if (not rates or any(isinstance(r, bool) or not isinstance(r, int | float) or not 0 <= r < 1 for r in rates)
                or len(rates) not in (1, len(feature_tables) if feature_tables is not None else len(table_sizes))):
            raise ValueError(f"`rare_row_rate` must be a number in [0, 1), or one per input column. Received: "
                             f"rare_row_rate={rare_row_rate!r}")
        if not (is_integer(rare_row) and is_integer(missing_row) and rare_row >= 0 and missing_row >= 0):
            raise ValueError(f"`rare_row` and `missing_row` must be row ids >= 0. Received: {rare_row!r}, "
                             f"{missing_row!r}")
        self.rare_row_rate = float(rates[0]) if len(rates) == 1 else [float(r) for r in rates]
        self.rare_row = int(rare_row)
        self.missing_row = int(missing_row)
        self.seed = seed
        self.seed_generator = None  # made in build, so that an unbuilt copy (from_config) makes no variable
        require_integer("embedding_dim", embedding_dim)
        num_features = len(table_sizes)  # tables, from here on
        if feature_tables is None:
            feature_tables = range(num_features)
        if isinstance(feature_tables, str | bytes) or not all(is_integer(t) and 0 <= t < num_features
                                                               for t in feature_tables):
            raise ValueError(f"`feature_tables` must give each input column a table index in [0, {num_features}). "
                             f"Received: feature_tables={feature_tables!r}")
        self.feature_tables = [int(t) for t in feature_tables]
        if (
            isinstance(hashed_features, str | bytes)
            or not hasattr(hashed_features, "__len__")
            or not all(is_integer(f) and 0 <= f < num_features for f in hashed_features)
            or len(set(hashed_features)) != len(hashed_features)
        ):
            raise ValueError(
                f"`hashed_features` must list distinct feature indices in [0, {num_features}), one per "
                f"feature of `table_sizes` to hash. Received: hashed_features={hashed_features!r}"
            )
        self.table_sizes = [int(s) for s in table_sizes]
        self.embedding_dim = embedding_dim
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.embeddings_regularizer = keras.regularizers.get(embeddings_regularizer)
        self.hashed_features = [int(f) for f in hashed_features]
        self.num_hash_buckets = num_hash_buckets
        self.num_hash_functions = num_hash_functions
        self.hash_combiner = hash_combiner
        if self.hashed_features:
            require_integer("num_hash_buckets", num_hash_buckets)
        self.hashed_embeddings = [
            MultiHashEmbedding(
                num_hash_buckets, embedding_dim, num_hash_functions, hash_combiner,
                embeddings_initializer=self.embeddings_initializer,
                embeddings_regularizer=self.embeddings_regularizer,
                dtype=self.dtype_policy, name=f"hashed_feature_{f}",
            )
            for f in self.hashed_features
        ]
        self.tiered_tables = tiered_tables_of(tiered_tables, num_features, self.hashed_features)
        if self.tiered_tables and (self.draws_rare_rows or self.embeddings_regularizer is not None):
            raise ValueError(
                "`tiered_tables` cannot be combined with `rare_row_rate` > 0 or an `embeddings_regularizer`: the "
                "rare row is drawn by row id inside the step, where a tiered column holds slot ids, and a "
                "regularizer would penalise every slot of the hot tier. Received: "
                f"rare_row_rate={self.rare_row_rate!r}, embeddings_regularizer={embeddings_regularizer!r}; set "
                "rare_row_rate=0 and embeddings_regularizer=None (row_l2 works with tiered tables)")
        self.hot_tables = [
            HotTable(-(-hot_rows // self.row_multiple) * self.row_multiple, embedding_dim, dtype=self.dtype_policy,
                     name=f"tiered_table_{table}")
            for table, hot_rows in self.tiered_tables.items()
        ]
        self.tabled_features = [f for f in range(num_features)
                                if f not in self.hashed_features and f not in self.tiered_tables]
        tabled_sizes = [self.table_sizes[f] for f in self.tabled_features]
        self.offsets = np.full(num_features, -1, dtype=np.int64)
        self.offsets[self.tabled_features] = np.cumsum([0, *tabled_sizes])[:-1]
        self.num_rows = int(sum(tabled_sizes))
        # Input columns by where their table lives, and the position of each column among [tabled columns...,
        # hashed columns...], to restore column order.
        self._tabled_columns = [f for f, t in enumerate(self.feature_tables) if t not in self.hashed_features]
        self._tabled_columns = [f for f in self._tabled_columns if self.feature_tables[f] not in self.tiered_tables]
        self._hashed_columns = [f for f, t in enumerate(self.feature_tables) if t in self.hashed_features]
        self._column_offsets = np.asarray([self.offsets[t] for t in self.feature_tables], dtype=np.int64)
        ordered = self._tabled_columns + self._hashed_columns + [
            column for table in self.tiered_tables for column in self.tiered_columns(table)]
        self._feature_order = np.argsort(ordered).astype(np.int64)

    @property
    def draws_rare_rows(self) -> bool:
        return bool(np.any(np.asarray(self.rare_row_rate) > 0))

    @property
    def num_features(self) -> int:
        """Input columns."""
        return len(self.feature_tables)

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        if input_shape[-1] != len(self.feature_tables):
            raise ValueError(
                f"CategoricalEmbedding reads {len(self.feature_tables)} columns, so its input must be "
                f"[batch, {len(self.feature_tables)}]. Received: input_shape={input_shape}"
            )
        if self.num_rows:  # every feature hashed: no table
            self.embeddings = self.add_weight(
                name="embeddings",
                shape=(-(-self.num_rows // self.row_multiple) * self.row_multiple, self.embedding_dim),
                initializer=self.embeddings_initializer,
                regularizer=self.embeddings_regularizer,
                autocast=False,
            )
        for hashed in self.hashed_embeddings:
            hashed.build(tuple(input_shape[:-1]))
        for hot in self.hot_tables:
            hot.build(tuple(input_shape[:-1]))
        if self.draws_rare_rows:
            # Only a layer that draws has a generator. Its state is a variable but not one of `weights`, so
            # deltas, warm starts and weight files see the same weights with and without it.
            self.seed_generator = keras.random.SeedGenerator(self.seed, name="rare_row_draws")

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        if training and self.draws_rare_rows:
            inputs = self._as_rare(inputs)
        output = self._lookup(inputs)
        if training and self.row_l2:
            values = ops.cast(output, "float32")
            self.add_loss(self.row_l2 * ops.mean(ops.sum(ops.square(values), axis=(-2, -1))))
        return output

    def _as_rare(self, ids: Any) -> Any:
        """`ids` with each value other than `missing_row` replaced by `rare_row` with probability rare_row_rate."""
        if not keras.backend.is_int_dtype(ids.dtype):
            ids = ops.cast(ids, "int64")
        draws = keras.random.uniform(ops.shape(ids), seed=self.seed_generator)
        rates = ops.convert_to_tensor(np.asarray(self.rare_row_rate, dtype="float32"))
        replace = ops.logical_and(ops.less(draws, rates), ops.not_equal(ids, self.missing_row))
        return ops.where(replace, ops.cast(self.rare_row, ids.dtype), ids)

    def _lookup(self, inputs: Any) -> Any:
        if not keras.backend.is_int_dtype(inputs.dtype):
            inputs = ops.cast(inputs, "int64")
        if not self._hashed_columns and not self.tiered_tables:
            rows = ops.add(inputs, ops.convert_to_tensor(self._column_offsets, dtype=inputs.dtype))
            return ops.cast(take_rows(self.embeddings, rows), self.compute_dtype)
        parts = []
        if self._tabled_columns:
            ids = ops.take(inputs, self._tabled_columns, axis=-1)
            offsets = ops.convert_to_tensor(self._column_offsets[self._tabled_columns], dtype=inputs.dtype)
            parts.append(ops.cast(take_rows(self.embeddings, ops.add(ids, offsets)), self.compute_dtype))
        for column in self._hashed_columns:
            hashed = self.hashed_embeddings[self.hashed_features.index(self.feature_tables[column])]
            parts.append(ops.expand_dims(hashed(ops.take(inputs, column, axis=-1)), -2))
        for table, hot in zip(self.tiered_tables, self.hot_tables, strict=True):
            # All of a table's columns in one gather, batch-major like the one-table lookup above, so that a
            # row's gradients are summed in the same order whether its table is tiered or not.
            slots = ops.take(inputs, self.tiered_columns(table), axis=-1)
            parts.append(ops.cast(hot(slots), self.compute_dtype))
        return ops.take(ops.concatenate(parts, axis=-2), self._feature_order, axis=-2)

    def embed_feature(self, ids: Any, feature: int) -> Any:
        """Row ids of input column `feature`'s table, any shape (a behaviour sequence [batch, length]) ->
        [..., embedding_dim], read from the rows `call` reads for that column."""
        if not is_integer(feature) or not 0 <= feature < len(self.feature_tables):
            raise ValueError(
                f"`feature` must be a column index in [0, {len(self.feature_tables)}). Received: feature={feature!r}"
            )
        return self.embed_table(ids, self.feature_tables[feature])

    def embed_table(self, ids: Any, table: int) -> Any:
        """Row ids of table `table`, any shape -> [..., embedding_dim]."""
        if not is_integer(table) or not 0 <= table < len(self.table_sizes):
            raise ValueError(f"`table` must be a table index in [0, {len(self.table_sizes)}). Received: {table!r}")
        if not keras.backend.is_int_dtype(ids.dtype):
            ids = ops.cast(ids, "int64")
        if table in self.hashed_features:
            return self.hashed_embeddings[self.hashed_features.index(table)](ids)
        if table in self.tiered_tables:  # slot ids, remapped like call's columns
            return ops.cast(self.hot_table(table)(ids), self.compute_dtype)
        rows = ops.add(ids, int(self.offsets[table]))
        return ops.cast(take_rows(self.embeddings, rows), self.compute_dtype)

    def tiered_columns(self, table: int) -> list[int]:
        """The input columns that read table `table`."""
        return [column for column, t in enumerate(self.feature_tables) if t == table]

    def hot_table(self, table: int) -> HotTable:
        """The HotTable of tiered table `table`."""
        if table not in self.tiered_tables:
            raise ValueError(f"Table {table!r} is not tiered; the tiered tables are {sorted(self.tiered_tables)}")
        return self.hot_tables[list(self.tiered_tables).index(table)]

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        return (*input_shape, self.embedding_dim)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            {
                "table_sizes": list(self.table_sizes),
                "embedding_dim": self.embedding_dim,
                "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer),
                "embeddings_regularizer": keras.regularizers.serialize(self.embeddings_regularizer),
                "hashed_features": list(self.hashed_features),
                "num_hash_buckets": self.num_hash_buckets,
                "num_hash_functions": self.num_hash_functions,
                "hash_combiner": self.hash_combiner,
                "feature_tables": list(self.feature_tables),
                "row_l2": self.row_l2,
                "rare_row_rate": self.rare_row_rate,
                "rare_row": self.rare_row,
                "missing_row": self.missing_row,
                "seed": self.seed,
                "row_multiple": self.row_multiple,
                "tiered_tables": dict(self.tiered_tables),
            }
        )
        return config


def tiered_tables_of(tiered_tables: Mapping[int | str, int] | None, num_tables: int,
                     hashed_features: Sequence[int]) -> dict[int, int]:
    """`tiered_tables` checked and as {table: hot_rows} in table order. Keys may be strings of digits, as a
    saved config's JSON gives them back."""
    if tiered_tables is None:
        return {}
    valid = isinstance(tiered_tables, Mapping)
    checked: dict[int, int] = {}
    for key, hot_rows in (tiered_tables.items() if valid else ()):
        table = int(key) if isinstance(key, str) and key.isdigit() else key
        if not (is_integer(table) and 0 <= table < num_tables and table not in hashed_features
                and is_integer(hot_rows) and hot_rows >= 1):
            valid = False
            break
        checked[int(table)] = int(hot_rows)
    if not valid:
        raise ValueError(
            f"`tiered_tables` must map table indices in [0, {num_tables}) that are not hashed to a number of hot "
            f"rows >= 1, e.g. {{1: 100000}}. Received: tiered_tables={tiered_tables!r}")
    return dict(sorted(checked.items()))
