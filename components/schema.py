"""The Criteo layout's columns, for what is Criteo-shaped by design: the synthetic click-log generator, the
row-per-example TFRecord layout, the fixed-width readers and the benchmarks built on them.

Every pipeline step names its columns through the feature spec (components.feature_spec; the `criteo` preset
declares these same columns). The Criteo layout: tab-separated, no header, one impression per line: label,
13 integer fields (I1..I13, may be empty or negative), 26 categorical fields (C1..C26, 8-hex hashes, may be
empty). An empty field is a missing value.
"""

from __future__ import annotations

LABEL = "label"
DENSE_FEATURES: tuple[str, ...] = tuple(f"I{i}" for i in range(1, 14))
CATEGORICAL_FEATURES: tuple[str, ...] = tuple(f"C{i}" for i in range(1, 27))
RAW_COLUMNS: tuple[str, ...] = (LABEL, *DENSE_FEATURES, *CATEGORICAL_FEATURES)
NUM_DENSE = len(DENSE_FEATURES)
NUM_CATEGORICAL = len(CATEGORICAL_FEATURES)
NUM_RAW_FIELDS = len(RAW_COLUMNS)

# The reserved rows of every vocabulary, as the feature spec defines them.
from components.feature_spec import MISSING_ROW, NUM_RESERVED_ROWS, RARE_ROW  # noqa: E402,F401

# Model input built from the dense fields: a standardized value and a missing indicator per field.
DENSE_INPUT_DIM = 2 * NUM_DENSE
