"""The row cache's segmented LRU against a plain LRU, served: one small-cache tiered export in two servers under the
same open-loop load, fresh servers each round, passes alternated on the same requests.

    make bench-row-cache-eviction        # -> bench/results/row_cache_eviction.json
    make bench-row-cache-eviction BENCH_ROW_CACHE_EVICTION_ARGS='--rate 40 --rounds 2 --out /tmp/eviction.json'

The exports are bench-row-cache's (DCNv2 with the trainer's defaults on the criteo spec, its three largest tables
tiered, caches of `--small-cache` rows, fewer than the requests read in all, so requests keep loading rows that
others' loads evicted): `evicting_preloaded`, whose caches are filled at load with the 2,000 rows training counted
most (as the pipeline exports them), and `evicting`, with nothing preloaded. Each is served with the row cache's
default policy (`segmented`: `serving.row_cache_protected_share` 0.8, rows read by more than one request and the
preload's most counted rows evicted only after rows read once) and as a plain LRU cache (`lru`: the same setting at
0), every other setting the default.

A round starts one server of each policy (both on bench-serving's server core, the load generator on the other),
waits until both answer, then sends the same `--loaded-requests` requests of 100 candidates at the same rate to
one and then the other (the order turns every round), latency from each request's scheduled send time, unanswered
requests counted (bench/loadgen.py), and stops both; so in every round both caches start as their load left them.
Around each pass: the server's own time (`ctr_request_duration_seconds` of predict, its mean over the pass), rows
loaded, load calls and the hit rate (`ctr_row_cache_*`) from /metrics. The rate is `--rate`, or half the highest
rate an in-memory server of the same weights holds at p99 <= 10 ms in an open-loop scan (the definition of
bench-serving's loaded phase), found once before the rounds.

Keys: `rate_per_s`, `rounds` (per round, per export, per policy: `p50_ms`, `p99_ms`, `server_mean_ms`,
`rows_loaded_per_request`, `load_calls_per_request`, `hit_rate`, `unanswered`), `segmented_over_lru` (per round
and export, the segmented server's p50, p99, server mean, rows loaded and load calls a request over the plain
LRU one's), `segmented_over_lru_range` ([lowest, highest] over the rounds, per export), `unanswered` (all passes).
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

from bench.bench_row_cache import BATCH, build
from bench.bench_row_cache_calls import scan_rate, served_pass, start
from bench.bench_serving import candidates, measuring_client, stop_server, wait_healthy
from bench.provenance import provenance
from serving.row_cache import PROTECTED_SHARE

# Each policy's serving.row_cache_protected_share.
POLICIES = {"segmented": PROTECTED_SHARE, "lru": 0.0}
EXPORTS = ("evicting_preloaded", "evicting")
KEYS = ("p50_ms", "p99_ms", "server_mean_ms", "rows_loaded_per_request", "load_calls_per_request")


def run(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    models = build(work / "exports", args.rows, args.small_cache, preload="evicting_preloaded" in args.exports)
    instances = candidates(args.loaded_requests * BATCH + BATCH, seed=13)
    with measuring_client():
        scan = None
        rate = args.rate
        if rate is None:
            rate, scan = scan_rate(work, models["memory"], instances, args.step_seconds)
        rounds = []
        for index in range(args.rounds):
            order = list(POLICIES) if index % 2 == 0 else list(reversed(POLICIES))
            round_: dict[str, Any] = {"order": order}
            for export in args.exports:
                servers = {policy: start(work, f"{export}-{policy}", models[export],
                                         (f"serving.row_cache_protected_share={share}",))
                           for policy, share in POLICIES.items()}
                try:
                    for policy, (server, port) in servers.items():
                        wait_healthy(port, server, work / f"{export}-{policy}" / "server.log")
                    results = {}
                    for policy in order:
                        results[policy] = r = served_pass(servers[policy][1], instances, rate, args.loaded_requests)
                        print(f"  round {index + 1} {export} {policy}: {rate:.1f} req/s, p50 {r['p50_ms']:.2f} ms, "
                              f"p99 {r['p99_ms']:.2f} ms, in the server {r['server_mean_ms']:.2f} ms, rows loaded "
                              f"a request {r['rows_loaded_per_request']:.1f}, load calls a request "
                              f"{r['load_calls_per_request']:.2f}, unanswered {r['unanswered']}", flush=True)
                finally:
                    for server, _ in servers.values():
                        stop_server(server)
                round_[export] = results
            rounds.append(round_)
    ratios = [{export: {key: r[export]["segmented"][key] / r[export]["lru"][key] if r[export]["lru"][key] else None
                        for key in KEYS} for export in args.exports} for r in rounds]
    return {"rate_per_s": rate, "scan": scan, "tiered_tables": models["tiered_tables"], "rounds": rounds,
            "segmented_over_lru": ratios,
            "segmented_over_lru_range": {
                export: {key: [min(values), max(values)] if (values := [r[export][key] for r in ratios
                                                                        if r[export][key] is not None]) else None
                         for key in KEYS} for export in args.exports},
            "unanswered": sum(r[export][policy]["unanswered"] for r in rounds for export in args.exports
                              for policy in POLICIES)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="rounds of one pass a server (default 4)")
    parser.add_argument("--exports", nargs="+", choices=EXPORTS, default=list(EXPORTS),
                        help="which small-cache exports to serve under both policies (default both)")
    parser.add_argument("--rows", type=int, default=200_000, help="generated rows whose values are admitted")
    parser.add_argument("--small-cache", type=int, default=2_000, help="rows of each tiered table's cache")
    parser.add_argument("--loaded-requests", type=int, default=3000, help="requests of 100 candidates a pass")
    parser.add_argument("--rate", type=float, help="requests a second (default: half the highest rate an in-memory "
                        "server holds at p99 <= 10 ms in a scan)")
    parser.add_argument("--step-seconds", type=float, default=5.0, help="length of each open-loop scan step")
    parser.add_argument("--out", default="bench/results/row_cache_eviction.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-row-cache-eviction-"))
    started = time.monotonic()
    try:
        out = run(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    command = "make bench-row-cache-eviction" + (
        f" BENCH_ROW_CACHE_EVICTION_ARGS='{os.environ['BENCH_ROW_CACHE_EVICTION_ARGS']}'"
        if os.environ.get("BENCH_ROW_CACHE_EVICTION_ARGS") else "")
    result = {**provenance(command), "benchmark": "row_cache_eviction",
              "settings": {"rounds": args.rounds, "exports": args.exports, "rows": args.rows,
                           "small_cache": args.small_cache, "loaded_requests": args.loaded_requests,
                           "rate": args.rate, "candidates": BATCH, "policies": POLICIES},
              **out, "seconds": time.monotonic() - started}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"rate_per_s": out["rate_per_s"], "segmented_over_lru_range": out["segmented_over_lru_range"],
                      "unanswered": out["unanswered"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
