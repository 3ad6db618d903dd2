"""Serving a tiered table from its store through the row cache, against the same model with the table in memory.

    make bench-row-cache                 # -> bench/results/row_cache.json

What it builds: DCNv2 (default settings) on the criteo spec with its three largest tables tiered
(`storage: tiered`), the feature state and candidates of bench-serving (generated rows; every value of 200,000
rows admitted), one set of weights exported twice as the pipeline exports it: with the tables in memory, and
with the tiered tables in stores beside the SavedModel and a row cache in it (serving/row_cache.py).

Measured in this process (`LoadedModel.predict` on TF-Serving instances, the request's conversion included;
one request at a time, so each figure is a request's own cost, not a server's under load), 100 candidates a
request, over the same candidate batches in the same order, the two models alternating batch by batch:
- `memory`: the table in memory;
- `cold`: a freshly loaded tiered model (warmed up as the server warms a model: its endpoints traced, nothing
  but the missing rows cached), each batch the first to read most of its rows (every row it reads of the three
  tables that no earlier batch read is loaded from the store: page-cache reads of a file this size);
- `warm`: the same batches again on that model, every row cached;
- `evicting`: a model whose cache holds `--small-cache` rows, less than the batches read in all, so batches keep
  loading rows that earlier batches' loads evicted.
p50 / p99 per phase, the ratio of each p99 to the in-memory one, rows loaded per request. Run at least twice
(`--runs`), the figures of each run kept.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_serving import candidates, export_full, feature_state, percentiles
from bench.provenance import provenance
from components.config import TrainConfig
from components.feature_spec import spec_from_dict

BATCH = 100
TIERED = 3  # the largest tables


def tiered_spec(state, base) -> Any:
    sizes = state.table_sizes()
    largest = sorted(sizes, key=sizes.get, reverse=True)[:TIERED]
    data = base.as_dict()  # one entry per feature
    for entry in data["features"]:
        if entry["kind"] == "categorical" and entry["name"] in largest:
            entry.update(storage="tiered", hot_rows=4096)
    return spec_from_dict(data), largest


def build(work: Path, rows: int, small_cache: int) -> dict[str, Any]:
    """The in-memory export, and two tiered exports of the same weights (cache of every row, and a small one)."""
    import keras

    from components.feature_spec import load_spec
    from trainer.model_inputs import model_inputs
    from trainer.models import build_model
    from trainer.row_store import RowStore
    from trainer.tiered_tables import rebuilt, store_name
    from trainer.warm_start import warm_start_weights

    keras.utils.set_random_seed(7)
    state = feature_state(rows, seed=3)
    base = load_spec("criteo")
    memory_model = build_model(TrainConfig(), state.table_sizes(), base)
    spec, largest = tiered_spec(state, base)
    names = list(model_inputs(spec).tables)
    layer = memory_model.embedding
    out = {"memory": export_full(memory_model, state, base, work / "memory", "202601010000"),
           "tiered_tables": {name: int(state.table_sizes()[name]) for name in largest}}
    values = np.asarray(layer.embeddings)
    for label, cache in (("tiered", None), ("evicting", small_cache)):
        directory = work / label
        (directory / "tables").mkdir(parents=True)
        tiered: dict[str, Any] = {}
        cache_rows = {}
        for name in largest:
            index = names.index(name)
            start, size = int(layer.offsets[index]), layer.table_sizes[index]
            RowStore.from_arrays(directory / "tables" / store_name(name), values[start:start + size],
                                 initial_accumulator=0.1).close()
            cache_rows[index] = cache or size
            tiered[name] = {"table": index, "file": f"tables/{store_name(name)}", "cache_rows": cache_rows[index]}
        model = rebuilt(memory_model, cache_rows)
        # Every weight but the tiered tables' (in the stores above) and their caches (filled on demand).
        warm_start_weights(model, memory_model, skip={model.embedding.hot_table(t).embeddings.path
                                                      for t in cache_rows})
        out[label] = export_full(model, state, spec, directory, "202601010000", tiered)
    return out


def timed(model, batches: list[list[dict]]) -> list[float]:
    out = []
    for batch in batches:
        start = time.perf_counter()
        model.predict(batch)
        out.append((time.perf_counter() - start) * 1e3)
    return out


def run(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from serving.model import LoadedModel

    models = build(work, args.rows, args.small_cache)
    instances = candidates(args.requests * BATCH, seed=11)
    batches = [instances[i:i + BATCH] for i in range(0, len(instances), BATCH)]
    memory = LoadedModel.load(models["memory"])
    memory.warm_up()
    tiered = LoadedModel.load(models["tiered"])
    evicting = LoadedModel.load(models["evicting"])
    assert tiered.tiered is not None and evicting.tiered is not None
    for model in (tiered, evicting):  # as the server does after a load: its endpoints traced, the missing rows cached
        model.warm_up()
    # Every answer checked against the in-memory model's first.
    expected = [memory.predict(batch) for batch in batches]
    latencies: dict[str, list[float]] = {"memory": [], "cold": [], "warm": [], "evicting": []}
    loaded: dict[str, list[int]] = {"cold": [], "warm": [], "evicting": []}
    calls: dict[str, list[int]] = {"cold": [], "warm": [], "evicting": []}  # graph calls that loaded rows
    for phase, model in (("cold", tiered), ("warm", tiered), ("evicting", evicting)):
        for index, batch in enumerate(batches):  # alternating with the in-memory model, batch by batch
            latencies["memory"] += timed(memory, [batch])
            before = sum(t["rows_loaded"] for t in model.tiered.counters().values())
            calls_before = model.tiered.load_calls
            start = time.perf_counter()
            answer = model.predict(batch)
            latencies[phase].append((time.perf_counter() - start) * 1e3)
            loaded[phase].append(sum(t["rows_loaded"] for t in model.tiered.counters().values()) - before)
            calls[phase].append(model.tiered.load_calls - calls_before)
            np.testing.assert_allclose(answer, expected[index], rtol=0, atol=1e-5)
    memory_p99 = percentiles(latencies["memory"])["p99_ms"]
    result: dict[str, Any] = {phase: {**percentiles(values), "requests": len(values)}
                              for phase, values in latencies.items()}
    for phase in ("cold", "warm", "evicting"):
        result[phase]["p99_ratio_to_memory"] = result[phase]["p99_ms"] / memory_p99
        result[phase]["rows_loaded_per_request"] = float(np.mean(loaded[phase]))
        # Of the requests that loaded rows, the load calls each took (one for all tables, since load_all_slots).
        loading = [c for c, rows in zip(calls[phase], loaded[phase], strict=True) if rows]
        result[phase]["load_calls_per_loading_request"] = float(np.mean(loading)) if loading else 0.0
    result["cache"] = {"tiered": tiered.tiered.counters(), "evicting": evicting.tiered.counters()}
    result["tiered_tables"] = models["tiered_tables"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000, help="generated rows whose values are admitted")
    parser.add_argument("--requests", type=int, default=300, help="requests of 100 candidates a phase")
    parser.add_argument("--small-cache", type=int, default=2_000, help="rows of the evicting phase's caches")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", default="bench/results/row_cache.json")
    args = parser.parse_args()
    runs = []
    for _ in range(args.runs):
        work = Path(tempfile.mkdtemp(prefix="bench-row-cache-"))
        try:
            runs.append(run(work, args))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(json.dumps({k: runs[-1][k] for k in ("memory", "cold", "warm", "evicting")}, indent=1), flush=True)
    ratios = {phase: [r[phase]["p99_ratio_to_memory"] for r in runs] for phase in ("cold", "warm", "evicting")}
    command = "make bench-row-cache" + (f" BENCH_ROW_CACHE_ARGS='{os.environ['BENCH_ROW_CACHE_ARGS']}'"
                                        if os.environ.get("BENCH_ROW_CACHE_ARGS") else "")
    result = {
        **provenance(command),
        "benchmark": "row_cache",
        "settings": {"rows": args.rows, "requests": args.requests, "batch": BATCH, "small_cache": args.small_cache,
                     "runs": args.runs, "measured": "in process, one request at a time (LoadedModel.predict)"},
        "p99_ratio_to_memory": {phase: [min(v), max(v)] for phase, v in ratios.items()},
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["p99_ratio_to_memory"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
