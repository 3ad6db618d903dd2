"""Where a pipeline's labelled rows come from, chosen once from `features.source` (RunContext.source).

Both pipelines ask their source the same questions and never branch on its name:

- `datasets(spec)`: the raw datasets validation checks (great-expectations suites per minute partition);
- `has_data(layout, spec, minute)`: whether a minute's raw partition (of the rows) is there;
- `minutes_with_data(layout, spec, interval)`: the interval's minutes whose raw partition (of the rows) is
  there, from a listing of the partitions (months of minutes cost what their partitions cost);
- `ready(layout, minute)`: whether everything a minute brings has arrived (its _SUCCESS markers);
- `label_delay(config)`: how long after a minute its labels are final (0 for a labelled click log; the
  attribution window, rounded up to whole minutes, for impression and click streams);
- `label(ctx, span, directory)`: makes the span's labelled rows under `directory` (the impression x click
  join, validated) and returns its metrics; None when the raw rows carry their labels;
- `rows(ctx, minutes, directory, holdout_fraction=None)`: the parsed rows of `minutes` (spark_jobs.raw.parse_raw's
  typed columns and `minute`), or None when there are none; with `holdout_fraction`, each row also says in
  HELD_OUT whether a stable hash split holds it out (about that fraction of the rows);
  the spec's history features (spark_jobs.history) are computed there, point in time, for the click log;
- `rows_come_shuffled`: whether `rows` are already in a pseudo-random order (the sample writer then keeps it);
- `planted_auc(ctx, minutes, directory)`: the generator's own model on those minutes' labels, for generated
  data (None otherwise).
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from components.config import PipelineConfig
    from components.feature_spec import FeatureSpec
    from components.interval import Interval
    from components.layout import Layout

SOURCE_NAMES = ("click_log", "events")
# Rows whose hash bucket (of 1000) is below fraction x 1000 are held out.
HASH_BUCKETS = 1000
# The column of rows(..., holdout_fraction=...): true for a held-out row.
HELD_OUT = "_held_out"


class SourceContext(Protocol):
    """What a source asks of the run it makes rows for (pipelines.context.RunContext has it; declared here so
    that the sources do not import the context that chooses them)."""

    config: PipelineConfig
    interval: Interval

    @property
    def layout(self) -> Layout: ...

    @property
    def spec(self) -> FeatureSpec: ...

    def spark(self) -> Any: ...

    def progress(self, message: str, *args: Any) -> None: ...


class Source(Protocol):
    name: str
    rows_come_shuffled: bool

    def datasets(self, spec: FeatureSpec) -> list[Any]: ...

    def has_data(self, layout: Layout, spec: FeatureSpec, minute: datetime) -> bool: ...

    def minutes_with_data(self, layout: Layout, spec: FeatureSpec, interval: Interval) -> list[datetime]: ...

    def ready(self, layout: Layout, minute: datetime) -> bool: ...

    def label_delay(self, config: PipelineConfig) -> timedelta: ...

    def label(self, ctx: SourceContext, span: Interval, directory: Path) -> dict[str, Any] | None: ...

    def rows(self, ctx: SourceContext, minutes: list[datetime], directory: Path,
             holdout_fraction: float | None = None): ...

    def planted_auc(self, ctx: SourceContext, minutes: list[datetime], directory: Path) -> float | None: ...


def hash_split(frame, columns: list[str], fraction: float | None):
    """`frame` with HELD_OUT (a stable hash of `columns` in the lowest `fraction` of HASH_BUCKETS), when
    `fraction` is given."""
    if fraction is None:
        return frame
    from pyspark.sql import functions as F

    bucket = F.pmod(F.xxhash64(*[F.col(c) for c in columns]), F.lit(HASH_BUCKETS))
    return frame.withColumn(HELD_OUT, bucket < int(round(fraction * HASH_BUCKETS)))


def split_rows(rows, column: str = HELD_OUT):
    """(training rows, held-out rows) of rows(..., holdout_fraction=...), without the column."""
    from pyspark.sql import functions as F

    return rows.where(~F.col(column)).drop(column), rows.where(F.col(column)).drop(column)


class ClickLogSource:
    """Labelled minute partitions in the spec's layout (Criteo TSV, CSV, Parquet): raw/date=/minute=/."""

    name = "click_log"
    rows_come_shuffled = False

    def datasets(self, spec: FeatureSpec) -> list[Any]:
        from components.validation import click_log_dataset

        return [click_log_dataset(spec)]

    def has_data(self, layout: Layout, spec: FeatureSpec, minute: datetime) -> bool:
        return (layout.raw_minute_dir(minute) / spec.source.file_name).exists()

    def minutes_with_data(self, layout: Layout, spec: FeatureSpec, interval: Interval) -> list[datetime]:
        from components.layout import list_minute_partitions

        return [m for m in list_minute_partitions(layout.raw_dataset_dir(), interval.start, interval.end)
                if self.has_data(layout, spec, m)]

    def ready(self, layout: Layout, minute: datetime) -> bool:
        from components.synthetic import SUCCESS_MARKER

        return (layout.raw_minute_dir(minute) / SUCCESS_MARKER).exists()

    def label_delay(self, config: PipelineConfig) -> timedelta:
        return timedelta(0)

    def label(self, ctx: SourceContext, span: Interval, directory: Path) -> dict[str, Any] | None:
        return None

    def rows(self, ctx: SourceContext, minutes: list[datetime], directory: Path,
             holdout_fraction: float | None = None):
        if ctx.spec.histories:  # point-in-time sequences from earlier rows (spark_jobs.history)
            from spark_jobs.history import rows_with_history

            return rows_with_history(ctx.spark(), ctx.layout.root, ctx.spec, minutes, since=ctx.interval.start,
                                     read=lambda span: self._parsed_rows(ctx, span, holdout_fraction))
        return self._parsed_rows(ctx, minutes, holdout_fraction)

    def _parsed_rows(self, ctx: SourceContext, minutes: list[datetime], holdout_fraction: float | None):
        from spark_jobs.raw import extract_raw, parse_raw, raw_columns

        paths = [str(ctx.layout.raw_minute_dir(m) / ctx.spec.source.file_name) for m in minutes
                 if self.has_data(ctx.layout, ctx.spec, m)]
        if not paths:
            return None
        raw = extract_raw(ctx.spark(), paths, ctx.spec)
        keep = [HELD_OUT] if holdout_fraction is not None else []
        if ctx.spec.histories:
            from spark_jobs.history import EVENT_SECONDS, event_seconds

            raw, keep = raw.withColumn(EVENT_SECONDS, event_seconds(ctx.spec)), [*keep, EVENT_SECONDS]
        # Split on the raw text, before parsing: a hash over the parsed expressions, inlined into the
        # vocabulary count, made Spark's optimizer run out of memory.
        return parse_raw(hash_split(raw, raw_columns(ctx.spec), holdout_fraction), ctx.spec, keep=keep)

    def planted_auc(self, ctx: SourceContext, minutes: list[datetime], directory: Path) -> float | None:
        from components.synthetic import planted_auc

        return planted_auc(ctx.layout, minutes, ctx.spec.source.file_name)


class EventsSource:
    """Impression and click streams (raw/impressions, raw/clicks), labelled by a Spark join: an impression is
    a click when one arrives within `events.attribution_window_s`; behaviour sequences come with it."""

    name = "events"
    rows_come_shuffled = True  # spark_jobs.events.joined_rows: a fixed pseudo-random order

    def datasets(self, spec: FeatureSpec) -> list[Any]:
        from components.event_validation import stream_dataset
        from components.events import STREAMS

        return [stream_dataset(stream, spec) for stream in STREAMS]

    def has_data(self, layout: Layout, spec: FeatureSpec, minute: datetime) -> bool:
        from components.events import EVENT_FILE, IMPRESSIONS

        return (layout.raw_events_minute_dir(IMPRESSIONS, minute) / EVENT_FILE).exists()

    def minutes_with_data(self, layout: Layout, spec: FeatureSpec, interval: Interval) -> list[datetime]:
        from components.events import IMPRESSIONS
        from components.layout import list_minute_partitions

        return [m for m in list_minute_partitions(layout.raw_events_dir(IMPRESSIONS), interval.start, interval.end)
                if self.has_data(layout, spec, m)]

    def ready(self, layout: Layout, minute: datetime) -> bool:
        from components.events import STREAMS
        from components.synthetic import SUCCESS_MARKER

        return all((layout.raw_events_minute_dir(stream, minute) / SUCCESS_MARKER).exists() for stream in STREAMS)

    def label_delay(self, config: PipelineConfig) -> timedelta:
        return timedelta(minutes=math.ceil(config.events.attribution_window_s / 60))

    def label(self, ctx: SourceContext, span: Interval, directory: Path) -> dict[str, Any] | None:
        from spark_jobs.events import run, validate_joined

        events = ctx.config.events
        ctx.progress("join: impressions x clicks for %s with Spark (window %d s, sequences of %d)", span.tag,
                     events.attribution_window_s, events.sequence_length)
        metrics = run(ctx.spark(), ctx.layout, span, directory, spec=ctx.spec, window_s=events.attribution_window_s,
                      sequence_length=events.sequence_length, lookback_s=events.history_lookback_s,
                      previous=ctx.layout.joined_dir_ending_at(span.start),
                      short_span_partitions=ctx.config.spark.minute_shuffle_partitions,
                      keep_lookback_mib=events.lookback_keep_mib)
        validate_joined(ctx.layout, directory, events.sequence_length,
                        ctx.layout.validation_report(span, "joined_samples"), span.start)
        return metrics

    def rows(self, ctx: SourceContext, minutes: list[datetime], directory: Path,
             holdout_fraction: float | None = None):
        from components.manifest import read_manifest
        from spark_jobs.events import JOINED_KIND, REQUEST_ID, joined_rows

        if ctx.spec.histories:
            from components.feature_spec import FeatureSpecError

            raise FeatureSpecError(
                f"feature spec {ctx.spec.name!r} declares history features {[f.name for f in ctx.spec.histories]}, "
                "which are computed for the click_log source; the events source builds its own `history` in the "
                "join: declare it as a plain sequence (see the events preset) or use features.source=click_log")
        read_manifest(directory, kind=JOINED_KIND)
        return joined_rows(ctx.spark(), directory, minutes, ctx.spec,
                           add=lambda frame: hash_split(frame, [REQUEST_ID], holdout_fraction),
                           keep=[HELD_OUT] if holdout_fraction is not None else [])

    def planted_auc(self, ctx: SourceContext, minutes: list[datetime], directory: Path) -> float | None:
        from spark_jobs.events import planted_auc_of_joined

        return planted_auc_of_joined(ctx.layout, directory, minutes)


def source_for(config: PipelineConfig) -> Source:
    """The source `features.source` names; ConfigError for any other value."""
    from components.config import ConfigError

    name = config.features.source
    if name == "events":
        return EventsSource()
    if name == "click_log":
        return ClickLogSource()
    raise ConfigError(f"features.source={name!r} is not a known input; expected one of {list(SOURCE_NAMES)}")
