from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual

from components.feature_spec import spec_from_dict
from components.ingest import ingest
from components.interval import Interval
from components.layout import Layout
from components.manifest import read_manifest
from pipelines.sources import ClickLogSource
from spark_jobs.history import (
    EVENT_SECONDS,
    STATE_KIND,
    add_history,
    advance_state,
    newest_state,
    rows_with_history,
    states_root,
)

pytestmark = pytest.mark.integration

SPEC = spec_from_dict({
    "name": "ratings", "source": {"format": "csv", "header": True}, "label": {"column": "liked"},
    "features": [
        {"name": "ts", "kind": "timestamp", "format": "unix_seconds"},
        {"names": ["user", "item"], "kind": "categorical"},
        {"name": "liked_items", "kind": "sequence", "shares": "item", "max_length": 2,
         "history": {"key": "user", "positive_only": True}},
        {"name": "seen_items", "kind": "sequence", "shares": "item", "max_length": 3,
         "history": {"key": "user", "value": "item"}},
    ],
})
LIKED, SEEN = SPEC.feature("liked_items"), SPEC.feature("seen_items")
SCHEMA = f"label int, user string, item string, minute string, {EVENT_SECONDS} long, row int"


def _frame(spark, rows):
    """rows of (label, user, item, time in seconds); `row` numbers them."""
    return spark.createDataFrame([(label, user, item, "-", t, i) for i, (label, user, item, t) in enumerate(rows)],
                                 SCHEMA)


def reference(rows, k, positive_only):
    """A row's history by brute force: the values of earlier rows (time strictly less) with its key, by (time,
    value), the newest k."""
    out = []
    for _, user, _, t in rows:
        if user is None:
            out.append([])
            continue
        earlier = sorted((t2, item2) for label2, user2, item2, t2 in rows
                         if user2 == user and item2 is not None and t2 < t and (label2 == 1 or not positive_only))
        out.append([item for _, item in earlier][-k:])
    return out


def test_a_row_sees_the_earlier_rows_of_its_key_only(spark):
    rows = [
        (1, "u1", "a", 10),
        (1, "u1", "b", 20),   # sees a
        (0, "u1", "c", 20),   # the same second as b: sees a only (neither b nor its own label)
        (1, "u1", "d", 30),   # sees a b (liked, newest 2), a b c (seen)
        (1, "u1", "e", 40),   # sees b d (liked), b c d (seen)
        (1, "u2", "a", 15),   # another key: sees nothing
        (1, None, "z", 50),   # no key: empty
        (1, "u2", None, 16),  # no value: not an event, sees a
        (1, "u2", "x", 17),   # sees a
    ]
    with_history = add_history(add_history(_frame(spark, rows), LIKED), SEEN)
    expected = spark.createDataFrame(
        [(0, [], []), (1, ["a"], ["a"]), (2, ["a"], ["a"]), (3, ["a", "b"], ["a", "b", "c"]),
         (4, ["b", "d"], ["b", "c", "d"]), (5, [], []), (6, [], []), (7, ["a"], ["a"]), (8, ["a"], ["a"])],
        "row int, liked_items array<string>, seen_items array<string>")
    assertDataFrameEqual(with_history.select("row", "liked_items", "seen_items"), expected)


def test_ties_in_time_order_earlier_values_by_value(spark):
    rows = [(1, "u", "b", 5), (1, "u", "a", 5), (1, "u", "c", 5), (0, "u", "q", 6)]
    got = add_history(_frame(spark, rows), LIKED).where("row = 3").select("liked_items").first()[0]
    assert got == ["b", "c"]  # a, b, c at one second: by value, the newest two kept


def test_spark_matches_brute_force_and_a_label_never_reaches_its_own_or_an_earlier_row(spark):
    rng = random.Random(7)
    rows = [(rng.random() < 0.4 and 1 or 0, rng.choice(["u1", "u2", "u3", None]), rng.choice("abcdefgh"),
             rng.randrange(0, 40)) for _ in range(300)]
    frame = _frame(spark, rows)
    got = {r["row"]: (r["liked_items"], r["seen_items"])
           for r in add_history(add_history(frame, LIKED), SEEN).collect()}
    assert [got[i][0] for i in range(len(rows))] == reference(rows, 2, True)
    assert [got[i][1] for i in range(len(rows))] == reference(rows, 3, False)
    # Flip every label of time 20: no row at time <= 20 changes its liked history; some later row does.
    flipped = [(1 - label if t == 20 else label, user, item, t) for label, user, item, t in rows]
    got_flipped = {r["row"]: r["liked_items"] for r in add_history(_frame(spark, flipped), LIKED).collect()}
    assert all(got_flipped[i] == got[i][0] for i, row in enumerate(rows) if row[3] <= 20)
    assert any(got_flipped[i] != got[i][0] for i, row in enumerate(rows) if row[3] > 20)


def test_a_state_continues_the_history_as_one_pass_would(spark):
    rng = random.Random(3)
    rows = [(rng.random() < 0.5 and 1 or 0, rng.choice(["u1", "u2"]), rng.choice("abcdef"), rng.randrange(0, 60))
            for _ in range(120)]
    frame = _frame(spark, rows)
    one_pass = add_history(frame, SEEN).where(f"{EVENT_SECONDS} >= 30")
    state = advance_state(None, frame.where(f"{EVENT_SECONDS} < 30"), SEEN)
    continued = add_history(frame.where(f"{EVENT_SECONDS} >= 30"), SEEN, seed=state)
    assertDataFrameEqual(continued, one_pass)
    # A state's pairs at or after a row's time are not its history (timestamps coarser than the partitions).
    late_seed = spark.createDataFrame([("u1", [(10, "old"), (35, "same"), (50, "later")])],
                                      "key string, items array<struct<t:bigint,v:string>>")
    got = add_history(_frame(spark, [(0, "u1", "z", 35)]), SEEN, seed=late_seed).first()["seen_items"]
    assert got == ["old"]


def _write_log(path, rows):
    path.write_text("liked,ts,user,item\n" + "".join(f"{lab},{t},{u},{i}\n" for lab, t, u, i in rows))


def test_daily_then_minute_runs_give_the_one_pass_histories(spark, tmp_path):
    """The daily run's features/train call, its eval call and two minute runs, each through the source's rows
    (raw minute files, states on disk), give every row the history one pass over all rows gives it."""
    day = datetime(2026, 1, 1, tzinfo=UTC)
    base = int(day.timestamp())
    rng = random.Random(11)
    drawn = [((rng.random() < 0.5) * 1, base + rng.randrange(0, 6 * 60), rng.choice(["u1", "u2", "u3"]),
              rng.choice("abcdefg")) for _ in range(200)]
    # One row per (user, item, minute), so that a row is known by them below.
    rows = sorted({(u, i, (t - base) // 60): (lab, t, u, i) for lab, t, u, i in drawn}.values())
    rows += [(1, base + 6 * 60 + 5, "u1", "m"), (0, base + 6 * 60 + 50, "u1", "n"),
             (1, base + 7 * 60 + 1, "u1", "o")]
    _write_log(tmp_path / "log.csv", rows)
    layout = Layout(tmp_path / "var")
    assert ingest(SPEC, [tmp_path / "log.csv"], layout).rejected == 0
    source = ClickLogSource()
    interval = Interval(day, day + timedelta(minutes=6))
    ctx = SimpleNamespace(layout=layout, spec=SPEC, spark=lambda: spark, interval=interval)

    def rows_of(minutes, ctx=ctx, holdout=None):
        frame = source.rows(ctx, minutes, tmp_path, holdout_fraction=holdout)
        return {(r["user"], r["item"], r["minute"]): (r["liked_items"], r["seen_items"]) for r in frame.collect()}

    minutes = list(interval.minutes())
    got = {**rows_of(minutes[:4]), **rows_of(minutes[4:])}  # train, then eval continuing the train's state
    for minute in (day + timedelta(minutes=6), day + timedelta(minutes=7)):
        got.update(rows_of([minute], SimpleNamespace(layout=layout, spec=SPEC, spark=lambda: spark,
                                                     interval=Interval.minute(minute.isoformat())), 0.5))
    liked = reference([(lab, u, i, t) for lab, t, u, i in rows], 2, True)
    seen = reference([(lab, u, i, t) for lab, t, u, i in rows], 3, False)
    expected = {}
    for (_, t, u, i), one, two in zip(rows, liked, seen, strict=True):
        expected[(u, i, datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M"))] = (one, two)
    assert len(got) == len(expected) and got == expected
    # The last minute run's own rows: m liked at 6:05 is in o's history; n (not liked) only in what o saw.
    assert got[("u1", "o", "2026-01-01 00:07")][0][-1] == "m"
    assert got[("u1", "o", "2026-01-01 00:07")][1][-2:] == ["m", "n"]
    # States at the end of the train minutes, of the day, and of each minute run, each with its manifest.
    root = states_root(layout.root, SPEC)
    assert sorted(p.name for p in root.iterdir()) == ["20260101T0004", "20260101T0006", "20260101T0007",
                                                      "20260101T0008"]
    manifest = read_manifest(root / "20260101T0008", kind=STATE_KIND)
    assert manifest["inputs"]["seed"] == "20260101T0007" and manifest["row_counts"]["liked_items"] == 3
    assert newest_state(layout.root, SPEC, day + timedelta(minutes=5))[1].name == "20260101T0004"
    # The same call again (the daily run's train split after its features step) keeps the state it made.
    written = (root / "20260101T0004" / "manifest.json").stat().st_mtime_ns
    assert rows_of(minutes[:4]) == {key: value for key, value in got.items() if key[2] < "2026-01-01 00:04"}
    assert (root / "20260101T0004" / "manifest.json").stat().st_mtime_ns == written
    assert newest_state(layout.root, SPEC, day + timedelta(minutes=3)) is None


def test_rows_with_history_reads_from_the_interval_start_without_a_state(spark, tmp_path):
    day = datetime(2026, 1, 1, tzinfo=UTC)
    base = int(day.timestamp())
    _write_log(tmp_path / "log.csv", [(1, base + 10, "u", "a"), (1, base + 70, "u", "b"), (1, base + 130, "u", "c")])
    layout = Layout(tmp_path / "var")
    ingest(SPEC, [tmp_path / "log.csv"], layout)
    ctx = SimpleNamespace(layout=layout, spec=SPEC, spark=lambda: spark, interval=Interval(day, day + timedelta(1)))
    source = ClickLogSource()
    frame = rows_with_history(spark, layout.root, SPEC, [day + timedelta(minutes=2)], since=day,
                              read=lambda span: source._parsed_rows(ctx, span, None))
    assert [r["liked_items"] for r in frame.collect()] == [["a", "b"]]
    assert EVENT_SECONDS not in frame.columns
    assert frame.select(F.col("minute")).first()[0] == "2026-01-01 00:02"


def test_validation_and_the_raw_reader_expect_no_column_for_a_history(spark, tmp_path):
    import great_expectations as gx

    from components.feature_spec import load_spec
    from components.validation import raw_click_log_suite
    from spark_jobs.raw import extract_raw, parse_raw

    gx.get_context(mode="ephemeral")  # GX builds suites only with an active context
    spec = load_spec("movielens")
    columns = {getattr(e, "column", None) for e in raw_click_log_suite(spec).expectations}
    assert "liked_items" not in columns and {"user_id", "item_id", "genres"} <= columns
    (tmp_path / "date=2026-01-01" / "minute=0000").mkdir(parents=True)
    part = tmp_path / "date=2026-01-01" / "minute=0000" / "part-00000.csv"
    part.write_text("liked,timestamp,user_id,item_id,age,gender,occupation,zip_code,release_year,genres\n"
                    "1,1767225600,7,3,24,M,other,85711,1995,Comedy|Drama\n")
    parsed = parse_raw(extract_raw(spark, [str(part)], spec), spec)
    assert "liked_items" not in parsed.columns and parsed.first()["genres"] == ["Comedy", "Drama"]
