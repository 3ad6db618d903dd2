"""The sources' listing of the minutes that hold data (split_minutes reads it)."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime, timedelta

import pytest

from components.config import GenerateConfig
from components.feature_spec import load_spec
from components.interval import Interval
from components.layout import Layout
from components.synthetic import RAW_FILE, generate
from pipelines.sources import ClickLogSource

pytestmark = pytest.mark.unit

START = datetime(2026, 1, 1, 23, 57, tzinfo=UTC)


def test_the_minutes_with_data_are_those_a_probe_of_every_minute_finds(tmp_path):
    layout, spec, source = Layout(tmp_path), load_spec("criteo"), ClickLogSource()
    generate(GenerateConfig(start=START.isoformat(), minutes=6, rows_per_minute=5, seed=1), layout)  # two days
    shutil.rmtree(layout.raw_minute_dir(START + timedelta(minutes=1)))
    (layout.raw_minute_dir(START + timedelta(minutes=4)) / RAW_FILE).unlink()  # a folder without its data file
    interval = Interval(START - timedelta(days=3), START + timedelta(days=3))
    listed = source.minutes_with_data(layout, spec, interval)
    assert listed == [m for m in interval.minutes() if source.has_data(layout, spec, m)]
    assert listed == [START + timedelta(minutes=i) for i in (0, 2, 3, 5)]
    later = Interval(START + timedelta(minutes=3), START + timedelta(minutes=5))
    assert source.minutes_with_data(layout, spec, later) == [START + timedelta(minutes=3)]
