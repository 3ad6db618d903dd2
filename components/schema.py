"""The criteo preset's columns as constants, for the tests and benchmarks built on the Criteo layout (the
synthetic generator's default spec, the row layouts' default columns).

Every pipeline step names its columns through the feature spec (components.feature_spec); these are read from
the `criteo` preset (components/feature_specs/criteo.yaml), not declared here: tab-separated, no header, one
impression per line: label, 13 integer fields (may be empty or negative), 26 categorical fields (8-hex hashes,
may be empty). An empty field is a missing value.
"""

from __future__ import annotations

from components.feature_spec import MISSING_ROW, NUM_RESERVED_ROWS, RARE_ROW, load_spec  # noqa: F401

CRITEO_SPEC = load_spec("criteo")
LABEL: str = CRITEO_SPEC.label.column
DENSE_FEATURES: tuple[str, ...] = CRITEO_SPEC.dense_names
CATEGORICAL_FEATURES: tuple[str, ...] = CRITEO_SPEC.categorical_names
RAW_COLUMNS: tuple[str, ...] = CRITEO_SPEC.input_columns
NUM_DENSE = len(DENSE_FEATURES)
NUM_CATEGORICAL = len(CATEGORICAL_FEATURES)
NUM_RAW_FIELDS = len(RAW_COLUMNS)
# Model input built from the dense fields: a standardized value and a missing indicator per field.
DENSE_INPUT_DIM = CRITEO_SPEC.dense_input_dim
