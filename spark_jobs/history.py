"""History features: the last K values of a column for the same key in rows strictly before the row's time.

A spec declares one as a sequence with `history:` (components/feature_spec.py):

    {name: liked_items, kind: sequence, shares: item_id, max_length: 20,
     history: {key: user_id, value: item_id, positive_only: true}}

The rule, the same in the daily and the minute runs (`add_history`): a row with key u at time t gets the
`value`s of the rows with key u and a time < t (label 1 only with `positive_only`), ordered by time and then
by value, the newest `max_length` kept, newest last. The time is the spec's timestamp in whole seconds, or
the partition's minute when the spec has none (`event_seconds`). Ties: rows at the same time never see each
other, so a row never sees its own label, nor a later one, nor one of its own second (a page of results
shown and rated together). A row without a key gets an empty sequence.

Point in time across runs: a history state holds, for every key, its last `max_length` (time, value) pairs
among the rows before the state's minute (`advance_state`). A run over `minutes` continues the newest state
at or before its first minute (`rows_with_history`): it reads the raw minutes from that state's minute (or
from `since`, the start of its interval, when there is none) to its last minute, computes every history from
the state and those rows, keeps the rows of `minutes`, and writes the state at its last minute's end. The
daily run's features and train split leave a state at the end of the training minutes that its eval split
continues; the state at the end of the day seeds the next day's run and the minute runs, and every minute run
leaves the state its successor continues. A raw minute written after a later state was made is not in that
state's histories (raw partitions are immutable and written in order, so this is a late arrival).

States live under <data_root>/history_state/<spec>-<settings hash>/<YYYYmmddTHHMM>/ (one Parquet folder per
history feature and a manifest); the hash covers what a state depends on (the history settings, max_length,
the label and the time rule), not the vocabularies, so `--set features.min_count=2` continues the same states.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from pathlib import Path

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from components.feature_spec import FeatureSpec, SequenceFeature
from components.manifest import ManifestError, commit_dir, read_manifest, staging_dir, write_manifest
from spark_jobs.raw import LABEL, MINUTE_COLUMN, epoch_seconds

# The row's time in whole UTC seconds, carried from the raw frame to the history (dropped before returning).
EVENT_SECONDS = "_event_seconds"
STATE_KIND = "history_state"
STATE_DIR = "history_state"
STATE_KEY = "key"  # the state's own columns: a key's value, and its last (time, value) pairs oldest first
STATE_ITEMS = "items"
_ITEM_TYPE = "array<struct<t:bigint,v:string>>"
_KIND, _ORDER, _RECENT, _SEED = "_history_kind", "_history_order", "_history_recent", "_history_seed"


def event_seconds(spec: FeatureSpec) -> Column:
    """The row's time on the raw frame (extract_raw's columns): the spec's timestamp in whole seconds, or the
    start of the partition's minute when the spec has none."""
    if spec.timestamp is not None:
        return epoch_seconds(F.col(spec.timestamp.column), spec.timestamp)
    return F.unix_timestamp(F.col(MINUTE_COLUMN), "yyyy-MM-dd HH:mm")


def _empty_items() -> Column:
    return F.array().cast(_ITEM_TYPE)


def _last(items: Column, k: int) -> Column:
    return F.slice(items, F.greatest(F.size(items) - (k - 1), F.lit(1)), k)


def history_events(rows: DataFrame, feature: SequenceFeature, *, time: str = EVENT_SECONDS) -> DataFrame:
    """The rows that enter `feature`'s histories, as (key, time, value): a key and a value, label 1 with
    positive_only."""
    history = feature.history
    assert history is not None, f"{feature.name} declares no history"
    events = rows.where(F.col(history.key).isNotNull() & F.col(history.value).isNotNull())
    if history.positive_only:
        events = events.where(F.col(LABEL) == 1)
    return events.select(F.col(history.key).alias(STATE_KEY), F.col(time).cast("long").alias("t"),
                         F.col(history.value).cast("string").alias("v"))


def add_history(rows: DataFrame, feature: SequenceFeature, *, time: str = EVENT_SECONDS,
                seed: DataFrame | None = None) -> DataFrame:
    """`rows` with `feature.name`: array<string>, the newest `max_length` values of the earlier rows with the
    same key (the module's rule), newest last. `seed` (a history state: key, items) holds each key's pairs from
    before `rows`; its pairs at or after a row's time are not that row's history.

    Each event (history_events) gets its key's k newest pairs up to and including it (a sliding window); each
    row then takes the list of its key's latest event on one timeline per key where, at equal times, rows sort
    before events: a row sees exactly the events of earlier times."""
    history = feature.history
    assert history is not None, f"{feature.name} declares no history"
    k = feature.max_length
    events = history_events(rows, feature, time=time)
    by_time = Window.partitionBy(STATE_KEY).orderBy("t", "v")
    recent = events.select(
        F.col(STATE_KEY).alias(history.key), F.col("t").alias(time), F.lit(1).alias(_KIND),
        F.row_number().over(by_time).alias(_ORDER),
        F.collect_list(F.struct("t", "v")).over(by_time.rowsBetween(-(k - 1), Window.currentRow)).alias(_RECENT),
    )
    timeline = (Window.partitionBy(history.key).orderBy(time, _KIND, _ORDER)
                .rowsBetween(Window.unboundedPreceding, Window.currentRow))
    marked = rows.withColumn(_KIND, F.lit(0)).withColumn(_ORDER, F.lit(0))
    combined = (marked.unionByName(recent, allowMissingColumns=True)
                .withColumn(_RECENT, F.last(_RECENT, ignorenulls=True).over(timeline))
                .where(F.col(_KIND) == 0).drop(_KIND, _ORDER))
    items = F.coalesce(F.col(_RECENT), _empty_items())
    if seed is not None:
        earlier = seed.select(F.col(STATE_KEY).alias(history.key), F.col(STATE_ITEMS).alias(_SEED))
        combined = combined.join(earlier, history.key, "left")
        before = F.filter(F.coalesce(F.col(_SEED), _empty_items()), lambda pair: pair["t"] < F.col(time))
        items = F.array_sort(F.concat(before, items))
    values = F.transform(_last(items, k), lambda pair: pair["v"])
    sequence = F.when(F.col(history.key).isNull(), F.array().cast("array<string>")).otherwise(values)
    return combined.select(*rows.columns, sequence.alias(feature.name))  # the columns of `rows` in their order


def advance_state(seed: DataFrame | None, rows: DataFrame, feature: SequenceFeature, *,
                  time: str = EVENT_SECONDS) -> DataFrame:
    """The history state after `rows`: each key's newest `max_length` (time, value) pairs of `seed` (a state
    from before `rows`, or None) and of the rows' events, oldest first (key, items)."""
    k = feature.max_length
    added = (history_events(rows, feature, time=time).groupBy(STATE_KEY)
             .agg(F.collect_list(F.struct("t", "v")).alias("_added")))
    if seed is None:
        return added.select(STATE_KEY, _last(F.array_sort("_added"), k).alias(STATE_ITEMS))
    merged = seed.select(STATE_KEY, F.col(STATE_ITEMS).alias(_SEED)).join(added, STATE_KEY, "full")
    items = F.concat(F.coalesce(F.col(_SEED), _empty_items()), F.coalesce(F.col("_added"), _empty_items()))
    return merged.select(STATE_KEY, _last(F.array_sort(items), k).alias(STATE_ITEMS))


# ------------------------------------------------------------------------------------------- states on disk


def state_settings(spec: FeatureSpec) -> dict:
    """What a history state depends on: its features' settings, the label and the time rule."""
    timestamp = spec.timestamp
    return {
        "label": spec.label.column,
        "time": {"column": timestamp.column, "format": timestamp.format} if timestamp else "minute",
        "features": {f.name: {"max_length": f.max_length, "key": f.history.key, "value": f.history.value,  # type: ignore[union-attr]
                              "positive_only": f.history.positive_only} for f in spec.histories},  # type: ignore[union-attr]
    }


def states_root(data_root: Path, spec: FeatureSpec) -> Path:
    digest = hashlib.sha256(json.dumps(state_settings(spec), sort_keys=True).encode()).hexdigest()[:12]
    return Path(data_root) / STATE_DIR / f"{spec.name}-{digest}"


def _tag(minute: datetime) -> str:
    return f"{minute:%Y%m%dT%H%M}"


def newest_state(data_root: Path, spec: FeatureSpec, at_or_before: datetime) -> tuple[datetime, Path] | None:
    """(its minute, its folder) of the newest committed history state at or before `at_or_before`."""
    root = states_root(data_root, spec)
    if not root.is_dir():
        return None
    limit = _tag(at_or_before)
    for folder in sorted((p for p in root.iterdir() if not p.name.startswith(".") and p.name <= limit),
                         reverse=True):
        try:
            read_manifest(folder, kind=STATE_KIND, verify=False)
        except ManifestError:
            continue
        as_of = datetime.strptime(folder.name, "%Y%m%dT%H%M").replace(tzinfo=at_or_before.tzinfo)
        return as_of, folder
    return None


def _state_inputs(data_root: Path, spec: FeatureSpec, as_of: datetime) -> dict | None:
    """The inputs (start, end, seed) of the committed state at `as_of`, or None when there is none."""
    try:
        manifest = read_manifest(states_root(data_root, spec) / _tag(as_of), kind=STATE_KIND)
    except ManifestError:
        return None
    return {key: manifest["inputs"].get(key) for key in ("start", "end", "seed")}


def read_state(spark: SparkSession, folder: Path, feature: SequenceFeature) -> DataFrame:
    return spark.read.parquet(str(folder / feature.name))


def write_state(states: dict[str, DataFrame], data_root: Path, spec: FeatureSpec, as_of: datetime, *,
                inputs: dict) -> Path:
    """Commits the states (feature name -> key, items) at minute `as_of` with their manifest."""
    final = states_root(data_root, spec) / _tag(as_of)
    staging = staging_dir(final)
    counts = {}
    for name, frame in states.items():
        frame.coalesce(1).write.parquet(str(staging / name))
        counts[name] = spark_rows(staging / name)
    files = [str(p.relative_to(staging)) for p in sorted(staging.rglob("*.parquet"))]
    write_manifest(staging, kind=STATE_KIND, version=_tag(as_of), files=files,
                   inputs={**inputs, "settings": state_settings(spec)}, row_counts=counts)
    return commit_dir(staging, final)


def spark_rows(folder: Path) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(path).metadata.num_rows for path in sorted(folder.glob("*.parquet")))


def rows_with_history(spark: SparkSession, data_root: Path, spec: FeatureSpec, minutes: Sequence[datetime], *,
                      since: datetime, read: Callable[[list[datetime]], DataFrame | None]) -> DataFrame | None:
    """The rows of `minutes` with every history feature of `spec` (the module's doc: continued from the newest
    state at or before the first minute, else from `since`), and the state at the end of the last minute
    written. `read(minutes)` gives the parsed rows of those minutes with EVENT_SECONDS (None when none has
    data). The result has the columns of `read`'s frame but EVENT_SECONDS, plus the history features."""
    wanted = sorted(minutes)
    if not wanted:
        return None
    first, end = wanted[0], wanted[-1] + timedelta(minutes=1)
    found = newest_state(data_root, spec, first)
    start = found[0] if found else min(since, first)
    span = [start + timedelta(minutes=i) for i in range(int((end - start).total_seconds() // 60))]
    rows = read(span)
    if rows is None:
        return None
    seeds = {f.name: read_state(spark, found[1], f) if found else None for f in spec.histories}
    with_history = rows
    for feature in spec.histories:
        with_history = add_history(with_history, feature, seed=seeds[feature.name])
    inputs = {"start": start.isoformat(), "end": end.isoformat(), "seed": found[1].name if found else None}
    if _state_inputs(data_root, spec, end) != inputs:  # the same inputs made the same state (raw is immutable)
        write_state({f.name: advance_state(seeds[f.name], rows, f) for f in spec.histories}, data_root, spec, end,
                    inputs=inputs)
    labels = [f"{m:%Y-%m-%d %H:%M}" for m in wanted]
    keep = F.col(MINUTE_COLUMN).isin(labels) if len(labels) < len(span) else F.lit(True)
    return with_history.where(keep).drop(EVENT_SECONDS)
