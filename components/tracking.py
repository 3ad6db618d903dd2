"""MLflow tracking as a side channel: one adapter, one MLflow run per pipeline run.

Every step of a run (each possibly its own Airflow task process) finds the same MLflow run by its run key
(tag `ctr.run_key`, e.g. "ctr_daily/scheduled__2026-01-02T00:00:00+00:00") or creates it. A tracking outage
is logged and the pipeline goes on, unless `tracking.strict` is set (tests set it): a server that does not
answer costs a run seconds (a short probe, bounded retries), and what could not be logged waits in the outbox
(<data_root>/mlflow/outbox) until a later run, or `ctr-pipeline tracking flush`, reaches the server again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import socket
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from components.config import PipelineConfig
from components.feature_spec import spec_for
from components.mlflow_settings import apply_http_limits
from components.tracking_outbox import Outbox, PendingRun

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
# Set on a run when calls kept while its server was away are delivered: how many were.
DELIVERED_LATE_TAG = "ctr.tracking.delivered_late"
DATABASE_PORTS = {"postgresql": 5432, "postgres": 5432, "mysql": 3306, "mssql": 1433}

# Logs an exported version to a run as an MLflow model: (run id, tracking URI, the version's directory, example
# rows) -> MLflow's ModelInfo. The served model's pyfunc is serving's (serving.pyfunc.log_model), a layer above
# this one, so whoever makes a Tracker hands it in (pipelines.context.log_served_model).
ModelLogger = Callable[[str, str, Path, list[dict[str, Any]]], Any]


def server_answers(uri: str, timeout_s: float) -> bool:
    """Whether the tracking backend at `uri` answers at all (any HTTP status counts: a login page is an
    answer); a database backend answers when its port accepts a connection. Local stores (sqlite, file) always
    do; any other scheme is left for MLflow to judge."""
    parts = urlsplit(uri)
    if parts.scheme in ("http", "https"):
        request = urllib.request.Request(f"{uri.rstrip('/')}/health", method="GET")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s):  # noqa: S310 - the configured tracking URI
                return True
        except urllib.error.HTTPError:
            return True
        except (OSError, ValueError):
            return False
    database_port = DATABASE_PORTS.get(parts.scheme.split("+")[0])
    if parts.hostname and database_port:
        try:
            with socket.create_connection((parts.hostname, parts.port or database_port), timeout=timeout_s):
                return True
        except OSError:
            return False
    return True


class Tracker:
    """One pipeline run's MLflow run. Every call is an op (a JSON-able dict) applied to the server, or, while
    the server does not answer, appended to the outbox (components.tracking_outbox) and delivered later."""

    def __init__(self, config: PipelineConfig, run_key: str, run_name: str, tags: Mapping[str, str],
                 model_logger: ModelLogger | None = None):
        self._config = config
        self._model_logger = model_logger
        self._strict = config.tracking.strict
        self._uri = config.tracking_uri
        self._experiment = config.tracking.experiment
        # A local store keeps artifacts beside its database; a tracking server chooses (the stack's proxies them
        # to S3 through `mlflow-artifacts:/`), so experiments made through it get no location of ours.
        self._remote = config.tracking_uri.startswith(("http://", "https://"))
        self._artifact_root = None if self._remote else (config.paths.root / "mlflow" / "artifacts").as_uri()
        self._run_key = run_key
        self._run_name = run_name
        self._tags = dict(tags)
        self._client = None
        self._outbox = Outbox(outbox_dir(config))
        self._offline = False
        self._started_ms = int(time.time() * 1000)
        self.run_id: str | None = None
        if self._remote:
            apply_http_limits(config)

    @property
    def offline(self) -> bool:
        """True while this run's calls go to the outbox."""
        return self._offline

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
        """Finds or creates the run. A server that does not answer (within `tracking.probe_timeout_s`) sends
        this run's calls to the outbox; one that does first gets what earlier runs left there."""
        if not server_answers(self._uri, self._config.tracking.probe_timeout_s):
            self._go_offline(f"nothing answered at {self._uri} within {self._config.tracking.probe_timeout_s} s")
            return None
        if self._outbox.pending():
            self._guard("delivering the outbox", deliver_outbox, self._config,
                        budget_s=self._config.tracking.flush_budget_s, model_logger=self._model_logger)
        try:
            return self._start()
        except Exception as err:  # noqa: BLE001 - sorted below: an outage, or an error to log (or raise if strict)
            if self._strict:
                raise
            if not server_answers(self._uri, self._config.tracking.probe_timeout_s):
                self._go_offline(str(err))
                return None
            log.warning("MLflow start failed (tracking is a side channel, the pipeline goes on): %s", err)
            return None

    def _start(self, reopen: bool = True, start_time_ms: int | None = None) -> str:
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
            if reopen:
                client.update_run(self.run_id, status="RUNNING")
        else:
            run = client.create_run(experiment_id, run_name=self._run_name, start_time=start_time_ms,
                                    tags={RUN_KEY_TAG: self._run_key, **self._tags})
            self.run_id = run.info.run_id
        return self.run_id

    # -- the calls --------------------------------------------------------------------------------------------

    def nest_under(self, run_key: str) -> None:
        """Groups this run under the run of `run_key` (MLflow's parent run: the UI lists it beneath), if that run
        exists."""
        if run_key:
            self._submit({"op": "nest_under", "run_key": run_key})

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._submit({"op": "log_params", "params": {k: str(v)[:6000] for k, v in params.items()}})

    def log_run_config(self, config: PipelineConfig) -> None:
        """Every config value as a param, and the feature spec it names: its hash as a param, the whole spec
        (declared features and their tables' resolved settings) as feature_spec.json."""
        spec = spec_for(config)
        self.log_params({**config.flat(), "features.spec_name": spec.name, "features.spec_hash": spec.hash()})
        self.log_dict({**spec.as_dict(), "hash": spec.hash(),
                       "tables": {name: dataclasses.asdict(table) for name, table in spec.tables().items()}},
                      "feature_spec.json")

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        values = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        self._submit({"op": "log_metrics", "metrics": values, "step": step or 0})

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self._submit({"op": "set_tags", "tags": {k: str(v) for k, v in tags.items()}})

    def log_dataset(self, name: str, manifest_path: str | Path, context: str, span: Mapping[str, Any],
                    profile: Mapping[str, Any]) -> None:
        """Logs a written dataset as a run input (MLflow's Dataset column): its digest is the sha256 of its
        manifest (which names every file with its sha256), its source the directory and the data span it holds,
        `context` "training" or "evaluation"."""
        path = Path(manifest_path)
        try:
            sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as err:
            if self._strict:
                raise
            log.warning("MLflow log_inputs skipped: the manifest %s cannot be read: %s", path, err)
            return
        self._submit({"op": "log_dataset", "name": name, "digest": sha256[:36], "context": context,
                      "source": json.dumps({"uri": path.parent.as_uri(), **span}),
                      "profile": json.dumps({**profile, "manifest_sha256": sha256})})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._submit({"op": "log_artifact", "path": str(path), "artifact_path": artifact_path})

    def log_dict(self, payload: Any, artifact_file: str) -> None:
        self._submit({"op": "log_dict", "payload": payload, "artifact_file": artifact_file})

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        if not self._offline:
            self._submit({"op": "log_figure", "artifact_file": artifact_file}, figure=figure)
            return
        with tempfile.TemporaryDirectory() as scratch:  # kept in the outbox as the image MLflow would store
            image = Path(scratch) / Path(artifact_file).name
            figure.savefig(image)
            self._submit({"op": "log_artifact", "path": str(image),
                          "artifact_path": str(Path(artifact_file).parent) if "/" in artifact_file else None})

    def log_model(self, directory: Path, store_version: str, store_uri: str, example_rows: list[dict]) -> None:
        """Logs an exported version as the run's pyfunc model (with the tracker's model logger) and registers it
        (components.registry)."""
        self._submit({"op": "log_model", "directory": str(directory), "store_version": store_version,
                      "store_uri": store_uri, "example_rows": example_rows})

    @contextlib.contextmanager
    def system_metrics(self, interval_s: float = SYSTEM_METRICS_INTERVAL_S) -> Iterator[None]:
        """MLflow's system metrics (system/cpu_utilization_percentage, memory, disk, network; GPU where there is
        one) sampled every `interval_s` while the block runs, continuing the run's earlier samples. Not sampled
        while the server is away (they are not kept for later)."""
        def start():
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(self.run_id, sampling_interval=interval_s, samples_before_logging=1,
                                           resume_logging=True, tracking_uri=self._uri)
            monitor.start()
            return monitor

        monitor = self._guard("system metrics", start) if self.run_id and not self._offline else None
        try:
            yield
        finally:
            if monitor is not None:
                self._guard("system metrics", monitor.finish)

    def end(self, status: str = "FINISHED") -> None:
        self._submit({"op": "end", "status": status})

    # -- applying or keeping them -----------------------------------------------------------------------------

    def _header(self) -> dict[str, Any]:
        return {"run_key": self._run_key, "run_name": self._run_name, "tags": self._tags,
                "start_time_ms": self._started_ms}

    def _go_offline(self, reason: str) -> None:
        if self._strict:
            raise RuntimeError(f"the MLflow tracking server does not answer ({reason}) and tracking.strict is set")
        if not self._offline:
            log.warning("MLflow at %s does not answer (%s): this run's tracking waits in %s and is delivered when "
                        "it answers again (by the next run, or `ctr-pipeline tracking flush`)", self._uri, reason,
                        self._outbox.directory)
        self._offline = True

    def _keep(self, op: dict[str, Any]) -> None:
        op = {**op, "time_ms": op.get("time_ms") or int(time.time() * 1000)}
        if op["op"] == "log_artifact":
            source = Path(op["path"])
            if not source.exists():
                log.warning("MLflow artifact %s does not exist; not kept for later", source)
                return
            op["kept"] = op["path"] = str(self._outbox.keep_file(self._run_key, source))
        self._outbox.append(self._header(), op)

    def _submit(self, op: dict[str, Any], **objects: Any) -> None:
        op = {**op, "time_ms": int(time.time() * 1000)}
        if self._offline:
            self._guard(f"keeping {op['op']} for later", self._keep, op)
            return
        if not self.run_id:  # the run could not be started for a reason other than an outage
            return
        try:
            self._apply(op, **objects)
        except Exception as err:  # noqa: BLE001 - sorted below: an outage, or an error to log (or raise if strict)
            if self._strict:
                raise
            if server_answers(self._uri, self._config.tracking.probe_timeout_s):
                log.warning("MLflow %s failed (tracking is a side channel, the pipeline goes on): %s", op["op"], err)
                return
            self._go_offline(f"{op['op']} failed: {err}")
            if op["op"] == "log_figure":
                self.log_figure(objects["figure"], op["artifact_file"])  # now offline: kept as its image
            else:
                self._guard(f"keeping {op['op']} for later", self._keep, op)

    def _apply(self, op: dict[str, Any], **objects: Any) -> None:
        from mlflow.entities import Metric, Param

        client, run_id, kind = self._client, self.run_id, op["op"]
        if kind == "log_params":
            existing = client.get_run(run_id).data.params
            new = [Param(k, v) for k, v in op["params"].items() if k not in existing]
            changed = {k: (existing[k], v) for k, v in op["params"].items() if k in existing and existing[k] != v}
            if changed:
                log.warning("MLflow params already logged with other values are kept: %s", changed)
            for i in range(0, len(new), 100):
                client.log_batch(run_id, params=new[i:i + 100])
        elif kind == "log_metrics":
            client.log_batch(run_id, metrics=[Metric(k, v, op["time_ms"], op["step"])
                                              for k, v in op["metrics"].items()])
        elif kind == "set_tags":
            for k, v in op["tags"].items():
                client.set_tag(run_id, k, v)
        elif kind == "nest_under":
            experiment = client.get_run(run_id).info.experiment_id
            found = client.search_runs([experiment], filter_string=f"tags.`{RUN_KEY_TAG}` = '{op['run_key']}'",
                                       max_results=1)
            if found:
                client.set_tag(run_id, PARENT_RUN_TAG, found[0].info.run_id)
        elif kind == "log_dataset":
            from mlflow.entities import Dataset, DatasetInput, InputTag

            dataset = Dataset(name=op["name"], digest=op["digest"], source_type="local", source=op["source"],
                              profile=op["profile"])
            client.log_inputs(run_id, datasets=[DatasetInput(dataset, tags=[InputTag("mlflow.data.context",
                                                                                       op["context"])])])
        elif kind == "log_artifact":
            path = Path(op["path"])
            if not path.exists():
                log.warning("MLflow artifact %s is gone; not logged", path)
            elif path.is_dir():
                client.log_artifacts(run_id, str(path), op["artifact_path"])
            else:
                client.log_artifact(run_id, str(path), op["artifact_path"])
        elif kind == "log_dict":
            client.log_dict(run_id, op["payload"], op["artifact_file"])
        elif kind == "log_figure":
            client.log_figure(run_id, objects["figure"], op["artifact_file"])
        elif kind == "log_model":
            self._log_model(op)
        elif kind == "end":
            run = client.get_run(run_id).info
            if run.end_time and run.status != "RUNNING" and run.end_time > op["time_ms"]:
                return  # a later try of the run ended it since: that status stands
            client.set_terminated(run_id, op["status"], end_time=op["time_ms"])
        else:
            raise ValueError(f"unknown tracking op {kind!r}")

    def _log_model(self, op: dict[str, Any]) -> None:
        from components.registry import register

        directory = Path(op["directory"])
        if not directory.is_dir():
            log.warning("MLflow log_model skipped: the exported version %s is gone", directory)
            return
        if self._model_logger is None:
            raise ValueError(f"this tracker was made without a model logger, so it cannot log {directory} as a "
                             "model; pass Tracker(..., model_logger=pipelines.context.log_served_model)")
        # Raising (registering as if strict) lets an outage keep the call for later, as for every other call.
        logged = self._model_logger(self.run_id, self._uri, directory, op["example_rows"])
        strict = dataclasses.replace(self._config, tracking=dataclasses.replace(self._config.tracking, strict=True))
        registered = register(strict, self.run_id, op["store_version"], op["store_uri"], model_uri=logged.model_uri,
                              model_id=logged.model_id)
        self._client.set_tag(self.run_id, "model.registered_version", registered)


def outbox_dir(config: PipelineConfig) -> Path:
    return config.paths.root / "mlflow" / "outbox"


@dataclass(frozen=True)
class Delivery:
    runs: int  # runs whose every waiting call was delivered
    calls: int  # calls delivered
    pending_runs: int  # runs still waiting (the server went away again, the budget ran out, or another process
    # was delivering them)


def deliver_outbox(config: PipelineConfig, budget_s: float | None = None, *,
                   model_logger: ModelLogger | None) -> Delivery:
    """Delivers the outbox's waiting runs, oldest first, in the order their calls were made, until done, the
    server stops answering, or `budget_s` is spent. A call the server refuses while it answers (an error, not an
    outage) is logged and dropped, so one bad call cannot block the rest. `model_logger` logs the waiting
    models (Tracker's)."""
    outbox = Outbox(outbox_dir(config))
    deadline = None if budget_s is None else time.monotonic() + budget_s
    runs = calls = 0
    for path in outbox.pending():
        if deadline is not None and time.monotonic() > deadline:
            break
        with outbox.take(path) as run:
            if run is None:
                continue
            delivered = _deliver(config, run, deadline, model_logger)
            run.settle(delivered)
            calls += delivered
            if delivered < len(run.ops):
                break
            runs += 1
    pending_runs = len(outbox.pending())
    if runs or calls:
        log.info("MLflow: delivered %d waiting call(s) of %d run(s) from %s; %d run(s) still waiting", calls,
                 runs, outbox.directory, pending_runs)
    return Delivery(runs=runs, calls=calls, pending_runs=pending_runs)


def _deliver(config: PipelineConfig, run: PendingRun, deadline: float | None,
             model_logger: ModelLogger | None) -> int:
    header = run.header
    tracker = Tracker(dataclasses.replace(config, tracking=dataclasses.replace(config.tracking, strict=False)),
                      header["run_key"], header["run_name"], header.get("tags", {}), model_logger=model_logger)
    try:
        tracker._start(reopen=False, start_time_ms=header.get("start_time_ms"))
    except Exception as err:  # noqa: BLE001 - the server went away again: nothing delivered, all kept
        log.warning("MLflow: the waiting calls of %s were not delivered: %s", header["run_key"], err)
        return 0
    for done, op in enumerate(run.ops):
        if deadline is not None and time.monotonic() > deadline:
            return done
        try:
            tracker._apply(op)
        except Exception as err:  # noqa: BLE001 - sorted below: an outage keeps the rest, an error drops this one
            if not server_answers(tracker._uri, config.tracking.probe_timeout_s):
                return done
            log.warning("MLflow refused the waiting %s of %s (dropped): %s", op["op"], header["run_key"], err)
    tracker.guard("set_tag", tracker._client.set_tag, tracker.run_id, DELIVERED_LATE_TAG, str(len(run.ops)))
    return len(run.ops)
