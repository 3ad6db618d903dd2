"""bench-freshness's account of where a minute run's time goes, read from an Airflow metadata DB (SQLite)."""

from __future__ import annotations

import sqlite3

from bench.bench_freshness import airflow_timeline, steady_minutes, worker_steps


def test_timeline_waits_follow_each_tasks_upstream(tmp_path):
    db = tmp_path / "airflow.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE dag_run (dag_id TEXT, run_id TEXT, data_interval_end TEXT, state TEXT)")
        conn.execute("CREATE TABLE task_instance (dag_id TEXT, run_id TEXT, task_id TEXT, start_date TEXT, "
                     "end_date TEXT, state TEXT)")
        conn.executemany("INSERT INTO dag_run VALUES ('ctr_incremental', ?, ?, ?)", [
            ("r1", "2026-01-01 00:01:00.000000", "success"), ("r2", "2026-01-01 00:02:00.000000", "failed")])
        tasks = [  # r1: plan, then validate and samples side by side, then train
            ("r1", "plan", "00:01:02", "00:01:03", "success"),
            ("r1", "validate", "00:01:04", "00:01:14", "success"),
            ("r1", "samples", "00:01:04", "00:01:20", "success"),
            ("r1", "train", "00:01:21", "00:01:31", "success"),
            ("r1", "publish", "00:01:32", "00:01:33", "success"),
            ("r1", "spans", "00:01:33", "00:01:35", "success"),
            ("r2", "plan", "00:02:04", "00:02:05", "success"),
            ("r2", "validate", "00:02:07", "00:02:08", "failed"),
        ]
        conn.executemany("INSERT INTO task_instance VALUES ('ctr_incremental', ?, ?, ?, ?, ?)", [
            (run, task, f"2026-01-01 {start}.000000", f"2026-01-01 {end}.000000", state)
            for run, task, start, end, state in tasks])
    timeline = airflow_timeline(db)
    assert timeline["dag_runs"] == {"success": 1, "failed": 1}
    assert timeline["task_run_s"] == {"plan": 1.0, "validate": 10.0, "samples": 16.0, "train": 10.0,
                                      "publish": 1.0, "spans": 2.0}
    # train waited from samples' end (its last upstream), not from validate's
    assert timeline["task_wait_s"] == {"validate": 1.0, "samples": 1.0, "train": 1.0, "publish": 1.0, "spans": 0.0}
    assert timeline["first_task_start_after_close_s"] == 2.0  # plan of r1; r2 has one successful task only
    assert timeline["last_task_end_after_close_s"] == 35.0  # the spans step, after the publish
    assert timeline["publish_task_end_after_close_s"] == 33.0  # the last task's before the spans step
    assert timeline["runs"] == 2


def test_steady_minutes_are_those_that_closed_after_the_first_publish_since_the_unpause():
    by_minute = {60.0: 31.0, 120.0: 12.0, 180.0: 9.0, 240.0: None, 300.0: 8.5}
    # 50: a daily model's publish before the unpause at 55; the first run's delta at 91
    first, steady = steady_minutes(by_minute, [50.0, 91.0, 132.0, 189.0], unpaused=55.0)
    assert first == 91.0
    assert steady == [12.0, 9.0, 8.5]  # the minute that closed at 60 waited for the first run; 240 never served
    assert steady_minutes(by_minute, [50.0], unpaused=55.0) == (None, [])


def test_worker_steps_say_when_each_step_started_after_its_minute_closed(tmp_path):
    log = tmp_path / "step-worker.log"
    lines = []
    for run, plan, train in (("2026-11-25T12:21:00+00:00", "12:21:44.566", "12:21:51.820"),  # after the unpause
                             ("2026-11-25T12:22:00+00:00", "12:22:00.550", "12:22:04.640"),
                             ("2026-11-25T23:59:00+00:00", "23:59:00.750", "00:00:04.900")):  # past midnight
        lines += [f"12:00:00 INFO pipelines.step_worker: incremental/plan of scheduled__{run}: started ahead of its "
                  f"task, at {plan}",
                  f"12:00:00 INFO pipelines.step_worker: incremental/plan of scheduled__{run}: done in 0.2 s",
                  f"12:00:00 INFO pipelines.step_worker: incremental/train of scheduled__{run}: started ahead of its "
                  f"task, at {train}",
                  f"12:00:00 INFO pipelines.step_worker: incremental/train of scheduled__{run}: done in 4.0 s"]
    lines.append("12:00:00 INFO pipelines.step_worker: incremental/plan of manual__2026-11-25T12:30:11+00:00: "
                 "started ahead of its task, at 12:30:12.000")
    log.write_text("\n".join(lines) + "\n")
    steps = worker_steps(log)
    assert steps["step_s"] == {"plan": 0.2, "train": 4.0}
    assert steps["steps_started_ahead"] == 7 and steps["steps_done"] == 6
    # The medians of the two runs after the first: plan 0.55 and 0.75 s, train 4.64 and 64.9 s after the close.
    assert steps["start_after_close_s"] == {"plan": 0.65, "train": 34.77}
