"""A long-running process that runs the minute pipeline's steps for Airflow's tasks, warm.

An Airflow task is a fresh process: each step of a minute run pays for its start-up again (TensorFlow's graphs
and XLA programs, a Spark Connect session, an MLflow client, Great Expectations' context). In fresh processes a
steady-state 60 K-row minute spent 33-37 s in its steps; run one after another in one warm process, the same
steps took 7-10 s. The step worker (`ctr-pipeline worker`) is that warm process. Each task of ctr_incremental still runs
in Airflow, with its own state, retries and log; it sends its step to the worker, prints the step's log lines
as they come, and ends as the step ends: its output is the task's return value, its error the task's error.

    Airflow task (fresh process)                step worker (one process per data root)
      run_airflow_step ---- step, run, config ---->  a thread per step: run_steps(ctx, [step]), or the
                                                   outcome of the step that ran ahead of its task
      log lines <--------------------------------- the step's log records, as they are emitted
      return / raise <---- output or error -------- DataValidationError, NothingToLearn, ... keep their type

The task's side (finding the worker, sending a step, relaying its answer) is pipelines/step_client.py.

Running ahead (pipelines/run_ahead.py): once a step ends well here, or the run's sensor task says its wait is
over, the worker starts the steps after it without waiting for their tasks; a task whose step ran ahead gets
that run's log lines and outcome instead of running it again. It takes Airflow's hand-offs (0.3-0.6 s each)
out of a minute's freshness; `incremental.run_ahead=false` turns it off.

Who may use it: the worker listens on loopback unless told otherwise (`--host`; the compose stack's service
listens on its private network), and before it reads a request the client proves that it holds the shared secret,
`CTR_STEP_WORKER_SECRET` (pipelines/step_auth.py). A client without it, or with another, is refused before its
request is read, and the worker logs who was refused and why. `ctr-pipeline stack up` generates the secret and
gives it to the worker and the tasks; docker-compose.yml refuses to start without it.

Finding it: the worker writes `<data_root>/worker/step-worker.json` (host, port, pid) once it listens and
removes it when it stops. A task whose data root has no answering worker runs the step itself, as before
(logged once per task), so a worker is a speed-up, never a dependency. `incremental.step_worker=false` turns
it off.

The worker runs the task's exact config: the task sends the values its own config was built from (its params'
overrides and the environment variables of components.config.ENVIRONMENT_KEYS); the rest of the environment
(credentials of the model store, MLflow) is the worker's own, so it is started with the scheduler's
environment (`ctr-pipeline stack up` does).

Memory: the worker's automatic garbage collections are off, and it collects in its idle time and at a run's end
when the run before it was not followed by a collection (pipelines/idle_gc.py): working off a backlog of 60 K-row
minutes it held 1.8-2.1 GiB where, collecting only when idle, it rose to 3.0 GiB (bench/bench_worker_memory.py).
A long-running process still grows slowly. Once a step ends with the worker's
resident memory above `incremental.step_worker_max_rss_mib`, it takes no more steps (its address file goes, so
new tasks run their steps themselves), lets the running ones finish and starts over as a fresh process
(`ctr-pipeline worker` re-executes itself), which warms up again.

Limits: a step already running goes on to its end when its task is killed (its outputs are written atomically,
so a retry that runs beside it cannot see a half-written one). Steps run in threads of one process, one thread
per step, side by side where the DAG has them side by side (validate beside samples); a step that fails drops
the worker's Spark session, so a restarted Spark Connect server costs one retry, not every later run.
"""

from __future__ import annotations

import json
import logging
import os
import socketserver
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from pipelines import arrivals, idle_gc
from pipelines.idle_gc import IdleCollector
from pipelines.run_ahead import Outcome, RunAhead
from pipelines.step_auth import Refused, verify_client
from pipelines.step_client import PIPELINES, address_file, error_types, send_message

log = logging.getLogger(__name__)


class _ThreadLogs(logging.Handler):
    """Routes each log record to the step running in the thread that emitted it."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.sinks: dict[int, Callable[[logging.LogRecord], None]] = {}
        self.setFormatter(logging.Formatter("%(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        sink = self.sinks.get(record.thread or 0)
        if sink is not None:
            try:
                sink(record)
            except Exception:  # noqa: BLE001 - a record that cannot be sent must not stop the step
                self.handleError(record)


def run_request(request: Mapping[str, Any]) -> Any:
    """Runs the requested step in this process, as run_airflow_step would in the task's own."""
    from components.config import load_config
    from components.interval import Interval
    from pipelines.context import RunContext
    from pipelines.runner import run_steps, select_steps

    pipeline = str(request["pipeline"])
    if pipeline not in PIPELINES:
        raise ValueError(f"the step worker runs the steps of {list(PIPELINES)}, not of {pipeline!r}")
    config = load_config(overrides=request.get("overrides") or {}, environ=request.get("environ") or {})
    ctx = RunContext(config=config, interval=Interval(datetime.fromisoformat(request["start"]),
                                                      datetime.fromisoformat(request["end"])),
                     pipeline=pipeline, run_id=str(request["run_id"]), dag_id=str(request.get("dag_id", "")))
    (step,) = select_steps(pipeline, [str(request["step"])])
    return run_steps(ctx, [step])[step.name]


def rss_mib(pid: int | None = None) -> float | None:
    """A process's resident memory in MiB (this process's by default), or None where it cannot be read."""
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except (psutil.Error, OSError):
        return None


def _drop_spark_session() -> None:
    """Stops the process's Spark session, so the next step starts a new one (a restarted Connect server does
    not know the old session)."""
    try:
        from pyspark.sql import SparkSession

        session = SparkSession.getActiveSession()
        if session is not None and type(session).__module__.startswith("pyspark.sql.connect"):
            session.stop()  # a local session does not go stale
    except Exception:  # noqa: BLE001 - best effort: the next step reports a Spark that is really gone
        log.debug("stopping the Spark session failed", exc_info=True)


class _Handler(socketserver.StreamRequestHandler):
    server: StepServer

    def handle(self) -> None:
        server = self.server
        try:
            if not verify_client(self.connection, server.secret):  # a health check's connect-and-close
                return
        except Refused as err:
            log.warning("refused the client at %s:%d: %s; nothing of its request runs", *self.client_address[:2], err)
            return
        line = self.rfile.readline()
        if not line.strip():  # a client that sent nothing after the handshake
            return
        request = json.loads(line)
        if request.get("notice") == "done":  # a sensor's task: its wait is over (pipelines/run_ahead.py)
            if not server.recycling.is_set():
                server.start(server.ahead.notice(request))
            send_message(self.wfile, {"ok": True, "output": None})
            return
        outcome = server.ahead.claim(request)
        if outcome is None:
            if server.recycling.is_set():  # announced gone already: the task runs the step itself
                send_message(self.wfile, {"ok": False, "error_type": "WorkerUnavailable",
                                          "error": "the step worker is restarting"})
                return
            outcome = server.ahead.begin(request)
            server.start([outcome])
        try:
            for message in outcome.messages():
                send_message(self.wfile, message)
        except OSError:  # the task went away (killed, timed out): the step still runs to its end
            log.warning("the task of %s went away before its step ended; the step runs to its end",
                        _name(request))


def _name(request: Mapping[str, Any]) -> str:
    return f"{request.get('pipeline')}/{request.get('step')} of {request.get('run_id')}"


class StepServer(socketserver.ThreadingTCPServer):
    # server_close() waits for the steps still running: a stop or a restart never cuts one off.
    daemon_threads = False
    block_on_close = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], max_rss_mib: float | None,
                 collector: IdleCollector | None = None, *, secret: bytes) -> None:
        from pipelines.runner import pipeline_steps

        super().__init__(address, _Handler)
        self.secret = secret
        self.thread_logs = _ThreadLogs()
        self.max_rss_mib = max_rss_mib
        self.recycling = threading.Event()
        self.ahead = RunAhead(pipeline_steps)
        self.steps: list[threading.Thread] = []
        self.collector = collector
        self._pipeline_steps = pipeline_steps

    def start(self, outcomes: list[Outcome]) -> None:
        """Runs each execution in a thread of its own (a step the worker started ahead of its task, or one a
        task asked for and waits on)."""
        for outcome in outcomes:
            if outcome.ahead and self.recycling.is_set():  # nothing new once it is starting over
                outcome.add({"ok": False, "error_type": "WorkerUnavailable", "error": "the step worker is restarting"})
                continue
            thread = threading.Thread(target=self.execute, args=(outcome,), name=_name(outcome.request))
            self.steps = [t for t in self.steps if t.is_alive()] + [thread]
            thread.start()

    def execute(self, outcome: Outcome) -> None:
        """Runs one step, its log records and then its end going to `outcome`; then starts what may run ahead."""
        request, name = outcome.request, _name(outcome.request)
        logs = self.thread_logs
        ident = threading.get_ident()
        logs.sinks[ident] = lambda record: outcome.add({"log": logs.format(record), "level": record.levelno})
        started = time.monotonic()
        if outcome.ahead:
            at = datetime.now().astimezone().strftime("%H:%M:%S.%f")[:-3]
            log.info("%s: started ahead of its task, at %s", name, at)
        else:
            log.info("%s: started", name)
        final: dict[str, Any] = {"ok": False, "error_type": "RuntimeError", "error": "the step worker failed"}
        next_steps: list[Outcome] = []
        try:
            try:
                output = run_request(request)
                log.info("%s: done in %.1f s", name, time.monotonic() - started)
                final = {"ok": True, "output": output}
            except Exception as err:  # noqa: BLE001 - every error goes back to the task, which raises it
                if not isinstance(err, tuple(error_types().values())):
                    _drop_spark_session()
                log.info("%s: %s after %.1f s: %s", name, type(err).__name__, time.monotonic() - started, err)
                final = {"ok": False, "error_type": type(err).__name__, "error": str(err),
                         "traceback": traceback.format_exc()}
            finally:
                logs.sinks.pop(ident, None)
            rss = rss_mib()
            if self.max_rss_mib and rss is not None and rss > self.max_rss_mib and not self.recycling.is_set():
                log.info("resident memory %.0f MiB is over incremental.step_worker_max_rss_mib=%.0f: no more steps "
                         "here; the worker starts over once the running ones end", rss, self.max_rss_mib)
                self.recycling.set()
            # Recorded before the task hears of the end, so the task of a step after it finds that step begun.
            next_steps = self.ahead.ended(outcome, ok=final["ok"])
        except Exception:  # noqa: BLE001 - the task still gets the step's end; what follows waits for its tasks
            log.exception("%s: the steps after it wait for their tasks", name)
        finally:
            ends_run = self.collector is not None and not next_steps and (not final["ok"] or self.ends_run(request))
            if ends_run:
                self.collect_at_run_end()
            outcome.add(final)
        self.start(next_steps)

    def collect_at_run_end(self) -> None:
        """A run's last step (or a failed one) ended: a collection now, before its task hears of the end, when
        one is overdue (a worker catching up starts the next run at once, and an idle time does not come; made
        while nothing else runs, since a collection beside a running step took 8-17 s instead of 1 s), else
        one in the idle time after the run."""
        try:
            others = [t for t in self.steps if t.is_alive() and t is not threading.current_thread()]
            if (why := self.collector.overdue()) and not others and not self.recycling.is_set():
                self.collector.collect_idle(why)
            else:
                self.collector.run_ended()
        except Exception:  # noqa: BLE001 - a collection that fails must not keep the step's end from its task
            log.exception("the collection at a run's end failed")

    def ends_run(self, request: Mapping[str, Any]) -> bool:
        try:
            return self._pipeline_steps(str(request["pipeline"]))[-1].name == request.get("step")
        except (KeyError, ValueError):
            return False

    def collect_when_idle(self, stop: threading.Event, poll_s: float = 0.5) -> None:
        """Until `stop`: a full garbage collection whenever one is due and no step runs (pipelines/idle_gc.py)."""
        while not stop.wait(poll_s):
            why = self.collector.due() if self.collector is not None else None
            if why and not any(t.is_alive() for t in self.steps) and not self.recycling.is_set():
                self.collector.collect_idle(why)

    def join_steps(self) -> None:
        """Waits for the steps still running, those started ahead of their tasks too."""
        for thread in list(self.steps):
            thread.join()


def warm_up() -> None:
    """Imports what the steps import, so the first minute does not pay for it."""
    import tensorflow  # noqa: F401 - heavy, imported by train, export and gate

    import components.validation  # noqa: F401
    import pipelines.incremental  # noqa: F401
    import spark_jobs.samples  # noqa: F401


def serve(config, host: str = "127.0.0.1", port: int = 0, ready: Callable[[tuple[str, int]], None] | None = None,
          stop: threading.Event | None = None, advertise: str | None = None, *, secret: bytes) -> bool:
    """Serves steps until `stop` is set (or forever) to the clients that prove they hold `secret`, announcing the
    address in the data root's address file (`advertise`, or the host it listens on, and the port). Returns True
    when it stopped to start over (its memory went over incremental.step_worker_max_rss_mib), False when stopped."""
    warm_up()
    collector = IdleCollector(automatic=not config.incremental.worker_idle_gc)
    collector.install()
    if not collector.automatic:
        collector.collect_idle("warmed up")
    server = StepServer((host, port), config.incremental.step_worker_max_rss_mib, collector, secret=secret)
    logging.getLogger().addHandler(server.thread_logs)
    # The steps' progress lines and the worker's go to the tasks; validation on arrival and the garbage
    # collections to the worker's log.
    for logger in (logging.getLogger("ctr"), log, arrivals.log, idle_gc.log):
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
    address = server.server_address[:2]
    path = address_file(config.paths.root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"host": advertise or address[0], "port": address[1], "pid": os.getpid(),
                               "started": datetime.now().astimezone().isoformat(timespec="seconds")}))
    os.replace(tmp, path)
    log.info("step worker for %s listening on %s:%d", config.paths.root, *address)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True,
                              name="step-worker")
    thread.start()
    watching = threading.Event()  # set when the worker stops: ends validation on arrival and idle collections
    arrivals.start(config, watching)
    threading.Thread(target=server.collect_when_idle, args=(watching,), name="idle-gc", daemon=True).start()
    if ready is not None:
        ready(address)
    def unannounce() -> None:
        try:
            current = json.loads(path.read_text())
            if current.get("pid") == os.getpid() and int(current.get("port", -1)) == address[1]:
                path.unlink()
        except (OSError, ValueError):
            pass

    try:
        while not (stop.wait(0.2) if stop is not None else time.sleep(0.2)):
            if server.recycling.is_set():
                unannounce()
                break
    finally:
        watching.set()
        unannounce()
        server.shutdown()
        server.server_close()  # waits for the running steps
        server.join_steps()
        collector.uninstall()
        logging.getLogger().removeHandler(server.thread_logs)
        log.info("step worker %s", "starting over" if server.recycling.is_set() else "stopped")
    return server.recycling.is_set()
