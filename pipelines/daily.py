"""The daily pipeline, defined once: the Airflow DAG `ctr_daily` and `ctr run daily` both run these steps.

validate -> join (event streams only) -> features -> samples -> train -> evaluate -> export. Each step is a
transaction on its data interval: it reads the manifests its predecessor committed, writes its own outputs
under paths that are a function of the interval (re-runs replace them), and logs to the run's MLflow run.
Heavy libraries are imported inside the steps so the DAG file parses fast.

`features.source` picks the input once (pipelines/sources.py, `ctx.source`): "click_log" (labelled minute
slices in the spec's layout) or "events" (impression and click streams, labelled by the join step; the join
has nothing to do for the click log). No step branches on the source's name.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from pipelines.context import RunContext, Step

MODEL_NAME = "ctr"
# The baseline step's summary and held-out predictions, beside the evaluation report.
BASELINE_FILE = "baseline.json"
BASELINE_PREDICTIONS_FILE = "baseline_predictions.npz"


def split_minutes(ctx: RunContext) -> tuple[list, list]:
    """The interval's minutes that hold (validated) raw data, split in time: the last `eval_fraction` of them
    are held out for evaluation, so the model is always scored on traffic later than what it trained on."""
    minutes = ctx.source.minutes_with_data(ctx.layout, ctx.spec, ctx.interval)
    if len(minutes) < 2:
        raise RuntimeError(
            f"{ctx.interval.tag} has {len(minutes)} minute slice(s) of {ctx.source.name} data; at least 2 are needed "
            f"to train on earlier minutes and evaluate on later ones (data root {ctx.layout.root})"
        )
    num_eval = max(1, math.ceil(len(minutes) * ctx.config.features.eval_fraction))
    return minutes[:-num_eval], minutes[-num_eval:]


def _input_frame(ctx: RunContext, minutes):
    """Parsed, labelled rows of `minutes` (the spec's typed columns and `minute`), and how many minutes they
    come from."""
    return ctx.source.rows(ctx, minutes, ctx.layout.joined_dir(ctx.interval)), len(minutes)


def validate(ctx: RunContext) -> dict:
    from components.validation import DATA_DOCS, DataValidationError, validate_interval

    minutes = list(ctx.interval.minutes())
    ctx.progress("validate: %d minutes in %s: listing their partitions", len(minutes), ctx.interval.tag)
    tracker = ctx.tracker
    tracker.log_run_config(ctx.config)
    datasets = ctx.source.datasets(ctx.spec)
    out, errors = {}, []
    click_log = datasets[0] if len(datasets) == 1 else None
    for dataset in datasets:
        # The click log keeps its report and metric names from before there were streams.
        report_path = ctx.layout.validation_report(ctx.interval, "report" if dataset is click_log else dataset.name)
        prefix = "validation" if dataset is click_log else f"validation.{dataset.name}"
        try:
            report = validate_interval(ctx.layout, minutes, report_path, dataset=dataset,
                                       docs_dir=report_path.parent / DATA_DOCS,
                                       progress=_validation_progress(ctx, dataset.name))
        except DataValidationError as err:  # the other streams are still validated; the run fails below
            errors.append(str(err))
            report = json.loads(report_path.read_text()) if report_path.exists() else None
        finally:
            if report_path.exists():
                tracker.log_artifact(report_path, "validation")
            if (report_path.parent / DATA_DOCS).is_dir():  # great-expectations' HTML, shown by the MLflow UI
                tracker.log_artifact(report_path.parent / DATA_DOCS, f"validation/{DATA_DOCS}")
        if report is None:
            continue
        tracker.log_metrics({f"{prefix}.slices_passed": report["num_passed"],
                             f"{prefix}.slices_failed": len(report["failed"]),
                             f"{prefix}.slices_missing": len(report["missing"]),
                             f"{prefix}.rows": report["num_rows"]})
        ctx.progress("validate: %s: %d slices passed, %d quarantined, %d missing, %d rows", dataset.name,
                     report["num_passed"], len(report["failed"]), len(report["missing"]), report["num_rows"])
        out[dataset.name] = {"report": str(report_path), "rows": report["num_rows"]}
    if errors:
        raise DataValidationError("\n".join(errors))
    return out[click_log.name] if click_log else out


def _validation_progress(ctx: RunContext, name: str, every_s: float = 10.0):
    """validate_interval's progress as a line every `every_s` seconds (and a last one when there was one):
    partitions done of those there, rows passed, rate and time left."""
    started = time.monotonic()
    last = started

    def report(done: int, total: int, rows: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last < every_s and (done < total or last == started):
            return
        last = now
        rate = done / max(now - started, 1e-6)
        ctx.progress("validate: %s: %d of %d partitions (%d rows passed so far), %.0f partitions/s, about %.0f s "
                     "left", name, done, total, rows, rate, (total - done) / rate if rate else 0.0)

    return report


def join(ctx: RunContext) -> dict:
    """Labels the interval's rows when its source needs it (events: impressions joined with their clicks in the
    attribution window, with behaviour sequences, validated, as Parquet under joined/<interval>)."""
    directory = ctx.layout.joined_dir(ctx.interval)
    started = time.monotonic()
    metrics = ctx.source.label(ctx, ctx.interval, directory)
    if metrics is None:
        ctx.progress("join: nothing to join, the %s source is labelled", ctx.source.name)
        return {"skipped": f"features.source={ctx.source.name}"}
    totals = {name: value for name, value in metrics.items() if name != "per_minute"}
    ctx.tracker.log_metrics({f"join.{name}": value for name, value in totals.items()}
                            | {"join.seconds": time.monotonic() - started})
    ctx.tracker.log_artifact(directory / "metrics.json", "join")
    ctx.progress("join: %d impressions, %d positives; clicks: %d attributed, %d late (after the window, counted, "
                 "not labelled), %d orphan, %d duplicate deliveries; %.0f s", totals["impressions"],
                 totals["positives"], totals["attributed_clicks"], totals["late_clicks"], totals["orphan_clicks"],
                 totals["duplicate_clicks"], time.monotonic() - started)
    return {"joined": str(directory), **totals}


def features(ctx: RunContext) -> dict:
    from components.feature_state import load_feature_state
    from components.interval import day_number
    from components.manifest import read_manifest
    from spark_jobs.features import build_feature_state, write_feature_state

    train_minutes, _ = split_minutes(ctx)
    started = time.monotonic()
    frame, num_slices = _input_frame(ctx, train_minutes)
    if frame is None:
        raise RuntimeError(f"no validated raw slices to build features from in {ctx.interval.tag}; run validate first")
    ctx.progress("features: building vocabularies from %d training minute slices with Spark", num_slices)
    frame = frame.cache()
    num_rows = frame.count()
    previous_dir = ctx.layout.previous_feature_state_dir(ctx.interval)
    previous = load_feature_state(previous_dir, spec=ctx.spec) if previous_dir is not None else None
    ctx.progress("features: folding into %s", f"the feature state of {previous_dir.name}" if previous_dir
                 else "a new feature state (no earlier interval has one)")
    state = build_feature_state(frame, previous, ctx.config.features, day=day_number(ctx.interval.start),
                                version=f"daily-{ctx.interval.tag}", evict=True, spec=ctx.spec, num_rows=num_rows)
    frame.unpersist()
    directory = ctx.layout.feature_state_dir(ctx.interval)
    write_feature_state(state, directory, spec_hash=ctx.spec.hash(),
                        inputs={"interval": ctx.interval.as_dict(), "raw_slices": num_slices,
                                                  "parent": previous.version if previous else None},
                        num_rows=num_rows)
    manifest = read_manifest(directory)
    ctx.tracker.log_artifact(directory / "manifest.json", "manifests/feature_state")
    admitted = sum(manifest["vocabulary_sizes"].values())
    ctx.tracker.log_metrics({"features.training_rows": num_rows, "features.vocabulary_rows": admitted,
                             "features.table_rows": sum(manifest["table_sizes"].values()),
                             "features.new_rows": manifest["num_new_rows"],
                             "features.evicted_rows": manifest["num_evicted_rows"],
                             "features.candidates": manifest["num_candidates"],
                             "features.seconds": time.monotonic() - started})
    ctx.progress("features: %d rows, %d admitted values over %d vocabularies (%d new, %d evicted, %d candidates "
                 "below min_count=%d) in %.0f s", num_rows, admitted, len(state.vocabularies), manifest["num_new_rows"],
                 manifest["num_evicted_rows"], manifest["num_candidates"], state.min_count,
                 time.monotonic() - started)
    return {"feature_state": str(directory)}


def samples(ctx: RunContext) -> dict:
    from components.feature_state import load_feature_state
    from components.manifest import read_manifest
    from spark_jobs.samples import write_samples

    state_dir = ctx.layout.feature_state_dir(ctx.interval)
    state = load_feature_state(state_dir)
    state_manifest = read_manifest(state_dir, verify=False, spec_hash=ctx.spec.hash())
    out = {}
    for split, minutes in zip(("train", "eval"), split_minutes(ctx), strict=True):
        frame, num_slices = _input_frame(ctx, minutes)
        if frame is None:
            raise RuntimeError(f"no validated raw slices for the {split} split of {ctx.interval.tag}")
        started = time.monotonic()
        directory = ctx.layout.samples_dir(ctx.interval, split)
        manifest = write_samples(
            frame, state, directory, spec=ctx.spec, split=split,
            block_rows=ctx.config.features.block_rows, num_shards=ctx.config.features.num_shards,
            seed=ctx.config.features.seed, layout=ctx.config.features.samples_layout,
            shuffle=not ctx.source.rows_come_shuffled,
            inputs={"interval": ctx.interval.tag, "raw_slices": num_slices, "source": ctx.source.name,
                    "feature_state": {"version": state.version, "path": str(state_dir),
                                      "files": {name: entry["sha256"] for name, entry in
                                                state_manifest["files"].items()}}},
        )
        seconds = time.monotonic() - started
        rows = manifest["row_counts"]["rows"]
        ctx.tracker.log_artifact(directory / "manifest.json", f"manifests/samples_{split}")
        ctx.tracker.log_dataset(f"samples_{split}", directory / "manifest.json",
                                "training" if split == "train" else "evaluation",
                                {"start": minutes[0].isoformat(), "end": (minutes[-1] + timedelta(minutes=1))
                                 .isoformat(), "minutes": len(minutes)},
                                {"rows": rows, "shards": len(manifest["shards"]), "spec": ctx.spec.name})
        ctx.tracker.log_metrics({f"samples.{split}_rows": rows, f"samples.{split}_seconds": seconds})
        ctx.progress("samples: %s split, %d rows in %d TFRecord shards, %.0f s", split, rows,
                     len(manifest["shards"]), seconds)
        out[split] = str(directory)
    return out


def baseline(ctx: RunContext) -> dict:
    """The run's own baseline (components/baseline.py): a hashed logistic regression fitted on the training
    minutes' rows and scored on the held-out minutes' rows, the same rows the model trains and is scored on.
    The evaluate step reads it (lift_auc, and the gate's gate.min_lift_auc)."""
    import numpy as np

    from components.baseline import LABEL, MINUTE, fit_baseline_on_rows
    from components.manifest import write_json_atomic

    config = ctx.config.baseline
    path = ctx.layout.evaluation_dir(ctx.interval) / BASELINE_FILE
    if not config.enabled:
        path.unlink(missing_ok=True)
        ctx.progress("baseline: off (baseline.enabled=false)")
        return {"skipped": "baseline.enabled=false"}
    started = time.monotonic()
    frames = {}
    available = 0
    for split, minutes in zip(("train", "eval"), split_minutes(ctx), strict=True):
        frame, _ = _input_frame(ctx, minutes)
        if frame is None:
            raise RuntimeError(f"no validated raw slices for the baseline's {split} rows of {ctx.interval.tag}")
        if split == "train":
            available = frame.count()
            if available > config.max_train_rows:
                frame = frame.sample(fraction=min(1.0, 1.05 * config.max_train_rows / available),
                                     seed=ctx.config.features.seed).limit(config.max_train_rows)
        rows = frame.toPandas().sort_values(MINUTE, kind="stable")
        frames[split] = rows
    ctx.progress("baseline: hashed logistic regression on %d of %d training rows, C from %s by logloss on the last "
                 "%.0f %% of them", len(frames["train"]), available, ",".join(map(str, config.regularization_grid)),
                 100 * config.validation_fraction)
    result = fit_baseline_on_rows(
        frames["train"].to_dict("records"), frames["train"][LABEL].to_numpy(),
        frames["eval"].to_dict("records"), frames["eval"][LABEL].to_numpy(), ctx.spec,
        regularization_grid=config.regularization_grid, validation_fraction=config.validation_fraction,
        num_features=config.num_features, available_train_rows=available)
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    np.savez(directory / BASELINE_PREDICTIONS_FILE, labels=frames["eval"][LABEL].to_numpy(np.float32),
             predictions=result.predictions)
    settings = {key: value for key, value in ctx.config.flat().items() if key.startswith("baseline.")}
    summary = {"kind": "hashed_logistic_regression", "library": "scikit-learn", **result.metrics(),
               "feature_set": result.feature_set,
               "validation_auc_by_c": result.validation_auc_by_c,
               "validation_logloss_by_c": result.validation_logloss_by_c, "config": settings}
    write_json_atomic(path, summary)
    ctx.tracker.log_metrics({f"baseline.{k}": v for k, v in result.metrics().items()})
    ctx.tracker.log_artifact(path, "evaluation")
    ctx.progress("baseline: AUC %.4f, logloss %.4f on %d held-out rows (C=%s, %s), %.0f s", result.auc,
                 result.logloss, result.eval_rows, result.regularization_c, result.feature_set.replace("_", " "),
                 time.monotonic() - started)
    return {"auc": result.auc, "logloss": result.logloss}


def sample_files(directory: Path, spec_hash: str | None = None) -> tuple[list[str], dict]:
    """The shard files of a committed samples directory, and its manifest (layout, row counts); given
    `spec_hash`, the samples must have been written with that feature spec."""
    from components.manifest import read_manifest

    manifest = read_manifest(directory, kind="samples", spec_hash=spec_hash)
    return [str(directory / shard["file"]) for shard in manifest["shards"]], manifest


def _sample_files(ctx: RunContext, split: str) -> tuple[list[str], dict]:
    return sample_files(ctx.layout.samples_dir(ctx.interval, split), ctx.spec.hash())


def train(ctx: RunContext) -> dict:
    import numpy as np

    from components.feature_state import load_feature_state
    from components.manifest import write_json_atomic
    from trainer.arguments import resolve_batch_size
    from trainer.train import StepMetricsLogger, train_model

    state = load_feature_state(ctx.layout.feature_state_dir(ctx.interval), spec=ctx.spec)
    train_files, train_manifest = _sample_files(ctx, "train")
    eval_files, _ = _sample_files(ctx, "eval")
    config = ctx.config.train
    num_rows = train_manifest["row_counts"]["rows"]
    ctx.progress("train: %s on %d rows, batch %d%s, at most %d epochs, XLA=%s, mixed precision=%s, micro-batches=%d",
                 config.model, num_rows, resolve_batch_size(config.batch_size, num_rows),
                 " (chosen from the rows)" if not config.batch_size else "", config.epochs,
                 config.jit_compile, config.mixed_precision, config.micro_batches)
    tracker = ctx.tracker
    curve: list[tuple[int, dict]] = []

    def log_step(metrics: dict, step: int) -> None:
        curve.append((step, dict(metrics)))
        tracker.log_metrics({f"train.{k}": v for k, v in metrics.items()}, step=step)
        ctx.progress("train: step %d %s", step, " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))

    warm_start = _warm_start(ctx, state)
    if config.backend == "jax":  # a child process with KERAS_BACKEND=jax (trainer/jax_train.py)
        from trainer.jax_train import train_in_jax_process as train_model
    result = train_model(config, state.table_sizes(), train_files, eval_files,
                         ctx.layout.checkpoint_dir(ctx.interval),
                         callbacks=[StepMetricsLogger(log_step, config.log_every_steps)], warm_start=warm_start,
                         layout=train_manifest["layout"], num_rows=train_manifest["row_counts"]["rows"],
                         spec=ctx.spec)
    if result.best_epoch is not None:
        val_auc = result.history["val_auc"]
        if result.averaged_epochs:
            ctx.progress("train: kept the mean of epochs %s's weights (the best and the ones after it; held-out AUC "
                         "by epoch: %s)", ", ".join(str(e + 1) for e in result.averaged_epochs),
                         " ".join(f"{v:.4f}" for v in val_auc))
        else:
            ctx.progress("train: kept epoch %d of %d (held-out AUC by epoch: %s)", result.best_epoch + 1,
                         config.epochs, " ".join(f"{v:.4f}" for v in val_auc))
        tracker.log_metrics({"train.best_epoch": result.best_epoch + 1, "train.epochs_run": len(val_auc),
                             "train.averaged_epochs": len(result.averaged_epochs)})
    if result.resumed_from_step is not None:
        ctx.progress("train: resumed from the progress saved at step %d", result.resumed_from_step)
        tracker.set_tags({"train.resumed_from_step": str(result.resumed_from_step)})
    calibration = result.calibration
    if calibration is not None and calibration.get("held_out"):
        ctx.progress("train: calibrated on %d held-out rows (every other one): logit scale %.3f, shift %+.3f; "
                     "logloss on the other %d %.4f -> %.4f", calibration["rows"], calibration["scale"],
                     calibration["shift"], calibration["check_rows"], calibration["check_logloss_before"],
                     calibration["check_logloss_after"])
    elif calibration is not None:
        ctx.progress("train: level calibrated on %d training rows: mean prediction %.4f -> %.4f (click rate %.4f), "
                     "logit shift %+.3f", calibration["rows"], calibration["prediction_mean_before"],
                     calibration["prediction_mean_after"], calibration["label_mean"], calibration["shift"])
        tracker.log_metrics({f"train.calibration.{k}": v for k, v in result.calibration.items()})
    if result.warm_start is not None:
        ctx.progress("train: warm-started from %s: %s", warm_start.checkpoint_dir,
                     ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in result.warm_start.items()))
        tracker.log_metrics({f"train.warm_start.{k}": v for k, v in result.warm_start.items()})
        tracker.set_tags({"train.warm_start_from": str(warm_start.checkpoint_dir)})
    evaluation_dir = ctx.layout.evaluation_dir(ctx.interval)
    evaluation_dir.mkdir(parents=True, exist_ok=True)
    np.savez(evaluation_dir / "predictions.npz", labels=result.eval_labels, predictions=result.eval_predictions)
    summary = {"examples_per_second": result.examples_per_second, "num_train_examples": result.num_train_examples,
               "history": result.history, "best_epoch": result.best_epoch,
               "averaged_epochs": list(result.averaged_epochs)}
    write_json_atomic(evaluation_dir / "training.json", summary)
    tracker.log_metrics({"train.examples_per_second": result.examples_per_second})
    tracker.log_params({f"train.flag.{k}": v for k, v in result.speed_flags.items()})
    model_summary = evaluation_dir / "model_summary.txt"
    lines: list[str] = []
    result.model.summary(line_length=120, print_fn=lambda line, **_: lines.append(line), expand_nested=True)
    model_summary.write_text("\n".join(lines) + "\n")
    tracker.log_artifact(model_summary, "model")
    _log_training_curve(ctx, curve)
    _table_report(ctx, state, warm_start, train_manifest, result.tiered_tables)
    ctx.progress("train: done, %.0f examples/s", result.examples_per_second)
    return {"checkpoint": str(ctx.layout.checkpoint_dir(ctx.interval))}


def _table_report(ctx: RunContext, state, warm_start, samples_manifest: dict,
                  tier_counters: dict | None = None) -> dict:
    """The table report of the checkpoint just written (components/table_report.py), against the checkpoint it
    was warm-started from when there is one; written beside the evaluation and put in the exported version.
    Tiered tables are read from the checkpoint's stores, with what their hot tiers did (`tier_counters`)."""
    from components.delta import saved_weights
    from components.interval import day_number
    from components.manifest import read_manifest
    from components.table_report import changed_rows_by_table, embedding_table, hashed_tables, table_report

    specs, weights = saved_weights(ctx.layout.checkpoint_dir(ctx.interval)) or ([], [])
    embeddings = embedding_table(specs, weights)
    hashed = hashed_tables(ctx.spec, ctx.config.train.multi_hash_features)
    tiered = {name: table.hot_rows for name, table in ctx.spec.tables().items() if table.tiered}
    changed, parent = None, None
    previous = saved_weights(warm_start.checkpoint_dir) if warm_start is not None else None
    parent_embeddings = embedding_table(*previous) if previous is not None else None
    if embeddings is not None and parent_embeddings is not None:
        # Tiered tables are not in the concatenated table: their rows touched are the values seen in the run.
        parent_sizes = read_manifest(warm_start.checkpoint_dir, kind="checkpoint")["table_sizes"]
        changed = changed_rows_by_table(embeddings, state.table_sizes(), parent_embeddings, parent_sizes,
                                        [*hashed, *tiered])
        parent = warm_start.checkpoint_dir.name
    tables: Any = contextlib.nullcontext({})
    if tiered:  # read from the checkpoint's stores, with what their hot tiers did
        from trainer.tiered_tables import checkpoint_tables

        tables = checkpoint_tables(ctx.layout.checkpoint_dir(ctx.interval), tiered, tier_counters,
                                   embedding_dim=ctx.config.train.embedding_dim)
    with tables as tables:
        report = table_report(ctx.spec, state, kind="daily", version=model_version(ctx), embeddings=embeddings,
                              hashed=hashed, changed=changed, parent=parent, since_day=day_number(ctx.interval.start),
                              samples=samples_manifest, tiered=tables)
    log_table_report(ctx, report, ctx.layout.evaluation_dir(ctx.interval))
    return report


def _stored_table_report(directory: Path) -> dict:
    """{"tables": the report written in `directory`}, or {} for a run from before there was one."""
    from components.table_report import TABLES_FILE

    path = directory / TABLES_FILE
    return {"tables": json.loads(path.read_text())} if path.exists() else {}


def log_table_report(ctx: RunContext, report: dict, directory: Path) -> None:
    """tables.json and tables.png into `directory`, both to MLflow (artifacts "tables"), the totals as metrics,
    and a line of progress."""
    from components.manifest import write_json_atomic
    from components.table_report import TABLES_FILE, plot_report

    write_json_atomic(directory / TABLES_FILE, report)
    ctx.tracker.log_artifact(directory / TABLES_FILE, "tables")
    ctx.tracker.log_artifact(plot_report(report, directory / "tables.png"), "tables")
    totals = report["totals"]
    ctx.tracker.log_metrics({f"tables.{key}": value for key, value in totals.items()})
    ctx.progress("tables: %d of %d rows in use, %d new, %d evicted, %d values waiting for admission, %s rows touched "
                 "(%s); `ctr-pipeline tables %s` prints every table", totals["rows_in_use"], totals["rows"],
                 totals["rows_new"], totals["rows_evicted"], totals["waiting_for_admission"],
                 f"{totals['rows_touched']:,}", report["rows_touched_basis"], report["version"])


def _warm_start(ctx: RunContext, state):
    """The previous interval's checkpoint to start from, with the rows its feature-state update reset; None
    when warm start is off or no earlier interval left a checkpoint."""
    from components.manifest import ManifestError, read_manifest
    from trainer.train import WarmStart
    from trainer.warm_start import reset_rows_by_feature

    previous_state = ctx.layout.previous_feature_state_dir(ctx.interval)
    if not ctx.config.train.warm_start or previous_state is None:
        return None
    checkpoint = ctx.layout.checkpoints_root / previous_state.name
    try:
        read_manifest(checkpoint, kind="checkpoint")
    except ManifestError:
        ctx.progress("train: no committed checkpoint for %s; training from scratch", previous_state.name)
        return None
    return WarmStart(checkpoint, reset_rows_by_feature(state.evicted_rows, state.new_rows, list(state.vocabularies)))


def _log_training_curve(ctx: RunContext, curve: list[tuple[int, dict]]) -> None:
    if not curve:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({k for _, m in curve for k in m})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        points = [(s, m[key]) for s, m in curve if key in m]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".")
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(f"training {ctx.interval.tag}")
    fig.tight_layout()
    path = ctx.layout.evaluation_dir(ctx.interval) / "training_curve.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    ctx.tracker.log_artifact(path, "plots")


def evaluate(ctx: RunContext) -> dict:
    import numpy as np

    from components.evaluation import QualityGateError, check_gate
    from components.evaluation import evaluate as compute
    from components.manifest import write_json_atomic

    evaluation_dir = ctx.layout.evaluation_dir(ctx.interval)
    data = np.load(evaluation_dir / "predictions.npz")
    positives, rows = int(data["labels"].sum()), len(data["labels"])
    if positives in (0, rows):
        raise QualityGateError(
            f"the held-out slice of {ctx.interval.tag} has {rows} rows and {positives} clicks: AUC needs both "
            "clicks and non-clicks; run on a longer interval or raise features.eval_fraction (the share of the "
            "interval's last minutes held out)")
    evaluation = compute(data["labels"], data["predictions"])
    _, eval_minutes = split_minutes(ctx)
    best = ctx.source.planted_auc(ctx, eval_minutes, ctx.layout.joined_dir(ctx.interval))
    comparison = _baseline_comparison(ctx, data["labels"], data["predictions"], evaluation.auc)
    failures = check_gate(evaluation, ctx.config.gate, comparison)
    report = {"metrics": evaluation.metrics(), "planted_auc": best, "baseline": comparison,
              "gate": {"passed": not failures, "failures": failures, "config": ctx.config.gate.__dict__},
              # The table report's totals (the whole report: tables.json beside this file).
              "tables": _stored_table_report(evaluation_dir).get("tables", {}).get("totals")}
    write_json_atomic(evaluation_dir / "report.json", report)
    metrics = {f"eval.{k}": v for k, v in evaluation.metrics().items()}
    if best is not None:
        metrics["eval.planted_auc"] = best
        metrics["eval.auc_gap_to_planted"] = best - evaluation.auc
    ctx.tracker.log_metrics({**metrics, "gate.passed": float(not failures)})
    ctx.tracker.log_artifact(evaluation_dir / "report.json", "evaluation")
    if comparison is not None:
        metrics.update({"eval.baseline_auc": comparison["baseline_auc"],
                        "eval.baseline_logloss": comparison["baseline_logloss"],
                        "eval.lift_auc": comparison["lift_auc"],
                        "eval.lift_auc_ci95_low": comparison["lift_auc_ci95"][0],
                        "eval.lift_auc_ci95_high": comparison["lift_auc_ci95"][1]})
        ctx.tracker.log_metrics(metrics)
    ctx.progress("evaluate: AUC %.4f (planted model %s), logloss %.4f, mean prediction %.4f vs label %.4f",
                 evaluation.auc, f"{best:.4f}" if best is not None else "n/a", evaluation.logloss,
                 evaluation.mean_prediction, evaluation.mean_label)
    if comparison is not None:
        ctx.progress("evaluate: %s", baseline_line(evaluation.auc, evaluation.logloss, comparison))
    if failures:
        ctx.tracker.set_tags({"gate": "failed"})
        raise QualityGateError("the model failed the quality gate and is not published: " + "; ".join(failures))
    ctx.tracker.set_tags({"gate": "passed"})
    return report


def _baseline_comparison(ctx: RunContext, labels, predictions, auc: float) -> dict | None:
    """The model against the baseline step's hashed logistic regression on the same held-out rows: AUC, logloss,
    the lift and its 95 % bootstrap interval; None when the baseline step did not run (baseline.enabled=false)."""
    import numpy as np

    from components.baseline import bootstrap_auc_difference

    path = ctx.layout.evaluation_dir(ctx.interval) / BASELINE_FILE
    if not ctx.config.baseline.enabled or not path.exists():
        return None
    summary = json.loads(path.read_text())
    data = np.load(path.parent / BASELINE_PREDICTIONS_FILE)
    if len(data["labels"]) != len(labels) or float(data["labels"].sum()) != float(np.sum(labels)):
        raise RuntimeError(
            f"the baseline was scored on {len(data['labels'])} held-out rows ({int(data['labels'].sum())} clicks) "
            f"and the model on {len(labels)} ({int(np.sum(labels))} clicks): they must be the same rows; run the "
            "baseline step again for this interval")
    # The model's held-out rows come in the samples' shuffled order, the baseline's in time order: the same rows,
    # not paired row by row, so each side is resampled on its own (a wider interval than a paired one).
    low, high = bootstrap_auc_difference(labels, predictions, data["labels"], data["predictions"], paired=False,
                                         seed=ctx.config.features.seed)
    return {"baseline_auc": summary["auc"], "baseline_logloss": summary["logloss"],
            "lift_auc": auc - summary["auc"], "lift_auc_ci95": [low, high],
            "baseline_train_rows": summary["train_rows"], "baseline_regularization_c": summary["regularization_c"]}


def baseline_line(auc: float, logloss: float, comparison: dict) -> str:
    """One line for a person: the model against its baseline."""
    low, high = comparison["lift_auc_ci95"]
    return (f"model AUC {auc:.4f} logloss {logloss:.4f}; baseline (hashed logistic regression, same rows) AUC "
            f"{comparison['baseline_auc']:.4f} logloss {comparison['baseline_logloss']:.4f}; lift_auc "
            f"{comparison['lift_auc']:+.4f} (95 % interval {low:+.4f} to {high:+.4f})")


def model_version(ctx: RunContext) -> str:
    """Versions are the end of the data interval, YYYYMMDDHHMM: later data, higher version."""
    return f"{ctx.interval.end:%Y%m%d%H%M}"


def example_rows(ctx: RunContext, count: int = 5) -> list[dict]:
    """A few raw rows of the run's first minute, as the instances a client would send (the logged model's
    input example); none for event streams, whose rows are not requests."""
    from components.validation import read_raw_slice

    if ctx.config.features.source != "click_log":
        return []
    for minute in ctx.interval.minutes():
        directory = ctx.layout.raw_minute_dir(minute)
        parts = sorted(p for p in directory.glob("part-*")) if directory.is_dir() else []
        if parts:
            frame = read_raw_slice(parts[0], minute, spec=ctx.spec).head(count)
            return [ctx.spec.request_instance(row) for row in frame.to_dict("records")]
    return []


def served_tiered_model(ctx: RunContext, model, checkpoint: Path, staging: Path, state) -> tuple:
    """(the model to export, {"tables": what serving reads of each tiered table, "files": the stores put in
    `staging`}); the model as it is and {} without tiered tables. Each table's store is linked (or copied) from
    the checkpoint into `staging/tables/`, and the model's hot slots resized to the serving row cache; beside
    it, the rows the feature state `state` counted most, up to the cache's size, which serving loads first."""
    import os
    import shutil

    import numpy as np

    from trainer.model_inputs import model_inputs
    from trainer.tiered_tables import TABLES_DIR, preload_name, preload_rows, store_name, tiered_layer, with_cache_rows

    layer = tiered_layer(model)
    if layer is None:
        return model, {}
    names = model_inputs(ctx.spec).tables
    cache_rows = {table: ctx.config.serving.row_cache_rows or hot_rows
                  for table, hot_rows in layer.tiered_tables.items()}
    model = with_cache_rows(model, cache_rows)
    (staging / TABLES_DIR).mkdir(parents=True, exist_ok=True)
    tables, files = {}, []
    for table, rows in cache_rows.items():
        name = f"{TABLES_DIR}/{store_name(names[table])}"
        try:  # the checkpoint's store is never written again: one inode for both is safe
            os.link(checkpoint / name, staging / name)
        except OSError:
            shutil.copyfile(checkpoint / name, staging / name)
        readers = [f.name for f in (*ctx.spec.categorical, *ctx.spec.multi_categorical)
                   if ctx.spec.table_of(f.name) == names[table]]
        preload = f"{TABLES_DIR}/{preload_name(names[table])}"
        np.save(staging / preload, preload_rows([state.vocabularies[f] for f in readers
                                                 if f in state.vocabularies], rows))
        tables[names[table]] = {"table": table, "file": name, "cache_rows": rows, "preload": preload}
        files += [name, preload]
    return model, {"tables": tables, "files": files}


def export(ctx: RunContext) -> dict:
    from components.feature_state import load_feature_state
    from components.manifest import commit_dir, read_manifest, staging_dir, write_manifest
    from components.model_store import open_model_store
    from trainer.export import export_serving_model, weight_specs
    from trainer.train import load_checkpoint

    state_dir = ctx.layout.feature_state_dir(ctx.interval)
    state = load_feature_state(state_dir)
    checkpoint = ctx.layout.checkpoint_dir(ctx.interval)
    read_manifest(checkpoint, kind="checkpoint", spec_hash=ctx.spec.hash())
    report = json.loads((ctx.layout.evaluation_dir(ctx.interval) / "report.json").read_text())
    if not report["gate"]["passed"]:
        raise RuntimeError("refusing to export: the evaluation report says the gate failed")
    model = load_checkpoint(checkpoint, verify=False)  # its checksums were verified just above
    version = model_version(ctx)
    directory = ctx.layout.export_dir(ctx.interval)
    staging = staging_dir(directory)
    # Tiered tables stay on disk: the model gets a row cache of serving.row_cache_rows rows per table, and the
    # checkpoint's stores go beside it (docs/tiers.md).
    model, tiered = served_tiered_model(ctx, model, checkpoint, staging, state)
    files = [*export_serving_model(model, state, staging, ctx.spec), *tiered.get("files", ())]
    write_manifest(
        staging, kind="full_model", version=version, files=files, spec_hash=ctx.spec.hash(),
        inputs={"interval": ctx.interval.as_dict(), "feature_state": state.version,
                "samples": {s: str(ctx.layout.samples_dir(ctx.interval, s)) for s in ("train", "eval")}},
        extra={"parent": None, "chain_root": version, "model": ctx.config.train.model, "metrics": report["metrics"],
               "data_end": ctx.interval.end.isoformat(), "run_key": ctx.run_key, "weight_specs": weight_specs(model),
               # What serving checks requests against (serving.model), and the spec's hash.
               "feature_spec": {**ctx.spec.as_dict(), "hash": ctx.spec.hash()},
               # Where minute runs find what they train on from this version (a delta chain starts here).
               "training_state": {"checkpoint": str(checkpoint), "feature_state": str(state_dir)},
               # The table report (components/table_report.py): `ctr-pipeline tables VERSION` prints it.
               **_stored_table_report(ctx.layout.evaluation_dir(ctx.interval)),
               # Tables served from their stores (serving/row_cache.py): table -> index, file, cache rows.
               **({"tiered_serving": tiered["tables"]} if tiered else {})},
    )
    commit_dir(staging, directory)
    store = open_model_store(ctx.config.paths.model_store_uri, ctx.config.paths.s3_endpoint_url)
    uri = store.publish(MODEL_NAME, version, directory)
    ctx.tracker.set_tags({"model.version": version, "model.uri": uri})
    ctx.tracker.log_model(directory, version, uri, example_rows(ctx))
    ctx.tracker.end("FINISHED")
    ctx.progress("export: published model version %s to %s", version, uri)
    return {"version": version, "uri": uri}


STEPS: tuple[Step, ...] = (
    Step("validate", "great-expectations validation of the raw minute slices; bad slices quarantined", validate,
         inlets=("raw_minutes",)),
    Step("join", "Spark: impressions x clicks in the attribution window, behaviour sequences (events only)", join,
         pool="spark", inlets=("raw_minutes",)),
    Step("features", "Spark: vocabularies with min-count admission and dense transforms", features, pool="spark",
         inlets=("raw_minutes",)),
    Step("samples", "Spark: block TFRecords for the train and eval splits", samples, pool="spark",
         inlets=("raw_minutes",)),
    Step("baseline", "hashed logistic regression (scikit-learn) on the same rows, to compare the model with",
         baseline, upstream=("join",), pool="spark", inlets=("raw_minutes",)),
    Step("train", "Keras 3 training from block TFRecords", train, upstream=("samples",), pool="training",
         system_metrics=True),
    Step("evaluate", "AUC, logloss and calibration on the held-out later slice, lift over the baseline; quality "
         "gate", evaluate, upstream=("train", "baseline")),
    Step("export", "SavedModel on raw features, published to the model store", export, outlets=("model",)),
)
STEP_NAMES: tuple[str, ...] = tuple(step.name for step in STEPS)
RETRIES_DELAY = timedelta(minutes=1)
