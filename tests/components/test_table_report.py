from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from components.feature_spec import spec_from_dict
from components.feature_state import COUNTS_SCHEMA, FeatureState, Vocabulary
from components.table_report import (
    age_bin_labels,
    changed_rows_by_table,
    embedding_table,
    format_report,
    hashed_tables,
    plot_report,
    table_offsets,
    table_report,
)

pytestmark = pytest.mark.unit

SPEC = spec_from_dict({
    "name": "team",
    "source": {"format": "csv", "header": True},
    "label": {"column": "clicked"},
    "features": [
        {"name": "user", "kind": "categorical"},
        {"name": "item", "kind": "categorical", "min_count": 3},
        {"name": "price", "kind": "dense"},
    ],
})
SIZES = {"user": 8, "item": 3}


def _state() -> FeatureState:
    candidates = pa.table({"feature": ["user", "user", "item"], "value": ["d", "e", "y"], "count": [1, 1, 2],
                           "last_seen": [100, 98, 100]}, schema=COUNTS_SCHEMA)
    return FeatureState(
        version="daily-x", min_count=2,
        vocabularies={
            # Row 4 was evicted this run and row 5 handed to "c"; rows 6 and 7 are room to grow.
            "user": Vocabulary(values=("a", "b", "c"), rows=(2, 3, 5), counts=(10, 2, 5), last_seen=(100, 99, 90),
                               num_rows=6, free_rows=(4,), capacity=8),
            "item": Vocabulary(values=("x",), rows=(2,), counts=(7,), last_seen=(100,), num_rows=3),
        },
        dense=(), candidates=candidates, day=100, evicted_rows={"user": (4,)}, new_rows={"user": (5,)},
    )


def _tables() -> np.ndarray:
    table = np.zeros((11, 2), np.float32)  # user rows 0..7, then item rows 8..10
    table[0], table[2], table[3], table[5] = [1, 0], [3, 4], [0, 1], [6, 8]
    table[8], table[10] = [0, 2], [0, 0.5]
    return table


SAMPLES = {"row_counts": {"rows": 100}, "rare_rows": {"user": 10, "item": 0}, "missing_rows": {"user": 5, "item": 20}}


def test_every_table_is_reported_from_the_state_the_weights_and_the_samples():
    table = _tables()
    parent = table.copy()[:10]  # the item table had 2 rows in the parent: its row 2 is new
    parent[1] += 1  # the missing row, a row in use and an evicted row changed; the evicted one is not training's
    parent[3] += 1
    parent[4] += 1
    changed = changed_rows_by_table(table, SIZES, parent, {"user": 8, "item": 2}, hashed=[])
    assert changed["user"].tolist() == [1, 3, 4] and changed["item"].tolist() == [2]

    report = table_report(SPEC, _state(), kind="daily", version="202601020000", embeddings=table, changed=changed,
                          parent="20260101", samples=SAMPLES)
    user, item = report["tables"]  # in spec order
    assert (user["rows"], user["rows_in_use"], user["rows_free"], user["rows_new"], user["rows_evicted"]) == (
        8, 3, 3, 1, 1)
    assert user["waiting_for_admission"] == 2 and item["waiting_for_admission"] == 1
    assert (user["min_count"], item["min_count"]) == (2, 3)  # the state's resolved count, or the table's own
    assert user["frequency"] == {"p50": 5.0, "p90": 9.0, "p99": 9.9, "max": 10.0}
    assert user["waiting_frequency"]["max"] == 1.0 and item["waiting_frequency"]["p50"] == 2.0
    assert user["rows_touched"] == 2 and item["rows_touched"] == 1
    assert dict(zip(user["age_days"]["bins"], user["age_days"]["rows"], strict=True)) == {
        "0": 1, "1": 1, "2-3": 0, "4-7": 0, "8-14": 1, "15-30": 0, "31+": 0}
    assert user["l2_norm"]["max"] == pytest.approx(10.0) and user["l2_norm"]["p50"] == pytest.approx(5.0)
    assert (user["rare_row_norm"], user["missing_row_norm"]) == (pytest.approx(1.0), 0.0)
    assert item["l2_norm"]["p50"] == pytest.approx(0.5)  # item "x" is row 2 of the item table: row 10
    assert (user["rare_share"], user["missing_share"], item["missing_share"]) == (0.1, 0.05, 0.2)
    assert user["bytes"] == 8 * 2 * 4
    assert report["totals"]["rows_touched"] == 3 and report["totals"]["rows"] == 11
    assert report["rows_touched_basis"] == "rows whose values differ from the parent's"


def test_without_a_parent_the_rows_of_values_seen_in_the_interval_are_the_touched_ones():
    report = table_report(SPEC, _state(), kind="daily", version="v", embeddings=_tables(), since_day=95,
                          samples=SAMPLES)
    # "a" and "b" were seen from day 95 on, "c" last on day 90; the rare and the missing row were read.
    user, item = report["tables"]
    assert user["rows_touched"] == 4
    assert item["rows_touched"] == 2  # "x" and the missing row
    assert "no parent" in report["rows_touched_basis"]


def test_a_hashed_table_has_no_rows_in_the_concatenated_table():
    hashed = hashed_tables(SPEC, ["user"])
    assert hashed == ["user"]
    assert table_offsets(SIZES, hashed) == {"item": 0}
    report = table_report(SPEC, _state(), kind="minute", version="v", embeddings=_tables()[8:], hashed=hashed,
                          samples=SAMPLES)
    user, item = report["tables"]
    assert user["storage"] == "hashed" and "l2_norm" not in user
    assert item["l2_norm"]["max"] == pytest.approx(0.5)


def test_the_embedding_table_is_found_by_its_path_and_not_a_multi_hash_one():
    specs = [{"path": "dcnv2/embedding/hashed_feature_0/embeddings"}, {"path": "dcnv2/embedding/embeddings"},
             {"path": "dcnv2/dense/kernel"}]
    weights = [np.zeros((4, 2)), np.ones((7, 2)), np.zeros((3, 3))]
    assert embedding_table(specs, weights).shape == (7, 2)
    assert embedding_table(specs[:1], weights[:1]) is None


def test_the_report_prints_a_line_per_table_and_draws_four_panels(tmp_path):
    report = table_report(SPEC, _state(), kind="daily", version="202601020000", embeddings=_tables(), since_day=95,
                          samples={"row_counts": {"rows": 100}, "rare_rows": {"user": 10, "item": 0}})
    text = format_report(report)
    lines = text.splitlines()
    assert lines[0].startswith("tables of daily version 202601020000 (feature state daily-x of 1970-04-11, 100 "
                               "training rows")
    user = next(line for line in lines if line.startswith("user "))
    # Touched: "a", "b" and the rare row (samples from before the missing reads were counted).
    assert user.split()[1:8] == ["memory", "8", "3", "1", "1", "2", "3"]
    assert "10.0%" in user and user.split()[-1] == "-"  # rare share; missing reads unknown in older samples
    assert age_bin_labels()[-1] == "31+"
    path = plot_report(report, tmp_path / "tables.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_a_tiered_tables_norms_are_over_a_bounded_sample_of_its_rows_in_use():
    # The user table tiered: its rows come from a reader (a store's, in the pipeline) that records what it is asked.
    table = _tables()
    asked: list[np.ndarray] = []

    def read(rows: np.ndarray) -> np.ndarray:
        asked.append(np.asarray(rows))
        return table[np.asarray(rows)]

    tiered = {"user": {"rows": read, "hot_rows": 4, "bytes": 64, "counters": {}}}
    whole = table_report(SPEC, _state(), kind="daily", version="v", embeddings=_tables()[8:], tiered=tiered,
                         samples=SAMPLES)["tables"][0]
    assert whole["l2_norm_rows"] == 3 and whole["l2_norm"]["max"] == pytest.approx(10.0)  # rows 2, 3, 5
    asked.clear()
    sampled = table_report(SPEC, _state(), kind="daily", version="v", embeddings=_tables()[8:], tiered=tiered,
                           samples=SAMPLES, norm_sample_rows=2)["tables"][0]
    assert sampled["l2_norm_rows"] == 2
    norms_read = [rows for rows in asked if not np.array_equal(rows, [0, 1])]  # not the reserved rows' read
    assert sum(len(rows) for rows in norms_read) == 2 and set(np.concatenate(norms_read)) <= {2, 3, 5}
    again = table_report(SPEC, _state(), kind="daily", version="w", embeddings=_tables()[8:], tiered=tiered,
                         samples=SAMPLES, norm_sample_rows=2)["tables"][0]
    assert again["l2_norm"] == sampled["l2_norm"]  # the same rows from run to run
    text = format_report(table_report(SPEC, _state(), kind="daily", version="v", embeddings=_tables()[8:],
                                      tiered=tiered, samples=SAMPLES, norm_sample_rows=2))
    assert "norms of 2 rows drawn from its 3 in use" in text
    assert "drawn from" not in format_report(table_report(SPEC, _state(), kind="daily", version="v",
                                                          embeddings=_tables()[8:], tiered=tiered, samples=SAMPLES))
