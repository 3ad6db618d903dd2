"""The bad raw minutes of bench-reliability are what they say: each one built from a generated minute, and the
validation suite (generated from the feature spec) refuses exactly those documented as quarantined."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from bench.reliability.chain import QUARANTINED, TRAINED
from bench.reliability.raw_data import raw_cases
from components.config import GenerateConfig
from components.feature_spec import load_spec
from components.synthetic import RAW_FILE, generate_minute, write_raw_minute
from components.validation import SliceValidator, click_log_dataset

pytestmark = pytest.mark.integration

MINUTE = datetime(2026, 1, 1, 0, 10, tzinfo=UTC)


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> bytes:
    directory = tmp_path_factory.mktemp("minute")
    write_raw_minute(generate_minute(GenerateConfig(rows_per_minute=200), 10, MINUTE).table, directory)
    return (directory / RAW_FILE).read_bytes()


@pytest.fixture(scope="module")
def validator():
    return SliceValidator(click_log_dataset(load_spec("criteo")))


def test_there_are_at_least_twenty_kinds_each_named_once():
    names = [case.name for case in raw_cases(load_spec("criteo"))]
    assert len(names) >= 20 and len(set(names)) == len(names)


@pytest.mark.parametrize("case", [c for c in raw_cases(load_spec("criteo")) if c.expected in (QUARANTINED, TRAINED)
                                  and c.rows_factor == 1], ids=lambda c: c.name)
def test_validation_refuses_exactly_the_minutes_documented_as_quarantined(case, good, validator, tmp_path):
    data = case.make(good, load_spec("criteo"))
    assert (data == good) is (case.name == "good_minute")  # every other case changes the minute
    path = tmp_path / RAW_FILE
    path.write_bytes(data)
    result, _ = validator.validate(MINUTE, path)
    assert result.success is (case.expected == TRAINED), result.summary()
    if case.expected == QUARANTINED:
        assert result.failures and all(f["detail"] for f in result.failures)
