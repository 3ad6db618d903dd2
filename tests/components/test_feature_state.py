from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from components.feature_state import (
    CANDIDATES_FILE,
    COUNTS_SCHEMA,
    DENSE_FILE,
    FEATURE_STATE_KIND,
    VOCABULARY_FILE,
    DenseTransform,
    FeatureState,
    Vocabulary,
    advance_feature_state,
    auto_min_count,
    categorical_rows,
    load_feature_state,
    save_feature_state,
    signed_log1p,
    transform_dense,
)
from components.manifest import ManifestError, commit_dir, read_manifest, staging_dir, write_manifest
from components.schema import (
    CATEGORICAL_FEATURES,
    DENSE_FEATURES,
    MISSING_ROW,
    NUM_RESERVED_ROWS,
    RARE_ROW,
)

pytestmark = pytest.mark.unit


def _state(version: str = "20260101T0000-20260102T0000") -> FeatureState:
    vocabularies = {name: Vocabulary() for name in CATEGORICAL_FEATURES}
    vocabularies["C1"] = Vocabulary.of(("aaaa0001", "bbbb0002", "cccc0003"), (50, 20, 5), last_seen=20454)
    vocabularies["C7"] = Vocabulary.of(("deadbeef",), (9,), last_seen=20454)
    # I1: log values clipped to [0, 2], mean 1, std 0.5; the others are the identity on [-10, 10].
    dense = tuple(
        DenseTransform(name, 0.0, 2.0, 1.0, 0.5)
        if name == "I1"
        else DenseTransform(name, -10.0, 10.0, 0.0, 1.0)
        for name in DENSE_FEATURES
    )
    return FeatureState(version=version, min_count=5, vocabularies=vocabularies, dense=dense, day=20454)


def test_categorical_rows_maps_known_unknown_and_missing_values():
    vocabulary = pa.array(["aaaa0001", "bbbb0002", "cccc0003"])
    values = pa.array(["cccc0003", "aaaa0001", "ffff9999", None, "", "bbbb0002", "AAAA0001"])
    rows = categorical_rows(values, vocabulary)
    assert rows.dtype == np.int64
    assert rows.tolist() == [
        NUM_RESERVED_ROWS + 2,
        NUM_RESERVED_ROWS + 0,
        RARE_ROW,
        MISSING_ROW,
        MISSING_ROW,
        NUM_RESERVED_ROWS + 1,
        RARE_ROW,  # matching is exact, case included
    ]
    assert rows.tolist() == [4, 2, 0, 1, 1, 3, 0]


def test_categorical_rows_with_an_empty_vocabulary():
    rows = categorical_rows(pa.array(["x", None, ""]), pa.array([], pa.string()))
    assert rows.tolist() == [RARE_ROW, MISSING_ROW, MISSING_ROW]


def test_signed_log1p():
    assert signed_log1p(np.array([0.0, 3.0, -3.0])).tolist() == pytest.approx(
        [0.0, math.log(4), -math.log(4)]
    )


def test_transform_dense_hand_computed():
    state = _state()
    raw = np.zeros((4, 13))
    raw[:, 0] = [math.e - 1, np.nan, 1000.0, -5.0]  # I1: log1p -> 1, missing, clipped to 2, clipped to 0
    raw[:, 1] = [-3.0, 0.0, np.nan, 1.0]  # I2: identity on signed log1p
    out = transform_dense(raw, state)
    assert out.shape == (4, 26)
    assert out.dtype == np.float32
    # I1 standardized: (clip(x) - 1) / 0.5
    np.testing.assert_allclose(out[:, 0], [0.0, 0.0, 2.0, -2.0], atol=1e-6)
    np.testing.assert_allclose(out[:, 1], [-math.log(4), 0.0, 0.0, math.log(2)], rtol=1e-6)
    # Other dense fields were 0 -> 0.
    np.testing.assert_array_equal(out[:, 2:13], 0.0)
    # Indicators follow the values: 1 exactly where the raw value was missing.
    np.testing.assert_array_equal(out[:, 13], [0, 1, 0, 0])
    np.testing.assert_array_equal(out[:, 14], [0, 0, 1, 0])
    np.testing.assert_array_equal(out[:, 15:], 0.0)


def test_transform_dense_missing_is_zero_even_when_the_mean_is_not():
    state = _state()
    raw = np.full((1, 13), np.nan)
    out = transform_dense(raw, state)
    # Without the missing mask, I1 would come out as (0 - 1) / 0.5 = -2.
    np.testing.assert_array_equal(out[0, :13], 0.0)
    np.testing.assert_array_equal(out[0, 13:], 1.0)


def test_transform_dense_reshapes_a_flat_row():
    state = _state()
    out = transform_dense(np.arange(13, dtype=np.float64), state)
    assert out.shape == (1, 26)
    assert out[0, 0] == pytest.approx((0.0 - 1.0) / 0.5)  # log1p(0) = 0, mean 1, std 0.5
    assert out[0, 12] == pytest.approx(math.log(13))


def test_table_sizes_count_reserved_rows():
    state = _state()
    assert state.table_size("C1") == NUM_RESERVED_ROWS + 3
    assert state.table_size("C2") == NUM_RESERVED_ROWS
    assert sum(state.table_sizes().values()) == 26 * NUM_RESERVED_ROWS + 4


def _write(state: FeatureState, directory):
    """As spark_jobs.features.write_feature_state: files in a staging dir, manifest, then commit."""
    staging = staging_dir(directory)
    files = save_feature_state(state, staging)
    write_manifest(
        staging,
        kind=FEATURE_STATE_KIND,
        version=state.version,
        files=files,
        extra={"min_count": state.min_count, "table_sizes": state.table_sizes()},
    )
    return commit_dir(staging, directory)


def test_save_load_round_trip(tmp_path):
    state = _state()
    directory = _write(state, tmp_path / "features" / "x")
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [VOCABULARY_FILE, CANDIDATES_FILE, DENSE_FILE, "manifest.json"]
    )
    loaded = load_feature_state(directory)
    assert loaded == state
    assert loaded.vocabularies["C1"].values == ("aaaa0001", "bbbb0002", "cccc0003")
    assert loaded.vocabularies["C1"].counts == (50, 20, 5)
    assert loaded.dense[0] == DenseTransform("I1", 0.0, 2.0, 1.0, 0.5)
    table = pq.read_table(directory / VOCABULARY_FILE)
    assert table.num_rows == 4
    assert table.filter(pa.compute.equal(table["feature"], "C7")).to_pylist() == [
        {"feature": "C7", "value": "deadbeef", "row": NUM_RESERVED_ROWS, "count": 9, "last_seen": 20454}
    ]
    assert read_manifest(directory)["table_sizes"]["C1"] == 5


def test_load_feature_state_verifies_checksums(tmp_path):
    directory = _write(_state(), tmp_path / "fs")
    doc = json.loads((directory / DENSE_FILE).read_text())
    doc["dense"][0]["mean"] = 99.0
    (directory / DENSE_FILE).write_text(json.dumps(doc, indent=2))
    with pytest.raises(ManifestError, match=r"file 'dense\.json' does not match its manifest checksum"):
        load_feature_state(directory)
    assert load_feature_state(directory, verify=False).dense[0].mean == 99.0


def test_load_feature_state_needs_a_committed_dir(tmp_path):
    staging = staging_dir(tmp_path / "fs")
    save_feature_state(_state(), staging)  # crashed before the manifest was written
    with pytest.raises(ManifestError, match=r"has no manifest\.json"):
        load_feature_state(staging)


def test_load_feature_state_rejects_another_kind(tmp_path):
    staging = staging_dir(tmp_path / "fs")
    files = save_feature_state(_state(), staging)
    write_manifest(staging, kind="checkpoint", version="v", files=files)
    with pytest.raises(ManifestError, match=r"describes a 'checkpoint', expected a 'feature_state'"):
        load_feature_state(staging)


def test_load_feature_state_rejects_rows_outside_the_table_or_shared(tmp_path):
    for rows_edit, message in [
        ({2: 7}, r"vocabulary of C1 uses rows 2\.\.7 outside \[2, 5\)"),  # C1's third value jumps past the table
        ({2: 3}, r"vocabulary of C1 gives one row to two values"),
    ]:
        staging = staging_dir(tmp_path / "fs")
        files = save_feature_state(_state(), staging)
        table = pq.read_table(staging / VOCABULARY_FILE)
        rows = table["row"].to_pylist()
        for index, row in rows_edit.items():
            rows[index] = row
        pq.write_table(table.set_column(2, "row", pa.array(rows, pa.int64())), staging / VOCABULARY_FILE)
        write_manifest(staging, kind=FEATURE_STATE_KIND, version="v", files=files)
        with pytest.raises(ValueError, match=message):
            load_feature_state(staging)


def test_load_feature_state_refuses_values_of_a_table_the_state_does_not_list(tmp_path):
    staging = staging_dir(tmp_path / "fs")
    files = save_feature_state(_state(), staging)
    table = pq.read_table(staging / VOCABULARY_FILE)
    features = table["feature"].to_pylist()
    features[-1] = "C99"
    pq.write_table(table.set_column(0, "feature", pa.array(features, pa.string())), staging / VOCABULARY_FILE)
    write_manifest(staging, kind=FEATURE_STATE_KIND, version="v", files=files)
    with pytest.raises(ValueError, match=r"has values of tables \['C99'\] that dense\.json does not list"):
        load_feature_state(staging)


# --- Feature state across runs -------------------------------------------------------------------------------

DAY = 20454  # 2026-01-01


def _counts(day: int, **by_feature: dict[str, int]) -> pa.Table:
    rows = [{"feature": f, "value": v, "count": c, "last_seen": day}
            for f, values in by_feature.items() for v, c in values.items()]
    return pa.Table.from_pylist(rows, schema=COUNTS_SCHEMA)


def _advance(previous, counts, day, evict_after_days=0, max_rows=1 << 40):
    return advance_feature_state(previous, counts, day=day, min_count=3, dense=_state().dense, version=f"d{day}",
                                 evict_after_days=evict_after_days, max_rows_per_feature=max_rows)


def _rows(state: FeatureState, feature: str = "C1") -> dict[str, int]:
    vocabulary = state.vocabularies[feature]
    return dict(zip(vocabulary.values, vocabulary.rows, strict=True))


def test_vocabulary_rows_are_stable_over_three_runs_while_values_accumulate_to_admission():
    first = _advance(None, _counts(DAY, C1={"a": 5, "b": 3, "c": 2, "d": 1}), DAY)
    assert _rows(first) == {"a": 2, "b": 3}
    assert first.table_size("C1") == 4
    # "c" and "d" wait as candidates with their counts.
    assert sorted((r["value"], r["count"]) for r in first.candidates.to_pylist()) == [("c", 2), ("d", 1)]

    # Day 2: "c" reaches 3 in total and is admitted after the existing rows; "e" is new and common at once.
    # "e" (count 9) is admitted before "c" (count 3): the higher count gets the lower row.
    second = _advance(first, _counts(DAY + 1, C1={"c": 1, "e": 9, "b": 1}), DAY + 1)
    assert _rows(second) == {"a": 2, "b": 3, "e": 4, "c": 5}
    assert second.new_rows["C1"] == (4, 5)
    assert second.vocabularies["C1"].counts == (5, 4, 9, 3)

    # Day 3: nothing admitted earlier moves, whatever the new counts.
    third = _advance(second, _counts(DAY + 2, C1={"e": 1, "a": 100, "d": 2, "f": 50}), DAY + 2)
    assert {v: r for v, r in _rows(third).items() if v in _rows(second)} == _rows(second)
    assert _rows(third) == {"a": 2, "b": 3, "e": 4, "c": 5, "f": 6, "d": 7}
    assert third.table_size("C1") == 8
    assert third.candidates.num_rows == 0


def test_eviction_frees_rows_that_new_values_reuse_and_forgets_stale_candidates():
    first = _advance(None, _counts(DAY, C1={"old": 6, "kept": 5, "x": 1}), DAY)
    assert _rows(first) == {"old": 2, "kept": 3}
    # Nine days later, with eviction after 7 days: "old" and candidate "x" were last seen on DAY.
    later = _advance(first, _counts(DAY + 9, C1={"kept": 1}), DAY + 9, evict_after_days=7)
    assert _rows(later) == {"kept": 3}
    assert later.evicted_rows["C1"] == (2,)
    assert later.vocabularies["C1"].free_rows == (2,)
    assert later.candidates.num_rows == 0
    assert later.table_size("C1") == 4  # tables never shrink: checkpoints keep their shapes

    # The freed row goes to the next admitted value before the table grows.
    refill = _advance(later, _counts(DAY + 10, C1={"new1": 4, "new2": 3}), DAY + 10, evict_after_days=7)
    assert _rows(refill) == {"kept": 3, "new1": 2, "new2": 4}
    assert refill.new_rows["C1"] == (2, 4) and refill.vocabularies["C1"].free_rows == ()

    # Without eviction (minute runs), nothing is evicted however old.
    kept = _advance(first, _counts(DAY + 30, C1={}), DAY + 30, evict_after_days=0)
    assert _rows(kept) == _rows(first)


def test_capacity_keeps_values_beyond_it_as_candidates():
    state = _advance(None, _counts(DAY, C1={"a": 9, "b": 8, "c": 7}), DAY, max_rows=NUM_RESERVED_ROWS + 2)
    assert _rows(state) == {"a": 2, "b": 3}
    assert [(r["value"], r["count"]) for r in state.candidates.to_pylist()] == [("c", 7)]
    with pytest.raises(ValueError, match=r"max_rows=2 of table .C1. leaves no room"):
        _advance(None, _counts(DAY, C1={"a": 9}), DAY, max_rows=2)


def test_advance_is_deterministic_and_round_trips_through_files(tmp_path):
    counts = _counts(DAY, C1={f"v{i}": i % 7 for i in range(1, 200)}, C9={"z": 4, "y": 4})
    one, two = _advance(None, counts, DAY), _advance(None, counts.take(list(range(counts.num_rows))[::-1]), DAY)
    assert one == two and one.candidates.equals(two.candidates)
    assert _rows(one, "C9") == {"y": 2, "z": 3}  # equal counts: ordered by value
    second = _advance(one, _counts(DAY + 9, C1={"v6": 1}), DAY + 9, evict_after_days=3)
    loaded = load_feature_state(_write(second, tmp_path / "fs"))
    assert loaded == second and loaded.candidates.equals(second.candidates.sort_by(
        [("feature", "ascending"), ("value", "ascending")]))
    assert loaded.evicted_rows["C1"] == second.evicted_rows["C1"] and len(loaded.evicted_rows["C1"]) > 0


def test_lookup_maps_values_to_their_rows_after_eviction():
    state = _advance(_advance(None, _counts(DAY, C1={"a": 5, "b": 4}), DAY),
                     _counts(DAY + 9, C1={"b": 1, "c": 6}), DAY + 9, evict_after_days=7)
    assert _rows(state) == {"c": 2, "b": 3}
    rows = categorical_rows(pa.array(["a", "b", "c", "", None]), *state.lookup("C1"))
    assert rows.tolist() == [RARE_ROW, 3, 2, MISSING_ROW, MISSING_ROW]


def test_daily_room_is_filled_by_minute_runs_without_growing_the_table(tmp_path):
    # Daily: C1 admits a and b (rows 2, 3) and leaves room for 2 more rows: the table has 6 rows.
    daily = advance_feature_state(None, _counts(10, C1={"a": 5, "b": 4}), day=10, min_count=3, dense=_state().dense,
                                  version="daily", growth_rows=2)
    assert (daily.vocabularies["C1"].num_rows, daily.table_size("C1")) == (4, 6)
    # A minute run admits c and d into the room, e waits for the daily run: the table keeps its 6 rows.
    minute = advance_feature_state(daily, _counts(10, C1={"c": 9, "d": 8, "e": 7}), day=10, min_count=3,
                                   dense=_state().dense, version="minute", fixed_tables=True)
    assert dict(zip(minute.vocabularies["C1"].values, minute.vocabularies["C1"].rows, strict=True)) == {
        "a": 2, "b": 3, "c": 4, "d": 5}
    assert minute.table_size("C1") == 6 and minute.table_sizes() == daily.table_sizes()
    assert minute.candidates.to_pylist() == [{"feature": "C1", "value": "e", "count": 7, "last_seen": 10}]
    assert minute.new_rows == {"C1": (4, 5)}
    directory = tmp_path / "state"
    staging = staging_dir(directory)
    files = save_feature_state(minute, staging)
    write_manifest(staging, kind=FEATURE_STATE_KIND, version=minute.version, files=files)
    commit_dir(staging, directory)
    assert load_feature_state(directory).table_sizes() == daily.table_sizes()


def _reference_advance(previous, counts, *, day, tables, growth_rows, fixed_tables):
    """advance_feature_state's rules written value by value, as they read: the check of its array version."""
    seen_by_table: dict[str, dict[str, list[int]]] = {}
    candidates = previous["candidates"] if previous else []
    for row in [*candidates, *counts.to_pylist()]:
        entry = seen_by_table.setdefault(row["feature"], {}).setdefault(row["value"], [0, row["last_seen"]])
        entry[0] += row["count"]
        entry[1] = max(entry[1], row["last_seen"])
    out = {"vocabularies": {}, "candidates": [], "new_rows": {}, "evicted_rows": {}}
    for name, settings in tables.items():
        old = previous["vocabularies"].get(name) if previous else None
        if old is None:
            old = Vocabulary.of(settings.fixed_values, last_seen=day) if settings.fixed_values else Vocabulary()
        seen = seen_by_table.get(name, {})
        entries = {}
        for value, row, count, last in zip(old.values, old.rows, old.counts, old.last_seen, strict=True):
            extra_count, extra_last = seen.pop(value, (0, last))
            entries[value] = [row, count + extra_count, max(last, extra_last)]
        free, evicted = set(old.free_rows), []
        if settings.evict_after_days > 0:
            stale_before = day - settings.evict_after_days
            for value in [v for v, (_, _, last) in entries.items() if last <= stale_before]:
                evicted.append(entries.pop(value)[0])
            free.update(evicted)
            seen = {v: cl for v, cl in seen.items() if cl[1] > stale_before}
        admissible = sorted((-c, v) for v, (c, _) in seen.items()
                            if c >= settings.min_count and (not settings.fixed_values or v in settings.fixed_values))
        num_rows, free_sorted, added = old.num_rows, sorted(free), []
        limit = old.table_size if fixed_tables and previous else settings.max_rows
        for _, value in admissible:
            if free_sorted:
                row = free_sorted.pop(0)
            elif num_rows < limit:
                row, num_rows = num_rows, num_rows + 1
            else:
                break
            entries[value] = [row, *seen.pop(value)]
            added.append(row)
        ordered = sorted(entries.items(), key=lambda item: item[1][0])
        out["vocabularies"][name] = Vocabulary(
            tuple(v for v, _ in ordered), tuple(e[0] for _, e in ordered), tuple(e[1] for _, e in ordered),
            tuple(e[2] for _, e in ordered), num_rows, tuple(free_sorted),
            old.table_size if fixed_tables or settings.fixed_values else min(settings.max_rows, num_rows + growth_rows))
        if evicted:
            out["evicted_rows"][name] = tuple(sorted(evicted))
        if added:
            out["new_rows"][name] = tuple(sorted(added))
        out["candidates"] += [{"feature": name, "value": v, "count": seen[v][0], "last_seen": seen[v][1]}
                              for v in sorted(seen)]
    return out


def test_advance_matches_the_rules_value_by_value_over_random_histories():
    """Admission order, free-row reuse, full tables, eviction, fixed values and minute runs (fixed_tables), over
    random multi-day histories: the array version gives exactly the reference's state, Python ints included."""
    from components.feature_state import TableSettings

    rng = np.random.default_rng(7)
    for trial in range(60):
        tables = {}
        for t in range(int(rng.integers(1, 4))):
            fixed = tuple(f"f{i}" for i in range(int(rng.integers(1, 4)))) if rng.random() < 0.25 else ()
            tables[f"T{t}"] = TableSettings(int(rng.integers(1, 4)), int(rng.choice([0, 1, 2])),
                                            int(rng.choice([3, 5, 8, 1 << 62])), fixed)
        state, reference = None, None
        for day in range(int(rng.integers(2, 6))):
            rows = []
            for name, settings in tables.items():
                pool = [*settings.fixed_values, *(f"v{i}" for i in range(12)), "é", "Z", "a b"]
                for value in sorted(set(rng.choice(pool, size=int(rng.integers(0, 15))).tolist())):
                    rows.append({"feature": name, "value": value, "count": int(rng.integers(1, 5)),
                                 "last_seen": day})
            counts = pa.Table.from_pylist(rows, schema=COUNTS_SCHEMA)
            evict, growth, fixed_tables = rng.random() < 0.6, int(rng.choice([0, 2, 5])), rng.random() < 0.3
            settings = {name: TableSettings(s.min_count, s.evict_after_days if evict else 0, s.max_rows,
                                            s.fixed_values) for name, s in tables.items()}
            state = advance_feature_state(state, counts, day=day, min_count=2, dense=(), version=f"d{day}",
                                          tables=settings, growth_rows=growth, fixed_tables=fixed_tables)
            reference = _reference_advance(reference, counts, day=day, tables=settings, growth_rows=growth,
                                           fixed_tables=fixed_tables)
            where = f"trial {trial} day {day}"
            assert state.vocabularies == reference["vocabularies"], where
            by_value = sorted(state.candidates.to_pylist(), key=lambda r: (list(tables).index(r["feature"]),
                                                                          r["value"]))
            assert by_value == reference["candidates"], where  # the candidates are a set: no order is kept
            assert (state.new_rows, state.evicted_rows) == (reference["new_rows"], reference["evicted_rows"]), where
            assert all(type(x) is int for v in state.vocabularies.values() for x in (*v.rows, *v.counts,
                                                                                     *v.last_seen)), where


@pytest.mark.parametrize(("num_rows", "expected"), [
    (0, 2), (8_000, 2), (90_000, 2), (299_999, 2), (300_000, 3), (1_000_000, 10), (1_999_999, 19),
    (2_000_000, 20), (2_700_000, 20), (10**9, 20)])
def test_auto_min_count_follows_the_rows_from_2_to_20(num_rows, expected):
    assert auto_min_count(num_rows) == expected
