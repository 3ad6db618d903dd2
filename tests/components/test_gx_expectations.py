"""ExpectColumnValuesToMatchPattern decides every value as great-expectations' stock regex check does."""

from __future__ import annotations

import re

import great_expectations as gx
import pandas as pd
import pytest

from components.feature_spec import TimestampFeature
from components.gx_expectations import matches
from components.validation import INTEGER_REGEX, LIST_REGEX, NUMBER_REGEX, STRING_REGEX, timestamp_regex

EDGE_VALUES = [
    None, "0", "-0", "7", "-12", "1.5", "1.", ".5", "-1.5e10", "1E-3", "1e1234", "12x", "x12", " 12", "12 ",
    "123456789012345678", "1234567890123456789", "12345678901234567890", "-", "+1", "1e", "0x1f", "１２",
    "9f3c2a71", "a b", "a\tb", "a\x00b", "\x7f", "a\x1fb", "caf\u00e9", "\ufffd", "ab\ufffd", "x" * 256,
    "x" * 257, "x" * 8192, "x" * 8193, "2026-01-01 00:04:05", "2026-1-01 00:04:05", "06/05/2017", "1700000000",
    "1700000000.25", "a,b,c", "1|2|3", "é" * 256, "é" * 257, "\u2028", "a\u0085b",
]
PATTERNS = [NUMBER_REGEX, INTEGER_REGEX, STRING_REGEX, LIST_REGEX, r"^[0-9]{1,6}$", r"^[0-9a-zA-Z_\-]{1,64}$",
            timestamp_regex(TimestampFeature(name="ts", column="ts", format="%Y-%m-%d %H:%M:%S")),
            timestamp_regex(TimestampFeature(name="ts", column="ts", format="%m/%d/%Y")),
            timestamp_regex(TimestampFeature(name="ts", column="ts", format="unix_seconds"))]


def stock(values: list[str | None], regex: str) -> list[bool]:
    """The stock metric's decision (`column.astype(str).str.contains(regex)` on the non-null values)."""
    pattern = re.compile(regex)
    return [value is None or pattern.search(str(value)) is not None for value in values]


@pytest.mark.parametrize("regex", PATTERNS)
@pytest.mark.parametrize("dtype", ["string[pyarrow]", "object"])
def test_every_suite_pattern_decides_edge_values_as_python_re(regex: str, dtype: str) -> None:
    column = pd.Series(EDGE_VALUES, dtype=dtype, index=range(100, 100 + len(EDGE_VALUES)))
    decided = matches(column, regex)
    assert list(decided.index) == list(column.index)
    assert decided.tolist() == stock(EDGE_VALUES, regex)


def test_a_suite_with_the_expectation_reports_unexpected_values_like_the_stock_one() -> None:
    from components.gx_expectations import ExpectColumnValuesToMatchPattern

    frame = pd.DataFrame({"I3": pd.Series(["1", None, "12x", "3", "4e"], dtype="string[pyarrow]")})
    context = gx.get_context(mode="ephemeral")
    batch_definition = (context.data_sources.add_pandas("raw").add_dataframe_asset(name="t")
                        .add_batch_definition_whole_dataframe("all"))
    batch = batch_definition.get_batch(batch_parameters={"dataframe": frame})
    result_format = {"result_format": "SUMMARY", "partial_unexpected_count": 5}
    ours = batch.validate(ExpectColumnValuesToMatchPattern(column="I3", regex=NUMBER_REGEX),
                          result_format=result_format)
    theirs = batch.validate(gx.expectations.ExpectColumnValuesToMatchRegex(column="I3", regex=NUMBER_REGEX),
                            result_format=result_format)
    assert not ours.success and not theirs.success
    assert ours.expectation_config.type == "expect_column_values_to_match_pattern"
    for key in ("element_count", "missing_count", "unexpected_count", "unexpected_percent",
                "partial_unexpected_list"):
        assert ours.result[key] == theirs.result[key], key
    assert ours.result["unexpected_count"] == 2 and ours.result["partial_unexpected_list"] == ["12x", "4e"]


@pytest.mark.parametrize("regex", [p for p in PATTERNS if p != LIST_REGEX])
def test_the_suites_patterns_other_than_lists_run_in_arrow(regex: str) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc

    # Arrow's RE2 itself, not `matches` (which falls back to Python for a pattern RE2 does not take): it takes the
    # pattern and decides every edge value as Python's re does.
    decided = pc.match_substring_regex(pa.array(EDGE_VALUES), pattern=regex).to_pylist()
    assert decided == [None if value is None else re.search(regex, value) is not None for value in EDGE_VALUES]


def test_the_list_pattern_is_one_arrow_does_not_take() -> None:
    """Its 8192-value repetition is over RE2's limit of 1000, so list columns are checked in Python."""
    import pyarrow as pa
    import pyarrow.compute as pc

    with pytest.raises(pa.ArrowInvalid, match=r"invalid repetition size: \{1,8192\}"):
        pc.match_substring_regex(pa.array(["7"]), pattern=LIST_REGEX)
