from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone

import pytest

from components.interval import Interval

pytestmark = pytest.mark.unit


def test_day_is_the_utc_day():
    interval = Interval.day("2026-01-02")
    assert interval.start == datetime(2026, 1, 2, tzinfo=UTC)
    assert interval.end == datetime(2026, 1, 3, tzinfo=UTC)
    assert interval.tag == "20260102T0000-20260103T0000"
    assert interval.as_dict() == {"start": "2026-01-02T00:00:00+00:00", "end": "2026-01-03T00:00:00+00:00"}


def test_day_crosses_month_and_year_ends():
    assert Interval.day("2025-12-31").end == datetime(2026, 1, 1, tzinfo=UTC)
    assert Interval.day("2024-02-28").end == datetime(2024, 2, 29, tzinfo=UTC)


@pytest.mark.parametrize("date", ["2026-1-2x", "02.01.2026", "2026-02-30", "", "2026-01-02T00:00"])
def test_day_rejects_a_bad_date_string(date):
    with pytest.raises(ValueError, match=rf"date {date!r} is not of the form YYYY-MM-DD"):
        Interval.day(date)


def test_parse_treats_naive_strings_as_utc_and_keeps_offsets():
    interval = Interval.parse("2026-01-01T00:00", "2026-01-01T01:30+01:00")
    assert interval.start == datetime(2026, 1, 1, tzinfo=UTC)
    assert interval.end == datetime(2026, 1, 1, 0, 30, tzinfo=UTC)
    assert interval.end.utcoffset() == timedelta(hours=1)


def test_parse_rejects_a_bad_time_string():
    with pytest.raises(ValueError, match="Invalid isoformat string: 'yesterday'"):
        Interval.parse("yesterday", "2026-01-01T00:00")


def test_minutes_are_half_open_and_counted():
    interval = Interval.parse("2026-01-01T23:58", "2026-01-02T00:03")
    minutes = list(interval.minutes())
    assert len(minutes) == 5
    assert minutes[0] == datetime(2026, 1, 1, 23, 58, tzinfo=UTC)
    assert minutes[-1] == datetime(2026, 1, 2, 0, 2, tzinfo=UTC)
    assert interval.end not in minutes
    assert Interval.day("2026-01-01").minutes().__next__() == datetime(2026, 1, 1, tzinfo=UTC)
    assert sum(1 for _ in Interval.day("2026-01-01").minutes()) == 1440


def test_minutes_include_a_partial_last_minute():
    interval = Interval.parse("2026-01-01T00:00", "2026-01-01T00:02:30")
    assert [m.minute for m in interval.minutes()] == [0, 1, 2]


def test_naive_datetimes_are_rejected():
    naive = datetime(2026, 1, 1)
    aware = datetime(2026, 1, 2, tzinfo=UTC)
    with pytest.raises(
        ValueError,
        match=r"Interval\.start must be timezone-aware, got datetime\.datetime\(2026, 1, 1, 0, 0\)",
    ):
        Interval(naive, aware)
    with pytest.raises(ValueError, match=r"Interval\.end must be timezone-aware"):
        Interval(datetime(2025, 12, 31, tzinfo=UTC), naive)


@pytest.mark.parametrize("end_minute", [0, -1])
def test_end_must_be_after_start(end_minute):
    start = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    end = start + timedelta(minutes=end_minute)
    with pytest.raises(
        ValueError,
        match=re.escape(f"Interval end {end.isoformat()} must be after its start 2026-01-01T12:00:00+00:00"),
    ):
        Interval(start, end)


def test_end_before_start_across_time_zones_is_rejected():
    start = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    # 12:30 at +01:00 is 11:30 UTC, before the start.
    end = datetime(2026, 1, 1, 12, 30, tzinfo=timezone(timedelta(hours=1)))
    with pytest.raises(ValueError, match="must be after its start"):
        Interval(start, end)
