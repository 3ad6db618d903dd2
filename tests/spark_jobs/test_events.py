from __future__ import annotations

import bisect
import csv
import hashlib
import json
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual

from components.config import EventsConfig, GenerateConfig
from components.events import (
    CLICKS,
    EVENT_FILE,
    IMPRESSIONS,
    TARGETED_SHARE,
    generate_event_minute,
    generate_events,
    item_topic,
    user_topic,
)
from components.feature_spec import load_spec, spec_from_dict
from components.interval import Interval
from components.layout import Layout
from components.manifest import read_manifest
from spark_jobs.events import (
    HISTORY,
    METRIC_COLUMNS,
    MINUTE,
    STALE_STATE_MARKER,
    EventInputError,
    attributed_clicks,
    behaviour_sequences,
    build_samples,
    collect_metrics,
    event_files,
    extract_events,
    final_until,
    join_events,
    joined_rows,
    mark_later_states_stale,
    minute_label,
    plan_join,
    read_history_state,
    relevant_lookback,
    run,
    sample_columns,
    stream_watermark,
)

CRITEO = load_spec("criteo")
EVENTS_SPEC = load_spec("events")

pytestmark = pytest.mark.integration

GOLDEN = Path(__file__).parent / "golden" / "join"
START = datetime(2026, 1, 1, tzinfo=UTC)
TIME_COLUMNS = {"ts", "click_ts"}
INT_COLUMNS = {"label", *METRIC_COLUMNS}


def ms(text: str) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp() * 1000)


def read_csv(spark, path: Path):
    """A golden CSV as a DataFrame: times (ISO, UTC) -> epoch ms, counts -> long, empty field -> null."""
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        columns = list(reader.fieldnames)
        rows = [[(ms(v) if c in TIME_COLUMNS else int(v) if c in INT_COLUMNS else v) if v != "" else None
                 for c, v in row.items()] for row in reader]
    types = ["long" if c in TIME_COLUMNS or c in INT_COLUMNS else "string" for c in columns]
    if "label" in columns:
        types[columns.index("label")] = "int"
    return spark.createDataFrame(rows, ", ".join(f"{c} {t}" for c, t in zip(columns, types, strict=True)))


@pytest.mark.parametrize("case", sorted(p.name for p in GOLDEN.iterdir() if p.is_dir()))
def test_join_golden(spark, case):
    directory = GOLDEN / case
    window_s = json.loads((directory / "case.json").read_text())["window_s"]
    samples, metrics = join_events(read_csv(spark, directory / "impressions.csv"),
                                   read_csv(spark, directory / "clicks.csv"), window_s)
    expected_samples = read_csv(spark, directory / "expected_samples.csv")
    assert samples.columns == expected_samples.columns
    assertDataFrameEqual(samples, expected_samples)
    expected_metrics = read_csv(spark, directory / "expected_metrics.csv")
    assertDataFrameEqual(metrics.withColumn(MINUTE, minute_label(F.col(MINUTE))), expected_metrics)


# ---------------------------------------------------------------------------------------------- leakage


def test_history_holds_only_clicks_strictly_before_the_impression(spark):
    t = START
    impressions = [  # request, seconds, user, item
        ("a", 1, "u1", "ia"), ("b", 20, "u1", "ib"), ("x", 30, "u1", "ix"), ("c", 50, "u1", "ic"),
        ("s", 60, "u1", "is"), ("late", 5, "u1", "ilate"), ("z", 1200, "u1", "iz"), ("other", 60, "u2", "io"),
    ]
    clicks = [
        ("a", 10), ("b", 40),
        ("x", 70),  # impression before s, click after s: must not be in s's history
        ("c", 60),  # click at exactly s's time: not strictly before
        ("s", 65),  # s's own click
        ("late", 900),  # more than the window after its impression: never attributed, never in a history
    ]
    impressions_frame = spark.createDataFrame(
        [(r, int((t + timedelta(seconds=s)).timestamp() * 1000), u, i) for r, s, u, i in impressions],
        "request_id string, ts long, user_id string, item_id string",
    )
    clicks_frame = spark.createDataFrame(
        [(r, int((t + timedelta(seconds=s)).timestamp() * 1000)) for r, s in clicks], "request_id string, ts long"
    )
    samples, _ = join_events(impressions_frame, clicks_frame, window_s=600)
    history = {
        k: {row["request_id"]: row[HISTORY] for row in behaviour_sequences(samples, attributed_clicks(samples), k)
            .select("request_id", HISTORY).collect()}
        for k in (3, 10)
    }
    assert history[10]["s"] == ["ia", "ib"]
    assert history[10]["other"] == []  # u2 never clicked; u1's clicks stay u1's
    assert history[10]["a"] == []
    assert history[10]["x"] == ["ia"]  # b was clicked at 40 s, after x was shown at 30 s
    # Most recent last, ordered by click time (c at 60 s, s at 65 s, x at 70 s), the late click left out.
    assert history[10]["z"] == ["ia", "ib", "ic", "is", "ix"]
    assert history[3]["z"] == ["ic", "is", "ix"]
    assert history[3]["s"] == ["ia", "ib"]


def test_equal_click_times_are_ordered_and_excluded_at_the_impression_time(spark):
    ts = 1_767_225_600_000
    samples = spark.createDataFrame(
        [(0, "u1", "q", "s1", ts), (0, "u1", "q", "s2", ts + 1)],
        "label int, user_id string, item_id string, request_id string, ts long",
    )
    clicks = spark.createDataFrame(
        [("u1", "i2", ts, "r2"), ("u1", "i1", ts, "r1"), ("u1", "i0", ts - 1, "r0")],
        "user_id string, item_id string, ts long, request_id string",
    )
    rows = {r["request_id"]: r[HISTORY] for r in behaviour_sequences(samples, clicks, 2).collect()}
    assert rows == {"s1": ["i0"], "s2": ["i1", "i2"]}
    with pytest.raises(ValueError, match="sequence length must be at least 1, got 0"):
        behaviour_sequences(samples, clicks, 0)


def reference_history(samples: list[dict], k: int) -> dict[str, list[str]]:
    """Brute force: for each sample, the user's attributed clicks with click time < ts, last k."""
    clicks_by_user = defaultdict(list)
    for row in samples:
        if row["label"] == 1:
            clicks_by_user[row["user_id"]].append((row["click_ts"], row["request_id"], row["item_id"]))
    for user_clicks in clicks_by_user.values():
        user_clicks.sort()
    out = {}
    for row in samples:
        user_clicks = clicks_by_user[row["user_id"]]
        before = bisect.bisect_left(user_clicks, (row["ts"],))
        out[row["request_id"]] = [item for _, _, item in user_clicks[max(0, before - k):before]]
    return out


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """12 minutes of both streams with few users, so users have long click histories."""
    layout = Layout(tmp_path_factory.mktemp("events"))
    generate = GenerateConfig(start="2026-01-01T00:00", minutes=12, rows_per_minute=800, seed=5)
    events = EventsConfig(attribution_window_s=120, num_users=150, num_items=640, duplicate_rate=0.03,
                          late_click_rate=0.05, lost_impression_rate=0.01)
    summary = generate_events(generate, events, layout)
    truth = pa.concat_tables(
        [generate_event_minute(generate, events, i, START + timedelta(minutes=i)).truth for i in range(12)]
    )
    return layout, generate, events, summary, truth


@pytest.fixture(scope="module")
def joined(spark, generated):
    """The generated world joined once, with histories of length 10, collected: (rows, metrics)."""
    layout, generate, events, _, _ = generated
    minutes = [START + timedelta(minutes=i) for i in range(generate.minutes)]
    samples, metrics = join_events(extract_events(spark, layout, IMPRESSIONS, minutes, EVENTS_SPEC),
                                   extract_events(spark, layout, CLICKS, minutes, EVENTS_SPEC),
                                   events.attribution_window_s)
    rows = [r.asDict() for r in behaviour_sequences(samples, attributed_clicks(samples), 10).collect()]
    return rows, collect_metrics(metrics)


def test_sequences_on_generated_data_match_a_brute_force_reference(joined):
    rows, _ = joined
    expected = reference_history(rows, 10)
    assert {r["request_id"]: r[HISTORY] for r in rows} == expected
    lengths = np.array([len(h) for h in expected.values()])
    # Seen: 9 510 samples, 61 % with a full history of 10; the comparison is not vacuous.
    assert len(rows) > 9000 and (lengths == 10).mean() > 0.4


def test_sequences_carry_the_planted_user_topic(joined, generated):
    """Impressions whose item shares the topic most frequent in the history are clicked more often."""
    rows, _ = joined
    seed = generated[1].seed
    with_history = [r for r in rows if len(r[HISTORY]) >= 5]
    topics = item_topic([r["item_id"] for r in with_history])
    guessed = np.array([np.bincount(item_topic(r[HISTORY]), minlength=32).argmax() for r in with_history])
    labels = np.array([r["label"] for r in with_history])
    match = topics == guessed
    # Seen: the majority topic of a history of 5 or more clicks is the user's planted topic for 88 % of the
    # samples (1/32 by chance); click rate 0.35 when the item's topic matches it, 0.21 otherwise.
    preferred = user_topic(seed, [r["user_id"] for r in with_history])
    assert (guessed == preferred).mean() > 0.8
    assert labels[match].mean() > 1.4 * labels[~match].mean()
    assert TARGETED_SHARE * 0.8 < match.mean() < TARGETED_SHARE * 1.3


# ---------------------------------------------------------------------------------------------- generated data


def test_join_metrics_on_generated_data_match_the_generator(joined, generated):
    rows, got = joined
    _, generate, events, summary, truth = generated
    t = {name: truth.column(name).to_numpy(zero_copy_only=False) for name in truth.column_names}
    end_ms = int((START + timedelta(minutes=generate.minutes)).timestamp() * 1000)
    click_ts = t["ts"] + np.nan_to_num(t["delay_ms"].astype(float)).astype(np.int64)
    written_click = t["clicked"] & (click_ts < end_ms)  # clicks after the span are not in the log yet
    expected = {
        "impressions": int((~t["lost"]).sum()),
        "duplicate_impressions": int((t["impression_deliveries"] == 2).sum()),
        "positives": int((written_click & ~t["late"] & ~t["lost"]).sum()),
        "clicks": int(written_click.sum()),
        "duplicate_clicks": int((written_click & (t["click_deliveries"] == 2)).sum()),
        "attributed_clicks": int((written_click & ~t["late"] & ~t["lost"]).sum()),
        "late_clicks": int((written_click & t["late"] & ~t["lost"]).sum()),
        "early_clicks": 0,
        "orphan_clicks": int((written_click & t["lost"]).sum()),
    }
    assert {name: got[name] for name in METRIC_COLUMNS} == expected
    assert summary["impressions"] == expected["impressions"] == len(rows)
    assert sum(r["label"] for r in rows) == expected["positives"]
    for row in got["per_minute"]:
        assert row["clicks"] == row["attributed_clicks"] + row["late_clicks"] + row["orphan_clicks"]
    # Measured on this data (seen: duplicates 0.030 of impressions and 0.030 of clicks, orphans 0.010).
    assert expected["duplicate_impressions"] / expected["impressions"] == pytest.approx(0.03, abs=0.008)
    assert expected["duplicate_clicks"] / expected["clicks"] == pytest.approx(0.03, abs=0.015)
    assert expected["orphan_clicks"] / expected["clicks"] == pytest.approx(0.01, abs=0.01)


def test_late_click_rate_measured_by_the_join(joined, generated):
    """Over impressions whose on-time clicks all lie inside the log, the share of clicks the join did not
    attribute is the late share, whether the late click arrived inside the log or after its end."""
    rows, _ = joined
    _, _, events, _, truth = generated
    cutoff = int((START + timedelta(minutes=6)).timestamp() * 1000)
    positives = sum(r["label"] for r in rows if r["ts"] < cutoff)
    clicked = int((truth.column("clicked").to_numpy(zero_copy_only=False)
                   & ~truth.column("lost").to_numpy(zero_copy_only=False)
                   & (truth.column("ts").to_numpy() < cutoff)).sum())
    measured = 1 - positives / clicked
    # Seen: 0.058 with late_click_rate 0.05 over 1 321 clicks (binomial sd 0.006).
    assert measured == pytest.approx(events.late_click_rate, abs=0.025)


def test_runs_over_consecutive_spans_count_every_record_once(spark, generated, joined, tmp_path):
    layout, generate, events, _, _ = generated
    window_s = events.attribution_window_s
    watermark = stream_watermark(layout, CLICKS)
    assert watermark == START + timedelta(minutes=12)
    assert final_until(watermark, window_s) == START + timedelta(minutes=10)
    first = run(spark, layout, Interval(START + timedelta(minutes=2), START + timedelta(minutes=5)),
                tmp_path / "a", spec=EVENTS_SPEC, window_s=window_s, sequence_length=4, lookback_s=7200)
    second = run(spark, layout, Interval(START + timedelta(minutes=5), START + timedelta(minutes=10)),
                 tmp_path / "b", spec=EVENTS_SPEC, window_s=window_s, sequence_length=4, lookback_s=7200)
    whole_rows = {r[MINUTE]: r for r in joined[1]["per_minute"]}  # the whole log joined at once
    split_rows = {r[MINUTE]: r for r in first["per_minute"] + second["per_minute"]}
    assert sorted(split_rows) == [f"2026-01-01 00:0{i}" for i in range(2, 10)]
    for minute, row in split_rows.items():
        assert {n: row[n] for n in METRIC_COLUMNS} == {n: whole_rows[minute][n] for n in METRIC_COLUMNS}

    manifest = read_manifest(tmp_path / "a", kind="joined_samples")
    written = spark.read.parquet(str(tmp_path / "a" / "samples"))
    assert tuple(written.columns) == sample_columns(EVENTS_SPEC)
    assert written.count() == manifest["row_counts"]["rows"] == first["impressions"]
    assert written.where("label = 1").count() == manifest["row_counts"]["positives"] == first["positives"]
    bounds = written.agg(F.min("ts"), F.max("ts")).first()
    assert bounds[0] >= ms("2026-01-01T00:02:00") and bounds[1] < ms("2026-01-01T00:05:00")

    with pytest.raises(EventInputError, match=r"minutes up to 2026-01-01 00:11 are not final: .* only minutes "
                                              r"before 2026-01-01 00:10:00\+00:00 can be joined"):
        run(spark, layout, Interval(START, START + timedelta(minutes=11)), tmp_path / "c", spec=EVENTS_SPEC,
            window_s=window_s,
            sequence_length=4, lookback_s=0)


def test_a_minute_run_reads_only_the_relevant_lookback_and_writes_the_whole_logs_rows(spark, generated, joined,
                                                                                     tmp_path):
    """A minute run classifies only the lookback impressions that can change its output (relevant_lookback):
    its samples, labels and behaviour sequences are those of the whole log joined at once."""
    layout, _, events, _, _ = generated
    minute = Interval(START + timedelta(minutes=6), START + timedelta(minutes=7))
    lookback = extract_events(spark, layout, IMPRESSIONS, [START + timedelta(minutes=i) for i in range(6)], EVENTS_SPEC)
    in_span = extract_events(spark, layout, IMPRESSIONS, [minute.start], EVENTS_SPEC)
    clicks = extract_events(spark, layout, CLICKS, [START + timedelta(minutes=i) for i in range(9)], EVENTS_SPEC)
    kept = relevant_lookback(lookback, in_span, clicks, minute)
    clicked = {r[0] for r in clicks.select("request_id").distinct().collect()}
    kept_ids = [r[0] for r in kept.select("request_id").collect()]
    assert 0 < len(kept_ids) < lookback.count() / 3  # most of the lookback has no click: left out
    assert set(kept_ids) <= clicked | {r[0] for r in in_span.select("request_id").collect()}
    assert {r[0] for r in lookback.select("request_id").collect()} & clicked <= set(kept_ids)

    metrics = run(spark, layout, minute, tmp_path / "minute", spec=EVENTS_SPEC, window_s=events.attribution_window_s,
                  sequence_length=10, lookback_s=7200)
    written = pq.read_table(tmp_path / "minute" / "samples").to_pylist()
    start, end = (int(t.timestamp() * 1000) for t in (minute.start, minute.end))
    whole = {r["request_id"]: r for r in joined[0] if start <= r["ts"] < end}
    assert len(written) == len(whole) == metrics["impressions"] > 500
    assert sum(r["label"] for r in written) > 10
    fields = ("label", "ts", "user_id", "item_id", HISTORY)
    assert ({r["request_id"]: tuple(r[f] for f in fields) for r in written}
            == {k: tuple(r[f] for f in fields) for k, r in whole.items()})
    assert sum(len(r[HISTORY]) > 0 for r in written) > len(written) / 2  # histories reach into the lookback


def test_minute_runs_that_continue_the_history_state_write_the_whole_logs_rows_beyond_their_lookback(
        spark, generated, joined, tmp_path):
    """A minute run continues the history state of the run before it: its behaviour sequences reach back past
    its lookback (2 minutes here) to the start of the chain, and its labels and metrics are the whole log's.
    Its lookback is read only for the clicks in the minute: a late click on an impression older than the
    lookback counts as an orphan there, as in any run."""
    _, _, events, _, _ = generated
    layout = Layout(tmp_path / "data")  # the generated streams, and joined outputs of its own
    layout.root.mkdir()
    (layout.root / "raw").symlink_to(generated[0].root / "raw")
    window_s, k = events.attribution_window_s, 10
    spans = [Interval(START, START + timedelta(minutes=3))] + [
        Interval(START + timedelta(minutes=i), START + timedelta(minutes=i + 1)) for i in range(3, 10)]
    whole_rows = {r["request_id"]: r for r in joined[0]}
    whole_metrics = {r[MINUTE]: r for r in joined[1]["per_minute"]}
    fields = ("label", "ts", "user_id", "item_id", HISTORY)
    for span in spans:
        previous = layout.joined_dir_ending_at(span.start)
        metrics = run(spark, layout, span, layout.joined_dir(span), spec=EVENTS_SPEC, window_s=window_s,
                      sequence_length=k,
                      lookback_s=120, previous=previous, keep_lookback_mib=64)  # lookback reads kept as they go
        manifest = read_manifest(layout.joined_dir(span), kind="joined_samples")
        assert manifest["history_state"] == {"as_of": span.end.isoformat(),
                                             "from": previous.name if previous else "lookback"}
        assert (previous is None) == (span is spans[0])
        written = pq.read_table(layout.joined_dir(span) / "samples").to_pylist()
        assert len(written) == metrics["impressions"] > 500
        assert ({r["request_id"]: tuple(r[f] for f in fields) for r in written}
                == {r["request_id"]: tuple(whole_rows[r["request_id"]][f] for f in fields) for r in written})
        for row in metrics["per_minute"]:
            same = [n for n in METRIC_COLUMNS if n not in ("late_clicks", "orphan_clicks")]
            assert {n: row[n] for n in same} == {n: whole_metrics[row[MINUTE]][n] for n in same}
            assert (row["late_clicks"] + row["orphan_clicks"]
                    == whole_metrics[row[MINUTE]]["late_clicks"] + whole_metrics[row[MINUTE]]["orphan_clicks"])
    # The last minute again, from its lookback alone: its sequences stop 2 minutes back.
    run(spark, layout, spans[-1], tmp_path / "alone", spec=EVENTS_SPEC, window_s=window_s, sequence_length=k,
        lookback_s=120)
    alone = {r["request_id"]: r[HISTORY] for r in pq.read_table(tmp_path / "alone" / "samples").to_pylist()}
    shorter = [key for key, history in alone.items() if len(history) < len(whole_rows[key][HISTORY])]
    assert len(shorter) > len(alone) / 2

    # The state at the chain's end: each user's last k attributed clicks before it, from the whole log.
    end = int(spans[-1].end.timestamp() * 1000)
    clicks = sorted((r["click_ts"], r["request_id"], r["user_id"], r["item_id"]) for r in joined[0]
                    if r["label"] == 1 and r["click_ts"] < end)
    expected = defaultdict(list)
    for _, _, user, item in clicks:
        expected[user] = (expected[user] + [item])[-k:]
    state = pq.read_table(layout.joined_dir(spans[-1]) / "history_state").to_pylist()
    assert {r["user_id"]: r[HISTORY] for r in state} == dict(expected)


def test_joining_a_minute_again_marks_the_states_built_on_it_stale_and_the_next_run_reads_the_lookback(
        spark, generated, tmp_path, caplog):
    """A raw minute fixed and joined again after later minutes continued its history state: those later states
    hold sequences built without the fix. The join marks each of them (and only them) stale; the next run
    does not continue them and builds its sequences from the lookback."""
    _, _, events, _, _ = generated
    layout = Layout(tmp_path / "data")
    layout.root.mkdir()
    (layout.root / "raw").symlink_to(generated[0].root / "raw")
    options = {"spec": EVENTS_SPEC, "window_s": events.attribution_window_s, "sequence_length": 10,
               "lookback_s": 120}
    spans = [Interval(START, START + timedelta(minutes=3))] + [
        Interval(START + timedelta(minutes=i), START + timedelta(minutes=i + 1)) for i in range(3, 7)]
    for span in spans:
        run(spark, layout, span, layout.joined_dir(span), previous=layout.joined_dir_ending_at(span.start), **options)
    assert not list(layout.root.rglob(STALE_STATE_MARKER))
    assert mark_later_states_stale(layout, spans[-1]) == []  # nothing continued the last one
    # An unrelated output starting where the re-joined span ends, built from the lookback: left alone.
    other = Interval(START + timedelta(minutes=4), START + timedelta(minutes=6))
    run(spark, layout, other, layout.joined_dir(other), **options)

    with caplog.at_level("WARNING", logger="spark_jobs.events"):
        run(spark, layout, spans[1], layout.joined_dir(spans[1]), previous=layout.joined_dir_ending_at(spans[1].start),
            **options)
    later = [layout.joined_dir(span) for span in spans[2:]]
    assert sorted(p.parent for p in layout.root.rglob(STALE_STATE_MARKER)) == later
    assert json.loads((later[0] / STALE_STATE_MARKER).read_text())["joined_again"] == spans[1].tag
    assert "joined again after 3 later joined outputs" in caplog.text
    assert read_history_state(later[-1], Interval(spans[-1].end, spans[-1].end + timedelta(minutes=1)),
                              window_s=events.attribution_window_s, sequence_length=10) is None

    after = Interval(spans[-1].end, spans[-1].end + timedelta(minutes=1))
    previous = layout.joined_dir_ending_at(after.start)
    assert previous == later[-1]
    run(spark, layout, after, layout.joined_dir(after), previous=previous, **options)
    assert read_manifest(layout.joined_dir(after), kind="joined_samples")["history_state"]["from"] == "lookback"


def test_a_run_reads_the_lookback_when_the_state_before_it_is_missing_or_made_otherwise(spark, generated, tmp_path):
    layout, _, events, _, _ = generated
    before, minute = (Interval(START + timedelta(minutes=i), START + timedelta(minutes=i + 1)) for i in (4, 5))
    run(spark, layout, before, tmp_path / "before", spec=EVENTS_SPEC, window_s=events.attribution_window_s,
        sequence_length=4,
        lookback_s=600)
    assert read_manifest(tmp_path / "before")["history_state"]["from"] == "lookback"
    for name, previous, k in (("continued", tmp_path / "before", 4), ("other-length", tmp_path / "before", 5),
                              ("none", None, 4), ("not-adjacent", tmp_path / "continued", 4)):
        run(spark, layout, minute, tmp_path / name, spec=EVENTS_SPEC, window_s=events.attribution_window_s,
            sequence_length=k,
            lookback_s=600, previous=previous)
        expected = before.tag if name == "continued" else "lookback"
        assert read_manifest(tmp_path / name)["history_state"]["from"] == expected, name
    rows = {name: sorted(pq.read_table(tmp_path / name / "samples").to_pylist(), key=lambda r: r["request_id"])
            for name in ("continued", "none")}
    assert rows["continued"] == rows["none"]  # a 10-minute lookback covers the whole log: the same sequences


def test_local_relations_keep_the_rows_after_an_empty_chunk(spark):
    """pyspark's createDataFrame drops the rows after an empty record batch; local_relation hands it one chunk."""
    from spark_jobs.events import local_relation

    part = pa.table({"request_id": ["a", "b"], "ts": [1, 2]})
    table = pa.concat_tables([part.slice(0, 0), part, part.slice(0, 0), part.slice(1)])
    assert [len(chunk) for chunk in table["ts"].chunks] == [0, 2, 0, 1]
    schema = pa.schema([("request_id", pa.string()), ("ts", pa.int64())])
    frame = local_relation(spark, table, schema, ["request_id", "ts"])
    assert sorted(tuple(r) for r in frame.collect()) == [("a", 1), ("b", 2), ("b", 2)]
    assert frame.schema.simpleString() == "struct<request_id:string,ts:bigint>"


def test_lookback_reads_are_kept_for_the_next_run_and_read_again_when_a_file_changes(tmp_path):
    """LookbackReads gives what one read of the files gives; a file it kept is not read again unless its size or
    time changes (a re-delivered minute), and it keeps only the files of the last read of each stream."""
    import os

    from spark_jobs.events import LookbackReads

    schema = pa.schema([("request_id", pa.string()), ("ts", pa.int64()), ("user_id", pa.string())])
    paths = []
    for minute in range(3):
        path = tmp_path / f"m{minute}.parquet"
        pq.write_table(pa.table({"request_id": [f"r{minute}-{i}" for i in range(4)], "ts": [minute] * 4,
                                 "user_id": ["u"] * 4}, schema=schema), path)
        paths.append(str(path))
    reads = LookbackReads()
    first = reads.read("impressions", paths[:2], schema, ["request_id", "ts"], keep_mib=1)
    assert first.column_names == ["request_id", "ts"]
    assert first["request_id"].to_pylist() == [f"r{m}-{i}" for m in range(2) for i in range(4)]
    # The next minute: one file dropped, one added; the kept file is not read again (a changed file would be).
    os.remove(paths[1])
    with pytest.raises(FileNotFoundError):
        reads.read("impressions", paths[:2], schema, ["request_id", "ts"], keep_mib=1)
    pq.write_table(pa.table({"request_id": ["again"], "ts": [9], "user_id": ["v"]}, schema=schema), paths[1])
    os.utime(paths[1], ns=(10**18, 10**18))
    second = reads.read("impressions", paths[1:], schema, ["request_id", "ts"], keep_mib=1)
    assert second.to_pylist() == [{"request_id": "again", "ts": 9}] + [
        {"request_id": f"r2-{i}", "ts": 2} for i in range(4)]
    assert sorted(key[0] for key in reads._kept["impressions"]) == sorted(paths[1:])
    held = dict(reads._kept["impressions"])
    assert reads.read("impressions", paths[1:], schema, ["request_id", "ts"], keep_mib=1).equals(second)
    assert all(reads._kept["impressions"][key] is table for key, table in held.items())  # not read again
    empty = reads.read("clicks", [], schema, ["request_id"], keep_mib=1)
    assert (empty.num_rows, empty.schema) == (0, pa.schema([("request_id", pa.string())]))
    # With keeping off, or above its limit, nothing is kept: the same rows, read again next time.
    assert reads.read("impressions", paths[1:], schema, ["request_id", "ts"], keep_mib=0).equals(second)
    assert not reads._kept.get("impressions")
    large = tmp_path / "large.parquet"
    pq.write_table(pa.table({"request_id": [f"{i:016x}" for i in range(80_000)], "ts": [0] * 80_000,
                             "user_id": ["u"] * 80_000}, schema=schema), large)
    assert reads.read("impressions", [str(large)], schema, ["request_id", "ts"], keep_mib=1).num_rows == 80_000
    assert not reads._kept.get("impressions")  # 2.1 MiB read
    assert reads.read("impressions", [str(large)], schema, ["request_id", "ts"], keep_mib=3).num_rows == 80_000
    assert len(reads._kept["impressions"]) == 1


def test_advancing_a_history_state_on_the_client():
    from spark_jobs.events import HISTORY_STATE_SCHEMA, advance_history

    seed = pa.table({"user_id": ["u1", "u2", "u3"], HISTORY: [["a", "b"], ["c"], ["d", "e", "f"]]},
                    schema=HISTORY_STATE_SCHEMA)
    clicks = pa.table({"user_id": ["u3", "u4", "u1", "u3", None, "u3"],
                       "item_id": ["y", "n", "x", "z", "lost", "w"],
                       "ts": [20, 5, 10, 20, 1, 7],
                       "request_id": ["r9", "r1", "r2", "r3", "r4", "r5"]})
    state = advance_history(seed, clicks, 3).to_pylist()
    assert [(row["user_id"], row[HISTORY]) for row in state] == [
        ("u2", ["c"]),  # no new click: kept, in its place
        ("u1", ["a", "b", "x"]),
        ("u3", ["w", "z", "y"]),  # by click time, then request id (r3 before r9); the last 3 kept
        ("u4", ["n"]),  # a new user
    ]


def test_span_bounds_select_the_span_and_stay_out_of_the_compiled_code(spark):
    """ms_in keeps start <= ts < end (nulls out) and a second span's bounds compile no new classes: a minute run
    recompiled its stages for every minute while its bounds were long literals."""
    from spark_jobs.events import ms_in

    start = 1_767_225_600_000  # 2026-01-01 00:00 UTC, in milliseconds
    rows = spark.createDataFrame([(start - 1,), (start,), (start + 59_999,), (start + 60_000,), (None,)], "ts bigint")
    compiled = spark._jvm.org.apache.spark.metrics.source.CodegenMetrics.METRIC_COMPILATION_TIME()

    def selected(first: int) -> tuple[list[int], int]:
        before = compiled.getCount()
        kept = sorted(row.ts for row in rows.where(ms_in("ts", first, first + 60_000)).collect())
        return kept, compiled.getCount() - before

    assert selected(start)[0] == [start, start + 59_999]
    kept, classes = selected(start - 60_000)
    assert kept == [start - 1]
    assert classes == 0
    # A long literal in the same place is compiled into the code: the count above can see a recompile.
    before = compiled.getCount()
    rows.where((F.col("ts") >= start + 7) & (F.col("ts") < start + 60_007)).collect()
    assert compiled.getCount() > before


def test_rerunning_a_join_gives_the_same_rows_in_the_same_order_and_identical_tfrecords(spark, generated, tmp_path):
    """The join's samples are written in a hash order that the sample writer keeps instead of shuffling: a
    re-run must reproduce it exactly, and the TFRecords written from either copy must be byte-identical."""
    from components.config import FeatureConfig
    from spark_jobs.events import joined_rows
    from spark_jobs.features import build_feature_state
    from spark_jobs.samples import write_samples

    layout, _, events, _, _ = generated
    span = Interval(START + timedelta(minutes=2), START + timedelta(minutes=7))
    for name in ("a", "b"):
        run(spark, layout, span, tmp_path / name, spec=EVENTS_SPEC, window_s=events.attribution_window_s,
            sequence_length=4,
            lookback_s=120)
    tables = {name: pa.concat_tables([pq.read_table(path) for path in
                                      sorted((tmp_path / name / "samples").glob("part-*.parquet"))])
              for name in ("a", "b")}
    assert tables["a"].num_rows > 3000 and tables["a"].equals(tables["b"])
    # Shuffled: neither in time order nor grouped by user, so blocks of the TFRecords mix minutes and users.
    ts = tables["a"].column("ts").to_numpy()
    assert 0.4 < np.mean(np.diff(ts) > 0) < 0.6

    minutes = list(span.minutes())
    state = build_feature_state(joined_rows(spark, tmp_path / "a", minutes, CRITEO), None, FeatureConfig(min_count=2),
                                day=0, version="v", evict=True, spec=CRITEO)
    written = {}
    for name in ("a", "b"):
        rows = joined_rows(spark, tmp_path / name, minutes, CRITEO)
        manifest = write_samples(rows, state, tmp_path / f"tf-{name}", spec=CRITEO, split="train", block_rows=64,
                                 num_shards=2, seed=1, inputs={}, shuffle=False)
        assert manifest["row_counts"]["rows"] == tables["a"].num_rows
        # No shuffle: the read's partitions, merged down to num_shards (small joins make fewer shards).
        assert len(manifest["shards"]) == min(2, rows.rdd.getNumPartitions())
        written[name] = {path.name: path.read_bytes() for path in (tmp_path / f"tf-{name}").iterdir()}
    assert written["a"] == written["b"]  # shards, schema and manifest


def test_build_samples_keeps_only_the_span(spark, generated):
    layout, _, events, _, _ = generated
    span = Interval(START + timedelta(minutes=3), START + timedelta(minutes=4))
    plan = plan_join(span, events.attribution_window_s, lookback_s=60)
    assert plan.impression_minutes() == [START + timedelta(minutes=2), START + timedelta(minutes=3)]
    assert plan.click_minutes() == [START + timedelta(minutes=i) for i in range(2, 6)]
    samples, metrics = build_samples(
        extract_events(spark, layout, IMPRESSIONS, plan.impression_minutes(), EVENTS_SPEC),
        extract_events(spark, layout, CLICKS, plan.click_minutes(), EVENTS_SPEC),
        window_s=events.attribution_window_s, sequence_length=3, span=span, spec=EVENTS_SPEC,
    )
    assert [r[MINUTE] for r in metrics.collect()] == ["2026-01-01 00:03"]
    minutes = {r[0] for r in samples.select(F.floor(F.col("ts") / 60_000)).distinct().collect()}
    assert minutes == {int(span.start.timestamp()) // 60}


# ---------------------------------------------------------------------------------------------- planning, input


def test_final_until_waits_one_minute_plus_the_window():
    watermark = datetime(2026, 1, 1, 0, 12, tzinfo=UTC)
    assert final_until(watermark, 600) == datetime(2026, 1, 1, 0, 2, tzinfo=UTC)  # 00:00 and 00:01 final
    assert final_until(watermark + timedelta(seconds=59), 600) == datetime(2026, 1, 1, 0, 2, tzinfo=UTC)
    assert final_until(watermark, 630) == datetime(2026, 1, 1, 0, 1, tzinfo=UTC)
    assert final_until(watermark, 0) == watermark


def test_plan_reads_clicks_to_the_end_of_the_window():
    span = Interval(START, START + timedelta(minutes=1))
    plan = plan_join(span, window_s=90, lookback_s=0)
    assert plan.impression_minutes() == [START]
    # The last impression (00:00:59.999) may be clicked until 00:02:29.999: partitions 00:00, 00:01, 00:02.
    assert plan.click_minutes() == [START + timedelta(minutes=i) for i in range(3)]


def test_incomplete_or_malformed_partitions_are_refused(generated, tmp_path):
    layout = Layout(tmp_path)
    minute = START
    directory = layout.raw_events_minute_dir(CLICKS, minute)
    directory.mkdir(parents=True)
    pq.write_table(pa.table({"request_id": ["a"], "ts": ["2026-01-01"]}), directory / "part-00000.parquet")
    with pytest.raises(EventInputError, match=r"clicks minute 2026-01-01 00:00 is not complete: .* no _SUCCESS"):
        event_files(layout, CLICKS, [minute], EVENTS_SPEC)
    (directory / "_SUCCESS").touch()
    with pytest.raises(EventInputError, match=r"part-00000.parquet is not a valid clicks file for feature spec "
                                              r"'events': column 'ts' is string, expected int64 \(it has 2 "
                                              r"columns: request_id, ts\)"):
        event_files(layout, CLICKS, [minute], EVENTS_SPEC)
    impressions_dir = layout.raw_events_minute_dir(IMPRESSIONS, minute)
    impressions_dir.mkdir(parents=True)
    pq.write_table(pa.table({"request_id": ["a"], "ts": [1]}), impressions_dir / "part-00000.parquet")
    (impressions_dir / "_SUCCESS").touch()
    with pytest.raises(EventInputError, match=r"column 'user_id' is missing; column 'item_id' is missing"):
        event_files(layout, IMPRESSIONS, [minute], EVENTS_SPEC)
    # A generated partition passes.
    assert len(event_files(generated[0], IMPRESSIONS, [minute], EVENTS_SPEC)) == 1


# A spec of its own over the impression stream: a column the generator does not write (campaign), one of the
# Criteo fields, and the join's behaviour sequence.
CAMPAIGN_SPEC = spec_from_dict({
    "name": "campaigns", "source": {"format": "parquet"}, "label": {"column": "clicked"},
    "features": [{"name": "ts", "kind": "timestamp", "format": "unix_millis"},
                 {"names": ["user_id", "item_id", "campaign"], "kind": "categorical"},
                 {"name": "I2", "kind": "dense"},
                 {"name": "history", "kind": "sequence", "max_length": 4, "shares": "item_id"}],
})


def _with_campaigns(source: Layout, target: Layout, minutes: list[datetime]) -> dict[str, str]:
    """`source`'s streams of `minutes` copied to `target`, each impression with a campaign named after its
    request id; returns request id -> campaign."""
    import shutil

    campaigns = {}
    for minute in minutes:
        for stream in (IMPRESSIONS, CLICKS):
            shutil.copytree(source.raw_events_minute_dir(stream, minute), target.raw_events_minute_dir(stream, minute))
        path = target.raw_events_minute_dir(IMPRESSIONS, minute) / EVENT_FILE
        table = pq.read_table(path)
        ids = table.column("request_id").to_pylist()
        named = [f"cmp-{int(hashlib.sha256(i.encode()).hexdigest(), 16) % 7}" for i in ids]
        campaigns.update(zip(ids, named, strict=True))
        pq.write_table(table.append_column("campaign", pa.array(named)), path)
    return campaigns


def test_the_join_carries_the_columns_its_spec_reads(spark, generated, tmp_path):
    """The join's samples carry the keys, the label and the sequence it makes, and the impression columns the
    run's spec reads: a column the generator never writes reaches the samples and the parsed rows with each
    impression's value, and the Criteo fields the spec does not read are left behind."""
    source, _, events, _, _ = generated
    layout = Layout(tmp_path / "data")
    minutes = [START + timedelta(minutes=i) for i in range(12)]
    campaigns = _with_campaigns(source, layout, minutes)
    # A minute of the lookback (read for its keys alone) written before the stream had campaigns.
    early = layout.raw_events_minute_dir(IMPRESSIONS, START + timedelta(minutes=2)) / EVENT_FILE
    pq.write_table(pq.read_table(early).drop(["campaign"]), early)
    span = Interval(START + timedelta(minutes=3), START + timedelta(minutes=5))
    run(spark, layout, span, tmp_path / "joined", spec=CAMPAIGN_SPEC, window_s=events.attribution_window_s,
        sequence_length=4, lookback_s=120)
    written = pq.read_table(tmp_path / "joined" / "samples")
    assert tuple(written.column_names) == ("label", "campaign", "I2", "user_id", "item_id", "request_id", "ts",
                                           "history")
    assert read_manifest(tmp_path / "joined")["columns"] == list(written.column_names)
    rows = written.to_pylist()
    assert len(rows) > 1000 and {r["campaign"] for r in rows} == {f"cmp-{i}" for i in range(7)}
    assert all(r["campaign"] == campaigns[r["request_id"]] for r in rows)
    # The same span joined with the events preset: the same labels, and its own columns.
    run(spark, layout, span, tmp_path / "preset", spec=EVENTS_SPEC, window_s=events.attribution_window_s,
        sequence_length=4, lookback_s=120)
    preset = pq.read_table(tmp_path / "preset" / "samples")
    assert "campaign" not in preset.column_names and "C26" in preset.column_names
    assert (sorted(zip(preset.column("request_id").to_pylist(), preset.column("label").to_pylist(), strict=True))
            == sorted((r["request_id"], r["label"]) for r in rows))
    # Parsed as the feature and sample jobs read them, the label under the spec's own name.
    parsed = joined_rows(spark, tmp_path / "joined", list(span.minutes()), CAMPAIGN_SPEC).toPandas()
    assert len(parsed) == len(rows) and set(parsed["campaign"]) == {f"cmp-{i}" for i in range(7)}
    assert parsed["label"].sum() == sum(r["label"] for r in rows)
    with pytest.raises(EventInputError, match=r"reads columns \['campaign'\] that the joined samples .* join the "
                                              r"span again with this spec"):
        joined_rows(spark, tmp_path / "preset", list(span.minutes()), CAMPAIGN_SPEC)


def test_impression_files_are_checked_against_the_columns_the_spec_reads(generated, tmp_path):
    """A file without a column the spec reads, or with one of a type its kind cannot be read from, is refused
    before any Spark job, with every problem named; a spec that does not read the column takes the same file;
    minutes whose files type a column differently are refused together."""
    source, _, _, _, _ = generated
    layout = Layout(tmp_path)
    minutes = [START, START + timedelta(minutes=1)]
    _with_campaigns(source, layout, minutes)
    first = layout.raw_events_minute_dir(IMPRESSIONS, minutes[0]) / EVENT_FILE
    table = pq.read_table(first)
    pq.write_table(table.drop(["campaign"]).set_column(table.schema.get_field_index("I2"), "I2",
                                                       table.column("I2").cast(pa.string())), first)
    with pytest.raises(EventInputError, match=r"for feature spec 'campaigns': column 'campaign' \(read by the "
                                              r"feature spec\) is missing; column 'I2' is string, which a dense "
                                              r"feature does not read; expected an integer or floating-point type"):
        event_files(layout, IMPRESSIONS, minutes, CAMPAIGN_SPEC)
    assert len(event_files(layout, IMPRESSIONS, minutes[:1], None)) == 1  # a lookback's: the keys alone
    # The events preset reads I2 as well, but not the campaign.
    with pytest.raises(EventInputError, match=r"for feature spec 'events': column 'I2' is string") as refused:
        event_files(layout, IMPRESSIONS, minutes, EVENTS_SPEC)
    assert "campaign" not in str(refused.value).split("(it has")[0]
    pq.write_table(table.set_column(table.schema.get_field_index("I2"), "I2", table.column("I2").cast(pa.float64())),
                   first)
    with pytest.raises(EventInputError, match=r"does not match the impressions files before it in the same join: "
                                              r"column 'I2' is int64 where .* has double"):
        event_files(layout, IMPRESSIONS, minutes, CAMPAIGN_SPEC)
    assert len(event_files(layout, IMPRESSIONS, minutes[:1], CAMPAIGN_SPEC)) == 1
    assert len(event_files(layout, IMPRESSIONS, minutes[1:], EVENTS_SPEC)) == 1


def test_a_partition_delivered_twice_changes_no_sample_and_is_counted(spark, generated, tmp_path):
    """A shipper that delivers a whole minute of both streams again (a second file beside the first) must not
    double any sample or label: every redelivered event is counted as a duplicate, and the raw files stay."""
    import shutil

    layout, generate, events, _, _ = generated
    window_s = events.attribution_window_s
    span = Interval(START + timedelta(minutes=4), START + timedelta(minutes=5))
    once = run(spark, layout, span, tmp_path / "once", spec=EVENTS_SPEC, window_s=window_s, sequence_length=4,
               lookback_s=7200)

    twice = Layout(tmp_path / "twice")
    shutil.copytree(layout.root / "raw", twice.root / "raw")
    redelivered = START + timedelta(minutes=4)
    for stream in (IMPRESSIONS, CLICKS):
        directory = twice.raw_events_minute_dir(stream, redelivered)
        shutil.copy(directory / "part-00000.parquet", directory / "part-00001.parquet")
    again = run(spark, twice, span, tmp_path / "again", spec=EVENTS_SPEC, window_s=window_s, sequence_length=4,
                lookback_s=7200)

    def copies_counted_in_span(stream: str) -> int:
        """Rows of the redelivered file whose event is counted in the span: duplicates are counted in the minute
        of the event's earliest delivery, which may lie in another minute."""
        every = pa.concat_tables(pq.read_table(path, columns=["request_id", "ts"])
                                 for path in sorted((layout.root / "raw" / stream).rglob("part-*.parquet")))
        earliest: dict[str, int] = {}
        for request, ts in zip(every.column("request_id").to_pylist(), every.column("ts").to_pylist(), strict=True):
            earliest[request] = min(ts, earliest.get(request, ts))
        copy = pq.read_table(layout.raw_events_minute_dir(stream, redelivered) / "part-00000.parquet")
        start, end = (int(t.timestamp() * 1000) for t in (span.start, span.end))
        return sum(start <= earliest[r] < end for r in copy.column("request_id").to_pylist())

    assert again["impressions"] == once["impressions"] > 0
    assert again["positives"] == once["positives"] > 0
    assert again["clicks"] == once["clicks"] > 0
    assert again["duplicate_impressions"] == once["duplicate_impressions"] + copies_counted_in_span(IMPRESSIONS)
    assert again["duplicate_clicks"] == once["duplicate_clicks"] + copies_counted_in_span(CLICKS)
    assert copies_counted_in_span(IMPRESSIONS) >= 0.9 * once["impressions"]  # nearly every impression doubled

    columns = ["request_id", "ts", "label", "history"]
    first = spark.read.parquet(str(tmp_path / "once" / "samples")).select(*columns)
    second = spark.read.parquet(str(tmp_path / "again" / "samples")).select(*columns)
    assertDataFrameEqual(second, first)
    for stream in (IMPRESSIONS, CLICKS):  # the raw deliveries are kept as they came
        assert len(list(twice.raw_events_minute_dir(stream, redelivered).glob("part-*.parquet"))) == 2


def test_a_minute_runs_join_shuffles_into_the_minutes_partitions_and_gives_the_same_rows(spark, generated, tmp_path,
                                                                                        monkeypatch):
    """short_span_partitions (spark.minute_shuffle_partitions) is the session's shuffle partitions while a span
    of up to NARROW_LOOKBACK_MAX_SPAN is joined, and put back after; the rows written do not depend on it."""
    import spark_jobs.events as events_module

    layout, _, events, _, _ = generated
    minute = Interval(START + timedelta(minutes=6), START + timedelta(minutes=7))
    key = "spark.sql.shuffle.partitions"
    before = spark.conf.get(key)
    seen = []
    write_joined = events_module.write_joined

    def noting(*args, **kwargs):
        seen.append(spark.conf.get(key))
        return write_joined(*args, **kwargs)

    monkeypatch.setattr(events_module, "write_joined", noting)
    for name, partitions in (("own", 3), ("session", None)):
        run(spark, layout, minute, tmp_path / name, spec=EVENTS_SPEC, window_s=events.attribution_window_s,
            sequence_length=10,
            lookback_s=7200, short_span_partitions=partitions)
    with pytest.raises(ValueError, match="spark.minute_shuffle_partitions must be at least 1, got 0"):
        run(spark, layout, minute, tmp_path / "none", spec=EVENTS_SPEC, window_s=events.attribution_window_s,
            sequence_length=10,
            lookback_s=7200, short_span_partitions=0)

    assert seen == ["3", before] and spark.conf.get(key) == before != "3"
    own, session = (sorted(pq.read_table(tmp_path / name / "samples").to_pylist(), key=lambda r: r["request_id"])
                    for name in ("own", "session"))
    assert len(own) > 500 and own == session
