"""Input speed by TFRecord layout: read + parse rows/s of the same rows written as blocks (the sample job's
layout), as one packed Example per row (uncompressed and GZIP; batched then parsed, and parsed one Example at a
time), and as one feature per column per row; plus the TensorFlow-free numpy block reader. Same rows, same
run. Writes bench/results/input.json.

    make bench-input

TensorFlow readers are timed with `Dataset.reduce` (the whole pipeline runs in C++, as it does under `fit`),
unshuffled, in batches of BATCH_SIZE; the numpy reader is a Python loop over its batches. Best of REPEATS.
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.provenance import provenance
from components.block_codec import encode_blocks, frame_records
from components.schema import DENSE_INPUT_DIM, NUM_CATEGORICAL, NUM_DENSE
from trainer.block_reader import block_batches
from trainer.row_layout import GZIP, PACKED, PER_COLUMN, write_row_files

NUM_ROWS = 400_000
NUM_FILES = 4
BLOCK_ROWS = 1024
BATCH_SIZE = 2048
REPEATS = 3
NUM_VALUES = 100_000  # ids of up to 3 varint bytes, as real vocabularies have


def make_rows(num_rows: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    missing = rng.random((num_rows, NUM_DENSE)) < 0.1
    values = np.where(missing, 0.0, rng.standard_normal((num_rows, NUM_DENSE)))
    dense = np.concatenate([values, missing], axis=1).astype(np.float32)
    categorical = rng.integers(2, NUM_VALUES + 2, (num_rows, NUM_CATEGORICAL)).astype(np.int64)
    labels = (rng.random(num_rows) < 0.25).astype(np.float32)
    assert dense.shape[1] == DENSE_INPUT_DIM
    return labels, dense, categorical


def write_block_files(directory: Path, labels, dense, categorical) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, len(labels), NUM_FILES + 1).astype(int)
    paths = []
    for index, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        path = directory / f"part-{index:05d}.tfrecord"
        records = encode_blocks(labels[start:stop], dense[start:stop], categorical[start:stop], BLOCK_ROWS)
        path.write_bytes(frame_records(records))
        paths.append(str(path))
    return paths


def best_rows_per_second(read: Callable[[], int]) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        started = time.perf_counter()
        num_rows = read()
        best = min(best, time.perf_counter() - started)
        if num_rows != NUM_ROWS:
            raise RuntimeError(f"read {num_rows} rows, expected {NUM_ROWS}: the reader lost or duplicated rows")
    return NUM_ROWS / best


def count_rows(dataset) -> int:
    import tensorflow as tf

    return int(dataset.reduce(tf.constant(0, tf.int64), lambda total, batch: total + tf.shape(batch[1], tf.int64)[0]))


def per_example_dataset(files: list[str]):
    """Packed rows parsed one Example at a time, then batched: how a first input function often reads."""
    import tensorflow as tf

    from trainer.input import packed_row_features

    def parse(record):
        example = tf.io.parse_single_example(record, packed_row_features())
        return {"dense": example["dense"], "categorical": example["categorical"]}, example["label"]

    records = tf.data.TFRecordDataset(files)
    return records.map(parse, num_parallel_calls=tf.data.AUTOTUNE).batch(BATCH_SIZE).prefetch(tf.data.AUTOTUNE)


def fixed_block_dataset(files: list[str]):
    """The block reader as it was before the feature spec (fixed keys and widths: dense 26, categorical 26),
    with the same pipeline as trainer.input.block_dataset: the baseline the spec-driven parse is held to."""
    import tensorflow as tf

    from trainer.input import PARSE_BLOCKS

    features = {"num_rows": tf.io.FixedLenFeature([1], tf.int64), "label": tf.io.RaggedFeature(tf.float32),
                "dense": tf.io.RaggedFeature(tf.float32), "categorical": tf.io.RaggedFeature(tf.int64)}

    def parse(records):
        parsed = tf.io.parse_example(records, features)
        num_rows = parsed["num_rows"][:, 0]
        checks = [tf.debugging.assert_equal(tf.cast(parsed[k].row_lengths(), tf.int64), num_rows * w)
                  for k, w in (("label", 1), ("dense", DENSE_INPUT_DIM), ("categorical", NUM_CATEGORICAL))]
        with tf.control_dependencies(checks):
            dense = tf.reshape(parsed["dense"].flat_values, [-1, DENSE_INPUT_DIM])
            categorical = tf.reshape(parsed["categorical"].flat_values, [-1, NUM_CATEGORICAL])
            labels = tf.identity(parsed["label"].flat_values)
        return {"dense": dense, "categorical": categorical}, labels

    records = tf.data.Dataset.from_tensor_slices(files).interleave(tf.data.TFRecordDataset, cycle_length=1)
    blocks = records.batch(PARSE_BLOCKS).map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return blocks.rebatch(BATCH_SIZE).prefetch(tf.data.AUTOTUNE)


def main() -> int:
    from trainer.input import block_dataset, row_dataset

    labels, dense, categorical = make_rows(NUM_ROWS, seed=0)
    with tempfile.TemporaryDirectory(prefix="bench-input-") as tmp:
        root = Path(tmp)
        blocks = write_block_files(root / "block", labels, dense, categorical)
        rows = write_row_files(root / "row", labels, dense, categorical, NUM_FILES, layout=PACKED)
        rows_gzip = write_row_files(root / "row_gzip", labels, dense, categorical, NUM_FILES, PACKED, GZIP)
        per_column = write_row_files(root / "per_column", labels, dense, categorical, NUM_FILES, PER_COLUMN)
        sizes = {
            name: sum(Path(f).stat().st_size for f in files)
            for name, files in (("block", blocks), ("row", rows), ("row_gzip", rows_gzip), ("per_column", per_column))
        }
        result: dict[str, object] = {
            "block_rows_per_s": best_rows_per_second(
                lambda: count_rows(block_dataset(blocks, BATCH_SIZE, shuffle=False, seed=0))
            ),
            "block_fixed_keys_rows_per_s": best_rows_per_second(lambda: count_rows(fixed_block_dataset(blocks))),
            "row_rows_per_s": best_rows_per_second(
                lambda: count_rows(row_dataset(rows, BATCH_SIZE, shuffle=False, seed=0))
            ),
            "row_gzip_rows_per_s": best_rows_per_second(
                lambda: count_rows(row_dataset(rows_gzip, BATCH_SIZE, shuffle=False, seed=0, compression=GZIP))
            ),
            "row_per_column_rows_per_s": best_rows_per_second(
                lambda: count_rows(row_dataset(per_column, BATCH_SIZE, shuffle=False, seed=0, layout=PER_COLUMN))
            ),
            "row_per_example_rows_per_s": best_rows_per_second(lambda: count_rows(per_example_dataset(rows))),
            "numpy_block_rows_per_s": best_rows_per_second(
                lambda: sum(len(label) for _, label in block_batches(blocks, BATCH_SIZE))
            ),
        }
    # The spec-driven reader (the criteo spec's inputs) against the fixed-key reader it replaced, same files.
    result["block_over_block_fixed_keys"] = result["block_rows_per_s"] / result["block_fixed_keys_rows_per_s"]
    result["block_over_row"] = result["block_rows_per_s"] / result["row_rows_per_s"]
    result["block_over_row_gzip"] = result["block_rows_per_s"] / result["row_gzip_rows_per_s"]
    result["block_over_row_per_column"] = result["block_rows_per_s"] / result["row_per_column_rows_per_s"]
    result["block_over_row_per_example"] = result["block_rows_per_s"] / result["row_per_example_rows_per_s"]
    result.update(
        {
            "rows": NUM_ROWS, "files": NUM_FILES, "block_rows": BLOCK_ROWS, "batch_size": BATCH_SIZE,
            "repeats": REPEATS, "bytes": sizes,
            "note": "read + parse, unshuffled, best of repeats, same rows in every layout; TF readers timed with "
                    "Dataset.reduce, the numpy reader (no TensorFlow) with a Python loop on one core",
            "machine": platform.machine(), "python": sys.version.split()[0], "command": "make bench-input",
        }
    )
    result = {**provenance(result["command"]), **result}
    out = Path(__file__).parent / "results" / "input.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
