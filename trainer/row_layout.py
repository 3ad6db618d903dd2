"""Row-layout TFRecord files (components.row_codec): one tf.Example per row, written by tests and benchmarks;
the sample job writes them itself (features.layout = "row"). Read by `trainer.input.row_dataset`.
"""

from __future__ import annotations

import gzip
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from components.block_codec import frame_records
from components.feature_spec import FeatureSpec, load_spec
from components.row_codec import (  # noqa: F401 - re-exported for the readers and benchmarks
    COMPRESSIONS,
    GZIP,
    LABEL_KEY,
    PACKED,
    PACKED_CATEGORICAL_KEY,
    PACKED_DENSE_KEY,
    PACKED_LABEL_KEY,
    PER_COLUMN,
    ROW_LAYOUT,
    ROW_LAYOUTS,
    RowColumns,
    check_compression,
    check_layout,
    encode_rows,
)

# The criteo preset's columns: what the per-column layout is written and read with when no spec is given.
CRITEO_ROW_COLUMNS = RowColumns.of(load_spec("criteo"))


def row_columns(spec: FeatureSpec | None, layout: str) -> RowColumns:
    """The features samples in the sample job's `layout` are read with: the spec's when they are rows
    (ROW_LAYOUT), else (blocks, which carry no names, or no spec) the criteo preset's."""
    return RowColumns.of(spec) if spec is not None and layout == ROW_LAYOUT else CRITEO_ROW_COLUMNS


def write_row_file(
    path: str | Path,
    labels: np.ndarray,
    dense: np.ndarray,
    categorical: np.ndarray,
    layout: str = PACKED,
    compression: str | None = None,
    columns: RowColumns = CRITEO_ROW_COLUMNS,
    lists: Mapping[str, np.ndarray] | None = None,
) -> str:
    """Writes the rows as one row-layout TFRecord file (GZIP-compressed with compression="GZIP"); the
    per-column layout names its features after `columns` and carries `lists` (per list feature, [n, width] ids)."""
    framed = frame_records(encode_rows(labels, dense, categorical, layout, columns if layout == PER_COLUMN else None,
                                       lists))
    if check_compression(compression) == GZIP:
        # Level 6 is zlib's and TensorFlow's default; tf.data reads Python's gzip stream as written.
        framed = gzip.compress(framed, compresslevel=6, mtime=0)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(framed)
    return str(path)


def write_row_files(
    directory: str | Path,
    labels: np.ndarray,
    dense: np.ndarray,
    categorical: np.ndarray,
    num_files: int,
    layout: str = PACKED,
    compression: str | None = None,
    columns: RowColumns = CRITEO_ROW_COLUMNS,
    lists: Mapping[str, np.ndarray] | None = None,
) -> list[str]:
    """Splits the rows into `num_files` consecutive parts, one row-layout file each; returns the paths."""
    suffix = ".tfrecord.gz" if check_compression(compression) == GZIP else ".tfrecord"
    bounds: Sequence[int] = np.linspace(0, len(labels), num_files + 1).astype(int).tolist()
    return [
        write_row_file(
            Path(directory) / f"part-{index:05d}{suffix}",
            labels[start:stop], dense[start:stop], categorical[start:stop], layout, compression, columns,
            {name: ids[start:stop] for name, ids in (lists or {}).items()},
        )
        for index, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))
    ]
