from __future__ import annotations

from datetime import UTC, datetime, timedelta

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


def test_the_joined_output_ending_at_a_time_is_a_minute_runs_before_a_daily_runs(tmp_path):
    import json

    layout = Layout(tmp_path)
    end = datetime(2026, 1, 2, 0, 0, tzinfo=UTC)

    def commit(directory, span_end):
        directory.mkdir(parents=True)
        (directory / "manifest.json").write_text(json.dumps({"inputs": {"end": span_end.isoformat()}}))
        return directory

    assert layout.joined_dir_ending_at(end) is None
    daily = commit(layout.joined_dir(Interval.day("2026-01-01")), end)
    assert layout.joined_dir_ending_at(end) == daily
    # Minute runs join up to their minute less the label delay (10 minutes here): the run of 00:10-00:11
    # joined 23:59-00:00; the one of 00:11-00:12 joined the minute after. One without a manifest is skipped.
    minute = timedelta(minutes=1)
    run = Interval(end + 10 * minute, end + 11 * minute)
    (layout.incremental_dir(Interval(end + 9 * minute, end + 10 * minute)) / "joined").mkdir(parents=True)
    commit(layout.incremental_dir(Interval(run.start + minute, run.end + minute)) / "joined", end + minute)
    joined = commit(layout.incremental_dir(run) / "joined", end)
    assert layout.joined_dir_ending_at(end) == joined
    assert layout.joined_dir_ending_at(end + minute) == layout.incremental_dir(
        Interval(run.start + minute, run.end + minute)) / "joined"
    assert layout.joined_dir_ending_at(end - minute) is None


def test_minute_partitions_are_listed_from_the_folders_there(tmp_path):
    from components.layout import list_minute_partitions

    base = tmp_path / "raw" / "click_log"
    for folder in ("date=2026-01-01/minute=0000", "date=2026-01-01/minute=0930", "date=2026-01-01/minute=2359",
                   "date=2026-01-01/minute=0931.2",  # a second delivery in quarantine's naming: not a partition
                   "date=2026-01-01/minute=2460", "date=2026-01-01/.minute=0932.tmp",
                   "date=2026-01-03/minute=0005", "date=2026-01-03/minute=0004", "date=2026-1-4/minute=0000",
                   "date=2025-12-31/minute=2359"):
        (base / folder).mkdir(parents=True)
    (base / "date=2026-01-02").write_text("a file, not a day of partitions")
    t = datetime(2026, 1, 1, tzinfo=UTC)
    in_order = [t, t + timedelta(minutes=570), t + timedelta(minutes=1439), t + timedelta(days=2, minutes=4),
                t + timedelta(days=2, minutes=5)]
    assert list_minute_partitions(base, t, t + timedelta(days=30)) == in_order
    # Half-open: the end minute is out, and so are the minutes before the start on its first day.
    assert list_minute_partitions(base, t + timedelta(minutes=1), t + timedelta(days=2, minutes=5)) == in_order[1:4]
    assert list_minute_partitions(base, t + timedelta(minutes=1440), t + timedelta(days=2)) == []
    assert list_minute_partitions(tmp_path / "absent", t, t + timedelta(days=1)) == []
