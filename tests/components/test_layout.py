from __future__ import annotations

import pytest

from components.interval import Interval, day_number
from components.layout import Layout

pytestmark = pytest.mark.unit


def _commit(layout: Layout, interval: Interval, manifest: bool = True):
    directory = layout.feature_state_dir(interval)
    directory.mkdir(parents=True)
    if manifest:
        (directory / "manifest.json").write_text("{}")


def test_previous_feature_state_is_the_latest_committed_one_before_the_interval(tmp_path):
    layout = Layout(tmp_path)
    day1, day2, day3, day4 = (Interval.day(f"2026-01-0{d}") for d in (1, 2, 3, 4))
    assert layout.previous_feature_state_dir(day2) is None
    _commit(layout, day1)
    _commit(layout, day3)
    _commit(layout, day2, manifest=False)  # half-written: no manifest, never a parent
    (tmp_path / "features" / "not-an-interval").mkdir()
    (tmp_path / "features" / "not-an-interval" / "manifest.json").write_text("{}")
    assert layout.previous_feature_state_dir(day1) is None
    assert layout.previous_feature_state_dir(day2) == layout.feature_state_dir(day1)
    assert layout.previous_feature_state_dir(day3) == layout.feature_state_dir(day1)
    # Re-running day 3 after day 4 exists still finds day 1's state (only states ending before day 3 count).
    _commit(layout, day4)
    assert layout.previous_feature_state_dir(day3) == layout.feature_state_dir(day1)
    assert layout.previous_feature_state_dir(Interval.day("2026-01-09")) == layout.feature_state_dir(day4)


def test_day_number_counts_utc_days():
    assert day_number(Interval.day("1970-01-02").start) == 1
    assert day_number(Interval.day("2026-01-01").start) == 20454
