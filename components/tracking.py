"""MLflow tracking as a side channel: one adapter, one MLflow run per pipeline run.

Every step of a run (each possibly its own Airflow task process) finds the same MLflow run by its run key
(tag `ctr.run_key`, e.g. "ctr_daily/scheduled__2026-01-02T00:00:00+00:00") or creates it. A tracking outage
is logged and the pipeline goes on, unless `tracking.strict` is set (tests set it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from components.config import PipelineConfig

log = logging.getLogger(__name__)
RUN_KEY_TAG = "ctr.run_key"
# The MLflow UI opens an experiment on the view its kind names; without it, MLflow 3 opens on the GenAI
# overview (traces, prompts). These runs train models. MLflow 3.17's UI also keeps a browser-wide mode (GenAI or
# model training, GenAI on a fresh browser) that the tag does not override: links into the UI carry
# `UI_TRAINING_VIEW`, which switches it.
# Seconds between system-metric samples of a monitored step (Step.system_metrics).
SYSTEM_METRICS_INTERVAL_S = 2.0
UI_TRAINING_VIEW = "#/experiments?workflowType=machine_learning"
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
PARENT_RUN_TAG = "mlflow.parentRunId"


@contextlib.contextmanager
def using_tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's fluent API (log_model) and the registry's resolution of `models:/` sources read the tracking URI
    from a process-wide global and MLFLOW_TRACKING_URI. This points both at `uri` for the block and puts back
    what was there, so the caller's process (and the config it reads from the environment) is left as it was."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    saved = os.environ.get("MLFLOW_TRACKING_URI")
    try:
        with _use_tracking_uri(uri):
            yield
    finally:
        if saved is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = saved


class Tracker:
    def __init__(self, config: PipelineConfig, run_key: str, run_name: str, tags: Mapping[str, str]):
        self._strict = config.tracking.strict
        self._uri = config.tracking_uri
        self._experiment = config.tracking.experiment
        # A local store keeps artifacts beside its database; a tracking server chooses (the stack's proxies them
        # to S3 through `mlflow-artifacts:/`), so experiments made through it get no location of ours.
        local = not config.tracking_uri.startswith(("http://", "https://"))
        self._artifact_root = (config.paths.root / "mlflow" / "artifacts").as_uri() if local else None
        self._run_key = run_key
        self._run_name = run_name
        self._tags = dict(tags)
        self._client = None
        self.run_id: str | None = None

    def guard(self, what: str, fn, *args, **kwargs):
        """Runs `fn`, the way every tracking call runs: a failure is logged and None returned, unless strict."""
        return self._guard(what, fn, *args, **kwargs)

    def _guard(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - tracking must not break training unless strict
            if self._strict:
                raise
            log.warning("MLflow %s failed (tracking is a side channel, the pipeline goes on): %s", what, err)
            return None

    def start(self) -> str | None:
        return self._guard("start", self._start)

    def _start(self) -> str:
        from mlflow.tracking import MlflowClient

        if self._uri.startswith("sqlite:///"):
            Path(self._uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        self._client = client = MlflowClient(tracking_uri=self._uri)
        experiment = client.get_experiment_by_name(self._experiment)
        if experiment is None:
            experiment_id = client.create_experiment(self._experiment, artifact_location=self._artifact_root,
                                                     tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        else:
            experiment_id = experiment.experiment_id
            if experiment.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:  # made by an earlier version
                client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{self._run_key}'",
                                   max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
        else:
            run = client.create_run(experiment_id, run_name=self._run_name,
                                    tags={RUN_KEY_TAG: self._run_key, **self._tags})
            self.run_id = run.info.run_id
        return self.run_id

    def nest_under(self, run_key: str) -> str | None:
        """Groups this run under the run of `run_key` (MLflow's parent run: the UI lists it beneath), if that run
        exists. Returns the parent's run id."""
        def do() -> str | None:
            experiment = self._client.get_run(self.run_id).info.experiment_id
            found = self._client.search_runs([experiment], filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'",
                                             max_results=1)
            if not found:
                return None
            self._client.set_tag(self.run_id, PARENT_RUN_TAG, found[0].info.run_id)
            return found[0].info.run_id

        return self._guard("nest_under", do) if self.run_id and run_key else None

    def log_params(self, params: Mapping[str, Any]) -> None:
        def do() -> None:
            from mlflow.entities import Param

            existing = self._client.get_run(self.run_id).data.params
            new = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in existing]
            changed = {k: (existing[k], str(v)) for k, v in params.items() if k in existing and existing[k] != str(v)}
            if changed:
                log.warning("MLflow params already logged with other values are kept: %s", changed)
            for i in range(0, len(new), 100):
                self._client.log_batch(self.run_id, params=new[i:i + 100])

        if self.run_id:
            self._guard("log_params", do)

    def log_run_config(self, config: PipelineConfig) -> None:
        """Every config value as a param, and the feature spec it names: its hash as a param, the whole spec
        (declared features and their tables' resolved settings) as feature_spec.json."""
        spec = config.feature_spec
        self.log_params({**config.flat(), "features.spec_name": spec.name, "features.spec_hash": spec.hash()})
        self.log_dict({**spec.as_dict(), "hash": spec.hash(),
                       "tables": {name: dataclasses.asdict(table) for name, table in spec.tables().items()}},
                      "feature_spec.json")

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        def do() -> None:
            import time

            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            items = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()
                     if v is not None and math.isfinite(float(v))]
            self._client.log_batch(self.run_id, metrics=items)

        if self.run_id:
            self._guard("log_metrics", do)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        if self.run_id:
            for k, v in tags.items():
                self._guard("set_tag", self._client.set_tag, self.run_id, k, str(v))

    def log_dataset(self, name: str, manifest_path: str | Path, context: str, span: Mapping[str, Any],
                    profile: Mapping[str, Any]) -> None:
        """Logs a written dataset as a run input (MLflow's Dataset column): its digest is the sha256 of its
        manifest (which names every file with its sha256), its source the directory and the data span it holds,
        `context` "training" or "evaluation"."""
        def do() -> None:
            import hashlib
            import json

            from mlflow.entities import Dataset, DatasetInput, InputTag

            path = Path(manifest_path)
            sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
            dataset = Dataset(name=name, digest=sha256[:36], source_type="local",
                              source=json.dumps({"uri": path.parent.as_uri(), **span}),
                              profile=json.dumps({**profile, "manifest_sha256": sha256}))
            self._client.log_inputs(self.run_id, datasets=[DatasetInput(
                dataset, tags=[InputTag("mlflow.data.context", context)])])

        if self.run_id:
            self._guard("log_inputs", do)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if not self.run_id:
            return
        path = Path(path)
        if path.is_dir():
            self._guard("log_artifacts", self._client.log_artifacts, self.run_id, str(path), artifact_path)
        else:
            self._guard("log_artifact", self._client.log_artifact, self.run_id, str(path), artifact_path)

    def log_dict(self, payload: Any, artifact_file: str) -> None:
        if self.run_id:
            self._guard("log_dict", self._client.log_dict, self.run_id, payload, artifact_file)

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        if self.run_id:
            self._guard("log_figure", self._client.log_figure, self.run_id, figure, artifact_file)

    @contextlib.contextmanager
    def system_metrics(self, interval_s: float = SYSTEM_METRICS_INTERVAL_S) -> Iterator[None]:
        """MLflow's system metrics (system/cpu_utilization_percentage, memory, disk, network; GPU where there is
        one) sampled every `interval_s` while the block runs, continuing the run's earlier samples."""
        def start():
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(self.run_id, sampling_interval=interval_s, samples_before_logging=1,
                                           resume_logging=True, tracking_uri=self._uri)
            monitor.start()
            return monitor

        monitor = self._guard("system metrics", start) if self.run_id else None
        try:
            yield
        finally:
            if monitor is not None:
                self._guard("system metrics", monitor.finish)

    def end(self, status: str = "FINISHED") -> None:
        if self.run_id:
            self._guard("end", self._client.set_terminated, self.run_id, status)
