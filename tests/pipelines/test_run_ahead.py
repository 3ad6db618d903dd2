"""Which steps of a minute run the step worker starts ahead of their tasks, and what a task takes
(pipelines/run_ahead.py). tests/pipelines/test_incremental_pipeline.py runs a whole minute ahead on a real worker."""

from __future__ import annotations

import threading

from pipelines.run_ahead import Outcome, RunAhead
from pipelines.runner import pipeline_steps

RUN = {"pipeline": "incremental", "run_id": "scheduled__2026-01-01T00:10", "dag_id": "ctr_incremental",
       "start": "2026-01-01T00:10:00+00:00", "end": "2026-01-01T00:11:00+00:00",
       "overrides": {"paths.data_root": "/data"}, "environ": {}, "run_ahead": True}


def finish(ahead: RunAhead, outcome: Outcome, ok: bool = True) -> dict[str, Outcome]:
    """Ends an execution as the worker does (recorded first, then its final message); the steps it starts."""
    started = ahead.ended(outcome, ok)
    outcome.add({"ok": ok, "output": {"step": outcome.step}} if ok else {"ok": False, "error": "boom"})
    return {o.step: o for o in started}


def run_through(ahead: RunAhead) -> dict[str, Outcome]:
    """A sensor's yes, then every step the worker starts, ended well in the order they start."""
    queue = ahead.notice({**RUN, "step": "wait_for_data"})
    ran: dict[str, Outcome] = {}
    while queue:
        outcome = queue.pop(0)
        ran[outcome.step] = outcome
        queue += [o for o in ahead.ended(outcome, True)]
        outcome.add({"ok": True, "output": {"step": outcome.step}})
    return ran


def test_a_sensors_yes_starts_the_steps_after_it_in_the_dags_order():
    ahead = RunAhead(pipeline_steps)
    (plan,) = ahead.notice({**RUN, "step": "wait_for_data"})
    assert plan.step == "plan" and plan.ahead and not plan.claimed
    started = finish(ahead, plan)
    assert list(started) == ["validate", "samples"] and all(o.ahead for o in started.values())
    assert started["samples"].request == {**RUN, "step": "samples"}
    assert finish(ahead, started["samples"]) == {}  # train needs validate too
    assert list(finish(ahead, started["validate"])) == ["train"]


def test_every_step_runs_ahead_once_and_its_task_takes_it_once():
    ahead = RunAhead(pipeline_steps)
    ran = run_through(ahead)
    assert list(ran) == ["plan", "validate", "samples", "train", "export_delta", "gate", "publish", "spans"]
    taken = ahead.claim({**RUN, "step": "train"})
    assert taken is ran["train"] and taken.claimed
    assert [m["output"] for m in taken.messages()] == [{"step": "train"}]
    # A retry of the task, or the task cleared after the run: nothing to take, the step runs again ...
    assert ahead.claim({**RUN, "step": "train"}) is None
    again = ahead.begin({**RUN, "step": "train"})
    # ... and the steps after it, which ran in this run already, wait for their tasks.
    assert finish(ahead, again) == {}
    assert ahead.claim({**RUN, "step": "export_delta"}) is ran["export_delta"]


def test_a_failed_step_starts_nothing_and_its_retry_goes_on_from_there():
    ahead = RunAhead(pipeline_steps)
    (plan,) = ahead.notice({**RUN, "step": "wait_for_data"})
    started = finish(ahead, plan)
    assert finish(ahead, started["validate"], ok=False) == {}
    assert finish(ahead, started["samples"]) == {}  # train waits: validate failed
    assert ahead.claim({**RUN, "step": "validate"}) is started["validate"]  # the task gets the failure, retries
    retry = ahead.begin({**RUN, "step": "validate"})
    assert list(finish(ahead, retry)) == ["train"]


def test_a_task_of_other_inputs_or_without_run_ahead_takes_and_starts_nothing():
    ahead = RunAhead(pipeline_steps)
    run_through(ahead)
    other = {**RUN, "step": "gate", "overrides": {"paths.data_root": "/data", "incremental.epochs": 2}}
    assert ahead.claim(other) is None  # a config that differs: the step runs again, for this config
    assert ahead.claim({**RUN, "step": "gate"}) is None  # and the run's record is the new config's now
    off = {**RUN, "run_ahead": False}
    assert ahead.notice({**off, "step": "wait_for_data", "run_id": "manual"}) == []
    plan = ahead.begin({**off, "step": "plan", "run_id": "manual"})
    assert finish(ahead, plan) == {}


def test_a_sensors_second_yes_while_the_run_goes_on_changes_nothing():
    ahead = RunAhead(pipeline_steps)
    (plan,) = ahead.notice({**RUN, "step": "wait_for_data"})
    assert ahead.notice({**RUN, "step": "wait_for_data"}) == []  # its task told, failed, and told again
    assert ahead.claim({**RUN, "step": "plan"}) is plan
    assert list(finish(ahead, plan)) == ["validate", "samples"]


def test_a_cleared_run_starts_afresh_and_a_replaced_execution_starts_nothing():
    ahead = RunAhead(pipeline_steps)
    first = run_through(ahead)
    (plan,) = ahead.notice({**RUN, "step": "wait_for_data"})  # the whole run cleared: its sensor says yes again
    assert plan is not first["plan"] and ahead.claim({**RUN, "step": "plan"}) is plan
    assert ahead.ended(first["gate"], True) == []  # an execution of the cleared run, ending late
    assert list(finish(ahead, plan)) == ["validate", "samples"]


def test_a_task_that_comes_while_its_step_runs_gets_every_line_then_the_end():
    ahead = RunAhead(pipeline_steps)
    (plan,) = ahead.notice({**RUN, "step": "wait_for_data"})
    plan.add({"log": "first", "level": 20})
    taken = ahead.claim({**RUN, "step": "plan"})
    got: list[dict] = []
    reader = threading.Thread(target=lambda: got.extend(taken.messages()))
    reader.start()
    plan.add({"log": "second", "level": 20})
    finish(ahead, plan)
    reader.join(10)
    assert not reader.is_alive()
    assert [m.get("log", m.get("ok")) for m in got] == ["first", "second", True]
