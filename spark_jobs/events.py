"""Impression x click join with an attribution window, and point-in-time behaviour sequences.

extract (event-time minute partitions of both streams) -> pure transforms -> load (Parquet + manifest):

    impressions -- one per request_id --+
                                        +-- full outer join on request_id -- label, click status -- samples
    clicks ------- one per request_id --+                                                     \\-- metrics
    samples + their attributed clicks -- last K clicked items strictly before each impression -- history

Label: 1 iff the request's click has impression.ts <= click.ts <= impression.ts + W. Every distinct click is
counted in exactly one of attributed / late (after W) / early (before its impression: clock skew, label 0) /
orphan (no impression among those read), so none is dropped silently.

Finality: minute t's samples need every click up to t + 1m + W, so a minute is final once the click stream is
complete that far (`final_until`). A run producing `span` reads impressions from span.start - lookback and
clicks from span.start - lookback to span.end + W (`plan_join`): the lookback feeds behaviour sequences and
tells late clicks from orphans. Samples and metrics are kept for `span` only; impression counts belong to the
impression's minute and click counts to the click's minute, so consecutive runs count every record once.

Runnable with spark-submit:

    spark-submit spark_jobs/events.py --data-root var --start 2026-01-01T00:00 --end 2026-01-01T01:00 \\
        --output var/joined/20260101T0000-20260101T0100
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute
import pyarrow.parquet as pq
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from components.events import (
    CLICK_SCHEMA,
    CLICK_TS,
    CLICKS,
    HISTORY,
    IMPRESSIONS,
    ITEM_ID,
    KEY_SCHEMA,
    LABEL,
    REQUEST_ID,
    TS,
    USER_ID,
    final_until,
    impression_payload,
    impression_schema,
    stream_problems,
    stream_watermark,
)
from components.feature_spec import FeatureSpec
from components.interval import Interval
from components.layout import Layout
from components.manifest import MANIFEST_NAME, commit_dir, staging_dir, write_manifest
from components.synthetic import SUCCESS_MARKER

log = logging.getLogger(__name__)

MINUTE = "minute"
# Impression counts by the impression's minute, click counts by the click's minute.
# clicks = attributed_clicks + late_clicks + early_clicks + orphan_clicks in every minute.
IMPRESSION_METRICS = ("impressions", "duplicate_impressions", "positives")
CLICK_METRICS = ("clicks", "duplicate_clicks", "attributed_clicks", "late_clicks", "early_clicks", "orphan_clicks")
METRIC_COLUMNS = IMPRESSION_METRICS + CLICK_METRICS
JOINED_KIND = "joined_samples"
HISTORY_STATE = "history_state"  # a joined output's folder of each user's last clicked items at its end
# Beside a joined output whose history state was built on an earlier version of a span joined again since:
# no run continues it (read_history_state), so the next one builds its sequences from the lookback.
STALE_STATE_MARKER = "history_state.stale.json"
LOOKBACK = "lookback"
_ARROW_TO_SPARK = {pa.string(): "string", pa.large_string(): "string", pa.int64(): "bigint", pa.int32(): "int",
                   pa.int16(): "smallint", pa.int8(): "tinyint", pa.uint8(): "smallint", pa.uint16(): "int",
                   pa.uint32(): "bigint", pa.float64(): "double", pa.float32(): "float", pa.bool_(): "boolean"}


class EventInputError(ValueError):
    """A raw event partition is missing, incomplete, or not in the expected schema."""


def sample_columns(spec: FeatureSpec) -> tuple[str, ...]:
    """The joined samples' columns: the label, the impression columns `spec` reads, the join's keys and the
    behaviour sequence."""
    return (LABEL, *impression_payload(spec), USER_ID, ITEM_ID, REQUEST_ID, TS, HISTORY)


# ---------------------------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class JoinPlan:
    span: Interval  # minutes whose samples and metrics the run produces
    impressions: Interval  # impression partitions read
    clicks: Interval  # click partitions read

    def impression_minutes(self) -> list[datetime]:
        return list(self.impressions.minutes())

    def click_minutes(self) -> list[datetime]:
        return list(self.clicks.minutes())


def plan_join(span: Interval, window_s: int, lookback_s: int) -> JoinPlan:
    lookback = timedelta(seconds=lookback_s)
    return JoinPlan(
        span=span,
        impressions=Interval(span.start - lookback, span.end),
        clicks=Interval(span.start - lookback, span.end + timedelta(seconds=window_s)),
    )


# ---------------------------------------------------------------------------------------------- extract


def event_files(layout: Layout, stream: str, minutes: Iterable[datetime], spec: FeatureSpec | None) -> list[str]:
    """The data files of the given minute partitions, after checking each is complete, has what the join and
    `spec` read (check_event_schema; with no spec, the join's keys: a lookback's impressions are read for those
    alone), with the same types as the first."""
    files: list[str] = []
    first: pa.Schema | None = None
    for minute in minutes:
        directory = layout.raw_events_minute_dir(stream, minute)
        if _quarantined(layout, stream, minute):  # failed validation: moved out, read as an empty minute
            continue
        if not (directory / SUCCESS_MARKER).exists():
            raise EventInputError(
                f"{stream} minute {minute:%Y-%m-%d %H:%M} is not complete: {directory} has no {SUCCESS_MARKER} "
                "marker. Wait for the writer to finish (or re-run it), or join only minutes before "
                "final_until(watermark)"
            )
        for path in sorted(directory.glob("part-*.parquet")):
            read = check_event_schema(path, stream, spec)
            if first is None:
                first = read
            elif read != first:
                changed = [f"{field.name!r} is {read.field(field.name).type} where {files[0]} has {field.type}"
                           for field in first if read.field(field.name).type != field.type]
                raise EventInputError(
                    f"{path} does not match the {stream} files before it in the same join: column "
                    f"{'; '.join(changed)}. Write every partition with one type per column, or join the spans "
                    "apart")
            files.append(str(path))
    return files


def _quarantined(layout: Layout, stream: str, minute: datetime) -> bool:
    return (layout.quarantine_events_minute_dir(stream, minute) / "report.json").exists()


def check_event_schema(path: Path, stream: str, spec: FeatureSpec | None) -> pa.Schema:
    """Reads the Parquet footer only; raises with every missing or mistyped column, else returns the schema the
    join reads the file in (its keys and the columns `spec` reads, as typed in the file)."""
    actual = pq.read_schema(path)
    problems = stream_problems(stream, actual, spec)
    if not problems:
        schema = read_schema(stream, spec, actual)
        problems = [f"column {field.name!r} is {field.type}, a type the join does not read; write it as "
                    "string, an integer or a floating-point type" for field in schema
                    if not _readable(field.type)]
    if problems:
        raise EventInputError(
            f"{path} is not a valid {stream} file{f' for feature spec {spec.name!r}' if spec else ''}: "
            f"{'; '.join(problems)} (it has "
            f"{len(actual.names)} columns: {', '.join(actual.names[:8])}{', ...' if len(actual.names) > 8 else ''}). "
            "Fix the producer and rewrite the partition, or move it to quarantine; a column the stream does not "
            "carry must leave the feature spec"
        )
    return schema


def read_schema(stream: str, spec: FeatureSpec | None, actual: pa.Schema | None = None) -> pa.Schema:
    """The columns the join reads from a `stream` file of schema `actual` (without a spec, the keys); without a
    file to read, the impression columns typed as the empty frame has them: numbers as double, lists of ids as
    lists of strings, the rest as string."""
    if stream == CLICKS:
        return CLICK_SCHEMA
    if spec is None:
        return KEY_SCHEMA
    if actual is None:
        dense, lists = {f.column for f in spec.dense}, {f.column for f in spec.lists}
        actual = pa.schema([(name, pa.float64() if name in dense else pa.list_(pa.string()) if name in lists
                             else pa.string()) for name in impression_payload(spec)])
    return impression_schema(spec, actual)


def spark_schema(schema: pa.Schema) -> str:
    return ", ".join(f"{field.name} {_spark_type(field.type)}" for field in schema)


def _readable(kind: pa.DataType) -> bool:
    return _readable(kind.value_type) if pa.types.is_list(kind) else kind in _ARROW_TO_SPARK


def _spark_type(kind: pa.DataType) -> str:
    return f"array<{_spark_type(kind.value_type)}>" if pa.types.is_list(kind) else _ARROW_TO_SPARK[kind]


def extract_events(spark: SparkSession, layout: Layout, stream: str, minutes: Iterable[datetime],
                   spec: FeatureSpec | None) -> DataFrame:
    return read_events(spark, stream, event_files(layout, stream, minutes, spec), spec)


def read_events(spark: SparkSession, stream: str, files: list[str], spec: FeatureSpec | None) -> DataFrame:
    """`files` (event_files' checked list) of `stream` as a DataFrame of the columns the join and `spec` read
    (the keys without a spec), typed as in the first file."""
    if not files:
        return spark.createDataFrame([], spark_schema(read_schema(stream, spec)))
    return spark.read.schema(spark_schema(read_schema(stream, spec, pq.read_schema(files[0])))).parquet(*files)


# ---------------------------------------------------------------------------------------------- transforms


def minute_of(ts_ms: Column) -> Column:
    """Epoch milliseconds -> the start of their minute, also in epoch milliseconds."""
    return (F.floor(ts_ms / 60_000) * 60_000).cast("long")


def minute_label(minute_ms: Column) -> Column:
    """Epoch milliseconds of a minute -> 'YYYY-MM-DD HH:MM' in UTC, whatever the session time zone."""
    minutes = F.floor(minute_ms / 60_000)
    days = F.floor(minutes / 1440)
    of_day = minutes - days * 1440
    date = F.date_add(F.lit("1970-01-01").cast("date"), days.cast("int")).cast("string")
    return F.format_string("%s %02d:%02d", date, F.floor(of_day / 60).cast("int"), (of_day % 60).cast("int"))


def join_events(impressions: DataFrame, clicks: DataFrame, window_s: int) -> tuple[DataFrame, DataFrame]:
    """Labels every distinct impression and classifies every distinct click; returns (samples, metrics).

    impressions: request_id, ts (epoch ms) and any payload columns, which are passed through.
    clicks: request_id, ts. Both may hold duplicate deliveries. A request with several clicks keeps its
    earliest; the others count as duplicate clicks. Duplicates are counted in the minute of the kept delivery.
    samples: label, the payload columns, request_id, ts, click_ts. metrics: one row per minute, METRIC_COLUMNS.
    The inputs are the whole world: a click whose impression is not in `impressions` is an orphan.
    """
    classified = classify_events(impressions, clicks, window_s)
    samples = attach_payload(impressions, joined_samples(classified))
    return samples.select(LABEL, *_payload(impressions), REQUEST_ID, TS, CLICK_TS), joined_metrics(classified)


def _keys(impressions: DataFrame) -> list[str]:
    """The impression columns the narrow join carries: the user and item, when present (behaviour sequences)."""
    return [name for name in (USER_ID, ITEM_ID) if name in impressions.columns]


def classify_events(impressions: DataFrame, clicks: DataFrame, window_s: int) -> DataFrame:
    """Distinct impressions full-outer-joined with distinct clicks, each row with its click `_status`
    (attributed, late, early, orphan, or null without a click): what join_events' samples and metrics are
    both read from (a job that needs both can persist it once).

    Narrow: only request_id, ts and the user and item of each impression take part, so the shuffles move
    keys, not the wide payload (attach_payload joins that back once). Deliveries of one impression are copies;
    the earliest is kept, ties broken by user and item, so a re-run picks the same one even if a redelivery
    differs (attach_payload breaks any remaining tie by a hash of the whole row).
    """
    if window_s < 0:
        raise ValueError(f"attribution window must be >= 0 seconds, got {window_s!r}")
    window_ms = int(round(window_s * 1000))
    keys = _keys(impressions)
    distinct_impressions = (
        impressions.groupBy(REQUEST_ID)
        .agg(F.min(F.struct(TS, *keys)).alias("_first"), F.count(F.lit(1)).alias("_impression_deliveries"))
        .select(REQUEST_ID, *[F.col(f"_first.{name}").alias(name) for name in (TS, *keys)],
                "_impression_deliveries", F.lit(True).alias("_impression"))
    )
    distinct_clicks = clicks.groupBy(REQUEST_ID).agg(
        F.min(TS).alias("_click_ts"), F.count(F.lit(1)).alias("_click_deliveries")
    )
    delay = F.col("_click_ts") - F.col(TS)
    status = (
        F.when(F.col("_click_ts").isNull(), F.lit(None))
        .when(F.col("_impression").isNull(), F.lit("orphan"))
        .when(delay < 0, F.lit("early"))
        .when(delay <= window_ms, F.lit("attributed"))
        .otherwise(F.lit("late"))
    )
    return distinct_impressions.join(distinct_clicks, REQUEST_ID, "full").withColumn("_status", status)


_BOOKKEEPING = ("_impression_deliveries", "_impression", "_click_ts", "_click_deliveries", "_status")


def _payload(frame: DataFrame) -> list[str]:
    return [name for name in frame.columns if name not in (REQUEST_ID, TS, *_BOOKKEEPING)]


def _attributed() -> Column:
    return F.coalesce(F.col("_status") == "attributed", F.lit(False))  # no click: status is null


def joined_samples(classified: DataFrame) -> DataFrame:
    """classify_events' rows with an impression, narrow: label, user and item (when known), request_id, ts,
    click_ts. attach_payload adds the impression's other columns."""
    attributed = _attributed()
    return classified.where(F.col("_impression")).select(
        attributed.cast("int").alias(LABEL), *_payload(classified), REQUEST_ID, TS,
        F.when(attributed, F.col("_click_ts")).alias(CLICK_TS),
    )


def attach_payload(impressions: DataFrame, labelled: DataFrame) -> DataFrame:
    """`labelled` (one narrow row per distinct impression, as joined_samples gives them, with any further
    columns such as `history`) with the payload of the delivery classify_events kept: the earliest, ties
    broken by user and item (as classify_events breaks them), then by a hash of the whole row. Impressions
    absent from `labelled` are dropped.

    The only shuffle of the wide rows: a hash join on (request_id, ts) into spark.sql.shuffle.partitions
    partitions (fewer where adaptive execution merges small ones), which a writer keeps. Each partition
    comes sorted by a hash of the request id, then request id and time: an order unrelated to time, user or
    label that a re-run reproduces, which the sample writer keeps instead of shuffling the rows again.
    """
    keys = [REQUEST_ID, TS]
    carried = _keys(impressions)  # the wide rows bring their own user and item
    wide = impressions.withColumn("_row", F.xxhash64(*impressions.columns))
    # Renamed and dropped on the server: asking for `labelled`'s columns here took a 0.46 s analysis of its
    # plan (sequences, the seed's read) through Spark Connect in a minute run.
    narrow = labelled.drop(*carried).withColumnsRenamed({name: f"_k_{name}" for name in keys})
    # A hash join: the wide rows are not sorted for the join, only once below.
    joined = wide.join(narrow.hint("shuffle_hash"), [wide[name] == narrow[f"_k_{name}"] for name in keys])
    # Deliveries at the kept time share the keys, so they sit in one partition: this adds no shuffle, only
    # the sort that also puts each partition in hash order. Struct minimum (classify_events) and this
    # ordering both put nulls first.
    first = (Window.partitionBy(F.xxhash64(REQUEST_ID), *keys)
             .orderBy(*[F.col(name).asc_nulls_first() for name in carried], "_row"))
    return (
        joined.withColumn("_delivery", F.row_number().over(first))
        .where(F.col("_delivery") == 1)
        .drop("_delivery", "_row", *[f"_k_{name}" for name in keys])
    )


def joined_metrics(joined: DataFrame) -> DataFrame:
    """classify_events' rows counted per minute: impressions by the impression's minute, clicks by the click's."""
    attributed = _attributed()

    def is_status(name: str) -> Column:
        return (F.col("_status") == name).cast("long")

    zero = F.lit(0).cast("long")
    impression_counts = F.struct(
        minute_of(F.col(TS)).alias(MINUTE), F.lit(1).cast("long").alias("impressions"),
        (F.col("_impression_deliveries") - 1).alias("duplicate_impressions"),
        attributed.cast("long").alias("positives"),
        *[zero.alias(name) for name in CLICK_METRICS],
    )
    click_counts = F.struct(
        minute_of(F.col("_click_ts")).alias(MINUTE), *[zero.alias(name) for name in IMPRESSION_METRICS],
        F.lit(1).cast("long").alias("clicks"), (F.col("_click_deliveries") - 1).alias("duplicate_clicks"),
        is_status("attributed").alias("attributed_clicks"), is_status("late").alias("late_clicks"),
        is_status("early").alias("early_clicks"), is_status("orphan").alias("orphan_clicks"),
    )
    return (
        joined.select(F.explode(F.array(
            F.when(F.col("_impression"), impression_counts), F.when(F.col("_click_ts").isNotNull(), click_counts)
        )).alias("counts"))
        .where(F.col("counts").isNotNull())
        .select("counts.*")
        .groupBy(MINUTE)
        .agg(*[F.sum(name).cast("long").alias(name) for name in METRIC_COLUMNS])
    )


def attributed_clicks(samples: DataFrame) -> DataFrame:
    """The clicks that made a label 1, as (user_id, item_id, ts = click time, request_id).

    Only attributed clicks enter behaviour sequences. A click's item and user are known only through its
    impression, so orphans cannot be used. Late clicks are left out so that a sequence is built from the same
    clicks as the labels; serving must apply the same rule (drop clicks more than W after their impression)
    to the user history it reads, or training and serving see different sequences. Whether a click is
    attributed is known the moment it arrives (both times are known then), so using only attributed clicks
    leaks nothing from after the impression.
    """
    return samples.where(F.col(LABEL) == 1).select(USER_ID, ITEM_ID, F.col(CLICK_TS).alias(TS), REQUEST_ID)


def last_items(items: Column, k: int) -> Column:
    """The last `k` elements of an array (all of it when it is shorter)."""
    return F.slice(items, F.greatest(F.size(items) - (k - 1), F.lit(1)), k)


def _empty_history() -> Column:
    return F.array().cast("array<string>")


def behaviour_sequences(samples: DataFrame, clicks: DataFrame, k: int, seed: DataFrame | None = None) -> DataFrame:
    """Adds `history`: the user's last `k` clicked item ids with click time strictly before the sample's ts,
    the most recent last (ties in click time ordered by request_id).

    The click time, not the time of the clicked impression, decides "before": an impression shown before this
    one but clicked after it must not be in its history. Each click gets the sequence of the k clicks up to
    and including it (a sliding window), then each sample takes the sequence of the user's latest earlier
    click (a running `last`) on one timeline per user where, at equal times, samples sort before clicks.

    `seed` (user_id, history), when given, holds each user's sequence before every click in `clicks` and
    every sample (a history state, advance_history): a sample's sequence is the last `k` of the seed's
    followed by its own.
    """
    if k < 1:
        raise ValueError(f"sequence length must be at least 1, got {k!r}")
    by_click_time = Window.partitionBy(USER_ID).orderBy(TS, REQUEST_ID)
    recent = clicks.select(
        USER_ID, TS, F.lit(1).alias("_kind"), F.row_number().over(by_click_time).alias("_order"),
        F.collect_list(ITEM_ID).over(by_click_time.rowsBetween(-(k - 1), Window.currentRow)).alias("_recent"),
    )
    timeline = (
        Window.partitionBy(USER_ID).orderBy(TS, "_kind", "_order")
        .rowsBetween(Window.unboundedPreceding, Window.currentRow)
    )
    events = samples.withColumn("_kind", F.lit(0)).withColumn("_order", F.lit(0))
    sequences = (
        events.unionByName(recent, allowMissingColumns=True)
        .withColumn(HISTORY, F.coalesce(F.last("_recent", ignorenulls=True).over(timeline), _empty_history()))
        .where(F.col("_kind") == 0)
        .drop("_kind", "_order", "_recent")
    )
    if seed is None:
        return sequences
    earlier = seed.select(USER_ID, F.col(HISTORY).alias("_seed"))
    return (sequences.join(earlier, USER_ID, "left")
            .withColumn(HISTORY, last_items(F.concat(F.coalesce(F.col("_seed"), _empty_history()), F.col(HISTORY)), k))
            .drop("_seed"))


def last_clicked(clicks: DataFrame, k: int) -> DataFrame:
    """A history state from scratch: user_id, history (the user's last `k` items among `clicks`, attributed_
    clicks' columns, by click time then request id, the most recent last)."""
    ordered = F.sort_array(F.collect_list(F.struct(TS, REQUEST_ID, ITEM_ID)))  # by click time, then request id
    added = clicks.groupBy(USER_ID).agg(F.transform(ordered, lambda click: click[ITEM_ID]).alias("_added"))
    return added.select(USER_ID, last_items(F.col("_added"), k).alias(HISTORY))


HISTORY_STATE_SCHEMA = pa.schema([(USER_ID, pa.string()), (HISTORY, pa.list_(pa.string()))])


def advance_history(seed: pa.Table, clicks: pa.Table, k: int) -> pa.Table:
    """The history state `seed` (HISTORY_STATE_SCHEMA) after `clicks` (attributed_clicks' columns, all later
    than every click the seed holds), on the client: a minute run's few thousand clicks, where a Spark job
    (last_clicked's grouping, a full join with the seed, a write) cost about 0.5 s through Spark Connect.
    Each user with new clicks gets the last `k` of their seed's items followed by the new ones (by click
    time, then request id), appended by user id; the others keep their row and its place. Clicks without a
    user are left out (a sequence is looked up by user)."""
    clicks = clicks.filter(pa.compute.is_valid(clicks[USER_ID]))
    order = pa.compute.sort_indices(clicks, [(name, "ascending") for name in (USER_ID, TS, REQUEST_ID, ITEM_ID)])
    added: dict[str, list[str]] = {}
    for user, item in zip(clicks[USER_ID].take(order).to_pylist(), clicks[ITEM_ID].take(order).to_pylist(),
                          strict=True):
        added.setdefault(user, []).append(item)
    seed = seed.select(HISTORY_STATE_SCHEMA.names).cast(HISTORY_STATE_SCHEMA)
    changed = pa.compute.is_in(seed[USER_ID], value_set=pa.array(list(added), pa.string()))
    before = dict(zip(*(seed.filter(changed)[name].to_pylist() for name in HISTORY_STATE_SCHEMA.names),
                      strict=True))
    users = list(added)  # by user id: the clicks were sorted so
    return pa.concat_tables([
        seed.filter(pa.compute.invert(changed)),
        pa.table({USER_ID: users, HISTORY: [(before.get(user, []) + added[user])[-k:] for user in users]},
                 schema=HISTORY_STATE_SCHEMA),
    ])


def ms_at_least(column: str, bound_ms: int) -> Column:
    """`column` (epoch milliseconds) >= bound_ms, with the bound out of Spark's generated code.

    Spark compiles a long literal into the Java code of the stage that compares with it, and keeps compiled
    classes by their code: with a long bound, every minute run compiled its own classes (17 a minute, 0.3-0.5 s,
    counted in the Connect server's log) where a re-run of the same minute compiled one. A decimal literal is
    passed to the code as a reference instead, so the code is the same for every minute. decimal(18, 0) holds
    every epoch millisecond before the year 31 million, and is narrower than a long, so Spark's optimizer does
    not turn the comparison back into one of longs."""
    return F.col(column).cast("decimal(18,0)") >= F.lit(Decimal(bound_ms))


def ms_in(column: str, start_ms: int, end_ms: int) -> Column:
    """start_ms <= `column` < end_ms (epoch milliseconds), the bounds out of the generated code (ms_at_least)."""
    return ms_at_least(column, start_ms) & ~ms_at_least(column, end_ms)


def _in_span(frame: DataFrame, column: str, span: Interval) -> DataFrame:
    start, end = (int(t.timestamp() * 1000) for t in (span.start, span.end))
    return frame.where(ms_in(column, start, end))


def build_samples(impressions: DataFrame, clicks: DataFrame, *, window_s: int, sequence_length: int,
                  span: Interval, spec: FeatureSpec, classified: DataFrame | None = None,
                  seed: DataFrame | None = None) -> tuple[DataFrame, DataFrame]:
    """The run's samples (sample_columns(spec), ts in `span`) and metrics (minutes in `span`), from inputs read
    according to `plan_join`. Metrics carry the minute as 'YYYY-MM-DD HH:MM'. `classified`: classify_events
    of the same inputs, already computed (persisted), to read instead of joining again.

    Behaviour sequences come from the attributed clicks among the inputs or, given `seed` (the history state
    at the span's start, history_state), from the seed and the attributed clicks in the span.

    Labels and behaviour sequences are computed on narrow rows; the span's wide impressions are shuffled
    once, to meet them."""
    classified = classified if classified is not None else classify_events(impressions, clicks, window_s)
    labelled = joined_samples(classified)
    clicked = attributed_clicks(labelled) if seed is None else _in_span(attributed_clicks(labelled), TS, span)
    with_history = behaviour_sequences(_in_span(labelled, TS, span), clicked, sequence_length, seed)
    samples = attach_payload(_in_span(impressions, TS, span), with_history)
    metrics = _in_span(joined_metrics(classified), MINUTE, span).withColumn(MINUTE, minute_label(F.col(MINUTE)))
    return samples.select(*sample_columns(spec)), metrics


def history_state(classified: DataFrame, *, sequence_length: int, span: Interval) -> DataFrame:
    """Each user's last `sequence_length` clicked items at the span's end, from the attributed clicks among
    the inputs before it (the lookback's and the span's). A run that continues a state adds the span's clicks
    to it instead (span_clicks, advance_history)."""
    end = int(span.end.timestamp() * 1000)
    return last_clicked(attributed_clicks(joined_samples(classified)).where(~ms_at_least(TS, end)), sequence_length)


def span_clicks(classified: DataFrame, span: Interval) -> pa.Table:
    """The attributed clicks with a click time in the span, on the client (attributed_clicks' columns)."""
    return _in_span(attributed_clicks(joined_samples(classified)), TS, span).toArrow()


def collect_metrics(metrics: DataFrame) -> dict[str, Any]:
    """Totals of every metric plus the per-minute rows ('YYYY-MM-DD HH:MM'), ready for logs and MLflow."""
    rows = sorted((row.asDict() for row in metrics.collect()), key=lambda row: row[MINUTE])
    for row in rows:
        if isinstance(row[MINUTE], int):  # straight from join_events: epoch milliseconds
            row[MINUTE] = datetime.fromtimestamp(row[MINUTE] / 1000, UTC).strftime("%Y-%m-%d %H:%M")
    return {**{name: sum(row[name] for row in rows) for name in METRIC_COLUMNS}, "per_minute": rows}


# ---------------------------------------------------------------------------------------------- load


def write_joined(samples: DataFrame, metrics: dict[str, Any], directory: Path, *, inputs: dict,
                 columns: Sequence[str], history: DataFrame | pa.Table | None = None,
                 history_from: str = LOOKBACK) -> dict:
    """Writes samples as Parquet (a file per partition), the history state (history_state: a Spark frame, or
    a table made on the client) as one Parquet file and the metrics as JSON, then the manifest, and renames
    into place. `history_from` names what the state was built from: the span before's state (its tag) or the
    lookback."""
    staging = staging_dir(directory)
    samples.write.parquet(str(staging / "samples"))
    if isinstance(history, pa.Table):
        (staging / HISTORY_STATE).mkdir()
        pq.write_table(history, staging / HISTORY_STATE / "part-00000.parquet")
    elif history is not None:
        history.coalesce(1).write.parquet(str(staging / HISTORY_STATE))
    (staging / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
    files = sorted(str(path.relative_to(staging)) for folder in ("samples", HISTORY_STATE)
                   for path in (staging / folder).glob("part-*.parquet"))
    manifest = write_manifest(
        staging, kind=JOINED_KIND, version=inputs.get("span", ""), files=[*files, "metrics.json"], inputs=inputs,
        row_counts={"rows": metrics["impressions"], "positives": metrics["positives"]},
        extra={"columns": list(columns), "format": "parquet",
               **({"history_state": {"as_of": inputs.get("end"), "from": history_from}} if history is not None
                  else {})},
    )
    commit_dir(staging, directory)
    return manifest


def read_history_state(previous: Path | None, span: Interval, *, window_s: int,
                       sequence_length: int) -> tuple[list[Path], str] | None:
    """The history state a run over `span` continues, as (its files, the previous span's tag): the one `previous`
    (a joined output) holds when it ends where `span` starts, was made with the same window and sequence
    length, and lists its files. None otherwise: the run then builds sequences from the lookback."""
    from components.manifest import ManifestError, read_manifest

    if previous is None or (previous / STALE_STATE_MARKER).exists():
        return None
    try:
        manifest = read_manifest(previous, kind=JOINED_KIND, verify=False)
    except ManifestError:
        return None
    state, inputs = manifest.get("history_state"), manifest.get("inputs", {})
    if (state is None or state.get("as_of") != span.as_dict()["start"] or inputs.get("window_s") != window_s
            or inputs.get("sequence_length") != sequence_length):
        return None
    files = [previous / name for name in manifest["files"] if name.startswith(f"{HISTORY_STATE}/")]
    if not files or not all(path.is_file() for path in files):
        return None
    return files, inputs["span"]


def mark_later_states_stale(layout: Layout, span: Interval) -> list[Path]:
    """After `span` is joined: the joined outputs whose history state continued `span`'s (an earlier version
    of it: they were made before this join), and those that continued theirs, and so on, each marked with
    STALE_STATE_MARKER; returns them in chain order. Their states hold sequences built without what changed in
    `span` (a raw minute fixed and joined again after later minutes ran), so no run continues them: the next
    one reads the lookback. Their samples were written already and stay as they are. Nothing is found, at
    the cost of a directory listing, when no later output continued `span`."""
    from components.manifest import write_json_atomic

    marked: list[Path] = []
    pending = [(span.end, span.tag)]
    while pending:
        start, tag = pending.pop(0)
        for directory in layout.joined_dirs_starting_at(start):
            manifest = json.loads((directory / MANIFEST_NAME).read_text())
            if (manifest.get("history_state") or {}).get("from") != tag:
                continue
            write_json_atomic(directory / STALE_STATE_MARKER, {
                "because": f"{span.tag} was joined again after this output's history state was built on it",
                "joined_again": span.tag, "marked_at": datetime.now(UTC).isoformat(timespec="seconds")})
            marked.append(directory)
            inputs = manifest.get("inputs", {})
            pending.append((datetime.fromisoformat(inputs["end"]), inputs["span"]))
    return marked


# Spans up to this long (minute runs) read only the lookback impressions that can change their output
# (relevant_lookback): the span's request ids and the clicks' are broadcast to the scan. Longer spans (the
# daily run, where the lookback is a small part of what is read) classify the whole lookback.
NARROW_LOOKBACK_MAX_SPAN = timedelta(minutes=15)


def relevant_lookback(lookback: DataFrame, in_span: DataFrame, clicks: DataFrame, span: Interval) -> DataFrame:
    """The lookback impressions that can change a run's samples or its span's metrics: those whose request id
    is among the span's impressions (an earlier delivery wins the dedup) or the clicks read (a click is
    classified, and enters behaviour sequences, through its impression), and any with a time in the span.

    Every other lookback impression has no click and a time before the span: classify_events labels it 0 in
    a minute the run neither writes nor counts. Leaving them out keeps a minute run's classification to the
    span's rows and the clicks, instead of every impression of the lookback (an hour of traffic by default:
    the join's cost grew by about 0.09 s per minute of lookback at 60 K impressions a minute)."""
    wanted = in_span.select(REQUEST_ID).unionByName(clicks.select(REQUEST_ID))  # the broadcast hash dedups
    start = int(span.start.timestamp() * 1000)
    earlier = ~ms_at_least(TS, start)
    return (lookback.where(earlier).join(F.broadcast(wanted), REQUEST_ID, "left_semi")
            .unionByName(lookback.where(~earlier)))


def continued_inputs(spark: SparkSession, layout: Layout, span: Interval, lookback: list[datetime],
                     click_minutes: list[datetime], spec: FeatureSpec,
                     keep_mib: int = 0) -> tuple[DataFrame, DataFrame]:
    """(impressions, clicks) for a run that continues a history state: the span's impressions, and only the
    lookback impressions and clicks whose request id is among the span's impressions or the clicks in the
    span (and any lookback impression with a time in the span), picked with Arrow on the client.

    With the behaviour sequences seeded, nothing else read can change the span's samples or metrics: labels
    need the clicks on the span's impressions; a click in the span is classified through its impression and
    its earlier deliveries; an impression delivered again in the span keeps its earliest delivery. Arrow
    reads the lookback's request ids (3.6 M at an hour of 60 K a minute) in a fraction of a second, where
    a Spark scan of them took 1.6 s and the ids to broadcast another second; the picked rows (a few
    thousand) reach Spark as local relations. `keep_mib` (events.lookback_keep_mib): what was read is kept in
    this process for the next minute, up to that many MiB per stream (LookbackReads)."""
    start, end = (int(t.timestamp() * 1000) for t in (span.start, span.end))
    span_files = event_files(layout, IMPRESSIONS, span.minutes(), spec)
    in_span = read_events(spark, IMPRESSIONS, span_files, spec)
    span_ids = _read_arrow(span_files, KEY_SCHEMA, [REQUEST_ID])[REQUEST_ID]
    clicks = LOOKBACK_READS.read("clicks", event_files(layout, CLICKS, click_minutes, spec), CLICK_SCHEMA,
                                 CLICK_SCHEMA.names, keep_mib=keep_mib)
    clicked = clicks.filter((pa.compute.field(TS) >= start) & (pa.compute.field(TS) < end))[REQUEST_ID]
    wanted = pa.compute.unique(pa.chunked_array([*span_ids.chunks, *clicked.chunks], pa.string()))
    clicks = clicks.filter(pa.compute.is_in(clicks[REQUEST_ID], value_set=wanted))
    narrow = [REQUEST_ID, TS, USER_ID, ITEM_ID]
    before = LOOKBACK_READS.read("impressions", event_files(layout, IMPRESSIONS, lookback, None), KEY_SCHEMA,
                                 narrow, keep_mib=keep_mib)
    before = before.filter(pa.compute.or_(pa.compute.is_in(before[REQUEST_ID], value_set=wanted),
                                          pa.compute.greater_equal(before[TS], start)))
    impressions = in_span.unionByName(local_relation(spark, before, KEY_SCHEMA, narrow), allowMissingColumns=True)
    return impressions, local_relation(spark, clicks, CLICK_SCHEMA, CLICK_SCHEMA.names)


def _read_arrow(files: list[str], schema: pa.Schema, columns: list[str]) -> pa.Table:
    import pyarrow.dataset as ds

    return ds.dataset(files, format="parquet", schema=schema).to_table(columns=columns)


class LookbackReads:
    """The columns a continued minute run picks from, read from its raw minute files and kept in this process
    for the next run: the step worker runs one minute after another, and each one's lookback (an hour by
    default, 3.6 M impressions at 60 K a minute) is the last one's, shifted by a minute. A file is read again
    when its size or modification time changes (a minute re-delivered); each `read` keeps only the files it
    was asked for, so what is kept is one lookback of narrow columns per stream (150 MiB for that hour),
    and nothing when that is above `keep_mib`. A fresh process reads everything once."""

    def __init__(self) -> None:
        self._kept: dict[str, dict[tuple, pa.Table]] = {}
        self._lock = threading.Lock()

    def read(self, slot: str, files: list[str], schema: pa.Schema, columns: list[str], *, keep_mib: int) -> pa.Table:
        if keep_mib <= 0 or not files:
            with self._lock:
                self._kept.pop(slot, None)
            return _read_arrow(files, schema, columns)
        keys = []
        for path in files:
            stat = os.stat(path)
            keys.append((path, stat.st_mtime_ns, stat.st_size, tuple(columns)))
        with self._lock:
            kept = self._kept.get(slot, {})
        tables = {key: kept[key] if key in kept else _read_arrow([key[0]], schema, columns) for key in keys}
        keep = tables if sum(table.nbytes for table in tables.values()) <= keep_mib * 2**20 else {}
        with self._lock:
            self._kept[slot] = keep  # nothing when too large (or keeping is off): the next run reads them again
        return pa.concat_tables([tables[key] for key in keys])


LOOKBACK_READS = LookbackReads()


def local_relation(spark: SparkSession, table: pa.Table, schema: pa.Schema, columns: list[str]) -> DataFrame:
    """A small Arrow table as a Spark DataFrame with the stream's Spark types (also when it is empty).

    In one chunk: pyspark 4.3's createDataFrame (classic) drops every row after an empty record batch (a
    table of chunks of 2, 0 and 3 rows gives 2 rows), and a filtered dataset scan yields empty batches."""
    fields = ", ".join(f"{name} {_spark_type(schema.field(name).type)}" for name in columns)
    typed = table.select(columns).cast(pa.schema([schema.field(n) for n in columns])).combine_chunks()
    return spark.createDataFrame(typed, schema=fields)


def run(spark: SparkSession, layout: Layout, span: Interval, output: Path, *, spec: FeatureSpec, window_s: int,
        sequence_length: int, lookback_s: int, previous: Path | None = None, short_span_partitions: int | None = None,
        keep_lookback_mib: int = 0) -> dict:
    """Joins `span` and writes its samples, metrics and history state to `output` (write_joined); returns
    the metrics. `previous`: the joined output of the span that ends where this one starts
    (Layout.joined_dir_ending_at). A run of up to NARROW_LOOKBACK_MAX_SPAN that can continue its history
    state reads only the span's rows and the few earlier ones they name (continued_inputs); any other run
    (the first after a gap, a quarantined or re-configured span, a daily run) reads the lookback.
    `short_span_partitions` (spark.minute_shuffle_partitions): the spark.sql.shuffle.partitions of a run of up
    to NARROW_LOOKBACK_MAX_SPAN, the session's own put back after; None, or a longer span: the session's.
    `keep_lookback_mib` (events.lookback_keep_mib): continued_inputs' `keep_mib`."""
    from spark_jobs.session import session_conf

    if short_span_partitions is not None and short_span_partitions < 1:
        raise ValueError(f"spark.minute_shuffle_partitions must be at least 1, got {short_span_partitions}")
    short = span.end - span.start <= NARROW_LOOKBACK_MAX_SPAN
    settings = ({"spark.sql.shuffle.partitions": str(short_span_partitions)}
                if short and short_span_partitions is not None else {})
    with session_conf(spark, settings):
        metrics = _run(spark, layout, span, output, spec=spec, window_s=window_s, sequence_length=sequence_length,
                       lookback_s=lookback_s, previous=previous, keep_lookback_mib=keep_lookback_mib)
    stale = mark_later_states_stale(layout, span)
    if stale:
        log.warning("%s was joined again after %d later joined outputs continued its behaviour sequences (%s ... "
                    "%s): their history states are marked stale (%s), and the next run builds its sequences "
                    "from the lookback", span.tag, len(stale), stale[0], stale[-1], STALE_STATE_MARKER)
    return metrics


def _run(spark: SparkSession, layout: Layout, span: Interval, output: Path, *, spec: FeatureSpec, window_s: int,
         sequence_length: int, lookback_s: int, previous: Path | None, keep_lookback_mib: int) -> dict:
    watermark = stream_watermark(layout, CLICKS)
    if watermark is None or span.end > final_until(watermark, window_s):
        raise EventInputError(
            f"minutes up to {span.end:%Y-%m-%d %H:%M} are not final: clicks are complete up to {watermark} and "
            f"the attribution window is {window_s} s, so only minutes before "
            f"{final_until(watermark, window_s) if watermark else 'any click partition'} can be joined; "
            "wait for more clicks or end the span earlier"
        )
    plan = plan_join(span, window_s, lookback_s)
    # The lookback may reach back before the first partition: read what exists there.
    first = min((m for m in plan.impression_minutes()
                 if layout.raw_events_minute_dir(IMPRESSIONS, m).exists()), default=span.start)
    lookback = [m for m in plan.impression_minutes() if first <= m < span.start]
    click_minutes = [m for m in plan.click_minutes() if m >= first]
    short = span.end - span.start <= NARROW_LOOKBACK_MAX_SPAN
    continued = (read_history_state(previous, span, window_s=window_s, sequence_length=sequence_length)
                 if short else None)
    seed_files, history_from = continued if continued is not None else ([], LOOKBACK)
    seed = spark.read.parquet(*[str(path) for path in seed_files]) if seed_files else None
    if seed is not None:
        impressions, clicks = continued_inputs(spark, layout, span, lookback, click_minutes, spec, keep_lookback_mib)
    else:
        # Lookback impressions only classify clicks and name clicked items: Parquet reads just these columns.
        in_span = extract_events(spark, layout, IMPRESSIONS, list(span.minutes()), spec)
        clicks = extract_events(spark, layout, CLICKS, click_minutes, spec)
        before = extract_events(spark, layout, IMPRESSIONS, lookback, None)  # the keys alone
        if short:
            before = relevant_lookback(before, in_span, clicks, span)
        impressions = in_span.unionByName(before, allowMissingColumns=True)
    # The metrics, the samples, their behaviour sequences and the history state all read the classified
    # join (narrow rows): computed once.
    classified = classify_events(impressions, clicks, window_s).persist()
    try:
        samples, metrics = build_samples(impressions, clicks, window_s=window_s, sequence_length=sequence_length,
                                         span=span, spec=spec, classified=classified, seed=seed)
        if seed is None:
            history = history_state(classified, sequence_length=sequence_length, span=span)
        else:
            history = advance_history(pq.read_table([str(path) for path in seed_files]),
                                      span_clicks(classified, span), sequence_length)
        collected = collect_metrics(metrics)
        inputs = {"span": span.tag, **span.as_dict(), "window_s": window_s, "sequence_length": sequence_length,
                  "lookback_s": lookback_s}
        write_joined(samples, collected, output, inputs=inputs, columns=sample_columns(spec), history=history,
                     history_from=history_from)
    finally:
        classified.unpersist()
    return collected


def _joined_table(directory: Path, columns: list[str]) -> pa.Table:
    return pq.read_table(directory / "samples", columns=columns)


def joined_rows(spark: SparkSession, directory: Path, minutes: list[datetime], spec: FeatureSpec,
                add: Callable[[DataFrame], DataFrame] | None = None, keep: Sequence[str] = ()) -> DataFrame:
    """The join's samples of `minutes` as the feature and sample jobs read rows: the spec's typed columns and
    the minute ('YYYY-MM-DD HH:MM'), through the same spark_jobs.raw.parse_raw as the click log's, in a fixed
    pseudo-random order (write_samples(..., shuffle=False)). `add`, when given, adds columns computed from the
    joined rows (all their columns, request_id included) before they are parsed; those named in `keep` are
    passed through."""
    from spark_jobs.raw import MINUTE_COLUMN, parse_raw

    start = int(min(minutes).timestamp() * 1000)
    end = int(max(minutes).timestamp() * 1000) + 60_000
    # Each file keeps its written order (attach_payload's) and the same files make the same Spark partitions:
    # rows come in the same, already shuffled, order on every read, so the sample writer keeps it.
    frame = spark.read.parquet(*sorted(str(path) for path in (directory / "samples").glob("part-*.parquet")))
    if spec.label.column != LABEL:  # the join names its label; the spec reads it under its own name
        frame = frame.withColumnRenamed(LABEL, spec.label.column)
    columns = frame.columns  # a call to the server each time through Spark Connect
    missing = [c for c in spec.input_columns if c not in columns]
    if missing:
        raise EventInputError(f"feature spec {spec.name!r} reads columns {missing} that the joined samples in "
                              f"{directory} do not have; they have {columns}: the join carries the impression "
                              "columns of the spec it ran with, so join the span again with this spec")
    frame = frame.where(ms_in(TS, start, end))
    raw = (add(frame) if add is not None else frame).select(
        *spec.input_columns,
        F.date_format(F.timestamp_millis(F.col(TS)), "yyyy-MM-dd HH:mm").alias(MINUTE_COLUMN), *keep,
    )
    return parse_raw(raw, spec, keep=keep)


def validate_joined(layout: Layout, directory: Path, sequence_length: int, report_path: Path,
                    span_start: datetime) -> dict[str, Any]:
    """Runs the joined-samples suite (components.event_validation) on the join's output. On failure the
    output moves to quarantine/joined/<span> with its report (nothing trains on it) and DataValidationError
    says why; the raw streams are untouched, so a fixed join can be re-run."""
    from components.event_validation import HISTORY_LENGTH_COLUMN, SUITE_VERSION, joined_samples_suite
    from components.manifest import write_json_atomic
    from components.validation import DataValidationError, PartitionedDataset, SliceValidator, quarantine

    table = _joined_table(directory, [LABEL, REQUEST_ID, HISTORY])
    frame = table.select([LABEL, REQUEST_ID]).to_pandas()
    frame[HISTORY_LENGTH_COLUMN] = pa.compute.list_value_length(table.column(HISTORY)).to_numpy(
        zero_copy_only=False)
    dataset = PartitionedDataset(
        name="joined_samples", suite_version=SUITE_VERSION, suite=lambda: joined_samples_suite(sequence_length),
        read=lambda path, minute: frame, minute_dir=lambda layout, minute: directory, file_name="samples",
        quarantine_dir=lambda layout, minute: layout.root / "quarantine" / "joined" / directory.name,
        noun="joined span",
    )
    result, full_report = SliceValidator(dataset).validate(span_start, directory)
    report = {"suite": dataset.name, "success": result.success, "num_rows": result.num_rows,
              "failures": result.failures, "great_expectations": full_report}
    write_json_atomic(report_path, report)
    if not result.success:
        target = quarantine(directory, dataset.quarantine_dir(layout, None), result, full_report)
        reasons = "; ".join(f"{f['expectation']}({f.get('column') or 'table'}): {f['detail']}"
                            for f in result.failures)
        raise DataValidationError(
            f"the joined samples of {directory.name} failed validation and were moved to {target} (nothing "
            f"trains on them; the raw streams are kept): {reasons}. Full report: {report_path}"
        )
    return report


def _joined_labels(directory: Path, minutes: list[datetime]) -> tuple[np.ndarray, np.ndarray]:
    """The request ids and joined labels of the samples of `minutes`."""
    table = _joined_table(directory, [REQUEST_ID, TS, LABEL])
    start = int(min(minutes).timestamp() * 1000)
    end = int(max(minutes).timestamp() * 1000) + 60_000
    ts = table.column(TS).to_numpy()
    keep = (ts >= start) & (ts < end)
    return (table.column(REQUEST_ID).to_numpy(zero_copy_only=False)[keep],
            table.column(LABEL).to_numpy(zero_copy_only=False)[keep])


def planted_auc_of_joined(layout: Layout, directory: Path, minutes: list[datetime]) -> float | None:
    """The planted model's AUC on the joined labels of `minutes`, or None for data the generator did not make."""
    from components.events import planted_event_auc

    return planted_event_auc(layout, minutes, *_joined_labels(directory, minutes))


def learnable_auc_of_joined(layout: Layout, directory: Path, train_minutes: list[datetime],
                            minutes: list[datetime]) -> float | None:
    """components.events.learnable_event_auc on the joined labels of `minutes`, users' topics inferred from
    `train_minutes`; None for data the generator did not make."""
    from components.events import learnable_event_auc

    return learnable_event_auc(layout, train_minutes, minutes, *_joined_labels(directory, minutes))


def main(argv: list[str] | None = None) -> None:
    from components.config import EventsConfig, SparkConfig
    from components.feature_spec import load_spec
    from spark_jobs.session import get_spark

    defaults = EventsConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", required=True)
    parser.add_argument("--start", required=True, help="first minute, e.g. 2026-01-01T00:00 (UTC)")
    parser.add_argument("--end", required=True, help="end minute (exclusive)")
    parser.add_argument("--output", required=True)
    parser.add_argument("--window-s", type=int, default=defaults.attribution_window_s)
    parser.add_argument("--sequence-length", type=int, default=defaults.sequence_length)
    parser.add_argument("--lookback-s", type=int, default=defaults.history_lookback_s)
    parser.add_argument("--spec", default="events", help="the feature spec whose columns the samples carry: a preset "
                        "name or a YAML file (default: events)")
    args = parser.parse_args(argv)
    spark = get_spark(SparkConfig(), "ctr-events")
    collected = run(spark, Layout(Path(args.data_root)), Interval.parse(args.start, args.end), Path(args.output),
                    spec=load_spec(args.spec), window_s=args.window_s, sequence_length=args.sequence_length,
                    lookback_s=args.lookback_s)
    print(json.dumps({name: collected[name] for name in METRIC_COLUMNS}))


if __name__ == "__main__":
    main()
