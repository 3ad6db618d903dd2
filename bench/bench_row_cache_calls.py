"""Two graph calls against three for a served request that loads rows: one tiered export served both ways under the
same open-loop load, in servers started fresh each round, passes alternated on the same requests.

    make bench-row-cache-calls           # -> bench/results/row_cache_calls.json
    make bench-row-cache-calls BENCH_ROW_CACHE_CALLS_ARGS='--rate 40 --rounds 2 --out /tmp/calls.json'

The exports are bench-row-cache's (DCNv2 with the trainer's defaults on the criteo spec, its three largest tables
tiered, no rows to preload): `tiered`, whose caches hold every row, and `evicting`, whose caches hold
`--small-cache` rows. Each is served as the pipeline exports it (`two_calls`: a request whose rows are not all
cached takes the cached endpoint's call, then the load and the answer in one, trainer.export LOADED_ENDPOINTS)
and as an export made before the loaded endpoint is served (`three_calls`: the same directory with the loaded
endpoint left out of its packed layout, so the server loads the rows in one call and preprocesses and answers the
request again in a third; a copy with its own manifest, every other byte the same).

A round starts one server of each (both on bench-serving's server core, the load generator on the other), waits
until both answer, then sends the same `--loaded-requests` requests of 100 candidates at the same rate to one and
then the other (the order turns every round), latency from each request's scheduled send time, unanswered requests
counted (bench/loadgen.py), and stops both. So in every round both servers meet the requests with caches as cold
as each other's. Around each pass: the server's own time (`ctr_request_duration_seconds` of predict, its mean over
the pass), rows loaded, load calls, requests answered by the loaded endpoint and the hit rate (`ctr_row_cache_*`)
from /metrics. The rate is `--rate`, or
half the highest rate an in-memory server of the same weights holds at p99 <= 10 ms in an open-loop scan (the
definition of bench-serving's loaded phase), found once before the rounds.

Keys: `rate_per_s`, `rounds` (per round, per export, per way: `p50_ms`, `p99_ms`, `server_mean_ms`,
`rows_loaded_per_request`, `load_calls_per_request`, `loaded_answers_per_request`, `hit_rate`, `unanswered`),
`three_over_two` (per round and export, the three-call server's p50, p99 and server mean over the two-call one's),
`three_over_two_range` ([lowest, highest] over the rounds, per export), `unanswered` (all passes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.bench_native_rows import predict_duration
from bench.bench_row_cache import BATCH, build, row_cache_totals
from bench.bench_serving import (
    FIRST_VERSION,
    MODEL_NAME,
    candidates,
    free_port,
    loaded,
    measuring_client,
    open_loop,
    start_server,
    stop_server,
    wait_healthy,
)
from bench.provenance import provenance
from components.manifest import MANIFEST_NAME, write_manifest
from trainer.export import PACKED_LAYOUT_FILE

WAYS = ("two_calls", "three_calls")
EXPORTS = ("tiered", "evicting")
# The manifest's own keys; the rest is what the export's writer passed as `extra`.
MANIFEST_KEYS = frozenset({"kind", "version", "format_hash", "feature_spec_hash", "code_version", "created_at",
                           "inputs", "row_counts", "files"})


def three_call_export(source: Path, target: Path) -> Path:
    """A copy of `source` whose packed layout names no loaded endpoint, as an export made before it: its server
    answers a request that loads rows in three graph calls. The manifest is written again over the copy."""
    shutil.copytree(source, target)
    layout_path = target / PACKED_LAYOUT_FILE
    layout = json.loads(layout_path.read_text())
    if "loaded_endpoints" not in layout:
        raise ValueError(f"{source} has no loaded endpoint to leave out: it is not a tiered export")
    del layout["loaded_endpoints"]
    layout_path.write_text(json.dumps(layout, indent=1) + "\n")
    manifest = json.loads((target / MANIFEST_NAME).read_text())
    created_at = manifest.get("created_at")
    write_manifest(target, kind=manifest["kind"], version=manifest["version"], files=list(manifest["files"]),
                   spec_hash=manifest.get("feature_spec_hash"), inputs=manifest.get("inputs"),
                   row_counts=manifest.get("row_counts"),
                   created_at=datetime.fromisoformat(created_at) if created_at else None,
                   extra={key: value for key, value in manifest.items() if key not in MANIFEST_KEYS})
    return target


def served_pass(port: int, instances: list[dict], rate: float, requests: int) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}/v1/models/{MODEL_NAME}:predict"
    seconds_before, count_before = predict_duration(port)
    cache_before = row_cache_totals(port)
    result = loaded(url, instances, rate, requests)
    cache_after = row_cache_totals(port)
    seconds_after, count_after = predict_duration(port)
    answered = count_after - count_before
    result["server_mean_ms"] = (seconds_after - seconds_before) / answered * 1e3 if answered else None
    loads, hits = cache_after["loads"] - cache_before["loads"], cache_after["hits"] - cache_before["hits"]
    result["rows_loaded_per_request"] = loads / requests
    result["load_calls_per_request"] = (cache_after["load_calls"] - cache_before["load_calls"]) / requests
    # Requests answered in the call that loaded their rows: every loading request with two calls, none with three.
    result["loaded_answers_per_request"] = (cache_after["loaded_answers"] - cache_before["loaded_answers"]) / requests
    result["hit_rate"] = hits / (hits + loads) if hits + loads else None
    return result


def start(work: Path, label: str, export: Path, settings: tuple[str, ...] = ()) -> tuple[Any, int]:
    """A server of `export` alone in its store under `work/label` (`settings`: more `--set` overrides), and its
    port."""
    from components.model_store import LocalModelStore

    home = work / label
    if home.exists():
        shutil.rmtree(home)
    home.mkdir()
    LocalModelStore(home / "store").publish(MODEL_NAME, FIRST_VERSION, export)
    port = free_port()
    return start_server(home, home / "store", port, free_port(), settings=settings), port


def scan_rate(work: Path, export: Path, instances: list[dict], step_seconds: float) -> tuple[float, dict]:
    """Half the highest rate an in-memory server holds at p99 <= 10 ms (half the lowest rate tried when none)."""
    server, port = start(work, "memory", export)
    try:
        wait_healthy(port, server, work / "memory" / "server.log")
        scan = open_loop(f"http://127.0.0.1:{port}/v1/models/{MODEL_NAME}:predict", instances, 20.0, step_seconds)
    finally:
        stop_server(server)
    return 0.5 * (scan["max_rate_per_s_at_p99_10ms"] or scan["steps"][0]["rate_per_s"]), scan


def run(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    models = build(work / "exports", args.rows, args.small_cache, preload=False)
    ways = {export: {"two_calls": models[export],
                     "three_calls": three_call_export(models[export], work / "exports" / f"{export}_three_calls")}
            for export in args.exports}
    instances = candidates(args.loaded_requests * BATCH + BATCH, seed=13)
    with measuring_client():
        scan = None
        rate = args.rate
        if rate is None:
            rate, scan = scan_rate(work, models["memory"], instances, args.step_seconds)
        rounds = []
        for index in range(args.rounds):
            order = list(WAYS) if index % 2 == 0 else list(reversed(WAYS))
            round_: dict[str, Any] = {"order": order}
            for export in args.exports:
                servers = {way: start(work, f"{export}-{way}", ways[export][way]) for way in WAYS}
                try:
                    for way, (server, port) in servers.items():
                        wait_healthy(port, server, work / f"{export}-{way}" / "server.log")
                    results = {}
                    for way in order:
                        results[way] = served_pass(servers[way][1], instances, rate, args.loaded_requests)
                        r = results[way]
                        print(f"  round {index + 1} {export} {way}: {rate:.1f} req/s, p50 {r['p50_ms']:.2f} ms, "
                              f"p99 {r['p99_ms']:.2f} ms, in the server {r['server_mean_ms']:.2f} ms, rows loaded "
                              f"a request {r['rows_loaded_per_request']:.1f}, load calls a request "
                              f"{r['load_calls_per_request']:.2f}, answered by the loading call "
                              f"{r['loaded_answers_per_request']:.2f}, unanswered {r['unanswered']}", flush=True)
                finally:
                    for server, _ in servers.values():
                        stop_server(server)
                # Each way as it says: the three-call server never answers in the loading call, the other does.
                if results["three_calls"]["loaded_answers_per_request"] or (
                        results["two_calls"]["load_calls_per_request"]
                        and not results["two_calls"]["loaded_answers_per_request"]):
                    raise RuntimeError(f"round {index + 1}, {export}: the servers did not answer as their ways say: "
                                       f"{results}")
                round_[export] = results
            rounds.append(round_)
    keys = ("p50_ms", "p99_ms", "server_mean_ms")
    ratios = [{export: {key: r[export]["three_calls"][key] / r[export]["two_calls"][key] for key in keys}
               for export in args.exports} for r in rounds]
    return {"rate_per_s": rate, "scan": scan, "tiered_tables": models["tiered_tables"], "rounds": rounds,
            "three_over_two": ratios,
            "three_over_two_range": {export: {key: [min(r[export][key] for r in ratios),
                                                    max(r[export][key] for r in ratios)] for key in keys}
                                     for export in args.exports},
            "unanswered": sum(r[export][way]["unanswered"] for r in rounds for export in args.exports
                              for way in WAYS)}


def main() -> int:
    return paired_main(__doc__, run, name="row_cache_calls", exports=EXPORTS,
                       exports_help="which tiered exports to serve both ways (default both)",
                       cache_help="rows of the evicting export's caches", summary="three_over_two_range")


def paired_main(doc: str, run: Callable[[Path, argparse.Namespace], dict[str, Any]], *, name: str,
                exports: Sequence[str], exports_help: str, cache_help: str, summary: str,
                settings: Mapping[str, Any] | None = None) -> int:
    """The command line of a bench that serves bench-row-cache's exports paired, round by round (this one and
    bench_row_cache_eviction): `run(work, args)` in a scratch directory, its result written to `--out`
    (bench/results/<name>.json) with the command, the settings and `run`'s keys, and `summary` printed."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="rounds of one pass a server (default 4)")
    parser.add_argument("--exports", nargs="+", choices=exports, default=list(exports), help=exports_help)
    parser.add_argument("--rows", type=int, default=200_000, help="generated rows whose values are admitted")
    parser.add_argument("--small-cache", type=int, default=2_000, help=cache_help)
    parser.add_argument("--loaded-requests", type=int, default=3000, help="requests of 100 candidates a pass")
    parser.add_argument("--rate", type=float, help="requests a second (default: half the highest rate an in-memory "
                        "server holds at p99 <= 10 ms in a scan)")
    parser.add_argument("--step-seconds", type=float, default=5.0, help="length of each open-loop scan step")
    parser.add_argument("--out", default=f"bench/results/{name}.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix=f"bench-{name.replace('_', '-')}-"))
    started = time.monotonic()
    try:
        out = run(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    variable = f"BENCH_{name.upper()}_ARGS"
    command = f"make bench-{name.replace('_', '-')}" + (
        f" {variable}='{os.environ[variable]}'" if os.environ.get(variable) else "")
    result = {**provenance(command), "benchmark": name,
              "settings": {"rounds": args.rounds, "exports": args.exports, "rows": args.rows,
                           "small_cache": args.small_cache, "loaded_requests": args.loaded_requests,
                           "rate": args.rate, "candidates": BATCH, **(settings or {})},
              **out, "seconds": time.monotonic() - started}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"rate_per_s": out["rate_per_s"], summary: out[summary], "unanswered": out["unanswered"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
