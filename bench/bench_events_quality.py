"""Model quality on the joined event streams: what the feature spec's user, item, slot, device and behaviour
sequence are worth, and the sequence models' speed recipes. Writes bench/results/events_quality.json.

One generated events span (default 200 minutes x 5,000 impressions: 1 M) goes through the daily pipeline's
join -> features -> samples steps twice: under the `events` spec (every column of the join) and under the
`criteo` spec (the Criteo-like columns only, what the events source fed the model before the spec). Then, on
the same samples and the same held-out minutes:

    auc_dcnv2             DCNv2, events spec
    auc_din               DIN (target attention over the behaviour sequence), events spec
    auc_criteo_columns    DCNv2, criteo spec
    planted_auc           the generator's own model on the held-out labels, every user's preferred topic known
    learnable_auc         the generator's model with each user's topic inferred from that user's training labels
                          (exact posterior; components.events.learnable_event_auc): a ceiling for models that
                          learn from these labels, which planted_auc is not
    dien_gru              DIEN, GRU interest extractor           {"ex_per_s", "auc"}
    dien_sru              DIEN, SRU interest extractor           {"ex_per_s", "auc"}
    dien_gru_micro2       DIEN, GRU, 2 micro-batches per step    {"ex_per_s", "auc"}

The DIEN runs train `--dien-epochs` epochs (default 1) with early stopping off, so the three see the same rows.

    make bench-events-quality
    make bench-events-quality BENCH_EVENTS_QUALITY_ARGS="--minutes 20 --rows-per-minute 2000"   # a quick look

Goals (the feature-spec issue): the best model within 0.01 of the planted AUC; DIN at least as good as DCNv2.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from bench.provenance import provenance
from components.config import load_config, parse_override_args
from components.events import generate_events
from components.interval import Interval
from components.layout import Layout
from components.manifest import read_manifest
from pipelines.context import RunContext
from pipelines.runner import run_steps, select_steps

START = "2026-01-01T00:00"
DATA_STEPS = ["join", "features", "samples"]
MODEL_STEPS = ["train", "evaluate"]
# Shared by every run. The gate is off: the bench reports AUCs, it does not publish.
COMMON = {"features.source": "events", "gate.min_auc": 0.0, "gate.max_logloss": 10.0,
          "gate.max_calibration_error": 10.0}
MODELS = {
    "auc_dcnv2": ("events", {"train.model": "dcnv2"}),
    "auc_din": ("events", {"train.model": "din"}),
    "auc_criteo_columns": ("criteo", {"train.model": "dcnv2"}),
}
DIEN = {
    "dien_gru": {"train.model": "dien", "train.interest_cell": "gru"},
    "dien_sru": {"train.model": "dien", "train.interest_cell": "sru"},
    "dien_gru_micro2": {"train.model": "dien", "train.interest_cell": "gru", "train.micro_batches": 2},
}


def log(message: str) -> None:
    print(f"[bench-events-quality] {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=int, default=200, help="minutes of final samples (default 200)")
    parser.add_argument("--rows-per-minute", type=int, default=5000)
    parser.add_argument("--dien-epochs", type=int, default=1)
    parser.add_argument("--skip-dien", action="store_true", help="leave out the three DIEN runs")
    parser.add_argument("--extra-model", action="append", default=[], metavar="NAME",
                        help="also train this model of the zoo on the events spec, reported as auc_NAME "
                             "(repeatable; e.g. deepfm, dlrm, wide_deep)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="config overrides for every run")
    parser.add_argument("--keep", metavar="DIR", help="write the data here and keep it (default: a temporary dir)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "events_quality.json"))
    args = parser.parse_args(argv)
    # The steps' progress lines (rows, epochs, held-out AUC by epoch), as `ctr run` prints them.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("ctr.progress").setLevel(logging.INFO)
    overrides = parse_override_args(args.set)
    started = time.perf_counter()
    seconds: dict[str, float] = {}
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-events-quality-") as tmp:
        root = Path(args.keep or tmp)

        def config_for(spec: str, extra: dict):
            # Clicks arrive up to the attribution window after their impression: the span's samples are final
            # once the streams run that long past its end, so the generator runs a window (and a minute) longer.
            base = load_config(overrides={"paths.data_root": str(root / spec)}, environ={})
            window_minutes = -(-base.events.attribution_window_s // 60) + 1
            return load_config(overrides={
                "paths.data_root": str(root / spec), "generate.start": START,
                "generate.minutes": args.minutes + window_minutes, "generate.rows_per_minute": args.rows_per_minute,
                **COMMON, "features.spec": spec, **overrides, **extra}, environ={})

        first = datetime.fromisoformat(START).replace(tzinfo=UTC)
        span = Interval(first, first + timedelta(minutes=args.minutes))
        for spec in ("events", "criteo"):
            config = config_for(spec, {})
            tick = time.perf_counter()
            generated = generate_events(config.generate, config.events, Layout(config.paths.root))
            seconds[f"generate_{spec}"] = time.perf_counter() - tick
            log(f"{spec}: generated {generated.get('impressions')} impressions in {seconds[f'generate_{spec}']:.0f} s")
            tick = time.perf_counter()
            outputs = run_steps(RunContext(config=config, interval=span, pipeline="daily", run_id=f"bench-{spec}"),
                                select_steps("daily", DATA_STEPS))
            seconds[f"data_{spec}"] = time.perf_counter() - tick
            result.setdefault("sample_rows", {})[spec] = {
                split: read_manifest(Path(directory), kind="samples")["row_counts"]["rows"]
                for split, directory in outputs["samples"].items()}
            log(f"{spec}: join, features and samples in {seconds[f'data_{spec}']:.0f} s")
            if spec == "events":
                from pipelines.daily import split_minutes
                from spark_jobs.events import learnable_auc_of_joined

                context = RunContext(config=config, interval=span, pipeline="daily", run_id="bench-ceiling")
                train_minutes, eval_minutes = split_minutes(context)
                result["learnable_auc"] = learnable_auc_of_joined(context.layout, context.layout.joined_dir(span),
                                                                  train_minutes, eval_minutes)
                log(f"learnable ceiling (users' topics from their training labels): AUC {result['learnable_auc']:.4f}")

        def train_and_evaluate(name: str, spec: str, extra: dict) -> dict:
            config = config_for(spec, extra)
            tick = time.perf_counter()
            run_steps(RunContext(config=config, interval=span, pipeline="daily", run_id=f"bench-{name}"),
                      select_steps("daily", MODEL_STEPS))
            seconds[name] = time.perf_counter() - tick
            layout = Layout(config.paths.root)
            report = json.loads((layout.evaluation_dir(span) / "report.json").read_text())
            training = json.loads((layout.evaluation_dir(span) / "training.json").read_text())
            out = {"auc": report["metrics"]["auc"], "planted_auc": report["planted_auc"],
                   "ex_per_s": training["examples_per_second"], "train_rows": training["num_train_examples"],
                   "eval_rows": report["metrics"].get("num_examples"),
                   "val_auc_by_epoch": training["history"].get("val_auc"), "best_epoch": training.get("best_epoch")}
            log(f"{name}: AUC {out['auc']:.4f} (planted {out['planted_auc']:.4f}), {out['ex_per_s']:.0f} ex/s, "
                f"{seconds[name]:.0f} s")
            return out

        extra_models = {f"auc_{name}": ("events", {"train.model": name}) for name in args.extra_model}
        runs = {name: train_and_evaluate(name, spec, extra)
                for name, (spec, extra) in {**MODELS, **extra_models}.items()}
        if not args.skip_dien:
            dien_settings = {"train.epochs": args.dien_epochs, "train.early_stopping_patience": 0}
            runs.update({name: train_and_evaluate(name, "events", {**dien_settings, **extra})
                         for name, extra in DIEN.items()})
    planted = runs["auc_dcnv2"]["planted_auc"]
    best = max(runs[name]["auc"] for name in runs)
    result.update({
        **{name: runs[name]["auc"] for name in {**MODELS, **extra_models}},
        "planted_auc": planted,
        **{name: {"ex_per_s": runs[name]["ex_per_s"], "auc": runs[name]["auc"]} for name in DIEN if name in runs},
        "best_gap_to_planted": planted - best,
        "best_gap_to_learnable": result["learnable_auc"] - best,
        "learnable_gap_to_planted": planted - result["learnable_auc"],
        "goal_best_within_0.01_of_planted": planted - best <= 0.01,
        "goal_din_at_least_dcnv2": runs["auc_din"]["auc"] >= runs["auc_dcnv2"]["auc"],
        "runs": runs,
        "impressions_per_minute": args.rows_per_minute, "minutes": args.minutes,
        "overrides": overrides, "dien_epochs": args.dien_epochs,
        "seconds": {**seconds, "total": time.perf_counter() - started},
        "machine": platform.machine(), "python": sys.version.split()[0],
        "command": "make bench-events-quality" + (
            f" BENCH_EVENTS_QUALITY_ARGS='{' '.join(argv if argv is not None else sys.argv[1:])}'"
            if (argv if argv is not None else sys.argv[1:]) else ""),
    })
    result = {**provenance(result["command"]), **result}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
