"""The feature state: per table of the feature spec a vocabulary (value -> embedding row), per dense feature its
transform. A table is read by one categorical feature, or shared by several (features with `table:`,
sequences with `shares:`); the criteo spec has one table per feature, named after it. Spark builds it, the
sample writer and the exported serving model apply it, so the same raw value maps to the same row everywhere.

The state carries over from run to run (`advance_feature_state`): counts accumulate, a value is admitted to
its own row after min_count occurrences, keeps that row while admitted, and is evicted when unseen for
features.evict_after_days days, its row freed for reuse.

Files in a feature-state directory: vocabulary.parquet (feature, value, row, count, last_seen),
candidates.parquet (seen, not yet admitted), dense.json (dense transforms, table sizes, free, evicted and new
rows), manifest.json. The functions `categorical_rows` and `transform_dense` are the reference transforms;
the SavedModel's TensorFlow version is tested against them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from components.feature_spec import MISSING_ROW, NUM_RESERVED_ROWS, RARE_ROW, FeatureSpec, TableSpec

VOCABULARY_FILE = "vocabulary.parquet"
CANDIDATES_FILE = "candidates.parquet"
DENSE_FILE = "dense.json"
FEATURE_STATE_KIND = "feature_state"

# Counted occurrences of categorical values: what Spark hands to `advance_feature_state`, and the layout of
# the candidates (seen, not yet admitted) kept in the state.
COUNTS_SCHEMA = pa.schema([("feature", pa.string()), ("value", pa.string()), ("count", pa.int64()),
                           ("last_seen", pa.int32())])
VOCABULARY_SCHEMA = pa.schema([("feature", pa.string()), ("value", pa.string()), ("row", pa.int64()),
                               ("count", pa.int64()), ("last_seen", pa.int32())])


@dataclass(frozen=True)
class DenseTransform:
    """x -> standardize(clip(sign(x) * log1p(|x|), low, high)) (without the log1p when `log` is false);
    missing -> 0, with a missing flag of 1 when `indicator`.

    A bucketized feature (transform: buckets) has `boundaries` instead: x -> its bucket number
    (`bucket_values`), which its derived categorical feature looks up; the other fields are unused."""

    name: str
    low: float
    high: float
    mean: float
    std: float
    log: bool = True
    indicator: bool = True
    boundaries: tuple[float, ...] = ()

    @property
    def bucketized(self) -> bool:
        return bool(self.boundaries)


@dataclass(frozen=True)
class TableSettings:
    """How one table admits, evicts and grows (from the spec's TableSpec; `evict_after_days` 0 in a minute
    run, which never evicts). `fixed_values`: the table holds exactly these, admitted from the start."""

    min_count: int
    evict_after_days: int = 0
    max_rows: int = 1 << 62
    fixed_values: tuple[str, ...] = ()


# features.min_count=0 (the default) resolves at the daily run from the rows it counts: one admission count per
# AUTO_MIN_COUNT_ROWS training rows, within [AUTO_MIN_COUNT_LOW, AUTO_MIN_COUNT_HIGH].
AUTO_MIN_COUNT_ROWS = 100_000
AUTO_MIN_COUNT_LOW = 2
AUTO_MIN_COUNT_HIGH = 20


def auto_min_count(num_rows: int) -> int:
    """The admission count for a daily run over `num_rows` training rows when features.min_count is 0 (auto).

    A fixed count of 20 sent nearly every value of a log of ten thousand rows to the shared rare row, where a
    hashed logistic regression keeps each of them; on hundreds of millions of rows the same 20 keeps the tables
    to values seen often enough to learn a row. So: 2 up to 299,999 rows, one more per 100,000 rows, at most
    20 (from 2 M rows on)."""
    return max(AUTO_MIN_COUNT_LOW, min(AUTO_MIN_COUNT_HIGH, int(num_rows) // AUTO_MIN_COUNT_ROWS))


def table_settings(tables: Mapping[str, TableSpec], *, evict: bool) -> dict[str, TableSettings]:
    """The spec's tables (FeatureSpec.tables()) as advance_feature_state takes them."""
    return {name: TableSettings(t.min_count, t.evict_after_days if evict else 0, t.max_rows, t.fixed_values)
            for name, t in tables.items()}


@dataclass(frozen=True)
class Vocabulary:
    """The admitted values of one categorical feature and their embedding rows.

    An admitted value keeps its row for as long as it stays admitted. Eviction frees its row; freed rows are
    handed out again (lowest first) before the table grows. `num_rows` counts the reserved rows plus every row
    ever handed out, freed ones included, so it never shrinks and old checkpoints stay loadable. `capacity`,
    when above `num_rows`, is the table size: the daily run leaves room there for the values that minute runs
    admit, because a minute's model must keep its daily parent's shape (its delta only changes rows).
    """

    values: tuple[str, ...] = ()
    rows: tuple[int, ...] = ()
    counts: tuple[int, ...] = ()
    # Day number (days since 1970-01-01 UTC) of the newest data in which the value occurred.
    last_seen: tuple[int, ...] = ()
    num_rows: int = NUM_RESERVED_ROWS
    free_rows: tuple[int, ...] = ()
    capacity: int = 0

    @property
    def table_size(self) -> int:
        return max(self.num_rows, self.capacity)

    @classmethod
    def of(cls, values: Sequence[str], counts: Sequence[int] | None = None, last_seen: int = 0) -> Vocabulary:
        """Values in row order from the first non-reserved row (a fresh vocabulary)."""
        rows = tuple(range(NUM_RESERVED_ROWS, NUM_RESERVED_ROWS + len(values)))
        return cls(tuple(values), rows, tuple(counts) if counts is not None else (0,) * len(values),
                   (last_seen,) * len(values), NUM_RESERVED_ROWS + len(values), ())

    def __len__(self) -> int:
        return len(self.values)


@dataclass(frozen=True)
class FeatureState:
    version: str
    min_count: int
    vocabularies: dict[str, Vocabulary]
    dense: tuple[DenseTransform, ...]
    # Values seen but not (yet) admitted, with their counts so far: COUNTS_SCHEMA rows.
    candidates: pa.Table = field(default_factory=COUNTS_SCHEMA.empty_table, compare=False)
    # Newest day of data folded into the state.
    day: int = 0
    # What the update that produced this state changed, per feature: rows freed by eviction and rows handed
    # to newly admitted values (features without changes are left out). A warm-started trainer re-initialises
    # both.
    evicted_rows: dict[str, tuple[int, ...]] = field(default_factory=dict)
    new_rows: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def table_size(self, feature: str) -> int:
        return self.vocabularies[feature].table_size

    def table_sizes(self) -> dict[str, int]:
        """Rows of every table, in the spec's table order."""
        return {name: self.table_size(name) for name in self.vocabularies}

    @property
    def dense_names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dense)

    @property
    def scaled(self) -> tuple[DenseTransform, ...]:
        """The transforms of the dense input (all but the bucketized features)."""
        return tuple(d for d in self.dense if not d.bucketized)

    def dense_arrays(self) -> dict[str, np.ndarray]:
        """The scaled transforms' fields as arrays, one entry per feature of the dense input."""
        return {
            key: np.array([getattr(d, key) for d in self.scaled], dtype=np.float64)
            for key in ("low", "high", "mean", "std", "log", "indicator")
        }

    def boundaries(self, name: str) -> tuple[float, ...]:
        """The bucket boundaries of the bucketized dense feature `name`."""
        for transform in self.dense:
            if transform.name == name and transform.bucketized:
                return transform.boundaries
        raise KeyError(f"feature state {self.version}: dense feature {name!r} has no bucket boundaries; "
                       f"bucketized: {[d.name for d in self.dense if d.bucketized]}")

    def lookup(self, feature: str) -> tuple[pa.Array, np.ndarray]:
        """(admitted values, their rows) of one feature, as `categorical_rows` takes them."""
        vocabulary = self.vocabularies[feature]
        return pa.array(vocabulary.values, pa.string()), np.asarray(vocabulary.rows, dtype=np.int64)

    def summary(self) -> dict:
        """Sizes, capacity use and what this update changed, for manifests and metrics."""
        return {
            "day": self.day,
            "min_count": self.min_count,
            "table_sizes": self.table_sizes(),
            "vocabulary_sizes": {name: len(v) for name, v in self.vocabularies.items()},
            "free_rows": {name: len(v.free_rows) for name, v in self.vocabularies.items()},
            "num_candidates": self.candidates.num_rows,
            "num_new_rows": sum(len(r) for r in self.new_rows.values()),
            "num_evicted_rows": sum(len(r) for r in self.evicted_rows.values()),
        }


def advance_feature_state(
    previous: FeatureState | None,
    counts: pa.Table,
    *,
    day: int,
    min_count: int,
    dense: tuple[DenseTransform, ...],
    version: str,
    evict_after_days: int = 0,
    max_rows_per_feature: int = 1 << 62,
    growth_rows: int = 0,
    fixed_tables: bool = False,
    tables: Mapping[str, TableSettings] | None = None,
) -> FeatureState:
    """Folds the occurrences counted in new data (`counts`, COUNTS_SCHEMA, `feature` naming the table) into
    the previous state.

    `tables` gives each table's settings (table_settings(spec.tables(), evict=...)); without it, the criteo
    spec's tables with `min_count`, `evict_after_days` and `max_rows_per_feature` for all.

    - counts and last-seen days add up across runs, for admitted values and candidates alike;
    - with `evict_after_days` > 0 (the daily run), admitted values last seen on or before day - N are evicted
      and their rows freed; candidates as stale are forgotten;
    - a candidate whose total reaches `min_count` is admitted (highest count first, ties by value), into a
      freed row if there is one, else a new row at the end, while the table stays within
      `max_rows_per_feature`; the rest stay candidates;
    - an admitted value never moves;
    - with `growth_rows`, each table gets room for that many more values (capacity, within
      `max_rows_per_feature`); with `fixed_tables` (a minute run) no table grows past its previous size: values
      are admitted into free rows and that room only, and the rest stay candidates for the daily run.
    The result is a function of its inputs only: the same previous state and counts give the same state. The
    candidates are a set, in no particular order (save_feature_state sorts them).
    """
    if tables is None:
        from components.feature_spec import load_spec

        tables = {name: TableSettings(min_count, evict_after_days, max_rows_per_feature)
                  for name in load_spec("criteo").tables()}
    for name, settings in tables.items():
        if settings.min_count < 1:
            raise ValueError(f"min_count={settings.min_count} of table {name!r} must be >= 1 (features.min_count, "
                             "or min_count in the feature spec)")
        if settings.max_rows <= NUM_RESERVED_ROWS:
            raise ValueError(
                f"max_rows={settings.max_rows} of table {name!r} leaves no room beyond the {NUM_RESERVED_ROWS} "
                f"reserved rows; set features.max_rows_per_feature (or max_rows in the spec) above "
                f"{NUM_RESERVED_ROWS}"
            )
    missing = set(COUNTS_SCHEMA.names) - set(counts.schema.names)
    if missing:
        raise ValueError(f"counts lack columns {sorted(missing)}; expected {COUNTS_SCHEMA.names}")
    counts = counts.select(COUNTS_SCHEMA.names).cast(COUNTS_SCHEMA)
    candidates = previous.candidates if previous is not None else COUNTS_SCHEMA.empty_table()
    untouched = COUNTS_SCHEMA.empty_table()
    if fixed_tables and previous is not None and not any(s.evict_after_days for s in tables.values()):
        candidates, untouched = _split_candidates(candidates, counts, tables)
    merged = _sum_counts(pa.concat_tables([candidates, counts]))
    unknown = sorted(set(pc.unique(merged["feature"]).to_pylist()) - set(tables))
    if unknown:
        raise ValueError(f"counts name an unknown table {unknown[0]!r}; expected one of {list(tables)}")

    vocabularies: dict[str, Vocabulary] = {}
    evicted_rows: dict[str, tuple[int, ...]] = {}
    new_rows: dict[str, tuple[int, ...]] = {}
    remaining_candidates: list[pa.Table] = [untouched] if untouched.num_rows else []
    for name, settings in tables.items():
        old = previous.vocabularies.get(name) if previous is not None else None
        if old is None:
            old = Vocabulary.of(settings.fixed_values, last_seen=day) if settings.fixed_values else Vocabulary()
        limit = old.table_size if fixed_tables and previous is not None and name in previous.vocabularies \
            else settings.max_rows
        seen = merged.filter(pc.equal(merged["feature"], name)).drop_columns(["feature"])
        vocabulary, evicted, added, rest = _advance_table(
            old, seen, settings, day=day, limit=limit,
            capacity=None if fixed_tables or settings.fixed_values else growth_rows)
        vocabularies[name] = vocabulary
        if evicted:
            evicted_rows[name] = evicted
        if added:
            new_rows[name] = added
        if rest.num_rows:
            remaining_candidates.append(pa.table({
                "feature": pa.array([name] * rest.num_rows, pa.string()), "value": rest["value"],
                "count": rest["count"], "last_seen": rest["last_seen"]}, schema=COUNTS_SCHEMA))
    return FeatureState(
        version=version, min_count=min_count, vocabularies=vocabularies, dense=dense,
        candidates=pa.concat_tables(remaining_candidates) if remaining_candidates else COUNTS_SCHEMA.empty_table(),
        day=max(day, previous.day if previous is not None else day),
        evicted_rows=evicted_rows, new_rows=new_rows,
    )


def _advance_table(old: Vocabulary, seen: pa.Table, settings: TableSettings, *, day: int, limit: int,
                   capacity: int | None) -> tuple[Vocabulary, tuple[int, ...], tuple[int, ...], pa.Table]:
    """One table's step of advance_feature_state, on whole arrays (a dict per value took 3.6 s for the 727 K
    values counted in 2 M rows, this 0.6 s). `seen`: (value, count, last_seen) of this update's counts summed
    with the previous candidates, admitted values among them. Returns the new vocabulary, the rows evicted and
    added, and the values left as candidates (sorted by value). `capacity`: the rows of growth room to leave
    (None: the table keeps its size)."""
    values = pa.array(old.values, pa.string())
    rows = np.asarray(old.rows, np.int64)
    counts = np.asarray(old.counts, np.int64)
    last = np.asarray(old.last_seen, np.int64)
    seen_counts = seen["count"].to_numpy()
    seen_last = seen["last_seen"].to_numpy().astype(np.int64)
    rest = np.ones(seen.num_rows, bool)  # counted values not admitted (yet)
    if seen.num_rows and len(values):
        position = pc.index_in(values, value_set=seen["value"])
        hit = position.is_valid().to_numpy(zero_copy_only=False)
        at = position.fill_null(0).to_numpy()[hit]
        counts[hit] += seen_counts[at]
        last[hit] = np.maximum(last[hit], seen_last[at])
        rest[at] = False
    keep = np.ones(len(values), bool)
    evicted = np.zeros(0, np.int64)
    free = set(old.free_rows)
    if settings.evict_after_days > 0:
        stale_before = day - settings.evict_after_days
        keep = last > stale_before
        evicted = rows[~keep]
        free.update(evicted.tolist())
        rest &= seen_last > stale_before
    admissible = rest & (seen_counts >= settings.min_count)
    if settings.fixed_values:
        admissible &= pc.is_in(seen["value"], value_set=pa.array(settings.fixed_values, pa.string())).to_numpy(
            zero_copy_only=False)
    # Highest count first, ties by value; into the lowest free rows, then new rows while the table has room.
    order = pc.sort_indices(seen.filter(pa.array(admissible)), [("count", "descending"), ("value", "ascending")])
    ranked = np.flatnonzero(admissible)[order.to_numpy()]
    free_sorted = sorted(free)
    room = max(0, limit - old.num_rows)
    taken = ranked[:len(free_sorted) + room]
    reused = free_sorted[:len(taken)]
    grown = len(taken) - len(reused)
    added = np.array(reused + list(range(old.num_rows, old.num_rows + grown)), np.int64)
    num_rows = old.num_rows + grown
    rest[taken] = False

    all_rows = np.concatenate([rows[keep], added])
    by_row = np.argsort(all_rows, kind="stable")
    all_values = pa.concat_arrays([values.filter(pa.array(keep)), seen["value"].combine_chunks().take(taken)])
    vocabulary = Vocabulary(
        values=tuple(all_values.take(by_row).to_pylist()), rows=tuple(all_rows[by_row].tolist()),
        counts=tuple(np.concatenate([counts[keep], seen_counts[taken]])[by_row].tolist()),
        last_seen=tuple(np.concatenate([last[keep], seen_last[taken]])[by_row].tolist()),
        num_rows=num_rows, free_rows=tuple(free_sorted[len(reused):]),
        # A table of fixed values (hours, days, buckets) holds exactly them: no room to grow.
        capacity=old.table_size if capacity is None else min(settings.max_rows, num_rows + capacity),
    )
    left = seen.filter(pa.array(rest))
    left = left.take(pc.sort_indices(left, [("value", "ascending")]))
    return vocabulary, tuple(sorted(evicted.tolist())), tuple(sorted(added.tolist())), left


def _split_candidates(candidates: pa.Table, counts: pa.Table, tables: Mapping[str, TableSettings]
                      ) -> tuple[pa.Table, pa.Table]:
    """(the candidates an update without eviction or growth can change, the others): a candidate that `counts`
    does not name and that is below its table's min_count stays as it is (its count, its last day, not
    admitted) whatever else is admitted, so a minute run folds only the values it counted (and any admissible
    one left waiting for room) instead of summing and sorting every candidate the day has gathered: 552 K after
    2 M rows, 0.23 s of a minute run's 0.38 s merge."""
    if not candidates.num_rows:
        return candidates, candidates
    indexed = candidates.append_column("_index", pa.array(np.arange(candidates.num_rows, dtype=np.int64)))
    named = indexed.join(counts.select(["feature", "value"]), keys=["feature", "value"], join_type="left semi")
    touched = np.zeros(candidates.num_rows, bool)
    touched[named["_index"].to_numpy()] = True
    names = list(tables)
    least = np.array([tables[name].min_count for name in names] + [1], np.int64)
    table_of = pc.index_in(candidates["feature"], value_set=pa.array(names, pa.string())).fill_null(len(names))
    touched |= candidates["count"].to_numpy() >= least[table_of.to_numpy()]
    mask = pa.array(touched)
    return candidates.filter(mask), candidates.filter(pc.invert(mask))


def _sum_counts(table: pa.Table) -> pa.Table:
    grouped = table.group_by(["feature", "value"]).aggregate([("count", "sum"), ("last_seen", "max")])
    return grouped.rename_columns(["feature", "value", "count", "last_seen"])


def save_feature_state(state: FeatureState, directory: str | Path) -> list[str]:
    """Writes the state's files into `directory` (a staging dir) and returns their names for the manifest."""
    directory = Path(directory)
    columns: dict[str, list] = {name: [] for name in VOCABULARY_SCHEMA.names}
    for name, vocabulary in state.vocabularies.items():
        columns["feature"].extend([name] * len(vocabulary))
        columns["value"].extend(vocabulary.values)
        columns["row"].extend(vocabulary.rows)
        columns["count"].extend(vocabulary.counts)
        columns["last_seen"].extend(vocabulary.last_seen)
    pq.write_table(pa.table(columns, schema=VOCABULARY_SCHEMA), directory / VOCABULARY_FILE)
    candidates = state.candidates.sort_by([("feature", "ascending"), ("value", "ascending")])
    pq.write_table(candidates.cast(COUNTS_SCHEMA), directory / CANDIDATES_FILE)
    (directory / DENSE_FILE).write_text(
        json.dumps(
            {
                "version": state.version,
                "min_count": state.min_count,
                "day": state.day,
                "dense": [asdict(d) for d in state.dense],
                "tables": {
                    name: {"num_rows": v.num_rows, "capacity": v.capacity, "free_rows": list(v.free_rows),
                           "evicted_rows": list(state.evicted_rows.get(name, ())),
                           "new_rows": list(state.new_rows.get(name, ()))}
                    for name, v in state.vocabularies.items()
                },
            },
            indent=1,
        )
    )
    return [VOCABULARY_FILE, CANDIDATES_FILE, DENSE_FILE]


def load_feature_state(directory: str | Path, verify: bool = True, spec: FeatureSpec | None = None) -> FeatureState:
    """The state in `directory`; with `spec`, checked to hold that spec's tables and dense features."""
    from components.manifest import read_manifest

    directory = Path(directory)
    read_manifest(directory, kind=FEATURE_STATE_KIND, verify=verify)
    doc = json.loads((directory / DENSE_FILE).read_text())
    # Sorted by table, then row: each table's values are one slice, read a column at a time (a loop over the
    # rows took 0.2-0.4 s for the 175 K values of a state from 2 M rows, paid by every minute run).
    table = pq.read_table(directory / VOCABULARY_FILE).sort_by([("feature", "ascending"), ("row", "ascending")])
    unknown = set(pc.unique(table["feature"]).to_pylist()) - set(doc["tables"])
    if unknown:
        raise ValueError(f"{directory}: {VOCABULARY_FILE} has values of tables {sorted(unknown)} that "
                         f"{DENSE_FILE} does not list; the state is damaged: build it again")
    found = pc.value_counts(table["feature"])
    sizes = dict(zip(found.field("values").to_pylist(), found.field("counts").to_pylist(), strict=True))
    starts, offset = {}, 0
    for name in sorted(sizes):  # the sort's order of the feature names
        starts[name], offset = offset, offset + sizes[name]
    vocabularies = {}
    for name, table_doc in doc["tables"].items():
        part = table.slice(starts.get(name, 0), sizes.get(name, 0))
        vocabulary = Vocabulary(tuple(part["value"].to_pylist()),
                                *(tuple(part[c].to_numpy().tolist()) for c in ("row", "count", "last_seen")),
                                table_doc["num_rows"], tuple(table_doc["free_rows"]), table_doc.get("capacity", 0))
        _check_rows(vocabulary, name, directory)
        vocabularies[name] = vocabulary
    dense = tuple(DenseTransform(**{**d, "boundaries": tuple(d.get("boundaries", ()))}) for d in doc["dense"])
    if spec is not None:
        check_state_matches(list(vocabularies), [d.name for d in dense], spec, directory)
    return FeatureState(
        version=doc["version"], min_count=doc["min_count"], vocabularies=vocabularies, dense=dense,
        candidates=pq.read_table(directory / CANDIDATES_FILE).cast(COUNTS_SCHEMA), day=doc["day"],
        evicted_rows={n: tuple(t["evicted_rows"]) for n, t in doc["tables"].items() if t["evicted_rows"]},
        new_rows={n: tuple(t["new_rows"]) for n, t in doc["tables"].items() if t["new_rows"]},
    )


def check_state_matches(tables: Sequence[str], dense: Sequence[str], spec: FeatureSpec, where: Any) -> None:
    """Refuses a state built for another spec: its tables and dense features must be the spec's."""
    if list(tables) != list(spec.tables()) or list(dense) != list(spec.dense_names):
        raise ValueError(
            f"{where}: the feature state has tables {list(tables)} and dense features {list(dense)}, but feature "
            f"spec {spec.name!r} has tables {list(spec.tables())} and dense features {list(spec.dense_names)}; "
            "it was built for another spec: run the daily pipeline with this spec from a fresh data root, or "
            "with the spec it was built for"
        )


def _check_rows(vocabulary: Vocabulary, feature: str, directory: Path) -> None:
    used = set(vocabulary.rows)
    if len(used) != len(vocabulary.rows) or used & set(vocabulary.free_rows):
        raise ValueError(f"{directory}: vocabulary of {feature} gives one row to two values, or a free row is in use")
    if used and (min(used) < NUM_RESERVED_ROWS or max(used) >= vocabulary.table_size):
        raise ValueError(
            f"{directory}: vocabulary of {feature} uses rows {min(used)}..{max(used)} outside "
            f"[{NUM_RESERVED_ROWS}, {vocabulary.table_size})"
        )


def categorical_rows(values: pa.Array, vocabulary: pa.Array, rows: np.ndarray | None = None) -> np.ndarray:
    """Row ids of raw string values: missing (null or empty) -> MISSING_ROW, unknown or rare -> RARE_ROW.

    `rows[i]` is the row of `vocabulary[i]` (FeatureState.lookup); without it, values sit in row order from
    the first non-reserved row. One lookup in the vocabulary with "" and null appended (both the missing row),
    one take and one fill: 0.7x the time of looking the missing values up apart (26 columns of 9 K rows).
    """
    rows = (np.arange(NUM_RESERVED_ROWS, NUM_RESERVED_ROWS + len(vocabulary), dtype=np.int64) if rows is None
            else np.asarray(rows, dtype=np.int64))
    value_set = pa.concat_arrays([vocabulary.cast(pa.string()), _MISSING_VALUES])
    index = pc.index_in(values, value_set=value_set, skip_nulls=False)
    mapped = pa.array(np.concatenate([rows, [MISSING_ROW, MISSING_ROW]]))
    return pc.take(mapped, index).fill_null(RARE_ROW).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


# What categorical_rows reads as missing, appended to a vocabulary (which never holds them: values are counted
# only when present).
_MISSING_VALUES = pa.array(["", None], pa.string())


def list_rows(values: pa.Array | pa.ChunkedArray, vocabulary: pa.Array, rows: np.ndarray | None,
              max_length: int) -> np.ndarray:
    """Row ids of a list column (one list of raw values a row, newest last) -> int64 [n, max_length], the
    newest `max_length` values right-aligned and the front padded with MISSING_ROW (which the models mask).
    A null list is an empty one; values map as in `categorical_rows`."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    num_rows = len(values)
    lengths = pc.fill_null(pc.list_value_length(values), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(values)
    out = np.full((num_rows, max_length), MISSING_ROW, dtype=np.int64)
    if len(flat) == 0:
        return out
    flat_rows = categorical_rows(flat.cast(pa.string()), vocabulary, rows)
    owner = np.repeat(np.arange(num_rows), lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    from_end = lengths[owner] - 1 - (np.arange(len(flat_rows)) - starts[owner])  # 0 = newest
    keep = from_end < max_length
    out[owner[keep], max_length - 1 - from_end[keep]] = flat_rows[keep]
    return out


def signed_log1p(values: np.ndarray) -> np.ndarray:
    return np.sign(values) * np.log1p(np.abs(values))


def bucket_values(values: np.ndarray, boundaries: Sequence[float]) -> pa.Array:
    """Raw values of a bucketized dense feature (NaN = missing) -> their bucket numbers as strings, the values
    of its derived categorical feature: bucket b holds boundaries[b - 1] <= x < boundaries[b] ("0" below the
    first boundary, str(len(boundaries)) from the last); missing -> "" (the missing row)."""
    values = np.asarray(values, dtype=np.float64)
    buckets = np.searchsorted(np.asarray(boundaries, dtype=np.float64), values, side="right")
    text = pc.cast(pa.array(buckets, pa.int64()), pa.string())
    return pc.if_else(pa.array(np.isnan(values)), "", text)


def transform_dense(values: np.ndarray, state: FeatureState) -> np.ndarray:
    """[n, D] raw dense values of the state's dense features (NaN = missing) -> float32 [n, S + flags]:
    the S scaled (not bucketized) features' standardized values, then the missing flags of those that have one
    (criteo: [n, 13] -> [n, 26])."""
    stats = state.dense_arrays()
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2 or values.shape[1] != len(state.dense):
        values = values.reshape(-1, len(state.dense))
    if len(state.scaled) != len(state.dense):
        values = values[:, [i for i, d in enumerate(state.dense) if not d.bucketized]]
    missing = np.isnan(values)
    filled = np.where(missing, 0.0, values)
    logged = np.where(stats["log"].astype(bool), signed_log1p(filled), filled)
    clipped = np.clip(logged, stats["low"], stats["high"])
    standardized = np.where(missing, 0.0, (clipped - stats["mean"]) / stats["std"])
    flags = missing[:, stats["indicator"].astype(bool)]
    return np.concatenate([standardized, flags.astype(np.float64)], axis=1).astype(np.float32)
