"""tf.data input from block TFRecords (components.schema): one tf.Example per block of rows, column-packed.

Whole blocks are read, shuffled and parsed, then re-cut into batches with tf ops, so no per-row Python and
no per-row parsing happens; this is what makes reading ~10x faster than one Example per row.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from components.schema import (
    BLOCK_CATEGORICAL_KEY,
    BLOCK_DENSE_KEY,
    BLOCK_LABEL_KEY,
    BLOCK_NUM_ROWS_KEY,
    DENSE_INPUT_DIM,
    NUM_CATEGORICAL,
)
from trainer.arguments import require_integer
from trainer.model_inputs import CATEGORICAL_INPUT, DENSE_INPUT

# Files read at once when shuffling: enough to mix minutes, few enough to keep memory flat.
MAX_PARALLEL_FILES = 8

_BLOCK_FEATURES = {
    BLOCK_NUM_ROWS_KEY: tf.io.FixedLenFeature([1], tf.int64),
    BLOCK_LABEL_KEY: tf.io.RaggedFeature(tf.float32),
    BLOCK_DENSE_KEY: tf.io.RaggedFeature(tf.float32),
    BLOCK_CATEGORICAL_KEY: tf.io.RaggedFeature(tf.int64),
}

Features = dict[str, tf.Tensor]


def parse_block(record: tf.Tensor) -> tuple[Features, tf.Tensor]:
    """One serialized block -> ({"dense": [n, DENSE_INPUT_DIM], "categorical": [n, NUM_CATEGORICAL]},
    label [n])."""
    parsed = tf.io.parse_single_example(record, _BLOCK_FEATURES)
    num_rows = parsed[BLOCK_NUM_ROWS_KEY][0]
    labels = parsed[BLOCK_LABEL_KEY]
    checks = [
        tf.debugging.assert_equal(
            tf.size(labels, out_type=tf.int64), num_rows, message="block label count differs from num_rows"
        )
    ]
    with tf.control_dependencies(checks):
        # reshape fails loudly when a packed column does not hold num_rows rows.
        dense = tf.reshape(parsed[BLOCK_DENSE_KEY], [num_rows, DENSE_INPUT_DIM])
        categorical = tf.reshape(parsed[BLOCK_CATEGORICAL_KEY], [num_rows, NUM_CATEGORICAL])
        labels = tf.identity(labels)
    return {DENSE_INPUT: dense, CATEGORICAL_INPUT: categorical}, labels


def block_dataset(
    files: Sequence[str],
    batch_size: int,
    shuffle: bool,
    seed: int,
    shuffle_buffer_blocks: int = 64,
) -> tf.data.Dataset:
    """Batches of ({"dense": float32 [B, 26], "categorical": int64 [B, 26]}, label float32 [B]).

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
    blocks = records.map(parse_block, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    # rebatch re-cuts blocks of any size into batches without a per-row element: 3.5-4.2 M rows/s here,
    # against 1.1-1.3 M rows/s for unbatch().batch() (2 cores, 600 K rows, batch 512 and 4096).
    return blocks.rebatch(batch_size).prefetch(tf.data.AUTOTUNE)
