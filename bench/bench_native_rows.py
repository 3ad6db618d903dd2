"""What the native row reader saves under open-loop load: the same model in two servers, one reading row-form
request bodies with serving/native/rows.c (`serving.native_rows`, the default) and one with the typed records of
the Python path (`serving.native_rows=false`), the same requests sent to each in passes that alternate.

    make bench-native-rows               # -> bench/results/native_rows.json
    make bench-native-rows BENCH_NATIVE_ROWS_ARGS='--rate 60 --rounds 2 --out /tmp/native_rows.json'

The model and requests are bench-serving's (DCNv2 with the trainer's defaults on the criteo spec, generated
candidates, 100 a request). Both servers run on one core (bench-serving's server core), the load generator on the
other; only one server is sent requests at a time. The rate is half the highest rate the native server holds at
p99 <= 10 ms in an open-loop scan (bench-serving's loaded phase), or `--rate`. Each round sends
`--loaded-requests` requests at that rate to one server, then the same requests to the other (the order turns
every round), latency from each request's scheduled send time, unanswered requests counted (bench/loadgen.py).
Around each pass the server's own time is read from /metrics (`ctr_request_duration_seconds` of predict: its
mean over the pass, the request read, predicted and answered inside the server).

Keys: `rate_per_s`, `rounds` (per round, per server: `p50_ms`, `p99_ms`, `server_mean_ms`, `unanswered`),
`python_over_native` (per round, the Python server's p50, p99 and server mean over the native one's),
`python_over_native_range` ([lowest, highest] of each over the rounds), `unanswered` (all passes).
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

from bench.bench_serving import (
    FIRST_VERSION,
    MODEL_NAME,
    build_models,
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

SERVERS = {"native": (), "python": ("serving.native_rows=false",)}


def predict_duration(port: int) -> tuple[float, float]:
    """(sum of seconds, count) of the server's predict requests, from /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    total, count = 0.0, 0.0
    for family in text_string_to_metric_families(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10.0).text):
        if family.name != "ctr_request_duration_seconds":
            continue
        for sample in family.samples:
            if sample.labels.get("endpoint") == "predict":
                if sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value
    return total, count


def served_pass(port: int, instances: list[dict], rate: float, requests: int) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}/v1/models/{MODEL_NAME}:predict"
    seconds_before, count_before = predict_duration(port)
    result = loaded(url, instances, rate, requests)
    seconds_after, count_after = predict_duration(port)
    answered = count_after - count_before
    result["server_mean_ms"] = (seconds_after - seconds_before) / answered * 1e3 if answered else None
    return result


def run(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from components.model_store import LocalModelStore

    models = build_models(work, args.state_rows, swap_rounds=0)
    instances = candidates(5_000, seed=11)
    servers, ports = {}, {}
    try:
        for name, settings in SERVERS.items():
            home = work / name
            home.mkdir()
            LocalModelStore(home / "store").publish(MODEL_NAME, FIRST_VERSION, models["first"])
            ports[name] = free_port()
            servers[name] = start_server(home, home / "store", ports[name], free_port(), settings=settings)
        for name, server in servers.items():
            wait_healthy(ports[name], server, work / name / "server.log")
        with measuring_client():
            scan = None
            rate = args.rate
            if rate is None:
                scan = open_loop(f"http://127.0.0.1:{ports['native']}/v1/models/{MODEL_NAME}:predict", instances,
                                 20.0, args.step_seconds)
                rate = 0.5 * (scan["max_rate_per_s_at_p99_10ms"] or scan["steps"][0]["rate_per_s"])
                time.sleep(2.0)  # the scan's last step went past saturation: its backlog drains first
            rounds = []
            for index in range(args.rounds):
                order = list(SERVERS) if index % 2 == 0 else list(reversed(SERVERS))
                results = {}
                for name in order:
                    results[name] = served_pass(ports[name], instances, rate, args.loaded_requests)
                    print(f"  round {index + 1} {name}: {rate:.1f} req/s, p50 {results[name]['p50_ms']:.2f} ms, "
                          f"p99 {results[name]['p99_ms']:.2f} ms, in the server {results[name]['server_mean_ms']:.2f}"
                          f" ms, unanswered {results[name]['unanswered']}", flush=True)
                rounds.append({"order": order, **results})
    finally:
        for server in servers.values():
            stop_server(server)
    ratios = [{key: round_["python"][key] / round_["native"][key] for key in ("p50_ms", "p99_ms", "server_mean_ms")}
              for round_ in rounds]
    return {"rate_per_s": rate, "scan": scan, "rounds": rounds, "python_over_native": ratios,
            "python_over_native_range": {key: [min(r[key] for r in ratios), max(r[key] for r in ratios)]
                                         for key in ("p50_ms", "p99_ms", "server_mean_ms")},
            "unanswered": sum(round_[name]["unanswered"] for round_ in rounds for name in SERVERS)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="rounds of one pass a server (default 4)")
    parser.add_argument("--loaded-requests", type=int, default=3000, help="requests of 100 candidates a pass")
    parser.add_argument("--rate", type=float, help="requests a second (default: half the highest rate the native "
                        "server holds at p99 <= 10 ms in a scan)")
    parser.add_argument("--step-seconds", type=float, default=5.0, help="length of each open-loop scan step")
    parser.add_argument("--state-rows", type=int, default=20_000, help="generated rows the vocabularies hold")
    parser.add_argument("--out", default="bench/results/native_rows.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-native-rows-"))
    try:
        out = run(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    command = "make bench-native-rows" + (f" BENCH_NATIVE_ROWS_ARGS='{os.environ['BENCH_NATIVE_ROWS_ARGS']}'"
                                          if os.environ.get("BENCH_NATIVE_ROWS_ARGS") else "")
    result = {**provenance(command), "benchmark": "native_rows",
              "settings": {"rounds": args.rounds, "loaded_requests": args.loaded_requests, "rate": args.rate,
                           "state_rows": args.state_rows, "candidates": 100}, **out}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"rate_per_s": out["rate_per_s"], "python_over_native_range": out["python_over_native_range"],
                      "unanswered": out["unanswered"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
