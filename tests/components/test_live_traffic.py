from __future__ import annotations

import functools
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

import components.live_traffic
from components.config import GenerateConfig
from components.layout import Layout
from components.live_traffic import live_minute_index, write_live_minutes
from components.synthetic import RAW_FILE, SUCCESS_MARKER, generate_minute, planted_path
from pipelines.cli import main

pytestmark = pytest.mark.unit

CONFIG = GenerateConfig(rows_per_minute=200, seed=11)
NOON = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


class FakeClock:
    """Epoch seconds that move only when slept on; `oversleep_s` makes every sleep overrun, as a loaded host's."""

    def __init__(self, now: datetime, oversleep_s: float = 0.0):
        self.now = now.timestamp()
        self.oversleep_s = oversleep_s
        self.sleeps: list[float] = []

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds + self.oversleep_s


def _minute_files(layout: Layout, minute: datetime) -> dict[str, bytes]:
    directory = layout.raw_minute_dir(minute)
    files = {path.name: path.read_bytes() for path in directory.iterdir()}
    files["planted"] = planted_path(layout, minute).read_bytes()
    return files


def test_writes_the_open_minute_first_and_each_minute_once_it_has_closed(tmp_path):
    layout = Layout(tmp_path)
    clock = FakeClock(NOON + timedelta(seconds=30))
    calls = []

    def on_minute(minute: datetime, seconds_after_close: float) -> None:
        # The partition is complete when the callback hears of it, and the minute has closed.
        assert (layout.raw_minute_dir(minute) / SUCCESS_MARKER).exists()
        assert clock.now >= (minute + timedelta(minutes=1)).timestamp()
        calls.append((minute, seconds_after_close))

    written = write_live_minutes(CONFIG, layout, num_minutes=3, clock=clock.time, sleep=clock.sleep,
                                 on_minute=on_minute)

    expected = [NOON, NOON + timedelta(minutes=1), NOON + timedelta(minutes=2)]
    assert written == expected
    assert calls == [(m, 0.0) for m in expected]
    assert clock.sleeps == [30.0, 60.0, 60.0]
    assert clock.now == (NOON + timedelta(minutes=3)).timestamp()
    minute_dirs = sorted(p.name for p in (tmp_path / "raw" / "click_log" / "date=2026-03-01").iterdir())
    assert minute_dirs == ["minute=1200", "minute=1201", "minute=1202"]
    for minute in expected:
        directory = layout.raw_minute_dir(minute)
        assert sorted(p.name for p in directory.iterdir()) == [SUCCESS_MARKER, RAW_FILE]
        assert (directory / RAW_FILE).read_text().count("\n") == 200
        labels, probability = np.load(planted_path(layout, minute))
        assert labels.shape == probability.shape == (200,)


def test_a_start_on_the_minute_boundary_waits_for_that_minute_to_close(tmp_path):
    clock = FakeClock(NOON)
    written = write_live_minutes(CONFIG, Layout(tmp_path), num_minutes=1, clock=clock.time, sleep=clock.sleep)
    assert written == [NOON]
    assert clock.sleeps == [60.0]


def test_a_writer_that_falls_behind_still_writes_every_minute_in_order(tmp_path):
    # The one sleep overruns by 130 s: woken at 12:03:10 it writes 12:00 (closed 130 s ago), then 12:01 (70 s)
    # and 12:02 (10 s) without sleeping.
    clock = FakeClock(NOON + timedelta(seconds=30), oversleep_s=130.0)
    calls = []
    written = write_live_minutes(CONFIG, Layout(tmp_path), num_minutes=3, clock=clock.time, sleep=clock.sleep,
                                 on_minute=lambda minute, lag: calls.append((minute, lag)))
    assert written == [NOON, NOON + timedelta(minutes=1), NOON + timedelta(minutes=2)]
    assert [lag for _, lag in calls] == [130.0, 70.0, 10.0]
    assert clock.sleeps == [30.0]


def test_a_minute_written_twice_is_byte_identical_whatever_its_position_in_the_run(tmp_path):
    layout = Layout(tmp_path / "a")
    clock = FakeClock(NOON + timedelta(seconds=5))
    write_live_minutes(CONFIG, layout, num_minutes=2, clock=clock.time, sleep=clock.sleep)
    second = NOON + timedelta(minutes=1)
    first_write = _minute_files(layout, second)
    assert sorted(first_write) == [SUCCESS_MARKER, RAW_FILE, "planted"]

    # A later run starts inside 12:01, so 12:01 is its first minute, not its second; it overwrites the same bytes.
    clock = FakeClock(second + timedelta(seconds=40))
    assert write_live_minutes(CONFIG, layout, num_minutes=1, clock=clock.time, sleep=clock.sleep) == [second]
    assert _minute_files(layout, second) == first_write
    # And a writer on another data root writes it alike.
    other = Layout(tmp_path / "b")
    clock = FakeClock(second)
    write_live_minutes(CONFIG, other, num_minutes=1, clock=clock.time, sleep=clock.sleep)
    assert _minute_files(other, second) == first_write

    # Neighbouring minutes are different draws.
    assert _minute_files(layout, NOON)[RAW_FILE] != first_write[RAW_FILE]


def test_rows_are_drawn_from_the_minute_timestamp():
    # 2026-03-01T12:00Z is 29,539,440 minutes after the epoch: (20,513 days * 1440) + 12 * 60.
    assert live_minute_index(NOON) == 29_539_440 == int(NOON.timestamp()) // 60
    assert live_minute_index(datetime(1970, 1, 1, 0, 1, tzinfo=UTC)) == 1


def test_written_minute_holds_the_rows_of_its_timestamp_draw(tmp_path):
    layout = Layout(tmp_path)
    clock = FakeClock(NOON + timedelta(seconds=59))
    write_live_minutes(CONFIG, layout, num_minutes=1, clock=clock.time, sleep=clock.sleep)
    expected = generate_minute(CONFIG, 29_539_440, NOON).table
    lines = (layout.raw_minute_dir(NOON) / RAW_FILE).read_text().split("\n")[:-1]
    assert [int(line.split("\t")[0]) for line in lines] == expected["label"].to_pylist()
    assert [line.split("\t")[14] or None for line in lines] == expected["C1"].to_pylist()


@pytest.mark.parametrize(
    ("minute", "match"),
    [
        (datetime(2026, 3, 1, 12, 0), r"timezone-aware \(UTC\), got naive 2026-03-01T12:00:00"),
        (NOON + timedelta(seconds=30), r"whole minute, got 2026-03-01T12:00:30\+00:00"),
        (datetime(1969, 12, 31, 23, 59, tzinfo=UTC), r"at or after 1970-01-01T00:00Z, got 1969-12-31T23:59"),
    ],
)
def test_live_minute_index_rejects_minutes_it_cannot_seed(minute, match):
    with pytest.raises(ValueError, match=match):
        live_minute_index(minute)


def test_num_minutes_must_be_positive(tmp_path):
    clock = FakeClock(NOON)
    with pytest.raises(ValueError, match="num_minutes must be at least 1, got 0"):
        write_live_minutes(CONFIG, Layout(tmp_path), num_minutes=0, clock=clock.time, sleep=clock.sleep)
    assert clock.sleeps == []
    assert not (tmp_path / "raw").exists()


def test_cli_generate_live_prints_one_line_per_minute(tmp_path, monkeypatch, capsys):
    clock = FakeClock(NOON + timedelta(seconds=50))
    monkeypatch.setattr(components.live_traffic, "write_live_minutes",
                        functools.partial(write_live_minutes, clock=clock.time, sleep=clock.sleep))
    code = main(["generate", "--live", "--minutes", "2", "--rows-per-minute", "100", "--seed", "11",
                 "--set", f"paths.data_root={tmp_path}"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"writing 2 live minutes of 100 rows to {tmp_path}, each right after it closes",
        "  wrote minute 2026-03-01T12:00Z, 0.0 s after it closed",
        "  wrote minute 2026-03-01T12:01Z, 0.0 s after it closed",
    ]
    text = (Layout(tmp_path).raw_minute_dir(NOON + timedelta(minutes=1)) / RAW_FILE).read_text()
    assert text.count("\n") == 100


def test_cli_generate_live_writes_the_named_specs_layout(tmp_path, monkeypatch, capsys):
    clock = FakeClock(NOON + timedelta(seconds=50))
    monkeypatch.setattr(components.live_traffic, "write_live_minutes",
                        functools.partial(write_live_minutes, clock=clock.time, sleep=clock.sleep))
    assert main(["generate", "--live", "--spec", "avazu", "--minutes", "1", "--rows-per-minute", "100",
                 "--set", f"paths.data_root={tmp_path}"]) == 0
    directory = Layout(tmp_path).raw_minute_dir(NOON)
    assert sorted(p.name for p in directory.iterdir()) == [SUCCESS_MARKER, "part-00000.csv"]
    header, first, *_ = (directory / "part-00000.csv").read_text().split("\n")
    assert header.split(",")[:3] == ["click", "hour", "C1"] and first.split(",")[1] == "26030112"  # %y%m%d%H


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--events"], "--live writes the labelled click log; drop --events"),
        (["--start", "2026-01-01T00:00"], "--start 2026-01-01T00:00 does not apply; drop --start"),
        (["--minutes", "0"], "--live needs --minutes of at least 1, got 0"),
    ],
)
def test_cli_generate_live_rejects_options_it_cannot_honour(tmp_path, capsys, extra, message):
    code = main(["generate", "--live", *extra, "--set", f"paths.data_root={tmp_path}"])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "raw").exists()
