"""Steps that run ahead of their Airflow tasks in the step worker.

Between two steps of a minute run, Airflow spends 0.3-0.6 s doing nothing but hand-offs: the scheduler notices
the upstream task's end, queues the next task, and a fresh task process starts and sends its step to the worker.
With seven steps that is 2-3 s of every minute's freshness. So once a step ends well in the step worker (or a
sensor task tells the worker that its wait is over), the worker starts the steps downstream of it whose
upstream steps have all ended well, without waiting for their tasks. When a step's task comes, it takes that
run's outcome instead of running the step again: the step's log lines (those already emitted, then the rest as
they come), then its output or its error. Each step is still a task in Airflow with its own log and state, and
Airflow's view of the run ends as the steps end, a hand-off later.

What a task takes:
- only an execution of its own run, step and inputs (the interval and the config it was built from); anything
  else runs the step again as before;
- only once: a retry, or a task cleared after the run, runs the step again, and the steps after it run ahead
  only where they have not run for this run yet. A sensor's notice after a cleared run starts the run afresh
  (one that comes while a step of the run still runs here changes nothing);
- the outcome as it was: an error (a failed gate, data that fails validation) is the task's error, Airflow's
  retry runs the step again, and nothing downstream of a failed step runs ahead.

What running ahead changes, knowingly: a run marked failed or a DAG paused in the UI while its steps run ahead
still goes on to publish (the gate still decides), since the worker does not ask Airflow; and the steps that
run ahead do not wait for their Airflow pools (a minute run has one run at a time, so its steps do not compete
with each other). `incremental.run_ahead=false` has every step wait for its task.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from pipelines.context import Step, step_upstream

# A run's outcomes are dropped this long after its last step began (a minute run lasts well under it).
KEEP_S = 1800.0


class Outcome:
    """One execution of a step in the worker: the messages for its task as they come (log lines, then one
    final message with `ok`), kept so that a task that comes later gets them all."""

    def __init__(self, request: Mapping[str, Any], ahead: bool) -> None:
        self.request = dict(request)
        self.ahead = ahead  # started by the worker, not by a task
        self.claimed = not ahead
        self.succeeded = False  # ended without an error (set by RunAhead.ended)
        self._messages: list[dict[str, Any]] = []
        self._changed = threading.Condition()

    @property
    def step(self) -> str:
        return str(self.request["step"])

    def add(self, message: dict[str, Any]) -> None:
        with self._changed:
            self._messages.append(message)
            self._changed.notify_all()

    @property
    def ended(self) -> dict[str, Any] | None:
        """The final message (`ok` True or False), or None while the step runs."""
        with self._changed:
            return self._messages[-1] if self._messages and "ok" in self._messages[-1] else None

    def messages(self) -> Iterator[dict[str, Any]]:
        """Every message from the first, waiting for the next until the final one."""
        index = 0
        while True:
            with self._changed:
                while index >= len(self._messages):
                    self._changed.wait()
                message = self._messages[index]
            index += 1
            yield message
            if "ok" in message:
                return


def inputs_key(request: Mapping[str, Any]) -> str:
    """What a step's execution depends on besides its step: the run, its interval and its config's inputs."""
    return json.dumps([request.get(k) for k in ("pipeline", "run_id", "dag_id", "start", "end", "overrides",
                                                "environ")], sort_keys=True, default=str)


class RunAhead:
    """The step outcomes of recent runs in this worker, and which steps may start before their tasks ask.

    `claim` gives a task its step's execution when one ran (or runs) ahead; `begin` records an execution a task
    asked for; `ended` records how an execution ended and returns the executions to start next, which the
    caller runs. A request with a false `run_ahead` never starts anything."""

    def __init__(self, steps: Callable[[str], Sequence[Step]], keep_s: float = KEEP_S) -> None:
        self._steps = steps
        self._keep_s = keep_s
        self._lock = threading.Lock()
        self._runs: dict[tuple[str, str], dict[str, Any]] = {}  # (pipeline, run_id) -> {"key", "steps", "at"}

    def _run(self, request: Mapping[str, Any], fresh: bool = False) -> dict[str, Outcome]:
        """The outcomes of the request's run by step; a new, empty record where the run's inputs changed."""
        now = time.time()
        for run_key in [k for k, run in self._runs.items() if now - run["at"] > self._keep_s]:
            del self._runs[run_key]
        run_key, key = (str(request["pipeline"]), str(request["run_id"])), inputs_key(request)
        run = self._runs.get(run_key)
        if fresh or run is None or run["key"] != key:
            run = self._runs[run_key] = {"key": key, "steps": {}, "at": now}
        run["at"] = now
        return run["steps"]

    def claim(self, request: Mapping[str, Any]) -> Outcome | None:
        """The execution of the request's step that ran ahead for the same run and inputs and no task has taken
        yet (it may still be running), now taken; else None."""
        with self._lock:
            outcome = self._run(request).get(str(request["step"]))
            if outcome is None or outcome.claimed:
                return None
            outcome.claimed = True
            return outcome

    def begin(self, request: Mapping[str, Any]) -> Outcome:
        """A task's own execution of its step (replacing an earlier one of the run)."""
        with self._lock:
            outcome = Outcome(request, ahead=False)
            self._run(request)[outcome.step] = outcome
            return outcome

    def ended(self, outcome: Outcome, ok: bool) -> list[Outcome]:
        """Records that `outcome`'s step ended (`ok`: without an error, and for a sensor with a yes), and
        returns the executions to start now: the steps downstream of it whose upstream steps all ended well in
        this run and that have not begun in it. Called before the outcome's task is told, so the task of a
        step downstream always finds that step begun."""
        request = outcome.request
        if not ok or not request.get("run_ahead"):
            return []
        with self._lock:
            steps = self._run(request)
            if steps.get(outcome.step) is not outcome:  # replaced by a later execution, or the run by a fresh one
                return []
            outcome.succeeded = True
            started = []
            for name, needs in step_upstream(self._steps(str(request["pipeline"]))).items():
                if outcome.step not in needs or name in steps:
                    continue
                if all((done := steps.get(need)) is not None and done.succeeded for need in needs):
                    steps[name] = Outcome({**request, "step": name}, ahead=True)
                    started.append(steps[name])
            return started

    def notice(self, request: Mapping[str, Any]) -> list[Outcome]:
        """A step that ended well outside this worker (a sensor's yes in its task): the run starts afresh from
        it (a cleared run's earlier outcomes are dropped); returns the executions to start. While a step of the
        run still runs here (a sensor task that told, then failed and was retried), the run goes on as it is."""
        with self._lock:
            if any(earlier.ended is None for earlier in self._run(request).values()):
                return []
            outcome = Outcome(request, ahead=False)
            outcome.add({"ok": True, "output": True})
            self._run(request, fresh=True)[outcome.step] = outcome
        return self.ended(outcome, ok=True)
