"""Row-layout records: one tf.Example per row, the layouts the block layout replaces (the contract between the
sample job, which writes the per-column layout when asked, and `trainer.input.row_dataset`, which reads both).

- "packed": three features per row: label float[1], dense float[DENSE_INPUT_DIM], categorical int64[26].
- "per_column": one feature per raw column, as a team typically starts: label float[1], I1..I13 float[1]
  (the standardized value; absent when the field is missing) and C1..C26 int64[1] (row ids).

Encoding uses tfx-bsl's C++ RecordBatchToExamplesEncoder on Arrow columns (the encoder the Spark jobs use);
no TensorFlow is imported here.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from components.schema import (
    CATEGORICAL_FEATURES,
    DENSE_FEATURES,
    DENSE_INPUT_DIM,
    LABEL,
    NUM_CATEGORICAL,
    NUM_DENSE,
)

PACKED = "packed"
PER_COLUMN = "per_column"
ROW_LAYOUTS = (PACKED, PER_COLUMN)
GZIP = "GZIP"
# tf.data's names: "" (or None) reads uncompressed files, "GZIP" gzip-compressed ones.
COMPRESSIONS = ("", GZIP)

# The packed layout's feature names.
PACKED_LABEL_KEY = LABEL
PACKED_DENSE_KEY = "dense"  # = trainer.model_inputs.DENSE_INPUT
PACKED_CATEGORICAL_KEY = "categorical"  # = trainer.model_inputs.CATEGORICAL_INPUT
# The manifest's name for the per-column layout written by the sample job.
ROW_LAYOUT = "row-per-column-v1"


def check_layout(layout: str) -> None:
    if layout not in ROW_LAYOUTS:
        raise ValueError(f"unknown row layout {layout!r}; expected one of {list(ROW_LAYOUTS)}")


def check_compression(compression: str | None) -> str:
    """The tf.data compression name for `compression` ("" for none)."""
    name = compression or ""
    if name not in COMPRESSIONS:
        raise ValueError(
            f"unknown compression {compression!r}; expected None, '' (uncompressed) or 'GZIP'"
        )
    return name


def encode_rows(
    labels: np.ndarray, dense: np.ndarray, categorical: np.ndarray, layout: str = PACKED
) -> list[bytes]:
    """Serialized tf.Examples, one per row.

    labels: [n] float, dense: [n, DENSE_INPUT_DIM] float32 (standardized values, then missing indicators),
    categorical: [n, NUM_CATEGORICAL] int64 row ids. The per-column layout stores a missing field as an absent
    value, so it needs indicators of exactly 0 or 1 and a standardized value of 0 where the indicator is 1
    (what the feature job writes); anything else would not read back as written and is refused.
    """
    check_layout(layout)
    labels = np.asarray(labels, dtype=np.float32)
    dense = np.asarray(dense, dtype=np.float32)
    categorical = np.asarray(categorical, dtype=np.int64)
    num_rows = len(labels)
    if dense.shape != (num_rows, DENSE_INPUT_DIM) or categorical.shape != (num_rows, NUM_CATEGORICAL):
        raise ValueError(
            f"encode_rows: expected dense [{num_rows}, {DENSE_INPUT_DIM}] and categorical "
            f"[{num_rows}, {NUM_CATEGORICAL}] for {num_rows} labels, got {dense.shape} and {categorical.shape}"
        )
    if num_rows == 0:
        return []
    from tfx_bsl.coders.example_coder import RecordBatchToExamplesEncoder

    if layout == PACKED:
        columns = {
            PACKED_LABEL_KEY: _fixed_lists(labels.reshape(num_rows, 1), pa.float32()),
            PACKED_DENSE_KEY: _fixed_lists(dense, pa.float32()),
            PACKED_CATEGORICAL_KEY: _fixed_lists(categorical, pa.int64()),
        }
    else:
        columns = {LABEL: _fixed_lists(labels.reshape(num_rows, 1), pa.float32())}
        values, missing = dense[:, :NUM_DENSE], dense[:, NUM_DENSE:]
        _check_missing_convention(values, missing)
        for index, name in enumerate(DENSE_FEATURES):
            present = missing[:, index] == 0
            # A null list: the encoder writes the feature with no value, which parses as absent.
            columns[name] = pa.ListArray.from_arrays(
                pa.array(np.concatenate([[0], np.cumsum(present)]).astype(np.int32)),
                pa.array(values[present, index], pa.float32()),
                mask=pa.array(~present),
            )
        for index, name in enumerate(CATEGORICAL_FEATURES):
            columns[name] = _fixed_lists(categorical[:, index : index + 1], pa.int64())
    batch = pa.RecordBatch.from_arrays(list(columns.values()), names=list(columns))
    return RecordBatchToExamplesEncoder().encode(batch)


def _fixed_lists(values: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    """[n, width] -> an Arrow list column of n lists of `width` values each."""
    num_rows, width = values.shape
    offsets = pa.array(np.arange(0, (num_rows + 1) * width, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(np.ascontiguousarray(values).reshape(-1), value_type))


def _check_missing_convention(values: np.ndarray, missing: np.ndarray) -> None:
    if not np.isin(missing, (0.0, 1.0)).all():
        bad = missing[~np.isin(missing, (0.0, 1.0))][0]
        raise ValueError(
            f"per_column layout: missing indicators (dense columns {NUM_DENSE}..{DENSE_INPUT_DIM - 1}) must be "
            f"0 or 1, got {bad!r}; write these rows in the packed layout instead"
        )
    if (values[missing == 1] != 0).any():
        bad = values[missing == 1][values[missing == 1] != 0][0]
        raise ValueError(
            f"per_column layout: a missing dense field must hold 0, got {bad!r}; the layout stores a missing "
            "field as absent and reads it back as 0, so write these rows in the packed layout instead"
        )
