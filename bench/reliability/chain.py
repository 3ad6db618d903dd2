"""A delta chain to break: a daily run on generated minutes, then minute runs one at a time, in-process, through
the same steps as Airflow's ctr_incremental (plan, validate, samples, train, export_delta, gate, publish)."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

TRAINED = "trained"
QUARANTINED = "quarantined"
FAILED = "failed"  # the run failed with a clear error, nothing published, nothing quarantined
NOTHING = "nothing to learn"

log = logging.getLogger(__name__)


def no_loss(**lost: int) -> dict[str, int]:
    return {"rows": 0, "minutes": 0, "versions": 0, "requests": 0, **lost}


def sha256_files(directory: Path) -> dict[str, str]:
    """sha256 of the files of a raw partition (validation's own marker left out)."""
    if not directory.is_dir():
        return {}
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.iterdir()) if p.is_file() and not p.name.startswith("_VALIDATED")}


@dataclass
class Chain:
    config: Any
    work: Path
    next_minute: datetime
    next_index: int
    progress: Callable[[str], None] = print
    scratch: Path = field(init=False)

    def __post_init__(self) -> None:
        self.scratch = Path(tempfile.mkdtemp(prefix="minutes-", dir=self.work))

    @classmethod
    def start(cls, work: Path, *, rows_per_minute: int = 2000, overrides: Mapping[str, Any] | None = None,
              progress: Callable[[str], None] = print) -> Chain:
        """Generates 10 minutes and runs the daily pipeline on them: the chain's full model."""
        from components.config import load_config
        from components.interval import Interval, parse_time
        from components.layout import Layout
        from components.synthetic import generate
        from pipelines.context import RunContext
        from pipelines.runner import run_steps, select_steps

        config = load_config(overrides={
            "paths.data_root": str(work / "data"), "generate.minutes": 10, "generate.rows_per_minute": rows_per_minute,
            "features.min_count": 5, "features.num_shards": 2, "features.growth_rows": 200,
            "spark.shuffle_partitions": 2, "spark.driver_memory": "2g", "train.epochs": 1, "train.batch_size": 256,
            "train.mlp_units": "32,16", "gate.min_auc": 0.55, "incremental.max_logloss_increase": 0.05,
            "incremental.wait_for_data_s": 0, **(overrides or {})}, environ={})
        started = time.monotonic()
        generate(config.generate, Layout(config.paths.root))
        first = parse_time(config.generate.start)
        end = first + timedelta(minutes=config.generate.minutes)
        day = Interval.parse(first.isoformat(), end.isoformat())
        run_steps(RunContext(config=config, interval=day, pipeline="daily", run_id=f"reliability-{work.name}"),
                  select_steps("daily", None))
        progress(f"chain: daily full model published in {time.monotonic() - started:.0f} s")
        return cls(config, work, end, config.generate.minutes, progress)

    @property
    def layout(self):
        from components.layout import Layout

        return Layout(self.config.paths.root)

    @property
    def store(self):
        from components.model_store import open_model_store

        return open_model_store(self.config.paths.model_store_uri, self.config.paths.s3_endpoint_url)

    def take_minute(self) -> tuple[int, datetime]:
        index, minute = self.next_index, self.next_minute
        self.next_index, self.next_minute = index + 1, minute + timedelta(minutes=1)
        return index, minute

    def good_bytes(self, index: int, minute: datetime, rows_factor: int = 1) -> bytes:
        from components.synthetic import RAW_FILE, generate_minute, write_raw_minute

        generate = dataclasses.replace(self.config.generate,
                                       rows_per_minute=self.config.generate.rows_per_minute * rows_factor)
        directory = self.scratch / str(index)
        write_raw_minute(generate_minute(generate, index, minute).table, directory)
        return (directory / RAW_FILE).read_bytes()

    def deliver(self, minute: datetime, data: bytes | None, marker: bool = True) -> Path:
        """Writes a raw partition as a writer would: the data file under a temporary name, renamed, then the
        completion marker."""
        from components.feature_spec import spec_for
        from components.synthetic import SUCCESS_MARKER

        directory = self.layout.raw_minute_dir(minute)
        directory.mkdir(parents=True, exist_ok=True)
        if data is not None:
            file_name = spec_for(self.config).source.file_name
            tmp = directory / f".{file_name}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, directory / file_name)
        if marker:
            (directory / SUCCESS_MARKER).touch()
        return directory

    def deliver_good(self) -> datetime:
        index, minute = self.take_minute()
        self.deliver(minute, self.good_bytes(index, minute))
        return minute

    def run(self, minute: datetime, overrides: Mapping[str, Any] | None = None,
            run_id: str | None = None) -> tuple[str, str, float]:
        """Runs one minute's steps; (observed outcome, the error's first line, seconds)."""
        from components.interval import Interval
        from components.validation import DataValidationError
        from pipelines.context import RunContext
        from pipelines.incremental import NothingToLearn
        from pipelines.runner import run_steps, select_steps

        config = self.config.with_overrides(dict(overrides)) if overrides else self.config
        ctx = RunContext(config=config, interval=Interval.minute(minute.isoformat()), pipeline="incremental",
                         run_id=run_id or f"reliability-{minute:%H%M}-{time.monotonic_ns()}")
        started = time.monotonic()
        try:
            run_steps(ctx, select_steps("incremental", None))
            return TRAINED, "", time.monotonic() - started
        except NothingToLearn as err:
            return NOTHING, _first_line(err), time.monotonic() - started
        except DataValidationError as err:
            return QUARANTINED, _first_line(err), time.monotonic() - started
        except Exception as err:  # noqa: BLE001 - every other failure is an observed outcome to record
            log.debug("%s", traceback.format_exc())
            return FAILED, f"{type(err).__name__}: {_first_line(err)}", time.monotonic() - started

    def learned(self) -> dict[str, list[str]]:
        from pipelines.daily import MODEL_NAME

        return learned_minutes(self.store, MODEL_NAME)


def learned_minutes(store, model_name: str) -> dict[str, list[str]]:
    """minute (ISO) -> the standing (not retracted) published deltas whose data holds it."""
    retracted = store.retracted(model_name)
    learned: dict[str, list[str]] = {}
    for version in store.versions(model_name):
        if version not in retracted:
            for minute in store.manifest(model_name, version).get("minutes") or []:
                learned.setdefault(minute, []).append(version)
    return learned


ERROR_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$")


def _first_line(err: BaseException) -> str:
    """The error's first line and, for an error that wraps another's traceback (Spark's from its Python
    workers), the innermost error line, which names the cause."""
    text = str(err).strip()
    first = (text.splitlines()[0] if text else type(err).__name__)[:300]
    causes = [line.strip() for line in text.splitlines()[1:] if ERROR_LINE.match(line)]
    return f"{first} ... {causes[-1][:200]}" if causes else first
