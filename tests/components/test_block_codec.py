from __future__ import annotations

import numpy as np
import pytest

from components.block_codec import (
    BLOCK_CATEGORICAL_KEY,
    BLOCK_DENSE_KEY,
    BLOCK_LABEL_KEY,
    BLOCK_NUM_ROWS_KEY,
    encode_blocks,
    frame_records,
    read_framed_records,
)
from components.schema import DENSE_INPUT_DIM, NUM_CATEGORICAL

pytestmark = pytest.mark.unit

tf = pytest.importorskip("tensorflow")


def _columns(num_rows: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    labels = (rng.random(num_rows) < 0.25).astype(np.float32)
    dense = rng.normal(size=(num_rows, DENSE_INPUT_DIM)).astype(np.float32)
    categorical = rng.integers(0, 100_000, size=(num_rows, NUM_CATEGORICAL), dtype=np.int64)
    return labels, dense, categorical


def _parse(record: bytes) -> dict[str, np.ndarray]:
    example = tf.train.Example.FromString(record)
    features = example.features.feature
    return {
        BLOCK_NUM_ROWS_KEY: np.array(features[BLOCK_NUM_ROWS_KEY].int64_list.value),
        BLOCK_LABEL_KEY: np.array(features[BLOCK_LABEL_KEY].float_list.value, np.float32),
        BLOCK_DENSE_KEY: np.array(features[BLOCK_DENSE_KEY].float_list.value, np.float32),
        BLOCK_CATEGORICAL_KEY: np.array(features[BLOCK_CATEGORICAL_KEY].int64_list.value),
    }


def test_framing_is_byte_identical_to_tf_record_writer(tmp_path):
    records = encode_blocks(*_columns(300), block_rows=128)
    records += [b"", b"x" * 70_000]  # an empty record and a long one
    path = tmp_path / "tf.tfrecord"
    with tf.io.TFRecordWriter(str(path)) as writer:
        for record in records:
            writer.write(record)
    assert frame_records(records) == path.read_bytes()


def test_tf_reads_our_framing(tmp_path):
    records = encode_blocks(*_columns(100), block_rows=40)
    path = tmp_path / "ours.tfrecord"
    path.write_bytes(frame_records(records))
    read_back = [r.numpy() for r in tf.data.TFRecordDataset(str(path))]
    assert read_back == records


def test_read_framed_records_round_trip():
    records = [b"first", b"", b"\x00" * 1000, bytes(range(256))]
    assert list(read_framed_records(frame_records(records))) == records
    assert list(read_framed_records(b"")) == []


def test_truncated_bytes_raise():
    data = frame_records([b"first record", b"second record"])
    first_end = 12 + len(b"first record") + 4
    with pytest.raises(
        ValueError, match=rf"truncated TFRecord header at byte {first_end} of {first_end + 5}"
    ):
        list(read_framed_records(data[: first_end + 5]))
    with pytest.raises(
        ValueError, match=rf"truncated TFRecord at byte {first_end}: record of 13 bytes runs past the end"
    ):
        list(read_framed_records(data[:-1]))


def test_a_corrupted_byte_fails_the_checksum():
    data = bytearray(frame_records([b"first record", b"second record"]))
    second = 12 + len(b"first record") + 4
    data[second + 12 + 3] ^= 0x01  # a byte inside the second record's data
    reader = read_framed_records(bytes(data))
    assert next(reader) == b"first record"
    with pytest.raises(ValueError, match=rf"TFRecord checksum mismatch at byte {second}"):
        next(reader)
    # Without verification the damaged bytes come through.
    assert list(read_framed_records(bytes(data), verify=False))[1] == b"secnnd record"  # "o" ^ 1 == "n"


def test_a_corrupted_length_crc_fails_the_checksum():
    data = bytearray(frame_records([b"abc"]))
    data[9] ^= 0xFF
    with pytest.raises(ValueError, match="TFRecord checksum mismatch at byte 0"):
        list(read_framed_records(bytes(data)))


def test_block_sizes_and_decoded_values():
    labels, dense, categorical = _columns(2500, seed=1)
    records = encode_blocks(labels, dense, categorical, block_rows=1024)
    assert len(records) == 3
    parsed = [_parse(r) for r in records]
    assert [int(p[BLOCK_NUM_ROWS_KEY][0]) for p in parsed] == [1024, 1024, 452]
    assert [len(p[BLOCK_NUM_ROWS_KEY]) for p in parsed] == [1, 1, 1]
    assert [len(p[BLOCK_LABEL_KEY]) for p in parsed] == [1024, 1024, 452]
    assert [len(p[BLOCK_DENSE_KEY]) for p in parsed] == [1024 * 26, 1024 * 26, 452 * 26]
    assert [len(p[BLOCK_CATEGORICAL_KEY]) for p in parsed] == [1024 * 26, 1024 * 26, 452 * 26]
    np.testing.assert_array_equal(np.concatenate([p[BLOCK_LABEL_KEY] for p in parsed]), labels)
    # Row-major packing: block rows follow each other, each row's 26 values together.
    np.testing.assert_array_equal(
        np.concatenate([p[BLOCK_DENSE_KEY] for p in parsed]).reshape(-1, DENSE_INPUT_DIM), dense
    )
    np.testing.assert_array_equal(
        np.concatenate([p[BLOCK_CATEGORICAL_KEY] for p in parsed]).reshape(-1, NUM_CATEGORICAL), categorical
    )
    third = parsed[2]
    assert third[BLOCK_DENSE_KEY][:DENSE_INPUT_DIM].tolist() == dense[2048].tolist()
    assert third[BLOCK_CATEGORICAL_KEY][-1] == categorical[2499, -1]


def test_a_hand_built_block():
    labels = np.array([1.0, 0.0], np.float32)
    dense = np.arange(2 * DENSE_INPUT_DIM, dtype=np.float32).reshape(2, DENSE_INPUT_DIM) / 4
    categorical = np.arange(2 * NUM_CATEGORICAL, dtype=np.int64).reshape(2, NUM_CATEGORICAL) + 2
    (record,) = encode_blocks(labels, dense, categorical, block_rows=8)
    parsed = _parse(record)
    assert parsed[BLOCK_NUM_ROWS_KEY].tolist() == [2]
    assert parsed[BLOCK_LABEL_KEY].tolist() == [1.0, 0.0]
    assert parsed[BLOCK_DENSE_KEY][:3].tolist() == [0.0, 0.25, 0.5]
    assert parsed[BLOCK_DENSE_KEY][DENSE_INPUT_DIM] == 6.5  # row 1, column 0 = 26 / 4
    assert parsed[BLOCK_CATEGORICAL_KEY][[0, 25, 26, 51]].tolist() == [2, 27, 28, 53]


def test_tf_example_parsing_agrees_with_the_block_layout(tmp_path):
    labels, dense, categorical = _columns(10, seed=2)
    records = encode_blocks(labels, dense, categorical, block_rows=4)
    spec = {
        BLOCK_NUM_ROWS_KEY: tf.io.FixedLenFeature([1], tf.int64),
        BLOCK_LABEL_KEY: tf.io.VarLenFeature(tf.float32),
        BLOCK_DENSE_KEY: tf.io.VarLenFeature(tf.float32),
        BLOCK_CATEGORICAL_KEY: tf.io.VarLenFeature(tf.int64),
    }
    parsed = tf.io.parse_single_example(records[-1], spec)
    assert int(parsed[BLOCK_NUM_ROWS_KEY][0]) == 2
    np.testing.assert_array_equal(tf.sparse.to_dense(parsed[BLOCK_LABEL_KEY]).numpy(), labels[8:])


def test_no_rows_give_no_blocks():
    labels, dense, categorical = _columns(0)
    assert encode_blocks(labels, dense, categorical, block_rows=16) == []


def test_shape_mismatch_is_rejected():
    labels, dense, categorical = _columns(5)
    with pytest.raises(ValueError, match=r"expected \[5, width\] arrays for 5 labels, got .*'categorical': \(5,\)"):
        encode_blocks(labels, dense, categorical[:, 0], block_rows=4)
    with pytest.raises(ValueError, match=r"'dense': \(4, 26\)"):
        encode_blocks(labels, dense[:4], categorical, block_rows=4)
    with pytest.raises(ValueError, match=r"'tags': \(5, 3, 1\)"):
        encode_blocks(labels, dense, categorical, block_rows=4, lists={"tags": np.ones((5, 3, 1), np.int64)})
    with pytest.raises(ValueError, match=r"tags rows must be >= 0, got -1"):
        encode_blocks(labels, dense, categorical, block_rows=4, lists={"tags": -np.ones((5, 3), np.int64)})
    with pytest.raises(ValueError, match=r"cannot be named \['dense'\]"):
        encode_blocks(labels, dense, categorical, block_rows=4, lists={"dense": np.ones((5, 3), np.int64)})


def test_records_are_tf_examples_in_canonical_byte_order():
    # Re-serializing with protobuf's deterministic (sorted map keys) mode gives back the very same bytes, so
    # equal rows give equal files in any process.
    records = encode_blocks(*_columns(50, seed=4), block_rows=32)
    for record in records:
        assert tf.train.Example.FromString(record).SerializeToString(deterministic=True) == record


def test_negative_categorical_rows_are_rejected():
    labels, dense, categorical = _columns(3)
    categorical[1, 4] = -1
    with pytest.raises(ValueError, match=r"encode_blocks: categorical rows must be >= 0, got -1"):
        encode_blocks(labels, dense, categorical, block_rows=4)


@pytest.mark.parametrize("top_bits", [1, 7, 8, 14, 15, 21, 22, 31, 32, 33, 49, 56, 63])
def test_packed_ids_are_protobufs_own_varints_at_every_width(top_bits):
    # Blocks whose largest id takes 1 to 9 varint bytes, with small ids beside it (each keeps its own length),
    # and the edges of each byte length: protobuf's own encoding of the same Int64List, byte for byte.
    rng = np.random.default_rng(top_bits)
    ids = rng.integers(0, 2**top_bits, size=(64, NUM_CATEGORICAL), dtype=np.int64)
    edges = [2**k for k in range(0, top_bits, 7)] + [2**k - 1 for k in range(7, top_bits + 1, 7)]
    ids.reshape(-1)[: len(edges)] = edges
    ids[-1, -1] = 2**top_bits - 1
    labels, dense, _ = _columns(64)
    (record,) = encode_blocks(labels, dense, ids, block_rows=64)
    expected = tf.train.Int64List(value=ids.reshape(-1)).SerializeToString()
    assert expected in record
    np.testing.assert_array_equal(_parse(record)[BLOCK_CATEGORICAL_KEY], ids.reshape(-1))
