"""Model quality on generated data: the daily pipeline's features -> samples -> train -> evaluate steps on a
generated day, and the test AUC next to the planted model's AUC on the same held-out minutes (the best any
model can reach). Writes bench/results/quality.json.

    make bench-quality                                   # 600 minutes x 5000 rows: 3 M rows, ~15 min here
    make bench-quality BENCH_QUALITY_ARGS="--minutes 60"   # a quick look

Goal (the trainer issue): DCNv2's test AUC within 0.005 of the planted AUC.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

from bench.provenance import provenance
from components.config import load_config, parse_override_args
from components.interval import Interval
from components.layout import Layout
from components.synthetic import generate
from pipelines.context import RunContext
from pipelines.runner import run_steps, select_steps

DAY = "2026-01-01"
# The run trains with the defaults, as a user's daily run does, and `--set` changes them. (The bench once set 2
# epochs and learning rates 0.01 / 0.1 of its own; that run's file is bench/results/quality_tuned.json.)


def serving_precision(ctx: RunContext, directory: Path) -> dict:
    """The trained model exported as the pipeline exports it, and the held-out minutes' raw rows sent to it as
    a client sends them (LoadedModel.predict, 1,000 a call) at serving.precision float32 and bfloat16: AUC,
    logloss and how far the two precisions' predictions are apart."""
    import keras
    import numpy as np

    from components.evaluation import evaluate
    from components.feature_state import load_feature_state
    from components.manifest import write_manifest
    from components.validation import read_raw_slice
    from pipelines.daily import split_minutes
    from serving.model import LoadedModel
    from trainer.export import export_serving_model

    spec = ctx.spec
    model = keras.saving.load_model(ctx.layout.checkpoint_dir(ctx.interval) / "model.keras")
    state = load_feature_state(ctx.layout.feature_state_dir(ctx.interval))
    files = export_serving_model(model, state, directory, spec)
    write_manifest(directory, kind="full_model", version="quality", files=files,
                   extra={"feature_spec": {**spec.as_dict(), "hash": spec.hash()}})
    instances, labels = [], []
    for minute in split_minutes(ctx)[1]:
        for part in sorted(ctx.layout.raw_minute_dir(minute).glob("part-*")):
            for row in read_raw_slice(part, minute, spec=spec).to_dict("records"):
                instances.append(spec.request_instance(row))
                labels.append(int(row[spec.label.column]))
    predictions = {}
    for precision in ("float32", "bfloat16"):
        served = LoadedModel.load(directory, precision=precision)
        predictions[precision] = np.concatenate([served.predict(instances[start:start + 1000])
                                                 for start in range(0, len(instances), 1000)])
    gap = np.abs(predictions["bfloat16"] - predictions["float32"])
    relative = gap / predictions["float32"]
    return {
        **{precision: {key: value for key, value in evaluate(np.array(labels), values).metrics().items()
                       if key in ("auc", "logloss", "mean_prediction")}
           for precision, values in predictions.items()},
        "rows": len(labels),
        "max_abs_difference": float(gap.max()), "mean_abs_difference": float(gap.mean()),
        "max_relative_difference": float(relative.max()), "mean_relative_difference": float(relative.mean()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=int, default=600)
    parser.add_argument("--rows-per-minute", type=int, default=5000)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="config overrides for the run (default: none, the defaults)")
    parser.add_argument("--keep", metavar="DIR", help="write the data here and keep it (default: a temporary dir)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "quality.json"))
    args = parser.parse_args()
    overrides = parse_override_args(args.set)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-quality-") as tmp:
        root = Path(args.keep or tmp)
        config = load_config(overrides={
            "paths.data_root": str(root), "generate.start": f"{DAY}T00:00", "generate.minutes": args.minutes,
            "generate.rows_per_minute": args.rows_per_minute, **overrides}, environ={})
        summary = generate(config.generate, Layout(config.paths.root))
        generated_s = time.perf_counter() - started
        interval = Interval.day(DAY)
        ctx = RunContext(config=config, interval=interval, pipeline="daily", run_id=f"bench-quality-{DAY}")
        run_steps(ctx, select_steps("daily", ["features", "samples", "train", "evaluate"]))
        layout = Layout(config.paths.root)
        report = json.loads((layout.evaluation_dir(interval) / "report.json").read_text())
        training = json.loads((layout.evaluation_dir(interval) / "training.json").read_text())
        print("the held-out minutes through the exported model in each serving precision ...", flush=True)
        precision = serving_precision(ctx, root / "precision")
    metrics = report["metrics"]
    result = {
        "auc": metrics["auc"],
        "planted_auc": report["planted_auc"],
        "auc_gap": report["planted_auc"] - metrics["auc"],
        "logloss": metrics["logloss"],
        "mean_prediction": metrics["mean_prediction"],
        "mean_label": metrics["mean_label"],
        "goal_gap_at_most_0.005": report["planted_auc"] - metrics["auc"] <= 0.005,
        "train_rows": training["num_train_examples"],
        "eval_rows": metrics.get("num_examples"),
        "examples_per_second": training["examples_per_second"],
        "serving_precision": precision,
        "generated_rows": args.minutes * args.rows_per_minute,
        "generated_planted_auc_all_minutes": summary.get("planted_auc"),
        "overrides": overrides,
        "model": config.train.model,
        "seconds": {"generate": generated_s, "total": time.perf_counter() - started},
        "machine": platform.machine(), "python": sys.version.split()[0],
        "command": "make bench-quality" + (f" BENCH_QUALITY_ARGS='{' '.join(sys.argv[1:])}'" if sys.argv[1:] else ""),
    }
    result = {**provenance(result["command"]), **result}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
