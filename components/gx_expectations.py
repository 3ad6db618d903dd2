"""A great-expectations expectation the raw-data suites use: a regex per value, run on whole Arrow columns.

`ExpectColumnValuesToMatchPattern` is great-expectations' own `ExpectColumnValuesToMatchRegex` (same
arguments, results, rendering and Data Docs) with another metric behind it. The stock pandas metric turns the
column into Python strings and calls `re.search` once per value, and first copies the whole frame without the
column's null rows; on a 60 K-row minute of the criteo spec that was 2.1 of the suite's 2.6 s, on the cores
the samples step needs at the same time. This metric matches an Arrow string column in one call of Arrow's
regex engine (RE2) and counts nulls as matching in place, so nothing is copied.

The check is the same: a value is unexpected when `re.search(regex, str(value))` finds nothing. RE2 and
Python's `re` agree on the suites' patterns (tests/components/test_gx_expectations.py checks them on edge
values). A pattern that RE2 does not take (a repeat over 1000, a backreference) and a column that is not Arrow
strings go through `re`, value by value, as before. One difference is left: for `$`, Python also matches
before a last newline and RE2 does not, so a value ending in a newline is unexpected here (raw text fields
never hold one: lines are split on it).

Importing this module imports great_expectations and registers the metric and the expectation.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from great_expectations.execution_engine import PandasExecutionEngine
from great_expectations.expectations import ExpectColumnValuesToMatchRegex
from great_expectations.expectations.metrics.map_metric_provider import (
    ColumnMapMetricProvider,
    column_condition_partial,
)

METRIC = "column_values.match_pattern"


def matches(column: pd.Series, regex: str) -> pd.Series:
    """Per value, whether `regex` is found in it (`re.search`); a null counts as matching."""
    if _is_arrow_string(column):
        try:
            found = pc.match_substring_regex(pa.array(column, from_pandas=True), pattern=regex)
        except pa.ArrowInvalid:  # a pattern RE2 does not take
            pass
        else:
            return pd.Series(pc.fill_null(found, True).to_numpy(zero_copy_only=False), index=column.index)
    present = column.notna().to_numpy()
    result = np.ones(len(column), dtype=bool)
    if present.any():
        result[present] = column[present].astype(str).str.contains(regex).to_numpy(dtype=bool)
    return pd.Series(result, index=column.index)


def _is_arrow_string(column: pd.Series) -> bool:
    dtype = column.dtype
    if isinstance(dtype, pd.StringDtype):
        return dtype.storage == "pyarrow"
    if isinstance(dtype, pd.ArrowDtype):
        return pa.types.is_string(dtype.pyarrow_dtype) or pa.types.is_large_string(dtype.pyarrow_dtype)
    return False


class ColumnValuesMatchPattern(ColumnMapMetricProvider):
    condition_metric_name = METRIC
    condition_value_keys = ("regex",)
    # Nulls are handled by `matches` (they match): great-expectations would otherwise copy the frame without
    # the column's null rows, every column.
    filter_column_isnull = False

    @column_condition_partial(engine=PandasExecutionEngine)
    def _pandas(cls, column, regex, **kwargs):
        return matches(column, regex)


class ExpectColumnValuesToMatchPattern(ExpectColumnValuesToMatchRegex):
    """Expect the column's values to match a regex (`re.search`); nulls are not checked. As
    ExpectColumnValuesToMatchRegex, matched on whole Arrow columns (this module's doc)."""

    map_metric = METRIC
