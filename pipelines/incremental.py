"""The minute pipeline, defined once: the Airflow DAG `ctr_incremental` and `ctr run incremental` run these steps.

plan -> (validate | samples) -> train -> export_delta -> gate -> publish, on the data interval of one minute.
Validation of the raw slices and the Spark samples job run side by side (each needs only the plan); training
needs both, so a minute that fails validation is quarantined and nothing trains on it: the run fails, and the
next minute's run plans without it.

Each run trains on from the newest standing model in the store (its parent): the delta left by the previous
minute, or a newer full model from the daily run, which starts a new chain. The parent's data end says what
the run has to learn: with `incremental.catch_up` = "in_order" every minute since then (after an outage: the
missed minutes, oldest first, at most `max_catch_up_minutes`), with "latest_only" the run's own minute (the
skipped span is logged and recorded). A minute whose data the parent already holds is a no-op.

Outputs live under incremental/<interval>/ and are replaced by a re-run; the delta is published only once the
gate passed, so serving never sees an ungated delta and a failed run leaves it on the last good version.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from components.evaluation import DeltaGateError
from pipelines.context import RunContext, Step
from pipelines.daily import MODEL_NAME

PLAN_FILE = "plan.json"
EVALUATION_FILE = "evaluation.json"
GATE_FILE = "gate.json"
CATCH_UP_POLICIES = ("in_order", "latest_only")
# At most this many minutes are caught up in one run after an outage.
MAX_CATCH_UP_MINUTES = 60


class NothingToLearn(RuntimeError):
    """The parent model already holds this minute's data: the run has nothing to do (a task skip)."""


@dataclass(frozen=True)
class Plan:
    """What a minute run learns and from what: written by `validate`, read by every later step."""

    version: str  # the delta's version: the end of the run's minute, YYYYMMDDHHMM
    parent: str
    chain_root: str
    parent_checkpoint: str
    parent_feature_state: str
    parent_data_end: str
    daily_run_key: str  # the MLflow/Airflow run that exported the chain's full model
    minutes: tuple[str, ...]  # ISO minutes with validated data, oldest first
    skipped_minutes: tuple[str, ...]  # missed minutes left out by catch_up = "latest_only"
    # Earlier minutes whose data is there without its completion marker (a writer that did not finish): never
    # learned, since their data may be partial.
    incomplete_minutes: tuple[str, ...] = ()

    @property
    def data_span(self) -> dict[str, str]:
        return {"start": self.minutes[0], "end": _minute_end(self.minutes[-1]).isoformat()}


def _dir(ctx: RunContext) -> Path:
    return ctx.layout.incremental_dir(ctx.interval)


def model_version(ctx: RunContext) -> str:
    return f"{ctx.interval.end:%Y%m%d%H%M}"


def _store(ctx: RunContext):
    from components.model_store import open_model_store

    return open_model_store(ctx.config.paths.model_store_uri, ctx.config.paths.s3_endpoint_url)


def _minute_end(minute: str) -> datetime:
    return datetime.fromisoformat(minute) + timedelta(minutes=1)


def read_plan(ctx: RunContext) -> Plan:
    path = _dir(ctx) / PLAN_FILE
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: run the validate step of {ctx.interval.tag} first")
    doc = json.loads(path.read_text())
    return Plan(**{**doc, "minutes": tuple(doc["minutes"]), "skipped_minutes": tuple(doc["skipped_minutes"]),
                   "incomplete_minutes": tuple(doc.get("incomplete_minutes", ()))})


def resolve_parent(ctx: RunContext) -> tuple[str, dict[str, Any]]:
    """The version to train on from: the newest standing version, unless a newer full model (a daily run)
    starts a new chain."""
    store = _store(ctx)
    latest = store.latest(MODEL_NAME)
    if latest is None:
        raise RuntimeError(f"no model in {store.uri} to train on from: run ctr_daily first, which publishes the "
                           "full model that minute runs build deltas on")
    manifest = store.manifest(MODEL_NAME, latest)
    full = store.latest_full(MODEL_NAME)
    if full is not None and int(full) > int(manifest.get("chain_root") or latest):
        latest, manifest = full, store.manifest(MODEL_NAME, full)
    return latest, manifest


def _training_state(ctx: RunContext, manifest: dict[str, Any]) -> dict[str, str]:
    state = manifest.get("training_state")
    if not state:
        raise RuntimeError(f"version {manifest.get('version')} names no training_state (its checkpoint and feature "
                           "state): it was exported by an older daily run; run ctr_daily again to start a chain")
    chain_spec = manifest.get("feature_spec_hash")
    if chain_spec != ctx.spec.hash():
        spec_name = (manifest.get("feature_spec") or {}).get("name")
        raise RuntimeError(
            f"version {manifest.get('version')} was trained with feature spec {spec_name!r} (hash {chain_spec!r}); "
            f"this run uses {ctx.spec.name!r} (hash {ctx.spec.hash()!r}). A delta must keep its chain's columns: "
            "run ctr_daily with the new spec to start a chain, or set features.spec back")
    for key in ("checkpoint", "feature_state"):
        if not (Path(state[key]) / "manifest.json").is_file():
            raise RuntimeError(f"the {key} of version {manifest.get('version')} is not on this machine at "
                               f"{state[key]}: minute runs train where the chain's checkpoints are")
    return state


def _damage(manifest: dict[str, Any]) -> str | None:
    """Why a version's training state (checkpoint and feature state) cannot be trained on: a file that does not
    match its manifest's sha256, or a manifest that is gone. None when it verifies."""
    from components.manifest import ManifestError, read_manifest

    state = manifest.get("training_state") or {}
    for key in ("checkpoint", "feature_state"):
        if key not in state:
            continue
        try:
            read_manifest(state[key])
        except ManifestError as err:
            return f"its {key}: {err}"
    return None


def verified_parent(ctx: RunContext, parent: str, manifest: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The parent itself when its training state verifies. Otherwise the newest version up its chain whose state
    does, with every standing version after that one retracted (the store's rollback, so serving moves back to
    it too): the minutes those versions learned are then learned again, once, on a state that verifies."""
    store = _store(ctx)
    version, current = parent, manifest
    damaged: list[tuple[str, str]] = []
    while (why := _damage(current)) is not None:
        damaged.append((version, why))
        ancestor = current.get("parent")
        if not ancestor or ancestor in store.retracted(MODEL_NAME):
            detail = "; ".join(f"{v}: {w}" for v, w in damaged)
            raise RuntimeError(f"no version of the chain has a training state that verifies ({detail}): run "
                               "ctr_daily to start a new chain")
        version, current = ancestor, store.manifest(MODEL_NAME, ancestor)
    if damaged:
        from components.model_store import rollback

        reason = f"training state of {damaged[0][0]} is damaged ({damaged[0][1]})"
        retracted = rollback(store, MODEL_NAME, version, reason)
        ctx.progress("plan: %s; retracted %s, training on from %s", reason, retracted, version)
        ctx.tracker.set_tags({"ctr.retracted_damaged": ",".join(retracted)})
    return version, current


def data_ready(ctx: RunContext, now: datetime | None = None) -> bool:
    """Sensor: is this run's minute complete (its partition's completion marker written)? A minute already in
    quarantine also ends the wait (plan says why nothing trains on it). Waiting ends
    `incremental.wait_for_data_s` after the minute closed: past that the data is late, and the run fails (its
    retries ask again)."""
    if ctx.source.ready(ctx.layout, ctx.interval.start):
        return True
    from components.validation import quarantined

    if quarantined(ctx.layout, ctx.source.datasets(ctx.spec)[0], ctx.interval.start):
        return True
    waited = ((now or datetime.now(UTC)) - ctx.interval.end).total_seconds()
    if waited > ctx.config.incremental.wait_for_data_s:
        raise RuntimeError(f"the {ctx.source.name} data of minute {ctx.interval.start.isoformat()} is not complete "
                           f"{waited:.0f} s after the minute closed (incremental.wait_for_data_s = "
                           f"{ctx.config.incremental.wait_for_data_s:.0f}): no completion marker under "
                           f"{ctx.layout.raw_minute_dir(ctx.interval.start).parent}")
    return False


def plan(ctx: RunContext) -> dict:
    """Plans the run: its parent model and the minutes to learn (those whose raw slices are there and whose
    labels are final)."""
    config = ctx.config.incremental
    if config.catch_up not in CATCH_UP_POLICIES:
        from components.config import ConfigError

        raise ConfigError(f"incremental.catch_up={config.catch_up!r}; expected one of {list(CATCH_UP_POLICIES)}")
    ctx.tracker.log_run_config(ctx.config)
    parent, manifest = verified_parent(ctx, *resolve_parent(ctx))
    parent_end = datetime.fromisoformat(manifest["data_end"])
    # Minutes whose labels are final by the end of this run's minute (all of them for a labelled click log).
    delay = ctx.source.label_delay(ctx.config)
    learn_end = ctx.interval.end - delay
    if parent_end >= learn_end:
        raise NothingToLearn(f"version {parent} already holds data up to {parent_end.isoformat()}, past what this "
                             f"run's minute {ctx.interval.tag} can learn (up to {learn_end.isoformat()}): nothing "
                             "to learn")
    wanted = [m for m in _minutes_between(max(parent_end, learn_end - timedelta(minutes=MAX_CATCH_UP_MINUTES)),
                                          learn_end)]
    target = learn_end - timedelta(minutes=1)  # the newest minute this run can learn
    skipped: list[datetime] = []
    if config.catch_up == "latest_only":
        skipped, wanted = [m for m in wanted if m < target], [m for m in wanted if m >= target]
    if skipped:
        ctx.progress("plan: catch_up=latest_only: skipping %d missed minutes %s..%s", len(skipped),
                     skipped[0].isoformat(), skipped[-1].isoformat())
    present, incomplete = [], []
    for m in wanted:
        if ctx.source.has_data(ctx.layout, ctx.spec, m):
            (present if ctx.source.ready(ctx.layout, m) else incomplete).append(m)
    if incomplete:
        ctx.progress("plan: %d earlier minute(s) have data but no completion marker and are not learned: %s",
                     len(incomplete), ", ".join(m.isoformat() for m in incomplete))
    from components.validation import DataValidationError, quarantined

    moved = quarantined(ctx.layout, ctx.source.datasets(ctx.spec)[0], target)
    if target not in present and moved:
        raise DataValidationError(
            f"the raw slice of minute {target.isoformat()} failed validation earlier and is in {moved} with "
            "its report; nothing trains on it. The next minute's run learns the minutes around it")
    if target in incomplete:
        raise RuntimeError(f"the {ctx.source.name} data of minute {target.isoformat()} has no completion marker: "
                           "its writer did not finish, so it may be partial and is not learned; later runs skip it "
                           "(their deltas list it under incomplete_minutes)")
    if target not in present and ctx.source.ready(ctx.layout, target):
        raise RuntimeError(f"minute {target.isoformat()} is marked complete but has no {ctx.source.name} data file "
                           f"under {ctx.layout.root / 'raw'}: an empty partition, nothing to learn; "
                           "the next minute's run goes on without it")
    if target not in present:
        raise RuntimeError(f"the {ctx.source.name} data of minute {target.isoformat()} is not there; run the "
                           "wait_for_data step first, which waits for it")
    if delay:
        ctx.progress("plan: labels are final %d minute(s) after their impressions (the attribution window): "
                     "this run learns up to %s", delay.total_seconds() // 60, learn_end.isoformat())
    training_state = _training_state(ctx, manifest)
    plan = Plan(
        version=model_version(ctx), parent=parent, chain_root=str(manifest.get("chain_root") or parent),
        parent_checkpoint=training_state["checkpoint"], parent_feature_state=training_state["feature_state"],
        parent_data_end=parent_end.isoformat(), daily_run_key=str(_daily_run_key(ctx, manifest)),
        minutes=tuple(m.isoformat() for m in present), skipped_minutes=tuple(m.isoformat() for m in skipped),
        incomplete_minutes=tuple(m.isoformat() for m in incomplete),
    )
    from components.manifest import write_json_atomic

    write_json_atomic(_dir(ctx) / PLAN_FILE, plan.__dict__)
    ctx.tracker.set_tags({"ctr.parent_version": parent, "ctr.chain_root": plan.chain_root,
                          "ctr.daily_run": plan.daily_run_key})
    ctx.tracker.nest_under(plan.daily_run_key)  # the MLflow UI lists a day's minute runs under its daily run
    ctx.tracker.log_metrics({"incremental.minutes": len(present), "incremental.skipped_minutes": len(skipped),
                             "incremental.incomplete_minutes": len(incomplete)})
    ctx.progress("plan: parent %s (chain %s); learning %d minute(s) %s..%s", parent, plan.chain_root,
                 len(present), plan.minutes[0], plan.minutes[-1])
    return {"parent": parent, "minutes": list(plan.minutes)}


def validate(ctx: RunContext) -> dict:
    """Validates the planned minutes' raw slices. One that fails is quarantined (raw data kept, with its
    report) and fails the run: training waits for this step, so nothing trains on it."""
    from components.validation import DATA_DOCS, validate_interval

    plan = read_plan(ctx)
    # The rows' dataset (the click log; the impressions) on the planned minutes; any other (the clicks) from
    # the first planned minute up to this run's, which hold the clicks that label them.
    planned = [datetime.fromisoformat(m) for m in plan.minutes]
    labelling = _minutes_between(planned[0], ctx.interval.end)
    reports = []
    for index, dataset in enumerate(ctx.source.datasets(ctx.spec)):
        minutes = planned if index == 0 else labelling
        report_path = ctx.layout.validation_report(ctx.interval, "report" if index == 0 else dataset.name)
        try:
            reports.append(validate_interval(ctx.layout, minutes, report_path, dataset=dataset,
                                             docs_dir=report_path.parent / DATA_DOCS))
        finally:  # a quarantined slice's report and Data Docs page are what a person opens first
            if report_path.exists():
                ctx.tracker.log_artifact(report_path, "validation")
            if (report_path.parent / DATA_DOCS).is_dir():
                ctx.tracker.log_artifact(report_path.parent / DATA_DOCS, f"validation/{DATA_DOCS}")
    report = reports[0]  # the dataset that holds the rows (the click log; the impressions)
    missing = [m for m in plan.minutes if m not in {p["minute"] for p in report["passed"]}]
    if missing:  # moved away between planning and now (quarantined by another run, or deleted)
        from components.validation import DataValidationError

        raise DataValidationError(f"planned minute(s) {missing} are no longer in the raw data (see "
                                  f"{ctx.layout.validation_report(ctx.interval, 'report')}); nothing trains on this "
                                  "plan. The next minute's run plans again")
    ctx.tracker.log_metrics({"validation.rows": report["num_rows"]})
    ctx.progress("validate: %d minute(s) passed (%d validated on arrival or by an earlier run), %d rows",
                 len(report["passed"]), report["num_validated_before"], report["num_rows"])
    return {"minutes": list(plan.minutes), "rows": report["num_rows"]}


def _minutes_between(start: datetime, end: datetime) -> list[datetime]:
    minute = start.replace(second=0, microsecond=0)
    out = []
    while minute < end:
        out.append(minute)
        minute += timedelta(minutes=1)
    return out


def _daily_run_key(ctx: RunContext, manifest: dict[str, Any]) -> str:
    if manifest.get("parent") is None:
        return str(manifest.get("run_key", ""))
    return str(_store(ctx).manifest(MODEL_NAME, str(manifest["chain_root"])).get("run_key", ""))


def _rows(ctx: RunContext, plan: Plan):
    """The planned minutes' rows, each with HELD_OUT (pipelines.sources: a stable hash split,
    incremental.holdout_fraction), labelled first when the source needs it (events: the join of those
    minutes, under incremental/<minute>/)."""
    from components.interval import Interval

    minutes = [datetime.fromisoformat(m) for m in plan.minutes]
    directory = _dir(ctx) / "joined"
    ctx.source.label(ctx, Interval(minutes[0], minutes[-1] + timedelta(minutes=1)), directory)
    return ctx.source.rows(ctx, minutes, directory, holdout_fraction=ctx.config.incremental.holdout_fraction)


def fold_and_write(spark, rows, parent, features, spec, *, day: int, version: str, directory: Path,
                   inputs: dict[str, Any], shuffle: bool = True, lap=lambda name: None) -> tuple[Any, dict[str, dict]]:
    """The Spark work of a minute run once its rows are labelled, in one session: the rows (`rows()`: parsed,
    with HELD_OUT) folded into `parent` (admissions into the room the daily run left, no eviction, the
    parent's dense transforms: build_feature_state with evict=False), then block TFRecords of the training and
    held-out rows under the new state, both in one Spark job, under `directory`/samples/{train,holdout}.
    `shuffle`: False when the rows come in a pseudo-random order already (Source.rows_come_shuffled), which the
    writer then keeps instead of hashing and sorting them again, as the daily run does.
    Returns (the new state, split -> manifest); `lap(name)` is called after each part.

    The rows are read and parsed once, kept in Spark's memory for both jobs, and let go at the end: a minute
    is small, and reading it a second time (and a third, for the held-out rows) cost more than keeping it."""
    from pipelines.sources import split_rows
    from spark_jobs.features import build_feature_state
    from spark_jobs.samples import write_splits
    from spark_jobs.session import MINUTE_CACHE_CONF, session_conf

    with session_conf(spark, MINUTE_CACHE_CONF):  # kept uncompressed: spark_jobs.session
        minute_rows = rows().persist()
        lap("spark_session")
        try:
            train_frame, holdout_frame = split_rows(minute_rows)
            state = build_feature_state(train_frame, parent, features, day=day, version=version, evict=False,
                                        spec=spec)
            if state.table_sizes() != parent.table_sizes():
                raise RuntimeError(f"a minute run changed table sizes {parent.table_sizes()} -> {state.table_sizes()}")
            lap("fold_counts")
            written = write_splits({split: (frame, directory / "samples" / split)
                                    for split, frame in (("train", train_frame), ("holdout", holdout_frame))},
                                   state, spec=spec, block_rows=features.block_rows, num_shards=1,
                                   seed=features.seed, layout=features.samples_layout, inputs=inputs, in_memory=True,
                                   shuffle=shuffle)
        finally:
            minute_rows.unpersist()
    lap("write_samples")
    return state, written


def samples(ctx: RunContext) -> dict:
    """Spark, in one session: the planned minutes' rows (labelled first when the source needs it) through
    fold_and_write, then the new feature state saved under incremental/<interval>/feature_state."""
    from components.feature_state import load_feature_state
    from components.interval import day_number
    from spark_jobs.features import write_feature_state

    plan = read_plan(ctx)
    started = time.monotonic()
    seconds: dict[str, float] = {}

    def lap(name: str) -> None:  # where the step's time goes, logged with its metrics
        seconds[name] = round(time.monotonic() - started - sum(seconds.values()), 2)

    parent = load_feature_state(plan.parent_feature_state, spec=ctx.spec)
    lap("load_parent_state")
    state, written = fold_and_write(
        ctx.spark(), lambda: _rows(ctx, plan), parent, ctx.config.features, ctx.spec,
        day=day_number(ctx.interval.start), version=f"minute-{ctx.interval.tag}", directory=_dir(ctx),
        inputs={"interval": ctx.interval.tag, "minutes": list(plan.minutes)},
        shuffle=not ctx.source.rows_come_shuffled, lap=lap)
    features_s = sum(seconds[name] for name in ("load_parent_state", "spark_session", "fold_counts"))
    rows = {split: manifest["row_counts"]["rows"] for split, manifest in written.items()}
    if rows["train"] == 0 or rows["holdout"] == 0:
        raise RuntimeError(f"{ctx.interval.tag}: {rows['train']} training and {rows['holdout']} held-out rows; a "
                           "minute run needs both (incremental.holdout_fraction)")
    manifest = write_feature_state(state, _dir(ctx) / "feature_state", num_rows=rows["train"],
                                   spec_hash=ctx.spec.hash(),
                                   inputs={"parent": parent.version, "minutes": list(plan.minutes)})
    lap("save_state")
    ctx.tracker.log_metrics({**{f"samples.seconds.{name}": value for name, value in seconds.items()},
                             "features.new_rows": manifest["num_new_rows"],
                             "features.candidates": manifest["num_candidates"], "features.seconds": features_s,
                             "samples.train_rows": rows["train"], "samples.holdout_rows": rows["holdout"],
                             "samples.seconds": time.monotonic() - started})
    ctx.progress("samples: %d values admitted into the tables' room (%d candidates waiting); %d training and %d "
                 "held-out rows; %.1f s (%s)", manifest["num_new_rows"], manifest["num_candidates"], rows["train"],
                 rows["holdout"], time.monotonic() - started, ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))
    return {"feature_state": str(_dir(ctx) / "feature_state"), "new_rows": manifest["num_new_rows"], **rows}


def train(ctx: RunContext) -> dict:
    """Trains the parent checkpoint (weights and optimizer state) on the minutes' rows and scores parent and
    child on the held-out rows for the gate."""
    from components.feature_state import load_feature_state
    from components.manifest import write_json_atomic
    from trainer.arguments import resolve_batch_size

    if ctx.config.train.backend == "jax":  # a child process with KERAS_BACKEND=jax (trainer/jax_train.py)
        from trainer.jax_train import train_increment_in_jax_process as train_increment
    else:
        from trainer.incremental import train_increment

    plan = read_plan(ctx)
    state = load_feature_state(_dir(ctx) / "feature_state")
    started = time.monotonic()
    from pipelines.daily import sample_files

    (train_files, manifest), (holdout_files, _) = (sample_files(_dir(ctx) / "samples" / split, ctx.spec.hash())
                                                   for split in ("train", "holdout"))
    result = train_increment(
        Path(plan.parent_checkpoint), train_files, holdout_files, _dir(ctx) / "checkpoint",
        # A minute trains once over its rows: train.batch_size=0 gives it the 2,048 it always had (the auto size
        # is for epochs of a whole interval).
        new_rows=state.new_rows, batch_size=resolve_batch_size(ctx.config.train.batch_size, None),
        epochs=ctx.config.incremental.epochs,
        seed=ctx.config.train.seed, version=plan.version, layout=manifest["layout"],
        num_rows=manifest["row_counts"]["rows"], spec=ctx.spec,
        span_max_bytes=0,  # the chain's spans are written after the publish, by the spans step
    )
    write_json_atomic(_dir(ctx) / EVALUATION_FILE, result)
    ctx.tracker.log_metrics({**{f"train.{k}": v for k, v in result.items() if isinstance(v, int | float)},
                             **{f"train.seconds.{k}": v for k, v in result["seconds"].items()}})
    ctx.progress("train: %d rows at %.0f ex/s; holdout logloss %.4f (parent %.4f, %s), %.1f s (%s)",
                 result["train_rows"], result["examples_per_second"], result["holdout_logloss"],
                 result["parent_holdout_logloss"], "kept in memory" if result["parent_from_memory"] else "loaded",
                 time.monotonic() - started, ", ".join(f"{k} {v:.2f} s" for k, v in result["seconds"].items()))
    return result


def export_delta(ctx: RunContext) -> dict:
    from components.delta import delta_arrays, saved_weights, write_delta
    from components.feature_state import load_feature_state
    from components.manifest import read_manifest

    plan = read_plan(ctx)
    started = time.monotonic()
    parent = saved_weights(Path(plan.parent_checkpoint))
    if parent is None:  # a daily checkpoint: its weights are read from the Keras model
        from trainer.incremental import checkpoint_weights

        parent = checkpoint_weights(Path(plan.parent_checkpoint))
    _, parent_weights = parent
    child = saved_weights(_dir(ctx) / "checkpoint")
    if child is None:
        raise RuntimeError(f"the checkpoint of {ctx.interval.tag} has no weights file; re-run its train step")
    specs, weights = child
    state = load_feature_state(_dir(ctx) / "feature_state")
    parent_state = load_feature_state(plan.parent_feature_state)
    delta_specs = specs
    if any(table.tiered for table in ctx.spec.tables().values()):
        arrays, delta_specs = _tiered_delta(ctx, plan, state, parent_state, specs, weights, parent_weights)
    else:
        arrays = delta_arrays(parent_weights, weights, parent_state, state)
    evaluation = json.loads((_dir(ctx) / EVALUATION_FILE).read_text())
    full_bytes = _full_model_bytes(ctx, plan.chain_root)
    tables = _table_report(ctx, plan, state, specs, weights, parent_weights)
    manifest = write_delta(
        _dir(ctx) / "delta", arrays, version=plan.version, parent=plan.parent, chain_root=plan.chain_root,
        weight_specs=delta_specs, spec_hash=ctx.spec.hash(),
        extra={"data_span": plan.data_span, "data_end": plan.data_span["end"], "minutes": list(plan.minutes),
               "skipped_minutes": list(plan.skipped_minutes), "incomplete_minutes": list(plan.incomplete_minutes),
               "global_step": evaluation["global_step"],
               "num_rows": evaluation["train_rows"], "run_key": ctx.run_key, "daily_run": plan.daily_run_key,
               "full_model_bytes": full_bytes,
               "training_state": {"checkpoint": str(_dir(ctx) / "checkpoint"),
                                  "feature_state": str(_dir(ctx) / "feature_state")},
               "tables": tables},
    )
    read_manifest(_dir(ctx) / "delta", kind="delta")
    changed = sum(manifest["rows_changed"].values())
    ctx.tracker.log_metrics({"delta.bytes": manifest["delta_bytes"], "delta.rows_changed": changed,
                             "delta.vocabulary_entries": manifest["num_vocabulary_entries"],
                             "delta.fraction_of_full_model": manifest["delta_bytes"] / full_bytes if full_bytes else 0,
                             "delta.seconds": time.monotonic() - started})
    ctx.progress("export_delta: version %s on %s: %d rows changed, %d new vocabulary entries, %.2f MB (%.1f%% of the "
                 "full model)", plan.version, plan.parent, changed, manifest["num_vocabulary_entries"],
                 manifest["delta_bytes"] / 1e6, 100 * manifest["delta_bytes"] / max(full_bytes, 1))
    return {"delta": str(_dir(ctx) / "delta"), "bytes": manifest["delta_bytes"]}


def _tiered_delta(ctx: RunContext, plan: Plan, state, parent_state, specs, weights, parent_weights) -> tuple:
    """(arrays, weight specs) of the delta of a model with tiered tables, in the layout of the served model (every
    table in memory: components.delta.served_weight_arrays). A tiered table's rows are the ones the minute's
    batches read (and the new values' rows it drew afresh): the child checkpoint's overlay of the table."""
    from components.delta import new_vocabulary_entries, served_weight_arrays
    from components.table_report import hashed_tables
    from trainer.tiered_tables import read_overlays

    served_specs = _store(ctx).manifest(MODEL_NAME, plan.chain_root)["weight_specs"]
    tiered_rows = {name: (overlay["rows"], overlay["values"])
                   for name, overlay in read_overlays(_dir(ctx) / "checkpoint").items()}
    keys, rows = new_vocabulary_entries(parent_state, state)
    hashed = hashed_tables(ctx.spec, ctx.config.train.multi_hash_features)
    arrays = {"vocab_keys": keys, "vocab_rows": rows,
              **served_weight_arrays(parent_weights, weights, specs, served_specs, state.table_sizes(), hashed,
                                     tiered_rows)}
    return arrays, served_specs


def _table_report(ctx: RunContext, plan: Plan, state, specs, weights, parent_weights) -> dict:
    """The minute's table report (components/table_report.py): the rows it touched are the rows its delta
    carries."""
    from components.manifest import read_manifest
    from components.table_report import changed_rows_by_table, embedding_table, hashed_tables, table_report
    from pipelines.daily import log_table_report

    embeddings, parent = embedding_table(specs, weights), embedding_table(specs, parent_weights)
    hashed = hashed_tables(ctx.spec, ctx.config.train.multi_hash_features)
    tiered = {name: table.hot_rows for name, table in ctx.spec.tables().items() if table.tiered}
    sizes = state.table_sizes()  # a minute's tables keep their parent's size
    changed = (changed_rows_by_table(embeddings, sizes, parent, sizes, [*hashed, *tiered])
               if embeddings is not None and parent is not None else None)
    tables: Any = contextlib.nullcontext({})
    if tiered:  # read from the child's chain; rows touched: the rows the minute's batches read (its overlay)
        from trainer.tiered_tables import checkpoint_tables, read_overlays

        changed = {**(changed or {}), **{name: overlay["rows"]
                                         for name, overlay in read_overlays(_dir(ctx) / "checkpoint").items()}}
        evaluation = json.loads((_dir(ctx) / EVALUATION_FILE).read_text())
        tables = checkpoint_tables(_dir(ctx) / "checkpoint", tiered, evaluation.get("tiered_tables"),
                                   embedding_dim=ctx.config.train.embedding_dim)
    with tables as tables:
        report = table_report(ctx.spec, state, kind="minute", version=plan.version, embeddings=embeddings,
                              hashed=hashed, changed=changed, parent=plan.parent,
                              samples=read_manifest(_dir(ctx) / "samples" / "train", kind="samples", verify=False),
                              tiered=tables)
    log_table_report(ctx, report, _dir(ctx))
    return report


def _full_model_bytes(ctx: RunContext, version: str) -> int:
    manifest = _store(ctx).manifest(MODEL_NAME, version)
    return int(sum(entry["bytes"] for entry in manifest.get("files", {}).values()))


def gate(ctx: RunContext) -> dict:
    """Every value finite, changed embedding rows within the norm bound, holdout logloss no worse than the
    parent's by more than the margin. Writes gate.json either way; raises DeltaGateError on failure."""
    from components.delta import read_delta
    from components.evaluation import check_delta_gate
    from components.manifest import write_json_atomic

    manifest, arrays = read_delta(_dir(ctx) / "delta")
    evaluation = json.loads((_dir(ctx) / EVALUATION_FILE).read_text())
    result = check_delta_gate(manifest["weight_specs"], arrays, evaluation["holdout_logloss"],
                              evaluation["parent_holdout_logloss"], ctx.config.incremental)
    failures, max_norm, increase = result.failures, result.max_embedding_norm, result.logloss_increase
    report = {"passed": result.passed, "failures": failures, "max_embedding_norm": max_norm,
              "holdout_logloss": evaluation["holdout_logloss"],
              "parent_holdout_logloss": evaluation["parent_holdout_logloss"], "logloss_increase": increase}
    write_json_atomic(_dir(ctx) / GATE_FILE, report)
    ctx.tracker.log_metrics({"gate.passed": float(not failures), "gate.max_embedding_norm": max_norm,
                             "gate.logloss_increase": increase})
    ctx.tracker.log_artifact(_dir(ctx) / GATE_FILE, "gate")
    if failures:
        ctx.tracker.set_tags({"gate": "failed"})
        raise DeltaGateError(f"delta {manifest['version']} failed its gate and is not published; serving stays on "
                             f"the last good version: " + "; ".join(failures))
    ctx.tracker.set_tags({"gate": "passed"})
    ctx.progress("gate: passed (max embedding norm %.2f, logloss %+.4f vs parent)", max_norm, increase)
    return report


def publish(ctx: RunContext) -> dict:
    from components.delta import read_delta
    from components.manifest import write_json_atomic

    gate_report = json.loads((_dir(ctx) / GATE_FILE).read_text())
    if not gate_report["passed"]:
        raise DeltaGateError("refusing to publish: the gate report says the delta failed")
    plan = read_plan(ctx)
    manifest, _ = read_delta(_dir(ctx) / "delta")
    store = _store(ctx)
    uri = store.publish(MODEL_NAME, plan.version, _dir(ctx) / "delta")
    published_at = datetime.now(UTC)  # a measurement for the freshness metric, not an input of any output
    freshness = (published_at - datetime.fromisoformat(manifest["data_end"])).total_seconds()
    history = _record_freshness(ctx, plan.version, manifest["data_end"], published_at)
    write_json_atomic(ctx.layout.freshness_log, history)
    ctx.tracker.log_metrics({"publish.freshness_s": freshness, "delta.bytes": manifest["delta_bytes"]})
    ctx.tracker.set_tags({"model.version": plan.version, "model.uri": uri, "model.parent": plan.parent})
    _log_freshness_plot(ctx, history)
    ctx.progress("publish: version %s (parent %s) in %s, %.1f s after its newest minute closed", plan.version,
                 plan.parent, uri, freshness)
    return {"version": plan.version, "uri": uri, "freshness_s": freshness}


def spans(ctx: RunContext) -> dict:
    """After the publish, off the minute's freshness: the spans the chain's binary counter places at this minute's
    checkpoint, one per tiered table, merged from the pieces they replace (trainer/tiered_tables.py
    `write_spans`), so that a table read from the chain later crosses one piece per set bit of its position. Until
    they are written the chain crosses the minutes' overlays, the same table. Nothing for a model without tiered
    tables."""
    from trainer.tiered_tables import write_spans

    started = time.monotonic()
    rows = {}
    if any(table.tiered for table in ctx.spec.tables().values()):
        rows = write_spans(_dir(ctx) / "checkpoint", ctx.config.incremental.tiered_span_max_mib * 2**20)
    seconds = time.monotonic() - started
    if rows:
        ctx.progress("spans: %s, %.1f s", ", ".join(f"{name} {count:,} rows" for name, count in rows.items()),
                     seconds)
        ctx.tracker.log_metrics({"spans.seconds": seconds, **{f"spans.rows.{k}": v for k, v in rows.items()}})
    ctx.tracker.end("FINISHED")  # the run's last step
    return {"span_rows": rows, "seconds": seconds}


def _record_freshness(ctx: RunContext, version: str, data_end: str, published_at: datetime) -> dict[str, Any]:
    path = ctx.layout.freshness_log
    history = json.loads(path.read_text()) if path.is_file() else {}
    history[version] = {"data_end": data_end, "published_at": published_at.isoformat()}
    return dict(sorted(history.items())[-1440:])  # a day of minutes


def _log_freshness_plot(ctx: RunContext, history: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(datetime.fromisoformat(e["data_end"]), (datetime.fromisoformat(e["published_at"])
               - datetime.fromisoformat(e["data_end"])).total_seconds()) for e in history.values()][-180:]
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot([p[0] for p in points], [p[1] for p in points], marker=".")
    ax.set_ylabel("seconds from minute close to publish")
    ax.set_title(f"delta freshness, last {len(points)} minutes")
    ax.grid(alpha=0.3)
    fig.autofmt_xdate()
    fig.tight_layout()
    ctx.tracker.log_figure(fig, "plots/freshness.png")
    plt.close(fig)


STEPS: tuple[Step, ...] = (
    Step("wait_for_data", "sensor: this minute's raw partition complete (its completion marker)", data_ready,
         sensor=True, inlets=("raw_minutes",)),
    Step("plan", "the parent model and the minutes to learn", plan),
    Step("validate", "great-expectations on the planned raw slices; a failing one is quarantined", validate,
         upstream=("plan",), inlets=("raw_minutes",)),
    Step("samples", "Spark: the minutes folded into the parent's vocabularies (no table grows), then block "
                    "TFRecords of training and held-out rows", samples, upstream=("plan",), pool="spark",
         inlets=("raw_minutes",)),
    Step("train", "warm-start training from the parent checkpoint; holdout logloss of parent and child", train,
         upstream=("validate", "samples"), pool="training", system_metrics=True),
    Step("export_delta", "the rows that changed, new vocabulary entries, dense weights, with a manifest", export_delta),
    Step("gate", "finite values, embedding norms, holdout logloss vs the parent", gate),
    Step("publish", "the delta into the model store (objects first, manifest last); freshness", publish,
         outlets=("model",)),
    Step("spans", "tiered tables: the chain's spans at this minute, merged from the pieces they replace, after "
                  "the publish", spans),
)
STEP_NAMES: tuple[str, ...] = tuple(step.name for step in STEPS)
