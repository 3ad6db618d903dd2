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
- `cold`: a freshly loaded tiered model (warmed up as the server warms a model: its endpoints traced, its caches
  holding the preload rows below, or with `--no-preload` nothing but the missing rows), each batch the first to
  read most of its rows (every row it reads of the three tables that no earlier batch read and no preload
  cached is loaded from the store: page-cache reads of a file this size);
- `warm`: the same batches again on that model, every row cached;
- `evicting`: a model whose cache holds `--small-cache` rows, less than the batches read in all, so batches keep
  loading rows that earlier batches' loads evicted;
- `cold_three_calls`: `cold` again on a second load of the same export, served as exports made before the
  loaded endpoint are (trainer.export LOADED_ENDPOINTS): a request that loads rows takes three graph calls (the
  cached endpoint's, the load, the request preprocessed and answered again) instead of two.
p50 / p99 per phase, the ratio of each p50 and p99 to the in-memory one, rows loaded per request. Run at least twice
(`--runs`), the figures of each run kept.

Then served, under open-loop load (`served`): the same exports, each in its own model server (serving.server on
one core, the load generator on the other, as bench-serving runs them), requests of 100 candidates sent on a
fixed schedule, latency from each one's scheduled send time, skipped requests counted as unanswered
(bench/loadgen.py). The rate is half the highest rate the in-memory server holds at p99 <= 10 ms in an open-loop
scan (half the lowest rate tried when none held), the definition of bench-serving's loaded phase, or `--rate`
(one noisy step low in the scan halves the rate, and a pass at 10 requests/s takes five minutes). Each server
gets `--loaded-requests` distinct requests, then the same requests again:
- `memory`: `first` and `again`, the in-memory model (after the scan, where there is one);
- `tiered`: `cold`, a server just started, whose row cache holds nothing but what its warm-up read, so each
  request loads the rows no earlier request read; `warm`, the same requests again, every row cached;
- `evicting`: the small-cache export, `cold` and `warm` as above, both loading rows that others evicted.
Rows loaded per request and the hit rate come from the server's /metrics (`ctr_row_cache_loads_total`,
`ctr_row_cache_hits_total`), read before and after each pass.

Eviction (`eviction`, in this process, no timing): the row cache evicts by a segmented LRU (serving.row_cache,
"Eviction"); the small-cache exports, with and without preload, run the served passes' requests twice under it
and again with every row on probation (a plain LRU, the policy before), and the rows each loads a request are
compared (`eviction_rows_loaded_ratio`).

The pipeline's exports carry rows to preload: the values the state's rows counted most, up to each cache's size,
which a model loads when it warms up (serving.row_cache TieredRows.preload). The exports above leave them out (a
cache that holds only what requests loaded); each is exported a second time with them (`tiered_preloaded`,
`evicting_preloaded`), and served beside the first in the same run: with the cache of every row, preloading is
the whole table, so that server answers as the in-memory one does (one pass, `cold`); with the small cache it is
its 2,000 most counted rows a table (`cold` and `warm`). `--no-preload` skips the preloaded servers. Besides rows
loaded and the hit rate, each pass reports the share of its requests that made a load call (three graph calls
instead of one: `ctr_row_cache_load_calls_total`), which is what a miss costs, whatever the rows it loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_serving import candidates, export_full, feature_state, hundreds, percentiles
from bench.provenance import provenance
from components.config import TrainConfig
from components.feature_spec import spec_from_dict
from serving.row_cache import PROTECTED_SHARE

BATCH = 100
# The row cache's policies, as the protected share that makes each (serving.row_cache_protected_share).
POLICIES = {"segmented": PROTECTED_SHARE, "lru": 0.0}
TIERED = 3  # the largest tables


def tiered_spec(state, base) -> Any:
    sizes = state.table_sizes()
    largest = sorted(sizes, key=sizes.get, reverse=True)[:TIERED]
    data = base.as_dict()  # one entry per feature
    for entry in data["features"]:
        if entry["kind"] == "categorical" and entry["name"] in largest:
            entry.update(storage="tiered", hot_rows=4096)
    return spec_from_dict(data), largest


def value_counts(rows: int, names: list[str], state) -> dict[str, Any]:
    """The vocabularies of `names` with each value's count in the generated rows the feature state was built
    from (bench-serving's state counts every value 5): what a daily run's feature state counts."""
    import dataclasses
    from collections import Counter
    from datetime import UTC, datetime

    from components.config import GenerateConfig
    from components.synthetic import generate_minute

    table = generate_minute(GenerateConfig(rows_per_minute=rows, seed=3), 0, datetime(2026, 1, 1, tzinfo=UTC)).table
    out = {}
    for name in names:
        counts = Counter(value for value in table.column(name).to_pylist() if value)
        vocabulary = state.vocabularies[name]
        out[name] = dataclasses.replace(vocabulary, counts=tuple(counts[value] for value in vocabulary.values))
    return out


def build(work: Path, rows: int, small_cache: int, preload: bool = True) -> dict[str, Any]:
    """The in-memory export, and two tiered exports of the same weights (cache of every row, and a small one);
    with `preload`, each tiered export again with the rows to preload as the pipeline's export writes them (the
    values counted most in the state's rows, up to the cache's size)."""
    import keras

    from components.feature_spec import load_spec
    from trainer.model_inputs import model_inputs
    from trainer.models import build_model
    from trainer.row_store import RowStore
    from trainer.tiered_tables import preload_name, preload_rows, rebuilt, store_name
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
    counted = value_counts(rows, largest, state)
    exports = [("tiered", None, False), ("evicting", small_cache, False)]
    if preload:
        exports += [("tiered_preloaded", None, True), ("evicting_preloaded", small_cache, True)]
    for label, cache, preloaded in exports:
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
            if preloaded:
                tiered[name]["preload"] = f"tables/{preload_name(name)}"
                np.save(directory / tiered[name]["preload"], preload_rows([counted[name]], cache_rows[index]))
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
    models = build(work, args.rows, args.small_cache, preload=not args.no_preload)
    result = in_process(models, args)
    result["eviction"] = eviction(models, args)
    if not args.in_process_only:
        result["served"] = served(work, models, args)
    return result


def in_process(models: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from serving.model import LoadedModel

    instances = candidates(args.requests * BATCH, seed=11)
    batches = [instances[i:i + BATCH] for i in range(0, len(instances), BATCH)]
    memory = LoadedModel.load(models["memory"])
    memory.warm_up()
    tiered = LoadedModel.load(models["tiered"])
    evicting = LoadedModel.load(models["evicting"])
    # The same export served as exports before the loaded endpoint are: the load, then the request preprocessed
    # and answered again in a third call (serving.row_cache TieredRows.run).
    three_calls = LoadedModel.load(models["tiered"])
    assert tiered.tiered is not None and evicting.tiered is not None and three_calls.packed is not None
    assert tiered.packed is not None and tiered.packed.loaded_function is not None
    three_calls = dataclasses.replace(three_calls, packed=dataclasses.replace(three_calls.packed,
                                                                              loaded_function=None))
    for model in (tiered, evicting, three_calls):  # as a server does after a load: endpoints traced, rows cached
        model.warm_up()
    # Every answer checked against the in-memory model's first.
    expected = [memory.predict(batch) for batch in batches]
    phases = ("cold", "warm", "evicting", "cold_three_calls")
    latencies: dict[str, list[float]] = {"memory": [], **{phase: [] for phase in phases}}
    loaded: dict[str, list[int]] = {phase: [] for phase in phases}
    calls: dict[str, list[int]] = {phase: [] for phase in phases}  # graph calls that loaded rows
    for phase, model in (("cold", tiered), ("warm", tiered), ("evicting", evicting),
                         ("cold_three_calls", three_calls)):
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
    memory_p50 = percentiles(latencies["memory"])["p50_ms"]
    for phase in phases:
        result[phase]["p99_ratio_to_memory"] = result[phase]["p99_ms"] / memory_p99
        result[phase]["p50_ratio_to_memory"] = result[phase]["p50_ms"] / memory_p50
        result[phase]["rows_loaded_per_request"] = float(np.mean(loaded[phase]))
        # Of the requests that loaded rows, the load calls each took (one for all tables, since load_all_slots).
        loading = [c for c, rows in zip(calls[phase], loaded[phase], strict=True) if rows]
        result[phase]["load_calls_per_loading_request"] = float(np.mean(loading)) if loading else 0.0
    result["cache"] = {"tiered": tiered.tiered.counters(), "evicting": evicting.tiered.counters()}
    result["tiered_tables"] = models["tiered_tables"]
    return result


def eviction(models: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Rows loaded per request by the small-cache exports under the row cache's segmented LRU (the default) and
    under a plain LRU (the same caches with no protected segment: `row_cache_protected_share` 0; POLICIES), in
    this process, over the requests the served passes send (`--loaded-requests` of them, twice: `cold` then
    `warm`). The counts do not depend on timing, so the two policies are compared on the very same requests in
    one run."""
    from serving.model import LoadedModel

    request = hundreds(candidates(args.loaded_requests * BATCH + BATCH, seed=13))  # the served passes' requests
    out: dict[str, Any] = {"requests_per_pass": args.loaded_requests}
    labels = [label for label in ("evicting", "evicting_preloaded") if label in models]
    for policy in ("segmented", "lru"):
        for label in labels:
            model = LoadedModel.load(models[label], row_cache_protected_share=POLICIES[policy])
            assert model.tiered is not None
            model.warm_up()
            for name in ("cold", "warm"):
                before = sum(t["rows_loaded"] for t in model.tiered.counters().values())
                calls = model.tiered.load_calls
                for index in range(args.loaded_requests):
                    model.predict(request(index))
                loaded = sum(t["rows_loaded"] for t in model.tiered.counters().values()) - before
                out[f"{label}_{name}_{policy}"] = {
                    "rows_loaded_per_request": loaded / args.loaded_requests,
                    "load_calls_per_request": (model.tiered.load_calls - calls) / args.loaded_requests}
            print(f"  eviction, {policy}, {label}: rows loaded a request "
                  f"{out[f'{label}_cold_{policy}']['rows_loaded_per_request']:.1f} (cold), "
                  f"{out[f'{label}_warm_{policy}']['rows_loaded_per_request']:.1f} (warm)", flush=True)
    out["rows_loaded_ratio_segmented_to_lru"] = {
        f"{label}_{name}": out[f"{label}_{name}_segmented"]["rows_loaded_per_request"]
        / out[f"{label}_{name}_lru"]["rows_loaded_per_request"] for label in labels for name in ("cold", "warm")}
    return out


def row_cache_totals(port: int) -> dict[str, float]:
    """The served model's row cache counters, summed over its tiered tables, from /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10.0).text
    totals = {"loads": 0.0, "hits": 0.0, "load_calls": 0.0, "loaded_answers": 0.0}
    for family in text_string_to_metric_families(text):
        for name in totals:
            if family.name == f"ctr_row_cache_{name}":
                totals[name] += sum(sample.value for sample in family.samples if sample.name.endswith("_total"))
    return totals


def plot_tenths(runs: list[dict[str, Any]], path: Path) -> None:
    """p99 of each tenth of a pass's requests, per export and pass, one line per run; the preloaded exports, where
    the run served them, in a second panel beside the same in-memory and small-cache passes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    memory = (("memory", "first", "in memory, first pass", "tab:gray"),
              ("memory", "again", "in memory, again", "black"))
    panels = [("rows loaded on demand", (*memory,
                                         ("tiered", "cold", "tiered, cold cache", "tab:red"),
                                         ("tiered", "warm", "tiered, warm cache", "tab:blue"),
                                         ("evicting", "cold", "tiered, small cache", "tab:orange")))]
    if "evicting_preloaded" in runs[0]["served"]:
        panels.append(("caches preloaded at load", (
            *memory,
            ("tiered_preloaded", "cold", "tiered, whole table preloaded", "tab:purple"),
            ("evicting", "cold", "small cache, not preloaded", "tab:orange"),
            ("evicting_preloaded", "cold", "small cache preloaded", "tab:green"),
            ("evicting_preloaded", "warm", "small cache preloaded, again", "tab:olive"))))
    figure, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels), 4.5), sharey=True, squeeze=False)
    rate = runs[0]["served"]["rate_per_s"]
    per_tenth = runs[0]["served"]["requests_per_pass"] // 10
    highest = max(t["p99_ms"] for _, passes in panels for run in runs for label, name, _, _ in passes
                  for t in run["served"][label][name]["tenths"])
    # Both panels on one scale; a tenth above twice the in-memory passes' worst is drawn at the top, its value
    # written beside it, so that one burst of the host does not flatten every other line.
    top = min(highest, 2 * max(t["p99_ms"] for run in runs for label, name, _, _ in memory
                               for t in run["served"][label][name]["tenths"])) * 1.05
    for axis, (title, passes) in zip(axes[0], panels, strict=True):
        for index, run in enumerate(runs):
            served = run["served"]
            for label, name, text, colour in passes:
                values = [t["p99_ms"] for t in served[label][name]["tenths"]]
                axis.plot(range(1, len(values) + 1), [min(v, top) for v in values], color=colour, marker="o",
                          markersize=3, linestyle="-" if index == 0 else "--", label=text if index == 0 else None)
                for tenth, v in enumerate(values, start=1):
                    if v > top:
                        axis.annotate(f"{v:.0f} ms", (tenth, top), textcoords="offset points", xytext=(4, -10),
                                      fontsize=7, color=colour)
        axis.set_xlabel(f"tenth of the pass ({per_tenth} requests each, in the order due)")
        axis.set_title(f"{title}: 100 candidates at {rate:.0f}/s, open loop\n(solid: run 1, dashed: later runs)",
                       fontsize=10)
        axis.set_ylim(0, top)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    axes[0][0].set_ylabel("p99 latency from the scheduled send (ms)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def serve_passes(work: Path, export: Path, label: str, passes: tuple[str, ...], instances: list[dict],
                 requests: int, rate: float | None, scan_seconds: float) -> dict[str, Any]:
    """One server of `export`; `passes` of the same `requests` requests at `rate` (None: half the highest rate an
    open-loop scan held first), the row cache's counters read around each pass."""
    from bench.bench_serving import (
        CLIENT_CORE,
        FIRST_VERSION,
        MODEL_NAME,
        free_port,
        loaded,
        open_loop,
        start_server,
        stop_server,
        wait_healthy,
    )
    from components.model_store import LocalModelStore

    home = work / f"server-{label}"
    home.mkdir()
    LocalModelStore(home / "store").publish(MODEL_NAME, FIRST_VERSION, export)
    port = free_port()
    server = start_server(home, home / "store", port, free_port())
    out: dict[str, Any] = {}
    try:
        wait_healthy(port, server, home / "server.log")
        if (os.cpu_count() or 1) > 1:
            os.sched_setaffinity(0, {CLIENT_CORE})
        url = f"http://127.0.0.1:{port}/v1/models/{MODEL_NAME}:predict"
        if rate is None:
            start_rate = 20.0
            scan = open_loop(url, instances, start_rate, scan_seconds)
            out["scan"] = scan
            rate = 0.5 * (scan["max_rate_per_s_at_p99_10ms"] or scan["steps"][0]["rate_per_s"])
            time.sleep(2.0)  # the scan's last step went past saturation: its backlog drains first
        for name in passes:
            before = row_cache_totals(port)
            result = loaded(url, instances, rate, requests, by_tenths=True)
            after = row_cache_totals(port)
            loads, hits = after["loads"] - before["loads"], after["hits"] - before["hits"]
            result["rows_loaded_per_request"] = loads / requests
            result["hit_rate"] = hits / (hits + loads) if hits + loads else None
            # One load call for all tables, so this is the share of requests that loaded rows (three graph calls).
            result["load_calls_per_request"] = (after["load_calls"] - before["load_calls"]) / requests
            out[name] = result
            print(f"  {label} {name}: {rate:.1f} req/s, p50 {result['p50_ms']:.2f} ms, p99 {result['p99_ms']:.2f} ms, "
                  f"unanswered {result['unanswered']}, rows loaded a request {result['rows_loaded_per_request']:.1f}, "
                  f"load calls a request {result['load_calls_per_request']:.2f}", flush=True)
    finally:
        stop_server(server)
    out["rate_per_s"] = rate
    return out


def served(work: Path, models: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The exports under open-loop load, each in its own server (the module's docstring)."""
    import gc

    instances = candidates(args.loaded_requests * BATCH + BATCH, seed=13)
    cores = os.sched_getaffinity(0)
    # As in bench-serving: this process's own collections would stop the client's threads mid-request.
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        memory = serve_passes(work, models["memory"], "memory", ("first", "again"), instances,
                              args.loaded_requests, args.rate, args.step_seconds)
        rate = memory["rate_per_s"]
        tiered = serve_passes(work, models["tiered"], "tiered", ("cold", "warm"), instances, args.loaded_requests,
                              rate, args.step_seconds)
        evicting = serve_passes(work, models["evicting"], "evicting", ("cold", "warm"), instances,
                                args.loaded_requests, rate, args.step_seconds)
        out = {"rate_per_s": rate, "requests_per_pass": args.loaded_requests, "memory": memory, "tiered": tiered,
               "evicting": evicting}
        if "tiered_preloaded" in models:  # the whole table preloaded: one pass, nothing left to load
            out["tiered_preloaded"] = serve_passes(work, models["tiered_preloaded"], "tiered_preloaded", ("cold",),
                                                   instances, args.loaded_requests, rate, args.step_seconds)
            out["evicting_preloaded"] = serve_passes(work, models["evicting_preloaded"], "evicting_preloaded",
                                                     ("cold", "warm"), instances, args.loaded_requests, rate,
                                                     args.step_seconds)
    finally:
        gc.enable()
        gc.unfreeze()
        os.sched_setaffinity(0, cores)
    against = {"cold": "first", "warm": "again"}
    out["p99_ratio_to_memory"] = {
        f"{label}_{name}": out[label][name]["p99_ms"] / memory[against[name]]["p99_ms"]
        for label in ("tiered", "evicting", "tiered_preloaded", "evicting_preloaded") if label in out
        for name in ("cold", "warm") if name in out[label]}
    return out


def served_ranges(runs: list[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """Per served export and pass, [lowest, highest] over the runs of its p50, p99, rows loaded, load calls a
    request and hit rate."""
    out: dict[str, dict[str, list[float]]] = {}
    first = runs[0]["served"]
    for label, passes in first.items():
        if not isinstance(passes, dict) or label == "p99_ratio_to_memory":
            continue
        for name, result in passes.items():
            if not isinstance(result, dict) or "p99_ms" not in result:
                continue  # the scan, where the rate was found by one
            ranges = {}
            for key in ("p50_ms", "p99_ms", "rows_loaded_per_request", "load_calls_per_request", "hit_rate"):
                values = [r["served"][label][name].get(key) for r in runs]
                if all(v is not None for v in values):
                    ranges[key] = [min(values), max(values)]
            out[f"{label}_{name}"] = ranges
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000, help="generated rows whose values are admitted")
    parser.add_argument("--requests", type=int, default=300, help="requests of 100 candidates a phase")
    parser.add_argument("--small-cache", type=int, default=2_000, help="rows of the evicting phase's caches")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--loaded-requests", type=int, default=3000,
                        help="requests of 100 candidates a pass under load (each distinct; every pass sends the same)")
    parser.add_argument("--step-seconds", type=float, default=5.0, help="length of each open-loop scan step")
    parser.add_argument("--rate", type=float, help="requests a second under load (default: half the highest rate "
                        "the in-memory server holds at p99 <= 10 ms in a scan, which on a noisy machine can land "
                        "on a rate a tenth of the one a quieter minute gives)")
    parser.add_argument("--in-process-only", action="store_true", help="skip the servers under load")
    parser.add_argument("--no-preload", action="store_true",
                        help="skip the exports with rows to preload and their servers (row_cache_served.json was "
                        "measured without them)")
    parser.add_argument("--out", default="bench/results/row_cache.json")
    args = parser.parse_args()
    runs = []
    for _ in range(args.runs):
        work = Path(tempfile.mkdtemp(prefix="bench-row-cache-"))
        try:
            runs.append(run(work, args))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(json.dumps({k: runs[-1][k] for k in ("memory", "cold", "warm", "evicting", "cold_three_calls")},
                         indent=1), flush=True)
    ratios = {phase: [r[phase]["p99_ratio_to_memory"] for r in runs]
              for phase in ("cold", "warm", "evicting", "cold_three_calls")}
    p50_ratios = {phase: [r[phase]["p50_ratio_to_memory"] for r in runs]
                  for phase in ("cold", "warm", "evicting", "cold_three_calls")}
    served_ratios = {phase: [r["served"]["p99_ratio_to_memory"][phase] for r in runs]
                     for phase in (runs[0].get("served") or {}).get("p99_ratio_to_memory", {})}
    command = "make bench-row-cache" + (f" BENCH_ROW_CACHE_ARGS='{os.environ['BENCH_ROW_CACHE_ARGS']}'"
                                        if os.environ.get("BENCH_ROW_CACHE_ARGS") else "")
    result = {
        **provenance(command),
        "benchmark": "row_cache",
        "settings": {"rows": args.rows, "requests": args.requests, "batch": BATCH, "small_cache": args.small_cache,
                     "runs": args.runs, "measured": "in process, one request at a time (LoadedModel.predict)",
                     "loaded_requests": None if args.in_process_only else args.loaded_requests,
                     "preload": not args.no_preload,
                     "served": None if args.in_process_only else
                     (f"a server per export, open-loop at {args.rate} requests/s" if args.rate else
                      "a server per export, open-loop at half the in-memory server's highest rate at p99 <= 10 ms")},
        "p99_ratio_to_memory": {phase: [min(v), max(v)] for phase, v in ratios.items()},
        "p50_ratio_to_memory": {phase: [min(v), max(v)] for phase, v in p50_ratios.items()},
        "served_p99_ratio_to_memory": {phase: [min(v), max(v)] for phase, v in served_ratios.items()} or None,
        "served_passes": served_ranges(runs) if not args.in_process_only else None,
        # Rows loaded a request, segmented LRU over plain LRU, per run (the same in every run: no timing in it).
        "eviction_rows_loaded_ratio": {key: [r["eviction"]["rows_loaded_ratio_segmented_to_lru"][key] for r in runs]
                                       for key in runs[0]["eviction"]["rows_loaded_ratio_segmented_to_lru"]},
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if not args.in_process_only:
        plot_tenths(runs, Path(args.out).with_suffix(".png"))
    print(json.dumps({"in_process": result["p99_ratio_to_memory"], "served": result["served_p99_ratio_to_memory"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
