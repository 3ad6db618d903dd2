"""Where each output lives under the data root. Every path is a function of the data interval."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from components.interval import Interval
from components.manifest import MANIFEST_NAME

RAW_DATASET = "click_log"


@dataclass(frozen=True)
class Layout:
    root: Path

    # Raw minute partitions: raw/click_log/date=YYYY-MM-DD/minute=HHMM/part-00000.tsv (+ _SUCCESS)
    def raw_minute_dir(self, minute: datetime) -> Path:
        return self.root / "raw" / RAW_DATASET / f"date={minute:%Y-%m-%d}" / f"minute={minute:%H%M}"

    # Raw event streams ('impressions', 'clicks') partitioned by event-time minute:
    # raw/<stream>/date=YYYY-MM-DD/minute=HHMM/part-00000.parquet (+ _SUCCESS)
    def raw_events_minute_dir(self, stream: str, minute: datetime) -> Path:
        return self.root / "raw" / stream / f"date={minute:%Y-%m-%d}" / f"minute={minute:%H%M}"

    def raw_dataset_dir(self) -> Path:
        """The folder of the click log's minute partitions (date=/minute= below it)."""
        return self.root / "raw" / RAW_DATASET

    def raw_events_dir(self, stream: str) -> Path:
        """The folder of an event stream's minute partitions (date=/minute= below it)."""
        return self.root / "raw" / stream

    def quarantine_minute_dir(self, minute: datetime) -> Path:
        return self.root / "quarantine" / RAW_DATASET / f"date={minute:%Y-%m-%d}" / f"minute={minute:%H%M}"

    def quarantine_events_minute_dir(self, stream: str, minute: datetime) -> Path:
        return self.root / "quarantine" / stream / f"date={minute:%Y-%m-%d}" / f"minute={minute:%H%M}"

    def joined_dir(self, interval: Interval) -> Path:
        """Impressions joined with their clicks (labels, behaviour sequences) as Parquet, with a manifest."""
        return self.root / "joined" / interval.tag

    def joined_dir_ending_at(self, end: datetime) -> Path | None:
        """The committed joined output of a span that ends exactly at `end`, or None: the run whose
        behaviour-sequence state a run starting at `end` continues (spark_jobs.events.run). A minute run's
        (incremental/<run>/joined: its run's minute less the label delay, so the run ends within a day after
        `end`; its manifest names the span) before a daily run's (joined/<span>)."""
        for directory, inputs in self._minute_runs_joined_after(end):
            if inputs.get("end") == end.isoformat():
                return directory
        daily = sorted((self.root / "joined").glob(f"*-{end:%Y%m%dT%H%M}/{MANIFEST_NAME}"))
        return daily[-1].parent if daily else None

    def joined_dirs_starting_at(self, start: datetime) -> list[Path]:
        """The committed joined outputs of spans that start exactly at `start`, minute runs' then daily runs':
        those that may have continued the history state of a span ending there."""
        found = [directory for directory, inputs in self._minute_runs_joined_after(start)
                 if inputs.get("start") == start.isoformat()]
        return found + [m.parent for m in sorted((self.root / "joined").glob(f"{start:%Y%m%dT%H%M}-*/{MANIFEST_NAME}"))]

    def _minute_runs_joined_after(self, time: datetime):
        """(incremental/<run>/joined, its manifest's inputs) of the committed joined outputs of the minute runs
        that end within a day after `time`, by run: a minute run joins its minute less the label delay."""
        # Names only, compared as text (tags sort as times): the folder holds every minute run ever made.
        low, high = (f"{t:%Y%m%dT%H%M}" for t in (time, time + timedelta(days=1)))
        try:
            names = os.listdir(self.root / "incremental")
        except FileNotFoundError:
            names = []
        later = sorted((name.partition("-")[2], self.root / "incremental" / name / "joined") for name in names
                       if low < name.partition("-")[2] <= high)
        for _, directory in later:
            try:
                inputs = json.loads((directory / MANIFEST_NAME).read_text()).get("inputs", {})
            except (OSError, ValueError):
                continue  # not committed
            yield directory, inputs

    def validation_report(self, interval: Interval, dataset: str = "report") -> Path:
        return self.root / "validation" / interval.tag / f"{dataset}.json"

    def feature_state_dir(self, interval: Interval) -> Path:
        return self.root / "features" / interval.tag

    def previous_feature_state_dir(self, interval: Interval) -> Path | None:
        """The committed feature state of the latest interval that ends at or before `interval` starts: the
        state a run folds its data into. Depends only on what is committed before the interval, so re-running
        an interval finds the same parent."""
        best: tuple[datetime, Path] | None = None
        for manifest in (self.root / "features").glob("*/manifest.json"):
            try:
                start, end = (datetime.strptime(t, "%Y%m%dT%H%M").replace(tzinfo=UTC)
                              for t in manifest.parent.name.split("-"))
            except ValueError:
                continue  # not an interval directory
            if end <= interval.start and (best is None or end > best[0]):
                best = (end, manifest.parent)
        return best[1] if best else None

    def samples_dir(self, interval: Interval, split: str) -> Path:
        return self.root / "samples" / interval.tag / split

    @property
    def checkpoints_root(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint_dir(self, interval: Interval) -> Path:
        return self.checkpoints_root / interval.tag

    def evaluation_dir(self, interval: Interval) -> Path:
        return self.root / "evaluation" / interval.tag

    def export_dir(self, interval: Interval) -> Path:
        return self.root / "exports" / interval.tag

    def incremental_dir(self, interval: Interval) -> Path:
        """A minute run's outputs: plan, feature state, samples, checkpoint, evaluation, delta."""
        return self.root / "incremental" / interval.tag

    @property
    def freshness_log(self) -> Path:
        """Published minute versions with their data end and publish time, for the freshness plot."""
        return self.root / "incremental" / "freshness.json"

    @property
    def airflow_home(self) -> Path:
        return self.root / "airflow"

    @property
    def mlflow_dir(self) -> Path:
        return self.root / "mlflow"


DATE_PREFIX, MINUTE_PREFIX = "date=", "minute="


def list_minute_partitions(base: Path, start: datetime, end: datetime) -> list[datetime]:
    """The minutes in [start, end) that have a partition folder under `base` (base/date=YYYY-MM-DD/minute=HHMM),
    sorted. Lists the folders that exist, one directory read per day in the span and none per empty minute:
    months of history with a few thousand minutes of data cost what those minutes cost. Names of another form
    (a quarantined partition's second delivery, minute=HHMM.2; temporary files) are not partitions."""
    try:
        days = os.listdir(base)
    except FileNotFoundError:
        return []
    first_day, last_day = f"{start:%Y-%m-%d}", f"{end - timedelta(microseconds=1):%Y-%m-%d}"
    found: list[datetime] = []
    for name in days:
        day = name[len(DATE_PREFIX):]
        if not name.startswith(DATE_PREFIX) or len(day) != 10 or not first_day <= day <= last_day:
            continue
        try:
            names = os.listdir(base / name)
            midnight = datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=UTC)
        except (FileNotFoundError, NotADirectoryError, ValueError):
            continue
        for entry in names:
            hhmm = entry[len(MINUTE_PREFIX):]
            if not entry.startswith(MINUTE_PREFIX) or len(hhmm) != 4 or not hhmm.isdigit():
                continue
            hours, minutes = int(hhmm[:2]), int(hhmm[2:])
            if hours > 23 or minutes > 59:
                continue
            minute = midnight + timedelta(hours=hours, minutes=minutes)
            if start <= minute < end:
                found.append(minute)
    found.sort()
    return found
