"""What every step of a pipeline run receives: the config, the data interval and the run's identity."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from components.config import PipelineConfig
from components.feature_spec import spec_for
from components.interval import Interval
from components.layout import Layout

progress_log = logging.getLogger("ctr.progress")


@dataclass(frozen=True)
class Step:
    name: str
    description: str
    run: object  # Callable[[RunContext], dict]
    # The steps this one needs, by name; None: the step before it. Steps that need the same steps and not each
    # other run side by side in Airflow; the CLI runs every step in order.
    upstream: tuple[str, ...] | None = None
    # A sensor's `run` answers whether what the run waits for is there (True) or not yet (False), and raises once
    # waiting longer is pointless. Airflow pokes it in reschedule mode (no worker slot held while it waits);
    # the CLI polls it.
    sensor: bool = False
    # Airflow only: the pool of the task (POOLS in pipelines/airflow_tasks.py), and the assets it reads and
    # produces (ASSETS there) by name.
    pool: str | None = None
    inlets: tuple[str, ...] = ()
    outlets: tuple[str, ...] = ()
    # MLflow system metrics (CPU, memory, disk, network, GPU) are sampled on the run while the step runs.
    system_metrics: bool = False


def log_served_model(run_id: str, tracking_uri: str, directory: Path, example_rows: list[dict[str, Any]]) -> Any:
    """The runs' model logger (components.tracking.ModelLogger): an exported version as the served model's pyfunc
    (serving.pyfunc), imported only when a model is logged (MLflow's pyfunc is a heavy import for a minute task)."""
    from serving.pyfunc import log_model

    return log_model(run_id, tracking_uri, directory, example_rows)


def step_upstream(steps: Sequence[Step]) -> dict[str, tuple[str, ...]]:
    """The steps each step needs, by name, in the steps' order: its `upstream`, or else the step before it."""
    upstream: dict[str, tuple[str, ...]] = {}
    previous: str | None = None
    for step in steps:
        needs = step.upstream if step.upstream is not None else ((previous,) if previous else ())
        unknown = [name for name in needs if name not in upstream]
        if unknown:
            raise ValueError(f"step {step.name!r} needs {unknown}, which are not steps before it")
        upstream[step.name] = tuple(needs)
        previous = step.name
    return upstream


@dataclass
class RunContext:
    config: PipelineConfig
    interval: Interval
    pipeline: str  # "daily"
    run_id: str  # Airflow run_id, or one made by the CLI
    dag_id: str = ""
    extra_tags: dict[str, str] = field(default_factory=dict)

    @cached_property
    def layout(self) -> Layout:
        return Layout(self.config.paths.root)

    @cached_property
    def spec(self):  # -> components.feature_spec.FeatureSpec
        """The run's feature spec (features.spec), read once."""
        return spec_for(self.config)

    @cached_property
    def source(self):  # -> pipelines.sources.Source
        """Where the run's labelled rows come from (features.source), chosen once."""
        from pipelines.sources import source_for

        return source_for(self.config)

    @property
    def run_key(self) -> str:
        return f"{self.dag_id or 'ctr_' + self.pipeline}/{self.run_id}"

    @cached_property
    def tracker(self):
        from components.tracking import Tracker

        tags = {"ctr.pipeline": self.pipeline, "ctr.interval_start": self.interval.start.isoformat(),
                "ctr.interval_end": self.interval.end.isoformat(), **self.extra_tags}
        if self.dag_id:
            tags.update({"airflow.dag_id": self.dag_id, "airflow.run_id": self.run_id})
        tracker = Tracker(self.config, run_key=self.run_key, run_name=f"{self.pipeline} {self.interval.tag}",
                          tags=tags, model_logger=log_served_model)
        tracker.start()
        return tracker

    def spark(self):  # -> pyspark.sql.SparkSession
        """The run's Spark session (local or Spark Connect, as `spark` config says), started on first use."""
        from spark_jobs.session import get_spark

        return get_spark(self.config.spark, app_name=f"ctr-{self.pipeline}")

    def progress(self, message: str, *args) -> None:
        progress_log.info("[ctr %s] " + message, self.pipeline, *args)
