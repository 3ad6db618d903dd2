"""Faults under live minute runs: Airflow's scheduler, Spark Connect, a training task and the model server
SIGKILLed while ctr_incremental runs every minute on live traffic and the model server answers a steady load.

The set-up is bench-freshness's (the live writer, Spark Connect, Airflow's api-server, scheduler and
dag-processor on their own metadata DB, a daily full model, the model server, an open-loop load). Each fault
waits for a fresh publish first, then kills one process; the bench plays the service manager and starts it
again. Recovery is the time from the restart (or the kill, for a task Airflow retries by itself) to the next
published minute. At the end every live minute that closed in time must be learned exactly once by the
standing versions, and the memory of the model server, the scheduler and the Spark server is compared between
the start and the end of the run (`--soak-minutes` keeps it going longer).

    PYTHONPATH=. python -m bench.reliability.live --out /tmp/live.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.bench_freshness import (
    DAG_ID,
    Processes,
    answers,
    dag_unpaused,
    free_port,
    instances_from,
    minute_floor,
    wait_until,
)
from bench.loadgen import run_load
from bench.reliability.chain import learned_minutes, no_loss
from components.stopping import group_and_descendants
from pipelines.stack import port_answers

PUBLISH_WAIT_S = 240.0


def _case(name: str, description: str, expected: str, observed: str, as_expected: bool, *,
          lost: dict[str, int] | None = None, recover_s: float | None = None, **detail: Any) -> dict[str, Any]:
    return {"group": "live", "case": name, "description": description, "expected": expected, "observed": observed,
            "as_expected": as_expected, "lost": lost or no_loss(), "manual_recovery": False,
            "recover_s": None if recover_s is None else round(recover_s, 1), "detail": detail}



def pss_mb(pid: int) -> float:
    """Proportional set size of one process in MiB: its private memory plus its share of pages it shares (a
    forked process's libraries), so forked workers are not counted many times over."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def service_pss_mb(pgid: int, largest_only: bool = False) -> float:
    """Memory of a service: its group leader's PSS, or (`largest_only`) that of the largest process of its group
    and descendants (Spark Connect's JVM under its launcher)."""
    if not largest_only:
        return pss_mb(pgid)
    return max((pss_mb(pid) for pid in group_and_descendants(pgid)), default=0.0)


def kill_tree(pgid: int, timeout_s: float = 30.0) -> None:
    """SIGKILL to a process group and to every descendant of it in other groups (a JVM, a task supervisor), then
    waits until all are gone (and so their ports free)."""
    targets = group_and_descendants(pgid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    for pid in targets:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while set(targets) & set(group_and_descendants(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    while any(Path(f"/proc/{pid}").exists() and _state(pid) not in ("Z", "X", None) for pid in targets):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {sorted(targets)} outlived SIGKILL for {timeout_s:.0f} s")
        time.sleep(0.1)


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def run_version(db: Path, run_id: str) -> str:
    """The version a ctr_incremental run publishes: the end of its data interval, YYYYMMDDHHMM."""
    from datetime import datetime

    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as conn:
        (end,) = conn.execute("SELECT data_interval_end FROM dag_run WHERE dag_id = ? AND run_id = ?",
                              (DAG_ID, run_id)).fetchone()
    return f"{datetime.fromisoformat(str(end)):%Y%m%d%H%M}"


def running_task(db: Path, task_id: str) -> tuple[str, int | None] | None:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as conn:
        row = conn.execute("SELECT run_id, pid FROM task_instance WHERE dag_id = ? AND task_id = ? AND state = "
                           "'running' ORDER BY start_date DESC LIMIT 1", (DAG_ID, task_id)).fetchone()
    return (row[0], row[1]) if row else None


class Live:
    def __init__(self, work: Path, rows_per_minute: int, progress: Callable[[str], None]):
        from components.config import load_config
        from components.layout import Layout
        from pipelines.airflow_env import airflow_environment

        self.work, self.progress = work, progress
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.spark_port, self.api_port, self.serving_port = free_port(), free_port(), free_port()
        self.overrides = {"paths.data_root": str(work / "data"), "generate.rows_per_minute": rows_per_minute,
                          "spark.remote": f"sc://127.0.0.1:{self.spark_port}", "serving.port": self.serving_port,
                          "serving.poll_seconds": 1.0}
        self.config = load_config(overrides=self.overrides, environ={})
        self.layout = Layout(self.config.paths.root)
        self.env = airflow_environment(self.config, api_port=self.api_port)
        self.env["AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION"] = "True"
        self.env["AIRFLOW__SCHEDULER__MIN_FILE_PROCESS_INTERVAL"] = "3600"
        self.processes = Processes(self.logs)
        self.named: dict[str, subprocess.Popen] = {}
        self.connect = None
        self.db = self.layout.root / "airflow" / "airflow.db"

    @property
    def store(self):
        from components.model_store import open_model_store

        return open_model_store(self.config.paths.model_store_uri)

    def start(self, name: str, command: list[str], env: dict[str, str]) -> None:
        self.named[name] = self.processes.start(name, command, env)

    def kill(self, name: str) -> None:
        process = self.named[name]
        kill_tree(process.pid)
        process.wait(60)

    def stop_all(self) -> None:
        """Every process started here, and whatever they started in other groups (Airflow's task supervisors,
        PySpark's workers), is gone at the end."""
        trees = {}
        for _, process in self.processes.children:
            trees.update(group_and_descendants(process.pid))
        if self.connect is not None:
            trees.update(group_and_descendants(self.connect.process.pid))
        self.processes.stop()
        if self.connect is not None:
            self.connect.stop()
        for pid in trees:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def start_scheduler(self) -> None:
        self.start("airflow-scheduler", [sys.executable, "-m", "airflow", "scheduler"], self.env)

    def start_serving(self) -> None:
        self.start("serving", [sys.executable, "-m", "pipelines.cli", "serve", "--port", str(self.serving_port)],
                   {**os.environ, **self.env})

    def start_connect(self) -> None:
        from spark_jobs.connect import start_connect_server

        self.connect = start_connect_server(self.config.spark, self.spark_port, log_dir=self.logs)

    def latest(self) -> str | None:
        return self.store.latest("ctr")

    def wait_publish(self, after: str | None, timeout_s: float = PUBLISH_WAIT_S) -> tuple[str | None, float]:
        """The first version newer than `after`, and the seconds it took (None if none came in time)."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            latest = self.latest()
            if latest is not None and (after is None or int(latest) > int(after)):
                return latest, time.monotonic() - started
            time.sleep(1)
        return None, time.monotonic() - started

    def learned(self) -> dict[str, list[str]]:
        return learned_minutes(self.store, "ctr")


def run_live_cases(work: Path, *, rows_per_minute: int = 20_000, rate: float = 10.0, soak_minutes: float = 2.0,
                   progress: Callable[[str], None] = print) -> dict[str, Any]:
    from components.live_traffic import write_live_minute, write_live_minutes
    from pipelines.airflow_env import prepare_database

    started = time.monotonic()
    live = Live(work, rows_per_minute, progress)
    first_live = minute_floor(time.time())
    history = [first_live - timedelta(minutes=m) for m in range(6, 0, -1)]
    for minute in history:
        write_live_minute(live.config.generate, live.layout, minute)
    writer = threading.Thread(target=lambda: write_live_minutes(live.config.generate, live.layout, num_minutes=240),
                              daemon=True, name="live-traffic")
    writer.start()
    cases: list[dict[str, Any]] = []
    memory: dict[str, list[tuple[float, float]]] = {"serving": [], "airflow-scheduler": [], "spark-connect": []}
    stop_sampling = threading.Event()
    try:
        live.start_connect()
        prepare_database(live.env, live.logs / "airflow-db.log")
        airflow = [sys.executable, "-m", "airflow"]
        live.start("airflow-api-server", [*airflow, "api-server", "--port", str(live.api_port)], live.env)
        live.start_scheduler()
        live.start("airflow-dag-processor", [*airflow, "dag-processor"], live.env)
        daily = subprocess.run(
            [sys.executable, "-m", "pipelines.cli", "run", "daily", "--start", history[0].isoformat(), "--end",
             first_live.isoformat(), "--set", "train.epochs=1", "--set", "gate.min_auc=0.55",
             *[item for key, value in live.overrides.items() for item in ("--set", f"{key}={value}")]],
            env={**os.environ, **live.env}, stdout=open(live.logs / "daily.log", "wb"), stderr=subprocess.STDOUT)
        if daily.returncode:
            raise RuntimeError(f"the daily run failed; see {live.logs / 'daily.log'}")
        live.start_serving()
        url = f"http://127.0.0.1:{live.serving_port}"
        wait_until("the model server", lambda: answers(f"{url}/healthz"), 300)
        wait_until("the DAG to be parsed and unpaused", lambda: subprocess.run(
            [*airflow, "dags", "unpause", DAG_ID], env=live.env, capture_output=True).returncode == 0
            and dag_unpaused(live.db, DAG_ID), 300, 5)
        progress(f"live: {DAG_ID} unpaused; load at {rate}/s")
        instances = instances_from(live.layout.raw_minute_dir(history[-1]) / "part-00000.tsv", 8)
        load_seconds = 60 * (14 + soak_minutes)
        load_box: dict[str, Any] = {}
        load_started = time.time()
        body = json.dumps({"instances": instances}).encode()
        loader = threading.Thread(target=lambda: load_box.update(result=run_load(
            f"{url}/v1/models/ctr:predict", make_body=lambda i: body, rate_per_s=rate, duration_s=load_seconds,
            concurrency=8)), daemon=True)
        loader.start()

        def sample() -> None:
            while not stop_sampling.wait(5):
                now = time.time()
                for name in ("serving", "airflow-scheduler"):
                    memory[name].append((now, service_pss_mb(live.named[name].pid)))
                if live.connect is not None:
                    memory["spark-connect"].append((now, service_pss_mb(live.connect.process.pid, largest_only=True)))

        threading.Thread(target=sample, daemon=True).start()
        first, waited = live.wait_publish(live.latest())
        progress(f"live: first minute published ({first}, {waited:.0f} s)")

        # 1. The scheduler SIGKILLed for 30 s (its LocalExecutor's running tasks die with it).
        before, _ = live.wait_publish(live.latest())
        live.kill("airflow-scheduler")
        time.sleep(30)
        live.start_scheduler()
        after, recover = live.wait_publish(before)
        cases.append(_case(
            "sigkill_scheduler", "Airflow's scheduler (and the tasks its executor runs) SIGKILLed, started again "
            "30 s later", "minute runs resume by themselves and catch up the missed minutes in order",
            f"next version {after} published {recover:.0f} s after the restart" if after else
            f"nothing published {recover:.0f} s after the restart", after is not None, recover_s=recover))
        progress(f"live: {cases[-1]['case']}: {cases[-1]['observed']}")

        # 2. Spark Connect SIGKILLed while a samples task runs on it; started again on the same port.
        found = None
        deadline = time.monotonic() + 180
        while found is None and time.monotonic() < deadline:
            found = running_task(live.db, "samples")
            time.sleep(0.3)
        if found is None:
            cases.append(_case("sigkill_spark_connect_mid_job", "Spark Connect SIGKILLed during a samples task",
                               "", "no samples task was seen running within 180 s", False))
        else:
            time.sleep(1.0)
            kill_tree(live.connect.process.pid)
            live.connect.process.wait(60)
            wait_until("Spark Connect's port to be free", lambda: not port_answers(live.spark_port), 60, 0.2)
            live.start_connect()
            after, recover = live.wait_publish(str(int(run_version(live.db, found[0])) - 1))
            cases.append(_case(
                "sigkill_spark_connect_mid_job", "the Spark Connect server SIGKILLed one second into a minute's "
                "samples task, started again", "the task fails and its retry (5 s later) runs on the new server; "
                "that run publishes its minute",
                f"killed during {found[0]}; its version {after} {recover:.0f} s after the restart" if after
                else f"its version not published {recover:.0f} s after the restart", after is not None,
                recover_s=recover))
        progress(f"live: {cases[-1]['case']}: {cases[-1]['observed']}")

        # 3. A minute's training task SIGKILLed (its process, as the OOM killer would).
        found = None
        deadline = time.monotonic() + 180
        while (found is None or not found[1]) and time.monotonic() < deadline:
            found = running_task(live.db, "train")
            time.sleep(0.3)
        if not found or not found[1]:
            cases.append(_case("sigkill_training_task", "a train task's process SIGKILLed", "",
                               "no running train task with a pid was seen within 180 s", False))
        else:
            try:
                os.kill(found[1], signal.SIGKILL)
                killed = True
            except ProcessLookupError:
                killed = False
            killed_at = time.monotonic()
            after, recover = live.wait_publish(str(int(run_version(live.db, found[0])) - 1))
            cases.append(_case(
                "sigkill_training_task", "the process of a running train task SIGKILLed",
                "Airflow retries the task; the retry trains from the parent and that run publishes its minute",
                f"{'killed' if killed else 'had ended before the kill'} pid {found[1]} of {found[0]}; its "
                f"version {after} {recover:.0f} s later" if after else f"its version not published {recover:.0f} s "
                "later",
                killed and after is not None, recover_s=time.monotonic() - killed_at if after else None))
        progress(f"live: {cases[-1]['case']}: {cases[-1]['observed']}")

        # 4. The model server SIGKILLed and started again at once.
        served_before = live.latest()
        killed_wall = time.time()
        live.kill("serving")
        live.start_serving()
        wait_until("the model server again", lambda: answers(f"{url}/healthz"), 300, 0.2)
        healthy_wall = time.time()
        try:
            import httpx

            version_after = httpx.get(f"{url}/v1/models/ctr", timeout=5).json()["model_version_status"][0]["version"]
        except Exception as err:  # noqa: BLE001 - recorded as observed
            version_after = f"unknown ({err})"
        restart = {"killed": killed_wall, "healthy": healthy_wall, "served_before": served_before,
                   "version_after": str(version_after)}
        progress(f"live: model server answering again {healthy_wall - killed_wall:.1f} s after its SIGKILL")
        # Memory is compared over the steady phase from here on: samples from before a restart are of another
        # process (a restarted scheduler grows as it warms up, which is not a leak).
        for series in memory.values():
            series.clear()
        steady_from = time.time()

        # 5. Steady minutes to the end of the load (the soak).
        loader.join()
        load = load_box["result"]
        load_ended = time.time()
    finally:
        stop_sampling.set()
        live.stop_all()
    # The model server's case: requests that failed while it was away.
    pending = restart
    failed = [r for r in load.records if r.status != 200]
    in_window = [r for r in failed if pending["killed"] - 1 <= r.sent_at_s <= pending["healthy"] + 1]
    recover = pending["healthy"] - pending["killed"]
    cases.append(_case(
        "sigkill_model_server", "the model server SIGKILLed under load and started again at once",
        "it answers again with the newest good version, not an older one; requests sent while it is away fail to "
        "connect (one server here: a second replica behind a load balancer takes them in production)",
        f"answering {recover:.1f} s after the kill with version {pending['version_after']} (newest before: "
        f"{pending['served_before']}); {len(in_window)} requests failed in that window",
        str(pending["version_after"]) >= str(pending["served_before"]), recover_s=recover,
        lost=no_loss(requests=len(in_window))))
    # Every minute that closed while the load ran (leaving 3 minutes to catch up) learned exactly once.
    learned = live.learned()
    closes = [m for m in (first_live + timedelta(minutes=i) for i in range(240))
              if m.timestamp() + 60 <= load_ended - 180]
    not_learned = [m.isoformat() for m in closes if m.isoformat() not in learned]
    twice = sorted(m for m, v in learned.items() if len(v) > 1)
    cases.append(_case(
        "every_live_minute_learned_once", f"every minute that closed during the {len(closes)}-minute run, through "
        "all the faults above", "each learned by exactly one standing version; none lost",
        f"{len(closes) - len(not_learned)} of {len(closes)} learned; not learned {not_learned[:5]}; learned twice "
        f"{twice[:5]}", not not_learned and not twice, lost=no_loss(minutes=len(not_learned))))
    other_failures = len(failed) - len(in_window)
    cases.append(_case(
        "good_requests_outside_faults", "the steady load outside the model server's restart window",
        "every request answered 200", f"{load.num_requests} requests, {other_failures} failed outside the window; "
        f"p99 {load.latency_p99_ms:.1f} ms", other_failures == 0, lost=no_loss(requests=other_failures),
        status_counts=load.status_counts))
    growth = {}
    for name, series in memory.items():
        if len(series) >= 8:
            quarter = max(2, len(series) // 4)
            growth[name] = {"start_mb": round(statistics.median(v for _, v in series[:quarter]), 1),
                            "end_mb": round(statistics.median(v for _, v in series[-quarter:]), 1)}
    bounded = all(g["end_mb"] <= 1.5 * g["start_mb"] + 50 for g in growth.values())
    cases.append(_case(
        "memory_over_the_run", f"memory (PSS) of the model server, the scheduler and Spark Connect's JVM over "
        f"the {(load_ended - steady_from) / 60:.0f} minutes of minute runs and load after the last fault",
        "no unbounded growth: the last quarter's median within 1.5x (+50 MiB) of the first quarter's",
        "; ".join(f"{n} {g['start_mb']:.0f} -> {g['end_mb']:.0f} MiB" for n, g in growth.items()),
        bounded and len(growth) == 3, memory_mb=growth))
    versions = live.store.versions("ctr")
    return {"cases": cases, "seconds": round(time.monotonic() - started, 1),
            "versions_published": len(versions), "load_minutes": round((load_ended - load_started) / 60, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--root", default="var/bench-reliability-live")
    parser.add_argument("--soak-minutes", type=float, default=2.0)
    args = parser.parse_args(argv)
    root = Path(args.root).absolute()
    if root.exists():
        import shutil

        shutil.rmtree(root)
    result = run_live_cases(root, soak_minutes=args.soak_minutes)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    for case in result["cases"]:
        print(f"{case['case']:34s} {'ok' if case['as_expected'] else 'NO'}  {case['observed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
