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
from pathlib import Path
from typing import Any

from bench.bench_row_cache import BATCH, POLICIES, build
from bench.bench_row_cache_calls import paired_main, scan_rate, served_pass, start
from bench.bench_serving import candidates, measuring_client, stop_server, wait_healthy

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
    return paired_main(__doc__, run, name="row_cache_eviction", exports=EXPORTS,
                       exports_help="which small-cache exports to serve under both policies (default both)",
                       cache_help="rows of each tiered table's cache", summary="segmented_over_lru_range",
                       settings={"policies": POLICIES})


if __name__ == "__main__":
    raise SystemExit(main())
