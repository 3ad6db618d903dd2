from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from statistics import NormalDist

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from components.config import ConfigError, EventsConfig, GenerateConfig
from components.events import (
    CLICK_SCHEMA,
    CLICKS,
    EVENT_FILE,
    IMPRESSION_SCHEMA,
    IMPRESSIONS,
    RawPartitionError,
    click_delays_ms,
    generate_event_minute,
    generate_events,
    write_event_minute,
)
from components.layout import Layout
from components.synthetic import SUCCESS_MARKER, generate_minute

pytestmark = pytest.mark.unit

START = datetime(2026, 1, 1, tzinfo=UTC)
GENERATE = GenerateConfig(start="2026-01-01T00:00", minutes=3, rows_per_minute=2000, seed=3)
EVENTS = EventsConfig()


def minute(index: int, generate: GenerateConfig = GENERATE, events: EventsConfig = EVENTS):
    return generate_event_minute(generate, events, index, START + timedelta(minutes=index))


@pytest.fixture(scope="module")
def many_minutes():
    """20 minutes x 5000 impressions with the default config: ~26 500 clicks."""
    generate = dataclasses.replace(GENERATE, rows_per_minute=5000)
    pieces = [minute(i, generate) for i in range(20)]
    return (pa.concat_tables([p.impressions for p in pieces]), pa.concat_tables([p.clicks for p in pieces]),
            pa.concat_tables([p.truth for p in pieces]))


def measured_delays_s(impressions: pa.Table, clicks: pa.Table) -> np.ndarray:
    """Click delay of every distinct click whose impression was delivered, from the delivered streams alone."""
    first_impression = impressions.group_by("request_id").aggregate([("ts", "min")])
    first_click = clicks.group_by("request_id").aggregate([("ts", "min")]).rename_columns(["request_id", "click"])
    both = first_click.join(first_impression, "request_id", join_type="inner")
    return (both.column("click").to_numpy() - both.column("ts_min").to_numpy()) / 1000.0


def test_minutes_are_deterministic_for_seed_and_index():
    first, again = minute(1), minute(1)
    assert first.impressions.equals(again.impressions) and first.clicks.equals(again.clicks)
    other_seed = generate_event_minute(dataclasses.replace(GENERATE, seed=4), EVENTS, 1, START + timedelta(minutes=1))
    assert not other_seed.impressions.column("request_id").equals(first.impressions.column("request_id"))
    ids = pa.concat_arrays([minute(i).truth.column("request_id").combine_chunks() for i in range(3)])
    assert len(pc.unique(ids)) == 3 * 2000  # request ids never repeat across minutes


def test_streams_have_the_schema_and_times_of_their_minute():
    piece = minute(2)
    assert piece.impressions.schema == IMPRESSION_SCHEMA
    assert piece.clicks.schema == CLICK_SCHEMA
    start_ms = int((START + timedelta(minutes=2)).timestamp() * 1000)
    ts = piece.impressions.column("ts").to_numpy()
    assert ts.min() >= start_ms and ts.max() < start_ms + 60_000 and (np.diff(ts) >= 0).all()
    assert (np.diff(piece.clicks.column("ts").to_numpy()) >= 0).all()
    # Every click refers to one of this minute's impressions (delivered or lost) and comes at or after it.
    truth_ts = dict(zip(piece.truth.column("request_id").to_pylist(), piece.truth.column("ts").to_pylist(),
                        strict=True))
    assert all(truth_ts[r] <= t for r, t in zip(piece.clicks.column("request_id").to_pylist(),
                                                 piece.clicks.column("ts").to_pylist(), strict=True))
    slots = piece.impressions.column("slot").to_numpy()
    assert slots.min() == 1 and slots.max() == 8
    assert set(piece.impressions.column("device").to_pylist()) == {"mobile", "desktop", "tablet"}


def test_delay_quantiles_follow_the_truncated_lognormal(many_minutes):
    impressions, clicks, _ = many_minutes
    delays = measured_delays_s(impressions, clicks)
    window = EVENTS.attribution_window_s
    on_time = delays[delays <= window]
    normal = NormalDist()
    below = normal.cdf(np.log(window / EVENTS.click_delay_median_s) / EVENTS.click_delay_sigma)
    for q in (0.1, 0.5, 0.9):
        expected = EVENTS.click_delay_median_s * np.exp(EVENTS.click_delay_sigma * normal.inv_cdf(q * below))
        # Seen (25 722 on-time clicks): 4.27 s, 29.1 s, 175 s against 4.30 s, 28.7 s, 174 s.
        assert np.quantile(on_time, q) == pytest.approx(expected, rel=0.06), q
    assert np.median(delays) == pytest.approx(30.6, rel=0.06)  # "tens of seconds"; seen 30.6 s
    assert on_time.max() <= window and delays.min() >= 0


def test_late_share_is_the_configured_rate(many_minutes):
    impressions, clicks, _ = many_minutes
    delays = measured_delays_s(impressions, clicks)
    late = delays > EVENTS.attribution_window_s
    # Seen: 0.0293 of 26 499 clicks (binomial sd 0.001); late clicks follow the lognormal's tail: median
    # 919 s (15 minutes), the longest 13 563 s.
    assert late.mean() == pytest.approx(EVENTS.late_click_rate, abs=0.004)
    assert 800 < np.median(delays[late]) < 1100
    assert delays[late].min() > EVENTS.attribution_window_s


def test_duplicate_and_lost_rates(many_minutes):
    impressions, clicks, truth = many_minutes
    generate = dataclasses.replace(GENERATE, rows_per_minute=5000)
    distinct_impressions = len(pc.unique(impressions.column("request_id")))
    distinct_clicks = len(pc.unique(clicks.column("request_id")))
    lost = truth.num_rows - distinct_impressions
    # Seen: 0.0100 of 99 757 impressions and 0.0098 of 26 564 clicks delivered twice; 0.0024 impressions lost.
    assert impressions.num_rows / distinct_impressions - 1 == pytest.approx(EVENTS.duplicate_rate, abs=0.0015)
    assert clicks.num_rows / distinct_clicks - 1 == pytest.approx(EVENTS.duplicate_rate, abs=0.003)
    assert lost / truth.num_rows == pytest.approx(EVENTS.lost_impression_rate, abs=0.0008)
    counts = pc.value_counts(impressions.column("request_id")).field("counts").to_numpy()
    assert counts.max() == 2  # delivered at most twice
    # The slot and affinity effects are centred: the click rate stays near the planted model's (seen: 0.266
    # against 0.253 for the same seed and minutes).
    planted = np.mean([generate_minute(generate, i, START).probability.mean() for i in range(20)])
    assert distinct_clicks / truth.num_rows == pytest.approx(planted, abs=0.03)


def test_click_delays_respect_the_window_to_the_millisecond():
    config = EventsConfig(attribution_window_s=60, click_delay_median_s=60.0, click_delay_sigma=0.01)
    uniform = np.array([0.0, 0.5, 1.0 - 1e-12, 0.0, 0.5, 1.0 - 1e-12])
    late = np.array([False, False, False, True, True, True])
    delays = click_delays_ms(config, uniform, late)
    assert (delays[:3] <= 60_000).all() and (delays[3:] >= 60_001).all()
    assert delays[0] == 0 and 59_990 <= delays[2] <= 60_000 and delays[3] == 60_001


def test_generate_events_writes_immutable_partitions(tmp_path):
    layout = Layout(tmp_path)
    summary = generate_events(GENERATE, EVENTS, layout)
    assert summary["minutes"] == 3 and summary["impressions"] > 5900
    written_impressions = written_clicks = 0
    for index in range(3):
        at = START + timedelta(minutes=index)
        for stream in (IMPRESSIONS, CLICKS):
            directory = layout.raw_events_minute_dir(stream, at)
            assert sorted(p.name for p in directory.iterdir()) == [SUCCESS_MARKER, EVENT_FILE]
        table = pq.read_table(layout.raw_events_minute_dir(CLICKS, at) / EVENT_FILE)
        ts = table.column("ts").to_numpy()
        start_ms = int(at.timestamp() * 1000)
        assert ts.min() >= start_ms and ts.max() < start_ms + 60_000  # a click lives in its own minute
        written_clicks += table.num_rows
        written_impressions += pq.read_table(layout.raw_events_minute_dir(IMPRESSIONS, at) / EVENT_FILE).num_rows
    assert written_impressions == summary["impression_deliveries"]
    # Every click delivery is written in its minute, except those whose time is after the span.
    generated = pa.concat_tables([minute(i).clicks for i in range(3)])
    end_ms = int((START + timedelta(minutes=3)).timestamp() * 1000)
    assert written_clicks == int((generated.column("ts").to_numpy() < end_ms).sum())
    assert summary["click_deliveries"] == generated.num_rows > written_clicks

    before = (layout.raw_events_minute_dir(CLICKS, START) / EVENT_FILE).stat().st_mtime_ns
    assert generate_events(GENERATE, EVENTS, layout) == summary  # same content again: nothing rewritten
    assert (layout.raw_events_minute_dir(CLICKS, START) / EVENT_FILE).stat().st_mtime_ns == before
    with pytest.raises(RawPartitionError, match=r"impressions/date=2026-01-01/minute=0000 is complete and holds "
                                                r"\d+ other rows .* raw partitions are immutable"):
        generate_events(dataclasses.replace(GENERATE, seed=99), EVENTS, layout)


def test_write_event_minute_refuses_a_complete_partition_without_data(tmp_path):
    (tmp_path / SUCCESS_MARKER).touch()
    with pytest.raises(RawPartitionError, match="is complete and holds no data file"):
        write_event_minute(CLICK_SCHEMA.empty_table(), tmp_path)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("late_click_rate", 1.0, r"'events.late_click_rate' = 1.0: expected a share in \[0, 1\)"),
    ("duplicate_rate", -0.1, r"'events.duplicate_rate' = -0.1: expected a share"),
    ("attribution_window_s", 0, r"'events.attribution_window_s' = 0: expected a positive number"),
    ("num_items", 10, r"'events.num_items' = 10: expected at least 32"),
])
def test_bad_config_names_the_key_and_value(key, value, message):
    with pytest.raises(ConfigError, match=message + r".*--set events\."):
        generate_event_minute(GENERATE, dataclasses.replace(EVENTS, **{key: value}), 0, START)


def test_the_learnable_ceiling_lies_between_knowing_no_user_and_knowing_every_users_topic(tmp_path):
    """learnable_event_auc infers each user's topic from the labels of the training minutes: with many
    labels per user it nears the planted AUC; with none it knows no user's topic and scores lower."""
    from components.evaluation import roc_auc
    from components.events import learnable_event_auc, planted_event_auc, planted_events_path

    layout = Layout(tmp_path)
    generate = GenerateConfig(start="2026-01-01T00:00", minutes=24, rows_per_minute=2000, seed=11)
    generate_events(generate, EventsConfig(num_users=60, num_items=320), layout)
    minutes = [START + timedelta(minutes=i) for i in range(24)]
    train, held_out = minutes[:20], minutes[20:]
    truth = pa.concat_tables([pq.read_table(planted_events_path(layout, m)) for m in held_out])
    ids = truth.column("request_id").to_numpy(zero_copy_only=False)
    labels = truth.column("clicked").to_numpy(zero_copy_only=False).astype(np.int8)
    planted = planted_event_auc(layout, held_out, ids, labels)
    learned = learnable_event_auc(layout, train, held_out, ids, labels)
    unknown = learnable_event_auc(layout, [], held_out, ids, labels)
    without_affinity = roc_auc(labels, truth.column("logit_without_affinity").to_numpy())
    # 60 users x ~660 training impressions each: their topics are all but known.
    assert planted - 0.003 < learned <= planted + 1e-9
    assert unknown == pytest.approx(without_affinity, abs=1e-9)  # the prior: the same score shifted per row
    assert learned > unknown + 0.01
    assert learnable_event_auc(Layout(tmp_path / "elsewhere"), train, held_out, ids, labels) is None
