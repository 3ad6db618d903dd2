import hashlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from components.block_codec import encode_blocks, frame_records
from components.schema import DENSE_INPUT_DIM, NUM_CATEGORICAL
from tests.trainer.synthetic import Rows, random_rows, write_block_files
from trainer.block_reader import BlockFormatError, block_batches, decode_block, read_records

NUM_ROWS = 2500
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rows() -> Rows:
    rows = random_rows(NUM_ROWS, num_values=30, seed=3)
    rows.categorical[:, 0] = np.arange(NUM_ROWS)  # a row id, to find each row after shuffling
    return rows


@pytest.fixture(scope="module")
def files(rows, tmp_path_factory) -> list[str]:
    # 1250 rows per file in blocks of 300 x 4 + 50: unequal blocks, and batches that straddle blocks and files.
    return write_block_files(rows, tmp_path_factory.mktemp("blocks"), num_files=2, block_rows=300)


def concatenated(batches) -> tuple[list[int], Rows]:
    batches = list(batches)
    sizes = [len(label) for _, label in batches]
    return sizes, Rows(
        np.concatenate([label for _, label in batches]),
        np.concatenate([features["dense"] for features, _ in batches]),
        np.concatenate([features["categorical"] for features, _ in batches]),
    )


@pytest.mark.integration
@pytest.mark.parametrize("batch_size", [1, 256, 1250, 4096])
def test_gives_exactly_the_batches_of_block_dataset(files, batch_size):
    from trainer.input import block_dataset

    expected = list(block_dataset(files, batch_size, shuffle=False, seed=0).as_numpy_iterator())
    actual = list(block_batches(files, batch_size))
    assert [len(label) for _, label in actual] == [len(label) for _, label in expected]
    for (features, label), (expected_features, expected_label) in zip(actual, expected, strict=True):
        for name in ("dense", "categorical"):
            assert features[name].dtype == expected_features[name].dtype
            np.testing.assert_array_equal(features[name], expected_features[name])
        assert label.dtype == expected_label.dtype == np.float32
        np.testing.assert_array_equal(label, expected_label)


@pytest.mark.unit
def test_reads_every_row_in_file_order(rows, files):
    sizes, read = concatenated(block_batches(files, batch_size=1000))
    assert sizes == [1000, 1000, 500]
    assert read.dense.dtype == np.float32 and read.categorical.dtype == np.int64
    np.testing.assert_array_equal(read.labels, rows.labels)
    np.testing.assert_array_equal(read.dense, rows.dense)
    np.testing.assert_array_equal(read.categorical, rows.categorical)
    sizes, _ = concatenated(block_batches(files, batch_size=1000, drop_remainder=True))
    assert sizes == [1000, 1000]


@pytest.mark.unit
def test_shuffled_reads_every_row_once_and_keeps_blocks_whole(rows, files):
    sizes, read = concatenated(block_batches(files, 700, shuffle=True, seed=4, shuffle_buffer_blocks=3))
    assert sizes == [700, 700, 700, 400]
    order = read.categorical[:, 0]
    assert sorted(order.tolist()) == list(range(NUM_ROWS))
    assert not np.array_equal(order, np.arange(NUM_ROWS))
    np.testing.assert_array_equal(read.labels, rows.labels[order])
    np.testing.assert_array_equal(read.dense, rows.dense[order])
    # Each file holds blocks [0, 300), [300, 600), ... [1200, 1250) of its rows: each is read whole, in order.
    position = np.argsort(order)
    for start in [0, 300, 600, 900, 1200, 1250, 1550, 1850, 2150, 2450]:
        stop = min(start + 300, 1250 if start < 1250 else NUM_ROWS)
        np.testing.assert_array_equal(np.diff(position[start:stop]), 1)
    again = concatenated(block_batches(files, 700, shuffle=True, seed=4, shuffle_buffer_blocks=3))[1]
    np.testing.assert_array_equal(again.categorical[:, 0], order)
    other = concatenated(block_batches(files, 700, shuffle=True, seed=5, shuffle_buffer_blocks=3))[1]
    assert not np.array_equal(other.categorical[:, 0], order)


@pytest.mark.unit
def test_decodes_large_ids_and_blocks_from_a_generic_encoder():
    # Ids of 1 to 10 varint bytes; tf.train.Example writes the map in another order than encode_blocks.
    categorical = np.resize(np.array([0, 127, 128, 2**21, 2**35, 2**62 + 5]), (2, NUM_CATEGORICAL))
    categorical[1, -1] = 2**63 - 1
    dense = np.arange(2 * DENSE_INPUT_DIM, dtype=np.float32).reshape(2, DENSE_INPUT_DIM) / 7
    labels = np.array([1.0, 0.0], np.float32)
    (ours,) = encode_blocks(labels, dense, categorical, block_rows=8)
    tf = pytest.importorskip("tensorflow")
    generic = tf.train.Example(
        features=tf.train.Features(
            feature={
                "label": tf.train.Feature(float_list=tf.train.FloatList(value=labels)),
                "dense": tf.train.Feature(float_list=tf.train.FloatList(value=dense.reshape(-1))),
                "categorical": tf.train.Feature(int64_list=tf.train.Int64List(value=categorical.reshape(-1))),
                "num_rows": tf.train.Feature(int64_list=tf.train.Int64List(value=[2])),
                "extra": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"ignored"])),
            }
        )
    ).SerializeToString()
    for record in (ours, generic):
        block = decode_block(record)
        np.testing.assert_array_equal(block.categorical, categorical)
        np.testing.assert_array_equal(block.dense, dense)
        np.testing.assert_array_equal(block.labels, labels)


@pytest.mark.unit
def test_decodes_unpacked_values():
    def tag(number, wire_type):
        return bytes([number << 3 | wire_type])

    def field(number, payload):
        assert len(payload) < 2**14
        length = bytes([len(payload)]) if len(payload) < 128 else bytes([len(payload) & 0x7F | 0x80, len(payload) >> 7])
        return tag(number, 2) + length + payload

    def entry(key, feature):
        return field(1, field(1, key.encode()) + field(2, feature))

    # One row; floats as fixed32 fields and ints as varint fields, one per value (the unpacked encoding).
    floats = b"".join(tag(1, 5) + np.float32(v).tobytes() for v in [0.5] * DENSE_INPUT_DIM)
    ints = b"".join(tag(1, 0) + bytes([v]) for v in range(2, 2 + NUM_CATEGORICAL))
    body = (
        entry("num_rows", field(3, tag(1, 0) + b"\x01"))
        + entry("label", field(2, tag(1, 5) + np.float32(1.0).tobytes()))
        + entry("dense", field(2, floats))
        + entry("categorical", field(3, ints))
    )
    block = decode_block(field(1, body))
    np.testing.assert_array_equal(block.labels, [1.0])
    np.testing.assert_array_equal(block.dense, np.full((1, DENSE_INPUT_DIM), 0.5, np.float32))
    np.testing.assert_array_equal(block.categorical, [np.arange(2, 2 + NUM_CATEGORICAL)])


@pytest.mark.unit
def test_corrupt_and_truncated_files_fail_with_the_path(rows, tmp_path):
    data = frame_records(encode_blocks(rows.labels[:10], rows.dense[:10], rows.categorical[:10], block_rows=5))
    corrupt = tmp_path / "corrupt.tfrecord"
    corrupt.write_bytes(data[:40] + bytes([data[40] ^ 1]) + data[41:])
    with pytest.raises(BlockFormatError, match=re.escape(f"{corrupt}: TFRecord checksum mismatch")):
        list(block_batches([str(corrupt)], 4))
    assert len(list(read_records(corrupt, verify=False))) == 2
    truncated = tmp_path / "truncated.tfrecord"
    truncated.write_bytes(data[:-10])
    with pytest.raises(BlockFormatError, match=re.escape(f"{truncated}: TFRecord at byte")):
        list(block_batches([str(truncated)], 4))


@pytest.mark.unit
def test_a_block_with_a_wrong_row_count_fails_loudly(rows, tmp_path):
    (record,) = encode_blocks(rows.labels[:3], rows.dense[:3], rows.categorical[:3], block_rows=8)
    # num_rows is the last map entry: its single varint value 3 is the record's last byte.
    assert record[-1] == 3
    path = tmp_path / "bad.tfrecord"
    path.write_bytes(frame_records([record[:-1] + b"\x04"]))
    expected = f"{path}: record 0: block feature 'label' holds 3 values, expected num_rows x 1 = 4"
    with pytest.raises(BlockFormatError, match=re.escape(expected)):
        list(block_batches([str(path)], 4))


@pytest.mark.unit
def test_a_block_without_its_features_fails_loudly():
    with pytest.raises(BlockFormatError, match=re.escape("block Example has no ['num_rows', 'label', 'dense',")):
        decode_block(b"")


@pytest.mark.unit
def test_invalid_arguments(files):
    with pytest.raises(ValueError, match="at least one file"):
        block_batches([], 4)
    with pytest.raises(ValueError, match=re.escape("batch_size=0")):
        block_batches(files, 0)


@pytest.mark.unit
def test_imports_and_reads_without_tensorflow(files, rows):
    script = textwrap.dedent(
        f"""
        import hashlib
        import sys
        sys.modules["tensorflow"] = None  # any import of TensorFlow now fails
        from trainer.block_reader import block_batches
        digest = hashlib.sha256()
        for features, labels in block_batches({files!r}, batch_size=512):
            for array in (features["dense"], features["categorical"], labels):
                digest.update(array.tobytes())
        print(digest.hexdigest(), sorted(name for name in sys.modules if name.startswith("tensorflow")))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    expected = hashlib.sha256()
    for start in range(0, len(rows), 512):
        for array in (rows.dense, rows.categorical, rows.labels):
            expected.update(array[start : start + 512].tobytes())
    # The blocked entry is the only TensorFlow module: nothing imported a part of it.
    assert done.stdout.split(maxsplit=1) == [expected.hexdigest(), "['tensorflow']\n"]
