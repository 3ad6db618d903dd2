"""Freshness: how long after a minute closes serving answers with a model that learned from it.

Runs the real stack on loopback for `--minutes` wall-clock minutes and writes bench/results/freshness.json
(`--out`: another file):
- a live traffic writer delivers each minute's click log right after the minute closes;
- a daily full model is trained first on the `--history-minutes` before the start (`ctr run daily` with the
  pipeline's defaults: its epochs, early stopping and gate; only paths, ports and the rows a minute are set);
- a Spark Connect server, and Airflow (api-server, scheduler, dag-processor; LocalExecutor, SQLite) with
  ctr_incremental unpaused: every minute validate -> features -> samples -> train -> delta -> gate -> publish;
- the model server (`ctr serve`, polling the store every second) under a bounded load of prediction requests.
- the step worker (`ctr worker`), which runs the minute tasks' steps in one warm process (`--no-step-worker`: each
  task runs its step in its own process, the baseline).

A minute's freshness is the time from its close to the first request answered by a version whose data reaches
the minute's end (the answering version comes back in the X-Model-Version header; each version's data end is
in its manifest). The minutes are those that closed while the load ran, less its last 90 s (left for the
pipeline to catch up); a minute that no answered request covered by the end of the load counts with the
seconds from its close to that end, the least its freshness can be (`minutes_not_served` says how many).
- `p50_s`, `p95_s`, `max_s`: over every minute that closed at or after the first publish since the DAG was
  unpaused (the first run after the unpause is a cold start: the worker's first Spark jobs and training, and
  it learns every minute since the daily model); `minutes`: how many (the default 33 minutes of load give
  31-32 minutes that close inside the window, 30-32 of them after a first publish that takes under a minute);
  p95 is the nearest rank, so over 30 minutes it is the second worst.
- `cold_first_minute_s`: the first minute that closed after the unpause; it is among the minutes above when it
  closed after the first publish (`minutes_before_first_publish` 0), and not when it waited for it (1).
- `minute_spark_in_run_p50_s`: the minute's Spark steps (pipelines.incremental.STEPS in pool "spark": samples,
  the fold into the parent's vocabularies and the block TFRecords), their seconds in each scheduled run as
  the scheduler ran them, summed per run, p50 over the runs after the first; `minute_spark_cold_s` the first
  run's. Read from the step worker's log ("done in" of each step: with run-ahead the step starts in the
  worker before its Airflow task, so the task's duration misses that part); with `--no-step-worker` from
  Airflow's task instances (start to end, the task's own process included), the step's whole time either way.
- `failed_requests`: requests due that got no 200 answer, skipped ones (all `concurrency` slots in flight)
  included; `failed_responses` (what `failed_requests` was before): the sent ones that got no 200.
- Earlier definitions, kept beside under new names: `all_minutes`, `all_minutes_p50_s`, `all_minutes_p95_s`
  (what `minutes`, `p50_s` and `p95_s` were: every minute served in the window, the cold one included,
  unserved ones left out); `steady_minutes`, `steady_p50_s`, `steady_p95_s` (the minutes after the first
  publish that were served); `service_p99_ms` (request latency from the actual send, as `p99_ms` was before
  bench.loadgen counted it from the scheduled send time).

    make bench-freshness                                   # 33 minutes, 60 K rows a minute (1,000 per second)
    make bench-freshness BENCH_FRESHNESS_ARGS="--minutes 4 --rows-per-minute 5000 --out /tmp/freshness.json"
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from bench.loadgen import run_load
from bench.provenance import provenance
from components.config import load_config
from components.layout import Layout
from components.live_traffic import write_live_minute, write_live_minutes
from components.model_store import open_model_store
from pipelines.airflow_env import airflow_environment, prepare_database
from pipelines.step_auth import SECRET_VARIABLE
from pipelines.step_client import address_file
from pipelines.step_worker import rss_mib

RESULTS = Path(__file__).resolve().parent / "results" / "freshness.json"
DAG_ID = "ctr_incremental"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def minute_floor(epoch_s: float) -> datetime:
    return datetime.fromtimestamp(int(epoch_s // 60) * 60, UTC)


class Processes:
    """Child processes in their own sessions, each logging to a file, all stopped at the end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, command: list[str], env: dict[str, str], nice: int = 0) -> subprocess.Popen:
        """`nice`: added to the process's nice value (its children inherit it)."""
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   preexec_fn=(lambda: os.nice(nice)) if nice else None)
        self.children.append((name, process))
        return process

    def stop(self) -> None:
        for _, process in reversed(self.children):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for name, process in reversed(self.children):
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                print(f"  {name} did not stop in 30 s; killing it", flush=True)
                os.killpg(process.pid, signal.SIGKILL)


def wait_until(what: str, condition, timeout_s: float, poll_s: float = 1.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def freshness_by_minute(versions: list[tuple[float, str | None]], data_ends: dict[str, float],
                        minute_closes: list[float]) -> dict[float, float | None]:
    """For each minute close: seconds until the first answered request whose version's data reaches it."""
    out: dict[float, float | None] = {}
    for close in minute_closes:
        first = next((sent for sent, version in versions
                      if version is not None and data_ends.get(version, 0.0) >= close and sent >= close), None)
        out[close] = None if first is None else first - close
    return out


def steady_minutes(by_minute: dict[float, float | None], published_at: list[float],
                   unpaused: float) -> tuple[float | None, list[float]]:
    """(when the first delta after `unpaused` was published, the freshness of the minutes that closed from
    then on); (None, []) when none was published."""
    first = min((t for t in published_at if t >= unpaused), default=None)
    if first is None:
        return None, []
    return first, [v for close, v in by_minute.items() if v is not None and close >= first]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def minutes_after_first_publish(by_minute: dict[float, float | None], first_publish: float | None,
                                load_ended: float) -> dict[str, Any]:
    """The freshness figures from each minute's freshness (keyed by its close, epoch seconds; None for a minute
    no answered request covered): `minutes`, `p50_s`, `p95_s`, `max_s` over every minute that closed at or after
    `first_publish`, and `cold_first_minute_s`, the earliest minute's, with `minutes_before_first_publish`. A
    minute never served counts with `load_ended - close`, the least its freshness can be, so that it cannot
    drop out of the percentiles."""
    seconds = {close: load_ended - close if value is None else value for close, value in by_minute.items()}
    after = [value for close, value in sorted(seconds.items()) if first_publish is not None and close >= first_publish]
    closes = sorted(seconds)
    return {"minutes": len(after),
            "p50_s": statistics.median(after) if after else None,
            "p95_s": percentile(after, 0.95) if after else None,
            "max_s": max(after) if after else None,
            "cold_first_minute_s": seconds[closes[0]] if closes else None,
            "minutes_before_first_publish": len(closes) - len(after)}


def spark_steps() -> tuple[str, ...]:
    """The minute's steps that run on Spark: those in the Airflow pool "spark"."""
    from pipelines.incremental import STEPS

    return tuple(step.name for step in STEPS if step.pool == "spark")


def worker_step_seconds(log_path: Path, steps: tuple[str, ...]) -> dict[str, float]:
    """Per scheduled run (its run id), the seconds `steps` took in the step worker, summed: each step's "done in"
    line, from its start (ahead of its task or for it) to its end; a step done twice in a run (a retry) counts
    its last time."""
    import re

    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    by_step: dict[tuple[str, str], float] = {}
    for step, run, seconds in re.findall(r"incremental/(\w+) of (scheduled__\S+): done in ([\d.]+) s", text):
        if step in steps:
            by_step[(run, step)] = float(seconds)
    by_run: dict[str, float] = {}
    for (run, _), seconds in by_step.items():
        by_run[run] = by_run.get(run, 0.0) + seconds
    return by_run


def airflow_step_seconds(db: Path, steps: tuple[str, ...]) -> dict[str, float]:
    """Per scheduled run of the DAG, the seconds its successful task instances of `steps` ran (start to end),
    summed, from Airflow's metadata DB (SQLite)."""
    import sqlite3

    marks = ", ".join("?" * len(steps))
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute(f"SELECT run_id, start_date, end_date FROM task_instance WHERE dag_id = ? AND task_id IN "
                            f"({marks}) AND state = 'success' AND run_id LIKE 'scheduled\\_\\_%' ESCAPE '\\'",
                            (DAG_ID, *steps)).fetchall()
    by_run: dict[str, float] = {}
    for run, start, end in rows:
        seconds = (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
        by_run[run] = by_run.get(run, 0.0) + seconds
    return by_run


def cold_and_rest_p50(by_run: dict[str, float]) -> tuple[float | None, float | None]:
    """(the first run's seconds, the median over the runs after it), runs in the order of their ids (a scheduled
    run's id names its data interval)."""
    ordered = [by_run[run] for run in sorted(by_run)]
    return (ordered[0] if ordered else None), (statistics.median(ordered[1:]) if len(ordered) > 1 else None)


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=int, default=33, help="wall-clock minutes of live traffic and load")
    parser.add_argument("--rows-per-minute", type=int, default=60_000)
    parser.add_argument("--history-minutes", type=int, default=8, help="minutes the daily full model learns")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the result file (default: %(default)s)")
    parser.add_argument("--rate", type=float, default=20.0, help="prediction requests per second")
    parser.add_argument("--rss-every-s", type=float, default=30.0,
                        help="seconds between samples of the step worker's resident memory during the load")
    parser.add_argument("--instances", type=int, default=8, help="instances per request")
    parser.add_argument("--root", default="var/bench-freshness")
    parser.add_argument("--no-step-worker", action="store_true",
                        help="no step worker: every task runs its step in its own process (the baseline)")
    parser.add_argument("--airflow-nice", type=int, default=0, metavar="N",
                        help="run Airflow's processes (and so its task processes) at nice N, below the step worker")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = argument_parser().parse_args(argv)

    root = Path(args.root).absolute()
    if root.exists():
        shutil.rmtree(root)
    logs = root / "logs"
    logs.mkdir(parents=True)
    spark_port, api_port, serving_port = free_port(), free_port(), free_port()
    overrides = {"paths.data_root": str(root), "generate.rows_per_minute": args.rows_per_minute,
                 "spark.remote": f"sc://127.0.0.1:{spark_port}", "serving.port": serving_port,
                 "serving.poll_seconds": 1.0}
    config = load_config(overrides=overrides, environ={})
    layout = Layout(config.paths.root)
    env = airflow_environment(config, api_port=api_port)
    env["AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION"] = "True"
    env["AIRFLOW__SCHEDULER__MIN_FILE_PROCESS_INTERVAL"] = "3600"
    env[SECRET_VARIABLE] = secrets.token_urlsafe(24)  # the step worker's and its tasks', for this run only
    processes = Processes(logs)
    started = time.time()
    first_live = minute_floor(started)
    history = [first_live - timedelta(minutes=m) for m in range(args.history_minutes, 0, -1)]
    print(f"[bench-freshness] writing {len(history)} history minutes of {args.rows_per_minute} rows", flush=True)
    for minute in history:
        write_live_minute(config.generate, layout, minute)
    written: list[tuple[datetime, float]] = []
    # The live writer starts now, so no minute goes missing while the daily model trains, and writes until the
    # process ends (a daemon thread): the load starts only after the daily run and Airflow are up.
    traffic = threading.Thread(
        target=lambda: write_live_minutes(config.generate, layout, num_minutes=args.minutes + 60,
                                          on_minute=lambda m, lag: written.append((m, lag))),
        daemon=True, name="live-traffic")
    traffic.start()
    result: dict[str, Any] = {}
    try:
        from spark_jobs.connect import start_connect_server

        print(f"[bench-freshness] Spark Connect on {spark_port}", flush=True)
        connect = start_connect_server(config.spark, spark_port, log_dir=logs)
        python = sys.executable
        # Airflow starts first and comes up while the daily model trains, as it would already be running in
        # production (ctr_incremental stays paused until the full model is published).
        print("[bench-freshness] Airflow (api-server, scheduler, dag-processor)", flush=True)
        airflow = [python, "-m", "airflow"]
        prepare_database(env, logs / "airflow-db.log")
        for component in (["api-server", "--port", str(api_port)], ["scheduler"], ["dag-processor"]):
            processes.start(f"airflow-{component[0]}", [*airflow, *component], env, nice=args.airflow_nice)
        print(f"[bench-freshness] daily full model on {history[0]:%H:%M}-{first_live:%H:%M}", flush=True)
        daily_started = time.monotonic()
        daily = subprocess.run(
            [python, "-m", "pipelines.cli", "run", "daily", "--start", history[0].isoformat(), "--end",
             first_live.isoformat(),
             *[item for key, value in overrides.items() for item in ("--set", f"{key}={value}")]],
            env={**os.environ, **env}, stdout=open(logs / "daily.log", "wb"), stderr=subprocess.STDOUT)
        daily_s = time.monotonic() - daily_started
        if daily.returncode:
            raise RuntimeError(f"the daily run failed after {daily_s:.0f} s (the pipeline's defaults on "
                               f"{args.history_minutes} history minutes of {args.rows_per_minute} rows); see "
                               f"{logs / 'daily.log'}; if its gate refused the model, more --history-minutes give it "
                               "more rows (never a lower gate)")
        worker = None
        if not args.no_step_worker:
            print("[bench-freshness] step worker", flush=True)
            worker = processes.start("step-worker", [python, "-m", "pipelines.cli", "worker"], {**os.environ, **env})
            wait_until("the step worker", lambda: address_file(config.paths.root).is_file(), 300)
            worker_rss = [rss_mib(worker.pid)]
        print("[bench-freshness] model server", flush=True)
        processes.start("serving", [python, "-m", "pipelines.cli", "serve", "--port", str(serving_port)],
                        {**os.environ, **env})
        wait_until("the model server", lambda: answers(f"http://127.0.0.1:{serving_port}/healthz"), 300)
        # `dags unpause` exits 0 even before the DAG is parsed, so the DB says when it took.
        airflow_db = layout.root / "airflow" / "airflow.db"
        wait_until("the DAG to be parsed and unpaused", lambda: subprocess.run(
            [*airflow, "dags", "unpause", DAG_ID], env=env, capture_output=True).returncode == 0
            and dag_unpaused(airflow_db, DAG_ID), 300, 5)
        print(f"[bench-freshness] {DAG_ID} unpaused; load for {args.minutes} minutes at {args.rate}/s", flush=True)
        sample = layout.raw_minute_dir(history[-1]) / "part-00000.tsv"
        instances = instances_from(sample, args.instances)
        load_started = time.time()
        sampler = RssSampler(worker.pid if worker is not None else None, load_started, args.rss_every_s)
        body = json.dumps({"instances": instances}).encode()
        load = run_load(f"http://127.0.0.1:{serving_port}/v1/models/ctr:predict", make_body=lambda i: body,
                        rate_per_s=args.rate, duration_s=args.minutes * 60, concurrency=8)
        load_ended = time.time()
        sampler.stop()
        (logs / "load.json").write_text(json.dumps(load.to_json(include_records=True)))
        connect.stop()
        result = summarize(config, layout, load, load_started, load_ended, written, args)
        result["daily_run_s"] = round(daily_s, 1)
        result["step_worker"] = worker is not None
        if worker is not None:  # its memory once warm and at the end: what a day of minutes would grow from
            result["step_worker_rss_mib"] = {"started": worker_rss[0], "end": rss_mib(worker.pid),
                                             "every_s": args.rss_every_s, "samples": sampler.samples}
    finally:
        processes.stop()
    result = {**provenance(result["command"]), **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("per_minute", "minute_spark_in_run_s")}, indent=2))
    print(f"[bench-freshness] wrote {args.out} in {time.time() - started:.0f} s")
    return 0


class RssSampler:
    """The step worker's resident memory every `every_s` seconds of the load, as [seconds since the load
    started, MiB]: whether it levels off under the scheduler's pacing or keeps growing."""

    def __init__(self, pid: int | None, started: float, every_s: float) -> None:
        self.samples: list[list[float]] = []
        self._stopped = threading.Event()
        self._thread = None
        if pid is not None:
            self._thread = threading.Thread(target=self._run, args=(pid, started, every_s), daemon=True,
                                            name="worker-rss")
            self._thread.start()

    def _run(self, pid: int, started: float, every_s: float) -> None:
        while not self._stopped.wait(every_s):
            mib = rss_mib(pid)
            if mib is not None:
                self.samples.append([round(time.time() - started, 1), round(mib, 1)])

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()


def dag_unpaused(db: Path, dag_id: str) -> bool:
    import sqlite3

    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        row = conn.execute("SELECT is_paused FROM dag WHERE dag_id = ?", (dag_id,)).fetchone()
    return row is not None and not row[0]


def instances_from(path: Path, count: int) -> list[dict[str, Any]]:
    from components.schema import CATEGORICAL_FEATURES, DENSE_FEATURES
    from components.validation import read_raw_slice

    frame = read_raw_slice(path).head(count)
    rows = []
    for _, row in frame.iterrows():
        instance: dict[str, Any] = {n: (None if row[n] is None or row[n] != row[n] else float(row[n]))
                                    for n in DENSE_FEATURES}
        instance.update({n: row[n] if isinstance(row[n], str) else None for n in CATEGORICAL_FEATURES})
        rows.append(instance)
    return rows


def airflow_timeline(db: Path) -> dict[str, Any]:
    """Where a minute run's time goes, from Airflow's metadata DB (SQLite): per task, the median of its run
    time and of the wait before it starts (the last earlier task of the run ended -> this one running), the
    delay from the minute's close to the run's first task starting, to its last task's end and to the publish
    task's end, and the runs by final state."""
    import sqlite3

    def ts(value: str | None) -> float | None:
        return None if value is None else datetime.fromisoformat(value).replace(tzinfo=UTC).timestamp()

    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        runs = {run_id: ts(end) for run_id, end in conn.execute(
            "SELECT run_id, data_interval_end FROM dag_run WHERE dag_id = ?", (DAG_ID,))}
        rows = conn.execute("SELECT run_id, task_id, start_date, end_date, state FROM task_instance "
                            "WHERE dag_id = ? ORDER BY run_id, start_date", (DAG_ID,)).fetchall()
        states: dict[str, int] = {}
        for (state,) in conn.execute("SELECT state FROM dag_run WHERE dag_id = ?", (DAG_ID,)):
            states[state] = states.get(state, 0) + 1
    run_s: dict[str, list[float]] = {}
    wait_s: dict[str, list[float]] = {}
    start_delay, total, published = [], [], []
    by_run: dict[str, list[tuple]] = {}
    for run_id, task_id, start, end, state in rows:
        if state == "success" and start and end:
            by_run.setdefault(run_id, []).append((task_id, ts(start), ts(end)))
    for run_id, tasks in by_run.items():
        for task_id, start, end in tasks:
            run_s.setdefault(task_id, []).append(end - start)
            # Waiting since the last task of the run that ended before this one started (its upstream).
            ended = [e for t, _, e in tasks if t != task_id and e <= start]
            if ended:
                wait_s.setdefault(task_id, []).append(start - max(ended))
        if runs.get(run_id) and len(tasks) > 1:
            start_delay.append(tasks[0][1] - runs[run_id])
            total.append(tasks[-1][2] - runs[run_id])
            published += [end - runs[run_id] for task_id, _, end in tasks if task_id == "publish"]
    median = lambda values: round(statistics.median(values), 1) if values else None  # noqa: E731
    return {"dag_runs": states,
            "task_run_s": {task: median(v) for task, v in run_s.items()},
            "task_wait_s": {task: median(v) for task, v in wait_s.items()},
            "first_task_start_after_close_s": median(start_delay),
            "last_task_end_after_close_s": median(total),
            # The publish task's end: the last task's until the minute DAG gained its `spans` step after it, so
            # runs before and after that change compare on this key.
            "publish_task_end_after_close_s": median(published),
            "runs": len(by_run)}


def worker_steps(log_path: Path) -> dict[str, Any]:
    """From the step worker's log: per step, the median of its time in the worker (what its Airflow task's run
    time adds hand-offs to), how many steps started ahead of their tasks (pipelines/run_ahead.py), and per step
    the median of when it started after its minute closed (`start_after_close_s`: scheduled runs, whose id
    names the close, except the first one, which starts when the DAG is unpaused)."""
    import re

    seconds: dict[str, list[float]] = {}
    ahead = 0
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    for match in re.finditer(r"incremental/(\w+) of \S+: (?:started ahead of its task|done in ([\d.]+) s)", text):
        if match.group(2) is None:
            ahead += 1
        else:
            seconds.setdefault(match.group(1), []).append(float(match.group(2)))
    starts: dict[str, dict[str, float]] = {}
    for step, run, at in re.findall(
            r"incremental/(\w+) of scheduled__(\S+): started ahead of its task, at (\d\d:\d\d:\d\d\.\d+)", text):
        close = datetime.fromisoformat(run)
        started = datetime.combine(close.date(), datetime.strptime(at, "%H:%M:%S.%f").time(), close.tzinfo)
        if started < close - timedelta(hours=12):  # the run's steps began past midnight
            started += timedelta(days=1)
        starts.setdefault(run, {}).setdefault(step, (started - close).total_seconds())
    after_close: dict[str, list[float]] = {}
    for run in sorted(starts)[1:]:
        for step, delay in starts[run].items():
            after_close.setdefault(step, []).append(delay)
    return {"step_s": {step: round(statistics.median(v), 1) for step, v in seconds.items()},
            "steps_done": sum(len(v) for v in seconds.values()), "steps_started_ahead": ahead,
            "start_after_close_s": {step: round(statistics.median(v), 2) for step, v in after_close.items()}}


def summarize(config, layout: Layout, load, load_started: float, load_ended: float,
              written: list[tuple[datetime, float]], args: argparse.Namespace) -> dict[str, Any]:
    store = open_model_store(config.paths.model_store_uri)
    data_ends, kinds = {}, {}
    for version in store.versions("ctr"):
        manifest = store.manifest("ctr", version)
        data_ends[version] = datetime.fromisoformat(manifest["data_end"]).timestamp()
        kinds[version] = manifest["kind"]
    # Minutes that closed while the load ran, leaving the last 90 s for the pipeline to catch up.
    closes = [m.timestamp() + 60 for m, _ in written if load_started <= m.timestamp() + 60 <= load_ended - 90]
    by_minute = freshness_by_minute(load.versions, data_ends, closes)
    served = [v for v in by_minute.values() if v is not None]
    publish_lags = [entry for entry in json.loads(layout.freshness_log.read_text()).values()] \
        if layout.freshness_log.is_file() else []
    # The first run after the DAG is unpaused learns every minute since the daily model in a worker that has run
    # nothing yet (Spark's first jobs, TensorFlow's first trace): 20 s or more. The minutes that close while it
    # runs wait for it, so how many do depends on where in a minute the DAG was unpaused. The percentiles leave
    # them out (the minutes that closed after the first delta was published); the first minute is beside.
    first_publish, steady = steady_minutes(
        by_minute, [datetime.fromisoformat(e["published_at"]).timestamp() for e in publish_lags], load_started)
    figures = minutes_after_first_publish(by_minute, first_publish, load_ended)
    # The Spark steps' seconds as the scheduler ran them: in the worker when there is one (with run-ahead, a
    # step starts there before its Airflow task, so the task's duration misses part of it), else in the tasks.
    steps = spark_steps()
    spark_by_run = (airflow_step_seconds(layout.root / "airflow" / "airflow.db", steps) if args.no_step_worker
                    else worker_step_seconds(layout.root / "logs" / "step-worker.log", steps))
    spark_cold, spark_p50 = cold_and_rest_p50(spark_by_run)
    gates = sorted(layout.root.glob("incremental/*/gate.json"))
    failed_gates = [p.parent.name for p in gates if not json.loads(p.read_text())["passed"]]
    deltas = [v for v, kind in kinds.items() if kind == "delta"]
    return {
        "benchmark": "freshness",
        "command": command_of(args),
        "machine": f"{platform.node()} ({os.cpu_count()} cores), no GPU",
        "airflow_nice": args.airflow_nice,
        **figures,
        "goals": {"p50_s_at_most_10": figures["p50_s"] is not None and figures["p50_s"] <= 10,
                  "p95_s_at_most_20": figures["p95_s"] is not None and figures["p95_s"] <= 20,
                  "minutes_at_least_30": figures["minutes"] >= 30},
        "minute_spark_in_run_p50_s": spark_p50,
        "minute_spark_cold_s": spark_cold,
        "minute_spark_in_run_source": "Airflow task instances" if args.no_step_worker else "step worker log",
        "minute_spark_steps": list(steps),
        "all_minutes": len(closes),
        "all_minutes_p50_s": statistics.median(served) if served else None,
        "all_minutes_p95_s": percentile(served, 0.95) if served else None,
        "steady_minutes": len(steady),
        "steady_p50_s": statistics.median(steady) if steady else None,
        "steady_p95_s": percentile(steady, 0.95) if steady else None,
        "first_publish_after_unpause_s": None if first_publish is None else round(first_publish - load_started, 1),
        "minutes_not_served": sum(v is None for v in by_minute.values()),
        "failed_requests": load.unanswered,
        "failed_responses": load.failed_requests,
        "p99_ms": load.latency_p99_ms,
        "service_p99_ms": load.service_percentile_ms(99),
        "p50_ms": load.latency_p50_ms,
        "requests": load.num_requests,
        "status_counts": load.status_counts,
        "skipped_requests": load.skipped,
        "deltas_published": len(deltas),
        "gate_failures": failed_gates,
        "publish_lag_s": [round(datetime.fromisoformat(e["published_at"]).timestamp()
                                - datetime.fromisoformat(e["data_end"]).timestamp(), 1) for e in publish_lags],
        "rows_per_minute": args.rows_per_minute,
        "request_rate_per_s": args.rate,
        "live_writer_lag_s": [round(lag, 2) for _, lag in written],
        "airflow_timeline": airflow_timeline(layout.root / "airflow" / "airflow.db"),
        "worker_steps": worker_steps(layout.root / "logs" / "step-worker.log"),
        "per_minute": {datetime.fromtimestamp(c, UTC).isoformat(): (None if v is None else round(v, 2))
                       for c, v in by_minute.items()},
        "minute_spark_in_run_s": {run: round(seconds, 2) for run, seconds in sorted(spark_by_run.items())},
    }


def command_of(args: argparse.Namespace) -> str:
    """The make command that reruns this run: the options that differ from their defaults."""
    defaults = vars(argument_parser().parse_args([]))
    options = []
    for name, value in vars(args).items():
        if value != defaults.get(name):
            flag = "--" + name.replace("_", "-")
            options.append(flag if value is True else f"{flag} {value}")
    return "make bench-freshness" + (f" BENCH_FRESHNESS_ARGS='{' '.join(options)}'" if options else "")


if __name__ == "__main__":
    sys.exit(main())
