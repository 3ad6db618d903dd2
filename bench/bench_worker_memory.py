"""Whether the step worker's memory levels off: its resident memory minute after minute, with glibc's allocator as
it comes and with its arenas capped. Writes bench/results/worker_memory.json.

    make bench-worker-memory                                 # 2 x 30 minutes of 60 K rows, about 25 minutes
    make bench-worker-memory BENCH_WORKER_MEMORY_ARGS="--minutes 5 --rows-per-minute 5000 --out /tmp/w.json"

A daily full model is trained first (`ctr-pipeline run daily` on `--history-minutes`, the pipeline's defaults),
on a Spark Connect server started here as the stack starts it. Then, for each variant, a step worker
(`ctr-pipeline worker`, its own process) runs `--minutes` minutes of ctr_incremental one after another: each
minute's partition is written, then every step of the minute is sent to the worker as the DAG's tasks send
them (pipelines/step_client.py; no Airflow, no run-ahead: one step at a time, in the DAG's order), the next
minute at once: the worker as it runs when it catches up on a backlog, with no idle time between minutes
(bench-freshness runs it as the scheduler paces it, a minute a minute). After each minute the worker's resident
memory is read (psutil). The variants run one after the other on the same chain
(the second goes on from the minute the first ended on), each in a fresh worker:

- `glibc_default`: the worker's environment as `ctr-pipeline stack up` gives it;
- `arena_max_2`: `MALLOC_ARENA_MAX=2` (glibc makes up to 8 arenas a core for a process's threads; the worker
  runs each step in a thread of its own).

The worker's own recycling (`incremental.step_worker_max_rss_mib`) is set out of reach, so that one process
is measured throughout. Keys, per variant under `variants.<name>`: `rss_mib` (after each minute),
`started_rss_mib` (once the worker is up, before any step), `minute_seconds` (each minute's steps),
`growth_mib_first_half` / `growth_mib_second_half` (RSS at the end of each half of the minutes less at its
start), `mib_per_minute_second_half`.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from bench.provenance import provenance
from components.config import load_config
from components.layout import Layout
from components.synthetic import write_minute
from pipelines.runner import select_steps
from pipelines.step_auth import SECRET_VARIABLE
from pipelines.step_client import address_file, run_on_worker
from pipelines.step_worker import rss_mib

RESULT = Path(__file__).parent / "results" / "worker_memory.json"
START = datetime.fromisoformat("2026-01-01T00:00:00+00:00")
VARIANTS = {"glibc_default": {}, "arena_max_2": {"MALLOC_ARENA_MAX": "2"}}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(what: str, condition, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(0.2)


def run_variant(name: str, extra_env: dict[str, str], first_index: int, args: argparse.Namespace, config: Any,
                layout: Layout, overrides: dict[str, Any], env: dict[str, str], logs: Path) -> dict[str, Any]:
    secret = env[SECRET_VARIABLE].encode()
    worker = subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "worker",
         *[item for key, value in overrides.items() for item in ("--set", f"{key}={value}")]],
        env={**env, **extra_env}, stdout=open(logs / f"worker-{name}.log", "wb"), stderr=subprocess.STDOUT)
    try:
        wait_until("the step worker's address file", lambda: address_file(config.paths.root).is_file(), 300, worker)
        started_rss = rss_mib(worker.pid)
        rss, seconds = [], []
        steps = [step.name for step in select_steps("incremental", None) if not step.sensor]
        for index in range(first_index, first_index + args.minutes):
            minute = START + timedelta(minutes=index)
            write_minute(config.generate, layout, index, minute)
            request = {"pipeline": "incremental", "run_id": f"{name}-{index:05d}", "start": minute.isoformat(),
                       "end": (minute + timedelta(minutes=1)).isoformat(), "overrides": overrides, "environ": {}}
            began = time.monotonic()
            for step in steps:
                run_on_worker(config.paths.root, {**request, "step": step}, lambda level, text: None, secret)
            seconds.append(round(time.monotonic() - began, 2))
            rss.append(rss_mib(worker.pid))
            print(f"[bench-worker-memory] {name} minute {index - first_index + 1}/{args.minutes}: "
                  f"{seconds[-1]:.1f} s, RSS {rss[-1]:.0f} MiB", flush=True)
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(120)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    half = len(rss) // 2
    first, second = [started_rss, *rss[:half]], rss[half:]
    return {"env": extra_env, "started_rss_mib": started_rss, "rss_mib": rss, "minute_seconds": seconds,
            "minute_seconds_p50": statistics.median(seconds),
            "growth_mib_first_half": round(first[-1] - first[0], 1),
            "growth_mib_second_half": round(second[-1] - second[0], 1),
            "mib_per_minute_second_half": round((second[-1] - second[0]) / max(1, len(second) - 1), 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=int, default=30, help="minute runs per variant (default 30)")
    parser.add_argument("--rows-per-minute", type=int, default=60_000)
    parser.add_argument("--history-minutes", type=int, default=8, help="minutes the daily full model learns")
    parser.add_argument("--variant", action="append", choices=sorted(VARIANTS), help="default: both")
    parser.add_argument("--root", type=Path, default=Path("/tmp/bench_worker_memory"))
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    command = "make bench-worker-memory" + (f" BENCH_WORKER_MEMORY_ARGS='{' '.join(argv or sys.argv[1:])}'"
                                            if (argv or sys.argv[1:]) else "")
    root = args.root.absolute()
    shutil.rmtree(root, ignore_errors=True)
    logs = root / "logs"
    logs.mkdir(parents=True)
    spark_port = free_port()
    overrides: dict[str, Any] = {"paths.data_root": str(root), "generate.rows_per_minute": args.rows_per_minute,
                                 "spark.remote": f"sc://127.0.0.1:{spark_port}",
                                 "incremental.step_worker_max_rss_mib": 1e9, "incremental.wait_for_data_s": 0}
    config = load_config(overrides=overrides, environ={})
    layout = Layout(config.paths.root)
    env = {**os.environ, SECRET_VARIABLE: secrets.token_urlsafe(24)}
    started = time.monotonic()
    from spark_jobs.connect import start_connect_server

    connect = start_connect_server(config.spark, spark_port, log_dir=logs)
    result: dict[str, Any] = {"minutes": args.minutes, "rows_per_minute": args.rows_per_minute,
                              "history_minutes": args.history_minutes, "variants": {}}
    try:
        for index in range(args.history_minutes):
            write_minute(config.generate, layout, index, START + timedelta(minutes=index))
        print(f"[bench-worker-memory] daily full model on {args.history_minutes} minutes", flush=True)
        daily_started = time.monotonic()
        daily = subprocess.run(
            [sys.executable, "-m", "pipelines.cli", "run", "daily", "--start", START.isoformat(), "--end",
             (START + timedelta(minutes=args.history_minutes)).isoformat(),
             *[item for key, value in overrides.items() for item in ("--set", f"{key}={value}")]],
            env=env, stdout=open(logs / "daily.log", "wb"), stderr=subprocess.STDOUT)
        if daily.returncode:
            raise RuntimeError(f"the daily run failed; see {logs / 'daily.log'}")
        result["daily_run_s"] = round(time.monotonic() - daily_started, 1)
        first_index = args.history_minutes
        for name in args.variant or list(VARIANTS):
            result["variants"][name] = run_variant(name, VARIANTS[name], first_index, args, config, layout,
                                                   overrides, env, logs)
            first_index += args.minutes
    finally:
        connect.stop()
    result["seconds"] = round(time.monotonic() - started, 1)
    result = {**provenance(command), **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({name: {k: v for k, v in side.items() if k not in ("rss_mib", "minute_seconds")}
                      for name, side in result["variants"].items()}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
