"""The click-log schema and the block TFRecord layout, shared by Spark, the trainer and serving.

Raw click logs use the Criteo layout: tab-separated, no header, one impression per line:
label, 13 integer fields (I1..I13, may be empty or negative), 26 categorical fields (C1..C26, 8-hex hashes,
may be empty). An empty field is a missing value.
"""

from __future__ import annotations

import hashlib
import json

LABEL = "label"
DENSE_FEATURES: tuple[str, ...] = tuple(f"I{i}" for i in range(1, 14))
CATEGORICAL_FEATURES: tuple[str, ...] = tuple(f"C{i}" for i in range(1, 27))
RAW_COLUMNS: tuple[str, ...] = (LABEL, *DENSE_FEATURES, *CATEGORICAL_FEATURES)
NUM_DENSE = len(DENSE_FEATURES)
NUM_CATEGORICAL = len(CATEGORICAL_FEATURES)
NUM_RAW_FIELDS = len(RAW_COLUMNS)

# Reserved embedding rows of every categorical feature. Admitted values start at NUM_RESERVED_ROWS.
RARE_ROW = 0  # values seen fewer than min_count times, and values never seen (out of vocabulary)
MISSING_ROW = 1  # empty field
NUM_RESERVED_ROWS = 2

# Model input built from the dense fields: a standardized value and a missing indicator per field.
DENSE_INPUT_DIM = 2 * NUM_DENSE

# Block TFRecord layout (components.block_codec): each record is one tf.Example holding a block of rows.
from components.block_codec import (  # noqa: E402
    BLOCK_CATEGORICAL_KEY,
    BLOCK_DENSE_KEY,
    BLOCK_LABEL_KEY,
    BLOCK_LAYOUT,
    BLOCK_NUM_ROWS_KEY,
)


def schema_hash() -> str:
    """A short hash of everything a reader must agree on: raw columns, reserved rows and block layout."""
    description = {
        "raw_columns": RAW_COLUMNS,
        "reserved_rows": {"rare": RARE_ROW, "missing": MISSING_ROW},
        "dense_input_dim": DENSE_INPUT_DIM,
        "block_layout": BLOCK_LAYOUT,
        "block_keys": [BLOCK_NUM_ROWS_KEY, BLOCK_LABEL_KEY, BLOCK_DENSE_KEY, BLOCK_CATEGORICAL_KEY],
    }
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]
