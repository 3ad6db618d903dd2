"""tf.data input from block TFRecords (components.block_codec): one tf.Example per block of rows, column-packed.

Whole blocks are read, shuffled and parsed, then re-cut into batches with tf ops, so no per-row Python and
no per-row parsing happens; this is what makes reading ~10x faster than one Example per row.

`row_dataset` reads the row layouts of trainer.row_layout (one Example per row) into the same batches, for
comparison and for data written that way. trainer.block_reader reads block files without TensorFlow.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from components.block_codec import (
    BLOCK_CATEGORICAL_KEY,
    BLOCK_DENSE_KEY,
    BLOCK_LABEL_KEY,
    BLOCK_LAYOUT,
    BLOCK_NUM_ROWS_KEY,
)
from trainer import row_layout
from trainer.arguments import require_integer
from trainer.model_inputs import CATEGORICAL_INPUT, CRITEO_INPUTS, DENSE_INPUT, ModelInputs

# Files read at once when shuffling: enough to mix minutes, few enough to keep memory flat.
MAX_PARALLEL_FILES = 8
# Blocks parsed per parse_example call (bench/bench_input.py: 1, 2, 8 and 32 blocks of 1024 rows read at
# 1.55, 2.1, 2.4 and 2.3 M rows/s on 2 shared cores).
PARSE_BLOCKS = 8

Features = dict[str, tf.Tensor]


def _block_widths(inputs: ModelInputs) -> dict[str, int]:
    """Values per row of every packed key of the block layout."""
    return {BLOCK_DENSE_KEY: inputs.dense_dim, BLOCK_CATEGORICAL_KEY: len(inputs.feature_tables),
            **{item.key: item.length for item in inputs.lists}}


def parse_blocks(records: tf.Tensor, inputs: ModelInputs = CRITEO_INPUTS) -> tuple[Features, tf.Tensor]:
    """A batch of serialized blocks -> their rows, in order: ({"dense": [n, dense_dim], "categorical": [n, F],
    one [n, max_length] per list feature}, label [n]), as `inputs` (the feature spec's, model_inputs) says.
    One parse_example over several blocks costs less per row than one parse per block (~1.5x faster reading
    here). Fails loudly when a block's columns do not hold its num_rows rows."""
    widths = _block_widths(inputs)
    spec = {BLOCK_NUM_ROWS_KEY: tf.io.FixedLenFeature([1], tf.int64),
            BLOCK_LABEL_KEY: tf.io.RaggedFeature(tf.float32),
            BLOCK_DENSE_KEY: tf.io.RaggedFeature(tf.float32),
            **{key: tf.io.RaggedFeature(tf.int64) for key in widths if key != BLOCK_DENSE_KEY}}
    parsed = tf.io.parse_example(records, spec)
    num_rows = parsed[BLOCK_NUM_ROWS_KEY][:, 0]
    labels = parsed[BLOCK_LABEL_KEY]

    def lengths(name: str) -> tf.Tensor:
        return tf.cast(parsed[name].row_lengths(), tf.int64)

    checks = [tf.debugging.assert_equal(lengths(BLOCK_LABEL_KEY), num_rows,
                                        message="block label count differs from num_rows")]
    checks += [tf.debugging.assert_equal(lengths(key), num_rows * width,
                                         message=f"block {key} values differ from num_rows x {width}")
               for key, width in widths.items() if width]
    with tf.control_dependencies(checks):
        total = tf.cast(tf.reduce_sum(num_rows), tf.int32)  # not -1: a spec without dense features has width 0
        features = {key: tf.reshape(parsed[key].flat_values, [total, width]) for key, width in widths.items()}
        labels = tf.identity(labels.flat_values)
    return features, labels


def parse_block(record: tf.Tensor, inputs: ModelInputs = CRITEO_INPUTS) -> tuple[Features, tf.Tensor]:
    """One serialized block -> its rows, as parse_blocks gives them."""
    return parse_blocks(tf.expand_dims(record, 0), inputs)


def block_dataset(
    files: Sequence[str],
    batch_size: int,
    shuffle: bool,
    seed: int,
    shuffle_buffer_blocks: int = 64,
    inputs: ModelInputs = CRITEO_INPUTS,
) -> tf.data.Dataset:
    """Batches of ({"dense": float32 [B, dense_dim], "categorical": int64 [B, F], list features: int64
    [B, max_length]}, label float32 [B]) as `inputs` describes them (criteo: dense and categorical [B, 26]).

    shuffle=False: files in the given order, rows in file order; the last batch may be short.
    shuffle=True: file order, file interleaving and block order are shuffled (reshuffled every epoch,
    deterministic for a seed); rows keep their order inside a block.
    """
    if not files:
        raise ValueError("block_dataset needs at least one file; received an empty list")
    require_integer("batch_size", batch_size)
    require_integer("shuffle_buffer_blocks", shuffle_buffer_blocks)
    file_names = tf.data.Dataset.from_tensor_slices([str(f) for f in files])
    if shuffle:
        file_names = file_names.shuffle(len(files), seed=seed, reshuffle_each_iteration=True)
        records = file_names.interleave(
            tf.data.TFRecordDataset,
            cycle_length=min(len(files), MAX_PARALLEL_FILES),
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=True,
        )
        records = records.shuffle(shuffle_buffer_blocks, seed=seed, reshuffle_each_iteration=True)
    else:
        records = file_names.interleave(tf.data.TFRecordDataset, cycle_length=1)
    blocks = records.batch(PARSE_BLOCKS).map(lambda batch: parse_blocks(batch, inputs),
                                             num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    # rebatch re-cuts blocks of any size into batches without a per-row element: 3.5-4.2 M rows/s here,
    # against 1.1-1.3 M rows/s for unbatch().batch() (2 cores, 600 K rows, batch 512 and 4096).
    return blocks.rebatch(batch_size).prefetch(tf.data.AUTOTUNE)


def packed_row_features(inputs: ModelInputs = CRITEO_INPUTS) -> dict[str, tf.io.FixedLenFeature]:
    """The packed row layout's Example keys for a model reading `inputs` (bench/bench_input.py parses them one
    Example at a time)."""
    return {
        row_layout.PACKED_LABEL_KEY: tf.io.FixedLenFeature([], tf.float32),
        row_layout.PACKED_DENSE_KEY: tf.io.FixedLenFeature([inputs.dense_dim], tf.float32),
        row_layout.PACKED_CATEGORICAL_KEY: tf.io.FixedLenFeature([len(inputs.feature_tables)], tf.int64),
    }


def per_column_row_features(columns: row_layout.RowColumns) -> dict[str, tf.io.FixedLenFeature]:
    """The per-column layout's Example keys. A missing dense field is absent from the Example and parses as NaN,
    which becomes value 0 and, for a feature with a missing flag, flag 1."""
    return {
        row_layout.LABEL_KEY: tf.io.FixedLenFeature([], tf.float32),
        **{name: tf.io.FixedLenFeature([], tf.float32, default_value=float("nan")) for name in columns.dense},
        **{name: tf.io.FixedLenFeature([], tf.int64) for name in columns.categorical},
        **{name: tf.io.FixedLenFeature([width], tf.int64) for name, width in columns.lists},
    }


def parse_packed_rows(records: tf.Tensor, inputs: ModelInputs = CRITEO_INPUTS) -> tuple[Features, tf.Tensor]:
    """A batch of serialized packed-row Examples -> (features, label), as `block_dataset` yields them."""
    parsed = tf.io.parse_example(records, packed_row_features(inputs))
    features = {DENSE_INPUT: parsed[row_layout.PACKED_DENSE_KEY],
                CATEGORICAL_INPUT: parsed[row_layout.PACKED_CATEGORICAL_KEY]}
    return features, parsed[row_layout.PACKED_LABEL_KEY]


def parse_per_column_rows(records: tf.Tensor, columns: row_layout.RowColumns = row_layout.CRITEO_ROW_COLUMNS
                          ) -> tuple[Features, tf.Tensor]:
    """A batch of serialized one-feature-per-column Examples -> (features, label)."""
    parsed = tf.io.parse_example(records, per_column_row_features(columns))
    if columns.dense:
        values = tf.stack([parsed[name] for name in columns.dense], axis=1)
        missing = tf.math.is_nan(values)
        parts = [tf.where(missing, 0.0, values)]
        if any(columns.flagged):
            flagged = [i for i, has_flag in enumerate(columns.flagged) if has_flag]
            parts.append(tf.cast(tf.gather(missing, flagged, axis=1), tf.float32))
        dense = tf.concat(parts, axis=1)
    else:
        dense = tf.zeros([tf.shape(records)[0], 0], tf.float32)
    categorical = tf.stack([parsed[name] for name in columns.categorical], axis=1) if columns.categorical \
        else tf.zeros([tf.shape(records)[0], 0], tf.int64)
    lists = {name: parsed[name] for name, _ in columns.lists}
    return {DENSE_INPUT: dense, CATEGORICAL_INPUT: categorical, **lists}, parsed[row_layout.LABEL_KEY]


def row_dataset(
    files: Sequence[str],
    batch_size: int,
    shuffle: bool,
    seed: int,
    layout: str = row_layout.PACKED,
    compression: str | None = None,
    shuffle_buffer_rows: int = 16_384,
    inputs: ModelInputs = CRITEO_INPUTS,
    columns: row_layout.RowColumns = row_layout.CRITEO_ROW_COLUMNS,
) -> tf.data.Dataset:
    """Batches from row-layout files (trainer.row_layout), with the structure, dtypes and shapes of
    `block_dataset`'s: the packed layout's widths from `inputs`, the per-column layout's features from `columns`
    (the spec's, row_layout.RowColumns.of).

    Records are batched before parsing, so each batch is one vectorized `parse_example` call: the fastest way
    to read this layout. shuffle=False keeps file order and row order; shuffle=True shuffles file order,
    interleaves files and shuffles rows in a buffer of `shuffle_buffer_rows`.
    """
    if not files:
        raise ValueError("row_dataset needs at least one file; received an empty list")
    row_layout.check_layout(layout)
    compression_type = row_layout.check_compression(compression)
    require_integer("batch_size", batch_size)
    require_integer("shuffle_buffer_rows", shuffle_buffer_rows)

    def read(path: tf.Tensor) -> tf.data.Dataset:
        return tf.data.TFRecordDataset(path, compression_type=compression_type)

    file_names = tf.data.Dataset.from_tensor_slices([str(f) for f in files])
    if shuffle:
        file_names = file_names.shuffle(len(files), seed=seed, reshuffle_each_iteration=True)
        records = file_names.interleave(
            read, cycle_length=min(len(files), MAX_PARALLEL_FILES),
            num_parallel_calls=tf.data.AUTOTUNE, deterministic=True,
        )
        records = records.shuffle(shuffle_buffer_rows, seed=seed, reshuffle_each_iteration=True)
    else:
        records = file_names.interleave(read, cycle_length=1)
    if layout == row_layout.PACKED:
        def parse(batch: tf.Tensor) -> tuple[Features, tf.Tensor]:
            return parse_packed_rows(batch, inputs)
    else:
        def parse(batch: tf.Tensor) -> tuple[Features, tf.Tensor]:
            return parse_per_column_rows(batch, columns)
    batches = records.batch(batch_size).map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return batches.prefetch(tf.data.AUTOTUNE)


def samples_dataset(
    files: Sequence[str],
    batch_size: int,
    shuffle: bool,
    seed: int,
    layout: str = BLOCK_LAYOUT,
    shuffle_buffer_blocks: int = 64,
    inputs: ModelInputs = CRITEO_INPUTS,
    columns: row_layout.RowColumns = row_layout.CRITEO_ROW_COLUMNS,
) -> tf.data.Dataset:
    """Batches from the sample job's files in the layout their manifest records (its "layout"): blocks
    (BLOCK_LAYOUT) or one per-column Example per row (row_layout.ROW_LAYOUT, named after `columns`: the spec's
    RowColumns). Same structure either way."""
    if layout == BLOCK_LAYOUT:
        return block_dataset(files, batch_size, shuffle, seed, shuffle_buffer_blocks=shuffle_buffer_blocks,
                             inputs=inputs)
    if layout == row_layout.ROW_LAYOUT:
        return row_dataset(files, batch_size, shuffle, seed, layout=row_layout.PER_COLUMN,
                           shuffle_buffer_rows=shuffle_buffer_blocks * 1024, inputs=inputs, columns=columns)
    raise ValueError(f"samples in layout {layout!r} cannot be read; this trainer reads {BLOCK_LAYOUT!r} and "
                     f"{row_layout.ROW_LAYOUT!r} (the manifest's 'layout')")
