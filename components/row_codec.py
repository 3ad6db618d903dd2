"""Row-layout records: one tf.Example per row, the layouts the block layout replaces (the contract between the
sample job, which writes the per-column layout when asked, and `trainer.input.row_dataset`, which reads both).

- "packed": three features per row: label float[1], dense float[dense input width], categorical int64[columns].
- "per_column": one feature per column of the feature spec (`RowColumns`), as a team typically starts: label
  float[1], each scaled dense feature float[1] (the standardized value; absent when the field is missing and the
  feature has a missing flag), each categorical feature int64[1] (its row id) and each multi-valued or sequence
  feature int64[max_length] (its row ids as the model reads them: newest last, the front padded with the
  missing row).

Encoding uses tfx-bsl's C++ RecordBatchToExamplesEncoder on Arrow columns (the encoder the Spark jobs use);
no TensorFlow is imported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from components.feature_spec import FeatureSpec

PACKED = "packed"
PER_COLUMN = "per_column"
ROW_LAYOUTS = (PACKED, PER_COLUMN)
GZIP = "GZIP"
# tf.data's names: "" (or None) reads uncompressed files, "GZIP" gzip-compressed ones.
COMPRESSIONS = ("", GZIP)

# The label's feature name in both layouts (the pipeline's name for it, whatever the raw column is called).
LABEL_KEY = "label"
# The packed layout's feature names.
PACKED_LABEL_KEY = LABEL_KEY
PACKED_DENSE_KEY = "dense"  # = trainer.model_inputs.DENSE_INPUT
PACKED_CATEGORICAL_KEY = "categorical"  # = trainer.model_inputs.CATEGORICAL_INPUT
# The manifest's name for the per-column layout written by the sample job.
ROW_LAYOUT = "row-per-column-v1"


@dataclass(frozen=True)
class RowColumns:
    """The per-column layout's features after the label, from a feature spec: its scaled dense features (the
    model's dense input, in order; `flagged`: those with a missing flag, whose flags follow the values in the
    dense input), its single-valued categorical features (bucket and time features included) and its
    multi-valued and sequence features with their widths (`lists`: (name, max_length))."""

    dense: tuple[str, ...]
    flagged: tuple[bool, ...]
    categorical: tuple[str, ...]
    lists: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of(cls, spec: FeatureSpec) -> RowColumns:
        scaled = spec.scaled_dense
        return cls(dense=tuple(f.name for f in scaled), flagged=tuple(f.missing_indicator for f in scaled),
                   categorical=spec.categorical_names, lists=tuple((f.name, f.max_length) for f in spec.lists))

    @property
    def dense_input_dim(self) -> int:
        return len(self.dense) + sum(self.flagged)


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
    labels: np.ndarray, dense: np.ndarray, categorical: np.ndarray, layout: str = PACKED,
    columns: RowColumns | None = None, lists: Mapping[str, np.ndarray] | None = None,
) -> list[bytes]:
    """Serialized tf.Examples, one per row.

    labels: [n] float, dense: [n, dense input width] float32 (standardized values, then missing flags),
    categorical: [n, categorical columns] int64 row ids, lists: per list feature its [n, max_length] int64 row ids
    (per-column layout only). The per-column layout needs `columns` (the spec's, RowColumns.of) and stores a
    missing field as an absent value, so it needs flags of exactly 0 or 1 and a standardized value of 0 where the
    flag is 1 (what the feature job writes); anything else would not read back as written and is refused.
    """
    check_layout(layout)
    labels = np.asarray(labels, dtype=np.float32)
    dense = np.asarray(dense, dtype=np.float32)
    categorical = np.asarray(categorical, dtype=np.int64)
    num_rows = len(labels)
    if layout == PER_COLUMN and columns is None:
        raise ValueError("encode_rows: the per_column layout names its features after the spec's; pass "
                         "columns=RowColumns.of(spec)")
    if dense.ndim != 2 or categorical.ndim != 2 or len(dense) != num_rows or len(categorical) != num_rows or (
            columns is not None and (dense.shape[1], categorical.shape[1]) !=
            (columns.dense_input_dim, len(columns.categorical))):
        widths = (f"[{num_rows}, {columns.dense_input_dim}] and [{num_rows}, {len(columns.categorical)}]"
                  if columns is not None else f"{num_rows} rows of each")
        raise ValueError(f"encode_rows: expected dense and categorical {widths} for {num_rows} labels, got "
                         f"{dense.shape} and {categorical.shape}")
    lists = {name: np.asarray(ids, dtype=np.int64) for name, ids in (lists or {}).items()}
    expected = {name: (num_rows, width) for name, width in columns.lists} if columns is not None else {}
    if layout == PACKED and lists:
        raise ValueError(f"encode_rows: the packed layout has no list features; got {sorted(lists)}")
    if layout == PER_COLUMN and {name: ids.shape for name, ids in lists.items()} != expected:
        raise ValueError(f"encode_rows: expected list features {expected}, got "
                         f"{ {name: ids.shape for name, ids in lists.items()} }")
    if num_rows == 0:
        return []
    from tfx_bsl.coders.example_coder import RecordBatchToExamplesEncoder

    if layout == PACKED:
        arrays = {
            PACKED_LABEL_KEY: _fixed_lists(labels.reshape(num_rows, 1), pa.float32()),
            PACKED_DENSE_KEY: _fixed_lists(dense, pa.float32()),
            PACKED_CATEGORICAL_KEY: _fixed_lists(categorical, pa.int64()),
        }
    else:
        arrays = {LABEL_KEY: _fixed_lists(labels.reshape(num_rows, 1), pa.float32())}
        num_dense = len(columns.dense)
        flag_of = np.cumsum(columns.flagged) - 1 + num_dense  # the dense input column of each feature's flag
        values = dense[:, :num_dense]
        missing = np.zeros_like(values)
        for index, flagged in enumerate(columns.flagged):
            if flagged:
                missing[:, index] = dense[:, flag_of[index]]
        _check_missing_convention(values, missing, num_dense, columns.dense_input_dim)
        for index, name in enumerate(columns.dense):
            present = missing[:, index] == 0
            # A null list: the encoder writes the feature with no value, which parses as absent.
            arrays[name] = pa.ListArray.from_arrays(
                pa.array(np.concatenate([[0], np.cumsum(present)]).astype(np.int32)),
                pa.array(values[present, index], pa.float32()),
                mask=pa.array(~present),
            )
        for index, name in enumerate(columns.categorical):
            arrays[name] = _fixed_lists(categorical[:, index : index + 1], pa.int64())
        for name, _ in columns.lists:
            arrays[name] = _fixed_lists(lists[name], pa.int64())
    batch = pa.RecordBatch.from_arrays(list(arrays.values()), names=list(arrays))
    return RecordBatchToExamplesEncoder().encode(batch)


def _fixed_lists(values: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    """[n, width] -> an Arrow list column of n lists of `width` values each."""
    num_rows, width = values.shape
    offsets = pa.array(np.arange(0, (num_rows + 1) * width, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(np.ascontiguousarray(values).reshape(-1), value_type))


def _check_missing_convention(values: np.ndarray, missing: np.ndarray, num_dense: int, width: int) -> None:
    if not np.isin(missing, (0.0, 1.0)).all():
        bad = missing[~np.isin(missing, (0.0, 1.0))][0]
        raise ValueError(
            f"per_column layout: missing indicators (dense columns {num_dense}..{width - 1}) must be "
            f"0 or 1, got {bad!r}; write these rows in the packed layout instead"
        )
    if (values[missing == 1] != 0).any():
        bad = values[missing == 1][values[missing == 1] != 0][0]
        raise ValueError(
            f"per_column layout: a missing dense field must hold 0, got {bad!r}; the layout stores a missing "
            "field as absent and reads it back as 0, so write these rows in the packed layout instead"
        )
