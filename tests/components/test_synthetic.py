from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa
import pytest

from components.config import GenerateConfig
from components.evaluation import roc_auc
from components.interval import Interval
from components.layout import Layout
from components.schema import CATEGORICAL_FEATURES, LABEL, NUM_RAW_FIELDS, RAW_COLUMNS
from components.synthetic import (
    RAW_FILE,
    SUCCESS_MARKER,
    generate,
    generate_minute,
    planted_auc,
    planted_path,
)

pytestmark = pytest.mark.unit

START = datetime(2026, 1, 1, tzinfo=UTC)
CONFIG = GenerateConfig(start="2026-01-01T00:00", minutes=4, rows_per_minute=1500, seed=11)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    layout = Layout(tmp_path_factory.mktemp("synthetic"))
    summary = generate(CONFIG, layout)
    return layout, summary


def _minute(index: int):
    return generate_minute(CONFIG, index, START + timedelta(minutes=index))


def test_generate_minute_is_deterministic_for_seed_and_minute_index():
    first, again = _minute(2), _minute(2)
    assert first.table.equals(again.table)
    np.testing.assert_array_equal(first.probability, again.probability)
    # The minute's timestamp does not enter the draw: only (seed, minute index) does.
    shifted = generate_minute(CONFIG, 2, START + timedelta(days=3))
    assert shifted.table.equals(first.table)


def test_generate_minute_differs_across_minutes_and_seeds():
    a, b = _minute(0), _minute(1)
    assert not a.table.equals(b.table)
    assert not np.allclose(a.probability, b.probability)
    other_seed = generate_minute(GenerateConfig(rows_per_minute=1500, seed=12), 0, START)
    assert not other_seed.table.equals(a.table)


def test_generate_minute_schema_and_value_ranges():
    piece = _minute(0)
    table = piece.table
    assert table.column_names == list(RAW_COLUMNS)
    assert table.num_rows == 1500
    assert set(table[LABEL].to_pylist()) == {0, 1}
    assert table.schema.field("I1").type == pa.int64()
    assert table.schema.field("C1").type == pa.string()
    assert piece.probability.shape == (1500,)
    assert ((piece.probability > 0) & (piece.probability < 1)).all()
    # Dense fields: I2 has negative values; I12 is mostly missing (rate 0.77); I2 is never missing.
    assert min(v for v in table["I2"].to_pylist() if v is not None) == -3
    assert 0.7 < table["I12"].null_count / 1500 < 0.84
    assert table["I2"].null_count == 0
    # Categorical: C23 is missing 70% of the time, C1 never.
    assert 0.64 < table["C23"].null_count / 1500 < 0.76
    assert table["C1"].null_count == 0


def test_written_tsv_is_in_the_criteo_layout(generated):
    layout, _ = generated
    directory = layout.raw_minute_dir(START)
    assert (directory / SUCCESS_MARKER).exists()
    assert sorted(p.name for p in directory.iterdir()) == [SUCCESS_MARKER, RAW_FILE]
    text = (directory / RAW_FILE).read_text()
    assert text.endswith("\n")
    lines = text[:-1].split("\n")
    assert len(lines) == 1500
    fields = [line.split("\t") for line in lines]
    assert {len(f) for f in fields} == {NUM_RAW_FIELDS} == {40}
    assert {f[0] for f in fields} == {"0", "1"}
    dense_fields = [v for f in fields for v in f[1:14]]
    categorical_fields = [v for f in fields for v in f[14:]]
    assert "" in dense_fields and "" in categorical_fields  # missing values are empty fields
    assert all(re.fullmatch(r"-?[0-9]+", v) for v in dense_fields if v)
    assert all(re.fullmatch(r"[0-9a-f]{8}", v) for v in categorical_fields if v)
    # The file holds exactly what generate_minute returns.
    table = _minute(0).table
    assert [int(f[0]) for f in fields] == table[LABEL].to_pylist()
    assert [f[14] or None for f in fields] == table["C1"].to_pylist()
    assert [int(f[3]) if f[3] else None for f in fields] == table["I3"].to_pylist()


def test_new_values_appear_in_later_minutes(generated):
    layout, _ = generated
    seen: dict[str, set[str]] = {name: set() for name in CATEGORICAL_FEATURES}
    new_per_minute = []
    for index in range(CONFIG.minutes):
        lines = (
            (layout.raw_minute_dir(START + timedelta(minutes=index)) / RAW_FILE).read_text().split("\n")[:-1]
        )
        new = 0
        current = {name: set() for name in CATEGORICAL_FEATURES}
        for line in lines:
            for name, value in zip(CATEGORICAL_FEATURES, line.split("\t")[14:], strict=True):
                if value:
                    current[name].add(value)
        for name in CATEGORICAL_FEATURES:
            new += len(current[name] - seen[name])
            seen[name] |= current[name]
        new_per_minute.append(new)
    # Every later minute brings thousands of values never seen in any earlier minute.
    # Seen with seed 11: [8058, 5202, 4440, 3937]. Minute 0 counts all its distinct values; every later
    # minute still brings thousands never seen in any earlier minute, fewer as the popular values repeat.
    assert new_per_minute[0] > new_per_minute[1] > new_per_minute[3] > 3000, new_per_minute


def test_new_value_rate_brings_unseen_values_to_a_small_feature():
    # C9 has 3 values; only the new-value draws can add more, and those are new in every minute.
    def c9_values(config, index):
        return set(generate_minute(config, index, START).table["C9"].drop_null().to_pylist())

    without = GenerateConfig(rows_per_minute=2000, seed=11, new_value_rate=0.0)
    assert set().union(*(c9_values(without, i) for i in range(3))) <= c9_values(without, 0)
    assert len(c9_values(without, 0)) == 3

    with_new = GenerateConfig(rows_per_minute=2000, seed=11, new_value_rate=0.01)
    base = c9_values(without, 0)
    earlier = c9_values(with_new, 0)
    for index in (1, 2):
        current = c9_values(with_new, index)
        unseen = current - earlier - base
        # ~20 new draws over 20 possible new ids per minute: about 13 distinct (13 seen), none seen before.
        assert 5 <= len(unseen) <= 20, len(unseen)
        earlier |= current


def test_planted_auc_and_click_rate(generated):
    layout, summary = generated
    assert summary["rows"] == 4 * 1500
    assert summary["minutes"] == 4
    assert summary["start"] == "2026-01-01T00:00:00+00:00"
    assert summary["end"] == "2026-01-01T00:04:00+00:00"
    # Seen with seed 11: planted AUC 0.846, click rate 0.313 (Criteo's is ~0.26); before HEAD_VALUES went
    # from 400 to 60 with no tail effect: 0.84 and 0.13.
    assert 0.6 < summary["planted_auc"] < 0.95
    assert 0.05 < summary["click_rate"] < 0.40
    minutes = list(Interval.parse(summary["start"], summary["end"]).minutes())
    assert planted_auc(layout, minutes) == pytest.approx(summary["planted_auc"], abs=1e-12)

    stacked = [np.load(planted_path(layout, m)) for m in minutes]
    labels = np.concatenate([s[0] for s in stacked])
    assert labels.mean() == pytest.approx(summary["click_rate"])
    assert roc_auc(labels, np.concatenate([s[1] for s in stacked])) == pytest.approx(summary["planted_auc"])


def test_planted_auc_skips_minutes_no_longer_in_the_raw_log(generated, tmp_path):
    layout, summary = generated
    minutes = list(Interval.parse(summary["start"], summary["end"]).minutes())
    assert planted_auc(layout, [START - timedelta(minutes=5)]) is None
    one = planted_auc(layout, minutes[:1])
    y, p = np.load(planted_path(layout, minutes[0]))
    assert one == pytest.approx(roc_auc(y, p))
    # A minute whose raw file was moved away (quarantined) is not scored.
    other = Layout(tmp_path)
    generate(GenerateConfig(minutes=2, rows_per_minute=300, seed=11), other)
    (other.raw_minute_dir(START + timedelta(minutes=1)) / RAW_FILE).unlink()
    y0, p0 = np.load(planted_path(other, START))
    assert planted_auc(other, [START, START + timedelta(minutes=1)]) == pytest.approx(roc_auc(y0, p0))


# A team's own layout: comma-separated with a header, a timestamp, dense features with and without a missing
# flag and one bucketized, string and integer ids.
SHOP_SPEC = {
    "name": "shop",
    "source": {"format": "csv", "header": True},
    "label": {"column": "clicked"},
    "features": [
        {"name": "event_time", "kind": "timestamp", "format": "%Y-%m-%d %H:%M:%S", "derive": ["hour_of_day"]},
        {"name": "price", "kind": "dense"},
        {"name": "age", "kind": "dense", "transform": "buckets", "num_buckets": 4},
        {"name": "stock", "kind": "dense", "missing_indicator": False},
        {"names": ["shop_id", "brand", "campaign", "site", "page", "user_segment"], "kind": "categorical"},
        {"name": "slot", "kind": "categorical", "dtype": "int"},
    ],
}


def test_a_specs_own_columns_are_written_in_its_layout(tmp_path):
    from components.feature_spec import spec_from_dict
    from components.synthetic import RawShape
    from components.validation import read_raw_slice

    spec = spec_from_dict(SHOP_SPEC)
    shape = RawShape.of(spec)
    assert shape.dense == ("price", "age", "stock")
    assert shape.categorical == ("shop_id", "brand", "campaign", "site", "page", "user_segment", "slot")
    config = GenerateConfig(start="2026-01-01T00:00", minutes=3, rows_per_minute=2000, seed=4)
    summary = generate(config, Layout(tmp_path / "a"), shape=shape)
    assert summary["spec"] == "shop" and summary["rows"] == 6000 and summary["planted_auc"] > 0.65

    minute = START + timedelta(minutes=1)
    directory = Layout(tmp_path / "a").raw_minute_dir(minute)
    assert sorted(p.name for p in directory.iterdir()) == [SUCCESS_MARKER, "part-00000.csv"]
    text = (directory / "part-00000.csv").read_text()
    assert text.split("\n")[0] == ",".join(spec.input_columns)  # the header, label first
    assert '"' not in text
    frame = read_raw_slice(directory / "part-00000.csv", minute, spec=spec)
    assert len(frame) == 2000 and set(frame["clicked"]) == {"0", "1"}
    times = [spec.timestamp.parse(value) for value in frame["event_time"]]
    assert times == sorted(times) and minute <= times[0] and times[-1] < minute + timedelta(minutes=1)
    assert len(set(times)) > 50  # spread over the minute's seconds
    slots = frame["slot"].dropna()
    assert slots.str.fullmatch(r"\d+").all() and slots.nunique() > 2
    assert frame["shop_id"].dropna().str.fullmatch(r"[0-9a-f]{8}").all()
    for name in ("price", "stock", "age"):
        values = frame[name].dropna()
        assert values.str.fullmatch(r"-?\d+").all() and values.nunique() > 5
    # Criteo's missing rates, column by column: I1's 0.45, I3's 0.2
    assert 0.4 < frame["price"].isna().mean() < 0.5 and 0.15 < frame["stock"].isna().mean() < 0.25

    # The same config writes the same bytes.
    generate(config, Layout(tmp_path / "b"), shape=shape)
    assert (Layout(tmp_path / "b").raw_minute_dir(minute) / "part-00000.csv").read_bytes() == text.encode()


def test_the_default_is_the_criteo_preset_and_names_come_only_from_the_spec():
    import yaml

    from components.feature_spec import PRESET_DIR, load_spec, spec_from_dict
    from components.synthetic import RawShape, default_shape

    criteo = RawShape.of(load_spec("criteo"))
    assert criteo == default_shape() and criteo.columns == RAW_COLUMNS
    # The criteo preset with every column renamed: the same rows under the new names.
    data = yaml.safe_load((PRESET_DIR / "criteo.yaml").read_text())
    rename = {name: f"f_{name.lower()}" for name in data["source"]["columns"]}
    data["source"]["columns"] = [rename[c] for c in data["source"]["columns"]]
    data["label"]["column"] = rename["label"]
    for group in data["features"]:
        group["names"] = [rename[n] for n in group["names"]]
    renamed = generate_minute(CONFIG, 2, START, RawShape.of(spec_from_dict(data)))
    original = _minute(2)
    assert renamed.table.column_names == [rename[c] for c in original.table.column_names]
    assert renamed.table.rename_columns(original.table.column_names).equals(original.table)
    np.testing.assert_array_equal(renamed.probability, original.probability)


def test_a_list_column_without_a_separator_in_a_text_layout_is_refused_before_anything_is_written(tmp_path, capsys):
    import yaml

    from pipelines.cli import main as ctr

    spec = {"name": "tagged", "source": {"format": "csv", "header": True}, "label": {"column": "y"},
            "features": [{"name": "item", "kind": "categorical"},
                         {"name": "tags", "kind": "multi_categorical", "max_length": 4}]}
    (tmp_path / "tagged.yaml").write_text(yaml.safe_dump(spec))
    root = tmp_path / "data"
    assert ctr(["generate", "--spec", str(tmp_path / "tagged.yaml"), "--minutes", "2",
                "--set", f"paths.data_root={root}"]) == 2
    error = capsys.readouterr().err
    assert "feature spec 'tagged': tags is a list column without a separator, which only Parquet stores" in error
    assert not root.exists()


def test_list_columns_hold_ids_of_their_own_or_of_the_column_they_share(tmp_path):
    """A sequence lists ids of the categorical column it shares (so they meet its vocabulary), and holds the
    row's own value in about SEQUENCE_TARGET_SHARE of the rows; a multi-valued column draws 1-3 values of its
    own; in Parquet, without a separator, both are list columns."""
    import pyarrow.parquet as pq

    from components.feature_spec import spec_from_dict
    from components.synthetic import MULTI_VALUED_CARDINALITY, SEQUENCE_TARGET_SHARE, RawShape

    spec = spec_from_dict({
        "name": "lists", "source": {"format": "parquet"}, "label": {"column": "y"},
        "features": [{"names": ["user", "item"], "kind": "categorical"},
                     {"name": "tags", "kind": "multi_categorical", "max_length": 5},
                     {"name": "seen", "kind": "sequence", "max_length": 8, "shares": "item"}]})
    shape = RawShape.of(spec)
    generate(GenerateConfig(minutes=1, rows_per_minute=3000, seed=2), Layout(tmp_path), shape=shape)
    table = pq.read_table(Layout(tmp_path).raw_minute_dir(START) / "part-00000.parquet")
    assert table.column_names == ["y", "user", "item", "tags", "seen"]
    assert pa.types.is_list(table.schema.field("seen").type) and pa.types.is_list(table.schema.field("tags").type)
    rows = table.to_pylist()
    items = {r["item"] for r in rows if r["item"]}
    seen = [r["seen"] or [] for r in rows]
    assert max(len(s) for s in seen) == 8 and sum(not s for s in seen) > 0
    assert len({v for s in seen for v in s} & items) > 20  # the sequence's ids are the item column's
    holds_own = np.mean([r["item"] in (r["seen"] or []) for r in rows if r["item"]])
    assert SEQUENCE_TARGET_SHARE < holds_own < SEQUENCE_TARGET_SHARE + 0.25, holds_own
    tags = [r["tags"] or [] for r in rows]
    assert {len(t) for t in tags} == {0, 1, 2, 3}
    assert len({v for t in tags for v in t}) <= MULTI_VALUED_CARDINALITY
    assert not {v for t in tags for v in t} & items
