"""Block TFRecords: one tf.Example per block of rows, column-packed.

Keys of a block of n rows (a feature spec's rows; see components.feature_spec):
- `num_rows` int64[1]: n;
- `label` float[n];
- `dense` float[n * D], row-major: D = the spec's dense_input_dim (standardized values, then missing flags);
- `categorical` int64[n * F], row-major: the embedding rows of the F single-valued categorical features;
- one int64[n * L] key per multi-valued or sequence feature, named after it: L = its max_length row ids per
  row, newest last, the front padded with MISSING_ROW.
Fixed-width columns are packed as they were before lists existed, so the criteo layout is unchanged.

Encoding works on whole column blocks with numpy; nothing here loops over rows.
The TFRecord framing (length, masked crc32c of the length, data, masked crc32c of the data) is written by
hand so Spark executors need no TensorFlow; the bytes are identical to tf.io.TFRecordWriter's.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Mapping

import google_crc32c
import numpy as np

BLOCK_NUM_ROWS_KEY = "num_rows"
BLOCK_LABEL_KEY = "label"
BLOCK_DENSE_KEY = "dense"
BLOCK_CATEGORICAL_KEY = "categorical"
BLOCK_LAYOUT = "block-v1"

_MASK_DELTA = 0xA282EAD8


def masked_crc(data: bytes | memoryview) -> int:
    """TFRecord's masked crc32c of `data`."""
    crc = google_crc32c.value(bytes(data))
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame_records(records: Iterable[bytes]) -> bytes:
    """TFRecord framing of serialized records (uncompressed)."""
    parts = []
    for record in records:
        length = struct.pack("<Q", len(record))
        parts.append(length + struct.pack("<I", masked_crc(length)) + record + struct.pack("<I", masked_crc(record)))
    return b"".join(parts)


def read_framed_records(data: bytes, verify: bool = True) -> Iterator[bytes]:
    """Splits TFRecord bytes into records, checking every crc. Raises ValueError on a truncated file."""
    offset, total = 0, len(data)
    while offset < total:
        if total - offset < 12:
            raise ValueError(f"truncated TFRecord header at byte {offset} of {total}")
        (length,) = struct.unpack_from("<Q", data, offset)
        (length_crc,) = struct.unpack_from("<I", data, offset + 8)
        end = offset + 12 + length + 4
        if end > total:
            raise ValueError(f"truncated TFRecord at byte {offset}: record of {length} bytes runs past the end")
        record = data[offset + 12 : offset + 12 + length]
        if verify:
            (data_crc,) = struct.unpack_from("<I", data, offset + 12 + length)
            if length_crc != masked_crc(data[offset : offset + 8]) or data_crc != masked_crc(record):
                raise ValueError(f"TFRecord checksum mismatch at byte {offset}")
        yield record
        offset = end


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


# The smallest value that takes k + 2 bytes, k = 0..8 (a varint carries 7 bits a byte).
_VARINT_LIMITS = np.array([1 << (7 * k) for k in range(1, 10)], dtype=np.uint64)


def _packed_varints(values: np.ndarray) -> bytes:
    """Protobuf varint encoding of non-negative int64 values, vectorized (no loop over values): a [values,
    width] byte matrix, width the largest value's varint length, of which each value keeps its own length's
    first bytes. Row ids fit 32 bits and take 1-3 bytes, so it is computed in uint32 with a loop of 1-3."""
    v = np.asarray(values).astype(np.uint64).ravel()
    if v.size == 0:
        return b""
    top = int(v.max())
    width = max(1, (top.bit_length() + 6) // 7)
    if top < 1 << 32:
        v = v.astype(np.uint32)
    if width == 1:
        return v.astype(np.uint8).tobytes()
    num_bytes = np.searchsorted(_VARINT_LIMITS[:width - 1], v, side="right") + 1
    out = np.empty((v.size, width), dtype=np.uint8)
    for k in range(width):
        group = (v >> (7 * k)) & 0x7F
        if k < width - 1:  # the continuation bit on every byte but a value's last
            group |= (num_bytes > k + 1).astype(v.dtype) << 7
        out[:, k] = group
    return out[np.arange(width) < num_bytes[:, None]].tobytes()


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint((number << 3) | 2) + _varint(len(payload)) + payload


def _feature_entry(key: str, feature: bytes) -> bytes:
    # Features.feature is map<string, Feature>: each entry is a message {1: key, 2: value}.
    return _field(1, _field(1, key.encode()) + _field(2, feature))


def _float_feature(values: np.ndarray) -> bytes:
    # Feature.float_list = 2; FloatList.value = 1 (packed little-endian float32)
    return _field(2, _field(1, np.ascontiguousarray(values, dtype="<f4").tobytes()))


def _int64_feature(values: np.ndarray) -> bytes:
    # Feature.int64_list = 3; Int64List.value = 1 (packed varints)
    return _field(3, _field(1, _packed_varints(values)))


def encode_blocks(labels: np.ndarray, dense: np.ndarray, categorical: np.ndarray, block_rows: int,
                  lists: Mapping[str, np.ndarray] | None = None) -> list[bytes]:
    """Serialized tf.Examples, one per block of up to `block_rows` rows.

    labels: [n] float, dense: [n, D] float32, categorical: [n, F] int64 rows (>= 0), lists: per multi-valued
    or sequence feature its [n, L] int64 rows (>= 0).
    The protobuf bytes are written directly, with map entries in sorted key order, so the same rows always give
    the same bytes (a generic encoder's map order can differ between processes, which breaks byte-identical
    re-runs). The result parses as an ordinary tf.train.Example.
    """
    num_rows = len(labels)
    lists = dict(lists or {})
    reserved = {BLOCK_NUM_ROWS_KEY, BLOCK_LABEL_KEY, BLOCK_DENSE_KEY, BLOCK_CATEGORICAL_KEY} & set(lists)
    if reserved:
        raise ValueError(f"encode_blocks: list features cannot be named {sorted(reserved)}")
    shapes = {"dense": dense.shape, "categorical": categorical.shape, **{k: v.shape for k, v in lists.items()}}
    if any(len(shape) != 2 or shape[0] != num_rows for shape in shapes.values()):
        raise ValueError(f"encode_blocks: expected [{num_rows}, width] arrays for {num_rows} labels, got {shapes}")
    for name, ids in (("categorical", categorical), *lists.items()):
        if ids.size and int(ids.min()) < 0:
            raise ValueError(f"encode_blocks: {name} rows must be >= 0, got {int(ids.min())}")
    labels = np.asarray(labels, dtype=np.float32)
    records = []
    for start in range(0, num_rows, block_rows):
        end = min(start + block_rows, num_rows)
        features = {
            BLOCK_CATEGORICAL_KEY: _int64_feature(categorical[start:end]),
            BLOCK_DENSE_KEY: _float_feature(dense[start:end]),
            BLOCK_LABEL_KEY: _float_feature(labels[start:end]),
            BLOCK_NUM_ROWS_KEY: _int64_feature(np.array([end - start])),
            **{name: _int64_feature(ids[start:end]) for name, ids in lists.items()},
        }
        body = b"".join(_feature_entry(key, features[key]) for key in sorted(features))
        records.append(_field(1, body))  # Example.features = 1
    return records
