"""bench-freshness's figures: the percentiles over the minutes after the first publish with the cold first minute
beside, and the minute's Spark seconds as the scheduler ran them, from the step worker's log or Airflow's DB."""

from __future__ import annotations

import os
import sqlite3
import time

import pytest

from bench.bench_freshness import (
    RssSampler,
    airflow_step_seconds,
    argument_parser,
    cold_and_rest_p50,
    command_of,
    minutes_after_first_publish,
    spark_steps,
    worker_step_seconds,
)

pytestmark = pytest.mark.unit

# Closes at 60 ... 360 s; the minute that closed at 240 was never served.
BY_MINUTE = {60.0: 31.0, 120.0: 12.0, 180.0: 9.0, 240.0: None, 300.0: 8.5, 360.0: 7.0}


def test_percentiles_are_over_the_minutes_after_the_first_publish_and_the_cold_minute_is_beside():
    figures = minutes_after_first_publish(BY_MINUTE, first_publish=91.0, load_ended=400.0)
    # After 91: 12, 9, 160 (never served: 400 - 240 at least), 8.5, 7 -> sorted 7, 8.5, 9, 12, 160
    assert figures == {"minutes": 5, "p50_s": 9.0, "p95_s": 160.0, "max_s": 160.0, "cold_first_minute_s": 31.0,
                       "minutes_before_first_publish": 1}


def test_a_first_minute_that_closed_after_the_first_publish_is_among_the_minutes():
    figures = minutes_after_first_publish(BY_MINUTE, first_publish=50.0, load_ended=400.0)
    # 7, 8.5, 9, 12, 31, 160: the median is (9 + 12) / 2; p95 the nearest rank, round(0.95 * 5) = 5
    assert figures == {"minutes": 6, "p50_s": 10.5, "p95_s": 160.0, "max_s": 160.0, "cold_first_minute_s": 31.0,
                       "minutes_before_first_publish": 0}


def test_no_publish_leaves_no_minutes_to_measure():
    figures = minutes_after_first_publish(BY_MINUTE, first_publish=None, load_ended=400.0)
    assert figures == {"minutes": 0, "p50_s": None, "p95_s": None, "max_s": None, "cold_first_minute_s": 31.0,
                       "minutes_before_first_publish": 6}


def test_over_thirty_minutes_p95_is_the_second_worst():
    by_minute = {60.0 * (i + 1): float(i + 1) for i in range(31)}  # 1 s ... 31 s; the first (1 s) before 100
    figures = minutes_after_first_publish(by_minute, first_publish=100.0, load_ended=10_000.0)
    # 2 ... 31: round(0.95 * 29) = 28 -> the 29th of 30, 30 s
    assert (figures["minutes"], figures["p50_s"], figures["p95_s"], figures["max_s"]) == (30, 16.5, 30.0, 31.0)
    assert figures["cold_first_minute_s"] == 1.0


def test_the_minutes_spark_steps_are_the_spark_pools():
    assert spark_steps() == ("samples",)


def test_worker_step_seconds_sum_the_steps_of_each_scheduled_run(tmp_path):
    log = tmp_path / "step-worker.log"
    prefix = "12:00:00 INFO pipelines.step_worker: incremental"
    log.write_text("\n".join([
        f"{prefix}/samples of scheduled__2026-01-01T00:01:00+00:00: started ahead of its task, at 00:01:00.600",
        f"{prefix}/samples of scheduled__2026-01-01T00:01:00+00:00: done in 12.3 s",
        f"{prefix}/validate of scheduled__2026-01-01T00:01:00+00:00: done in 1.0 s",
        f"{prefix}/samples of scheduled__2026-01-01T00:02:00+00:00: done in 3.4 s",
        f"{prefix}/samples of scheduled__2026-01-01T00:02:00+00:00: done in 3.6 s",  # a retry: the last counts
        f"{prefix}/samples of manual__2026-01-01T00:02:30+00:00: done in 2.0 s",
        f"{prefix}/samples of scheduled__2026-01-01T00:03:00+00:00: RuntimeError after 1.0 s: lost",
    ]) + "\n")
    assert worker_step_seconds(log, ("samples",)) == {"scheduled__2026-01-01T00:01:00+00:00": 12.3,
                                                       "scheduled__2026-01-01T00:02:00+00:00": 3.6}
    assert worker_step_seconds(log, ("samples", "validate")) == {"scheduled__2026-01-01T00:01:00+00:00": 13.3,
                                                                 "scheduled__2026-01-01T00:02:00+00:00": 3.6}
    assert worker_step_seconds(tmp_path / "absent.log", ("samples",)) == {}


def test_airflow_step_seconds_are_successful_task_instances_of_scheduled_runs(tmp_path):
    db = tmp_path / "airflow.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE task_instance (dag_id TEXT, run_id TEXT, task_id TEXT, start_date TEXT, "
                     "end_date TEXT, state TEXT)")
        conn.executemany("INSERT INTO task_instance VALUES (?, ?, ?, ?, ?, ?)", [
            ("ctr_incremental", "scheduled__1", "samples", "2026-01-01 00:01:04.000000", "2026-01-01 00:01:20.000000",
             "success"),
            ("ctr_incremental", "scheduled__1", "validate", "2026-01-01 00:01:04.000000",
             "2026-01-01 00:01:06.000000", "success"),
            ("ctr_incremental", "scheduled__2", "samples", "2026-01-01 00:02:03.500000", "2026-01-01 00:02:07.000000",
             "success"),
            ("ctr_incremental", "scheduled__3", "samples", "2026-01-01 00:03:03.000000", "2026-01-01 00:03:05.000000",
             "failed"),
            ("ctr_incremental", "manual__4", "samples", "2026-01-01 00:03:30.000000", "2026-01-01 00:03:33.000000",
             "success"),
            ("ctr_daily", "scheduled__1", "samples", "2026-01-01 00:00:00.000000", "2026-01-01 00:09:00.000000",
             "success"),
        ])
    assert airflow_step_seconds(db, ("samples",)) == {"scheduled__1": 16.0, "scheduled__2": 3.5}


def test_the_first_run_is_cold_and_the_rest_give_the_median():
    runs = {"scheduled__2026-01-01T00:03:00+00:00": 4.0, "scheduled__2026-01-01T00:01:00+00:00": 20.0,
            "scheduled__2026-01-01T00:02:00+00:00": 3.0, "scheduled__2026-01-01T00:04:00+00:00": 5.0}
    assert cold_and_rest_p50(runs) == (20.0, 4.0)
    assert cold_and_rest_p50({"scheduled__2026-01-01T00:01:00+00:00": 20.0}) == (20.0, None)
    assert cold_and_rest_p50({}) == (None, None)


def test_the_command_names_the_options_that_differ_from_their_defaults():
    assert command_of(argument_parser().parse_args([])) == "make bench-freshness"
    args = argument_parser().parse_args(["--minutes", "4", "--rows-per-minute", "5000", "--out", "/tmp/f.json",
                                         "--no-step-worker"])
    assert command_of(args) == ("make bench-freshness BENCH_FRESHNESS_ARGS='--minutes 4 --rows-per-minute 5000 "
                                "--out /tmp/f.json --no-step-worker'")


def test_the_worker_memory_sampler_records_a_live_process_until_stopped_and_nothing_without_one():
    started = time.time()
    sampler = RssSampler(os.getpid(), started, 0.05)
    deadline = time.monotonic() + 10
    while len(sampler.samples) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    sampler.stop()
    taken = len(sampler.samples)
    assert taken >= 3
    seconds = [at for at, _ in sampler.samples]
    assert seconds == sorted(seconds) and seconds[0] > 0
    assert all(mib > 10 for _, mib in sampler.samples)  # this interpreter's own resident memory
    time.sleep(0.2)
    assert len(sampler.samples) == taken  # nothing after stop()
    none = RssSampler(None, started, 0.05)
    time.sleep(0.15)
    none.stop()
    assert none.samples == []
