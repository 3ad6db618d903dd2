"""Block TFRecords: one tf.Example per block of rows, column-packed (see components.schema).

Encoding works on whole columns with pyarrow and the tfx-bsl C++ encoder; nothing here loops over rows.
The TFRecord framing (length, masked crc32c of the length, data, masked crc32c of the data) is written by
hand so Spark executors need no TensorFlow; the bytes are identical to tf.io.TFRecordWriter's.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator

import google_crc32c
import numpy as np
import pyarrow as pa

from components.schema import (
    BLOCK_CATEGORICAL_KEY,
    BLOCK_DENSE_KEY,
    BLOCK_LABEL_KEY,
    BLOCK_NUM_ROWS_KEY,
    DENSE_INPUT_DIM,
    NUM_CATEGORICAL,
)

_MASK_DELTA = 0xA282EAD8


def _masked_crc(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame_records(records: Iterable[bytes]) -> bytes:
    """TFRecord framing of serialized records (uncompressed)."""
    parts = []
    for record in records:
        length = struct.pack("<Q", len(record))
        parts.append(length + struct.pack("<I", _masked_crc(length)) + record + struct.pack("<I", _masked_crc(record)))
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
            if length_crc != _masked_crc(data[offset : offset + 8]) or data_crc != _masked_crc(record):
                raise ValueError(f"TFRecord checksum mismatch at byte {offset}")
        yield record
        offset = end


def encode_blocks(labels: np.ndarray, dense: np.ndarray, categorical: np.ndarray, block_rows: int) -> list[bytes]:
    """Serialized tf.Examples, one per block of up to `block_rows` rows.

    labels: [n] float, dense: [n, DENSE_INPUT_DIM] float32, categorical: [n, NUM_CATEGORICAL] int64 rows.
    """
    num_rows = len(labels)
    if dense.shape != (num_rows, DENSE_INPUT_DIM) or categorical.shape != (num_rows, NUM_CATEGORICAL):
        raise ValueError(
            f"encode_blocks: expected dense [{num_rows}, {DENSE_INPUT_DIM}] and categorical "
            f"[{num_rows}, {NUM_CATEGORICAL}], got {dense.shape} and {categorical.shape}"
        )
    if num_rows == 0:
        return []
    from tfx_bsl.coders.example_coder import RecordBatchToExamplesEncoder

    starts = np.arange(0, num_rows, block_rows, dtype=np.int64)
    sizes = np.diff(np.append(starts, num_rows))

    def packed(values: np.ndarray, width: int, value_type: pa.DataType) -> pa.ListArray:
        offsets = pa.array(np.append(starts, num_rows) * width, pa.int32())
        return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1), value_type))

    batch = pa.RecordBatch.from_arrays(
        [
            pa.ListArray.from_arrays(pa.array(np.arange(len(sizes) + 1), pa.int32()), pa.array(sizes, pa.int64())),
            packed(np.asarray(labels, np.float32), 1, pa.float32()),
            packed(np.ascontiguousarray(dense, np.float32), DENSE_INPUT_DIM, pa.float32()),
            packed(np.ascontiguousarray(categorical, np.int64), NUM_CATEGORICAL, pa.int64()),
        ],
        names=[BLOCK_NUM_ROWS_KEY, BLOCK_LABEL_KEY, BLOCK_DENSE_KEY, BLOCK_CATEGORICAL_KEY],
    )
    return RecordBatchToExamplesEncoder().encode(batch)
