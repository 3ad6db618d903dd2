"""bench-serving's taking apart of the loaded phase's requests: the server's stages, the client's delay, and the
time a request waited behind the requests sent before it (bench.bench_serving.sent_behind, where_time_went)."""

from __future__ import annotations

import dataclasses

import pytest

from bench.bench_serving import queued_alone, sent_behind, where_time_went
from bench.loadgen import RequestRecord

pytestmark = pytest.mark.unit


def record(sent: float, service: float, delay: float = 0.0, status: int | None = 200,
           compute_ms: float = 1.0) -> RequestRecord:
    return RequestRecord(sent_at_s=sent, latency_s=delay + service, status=status, version="1",
                         scheduled_at_s=sent - delay, service_s=service,
                         server_ms={"read": 0.1, "queue": 0.2, "compute": compute_ms, "return": 0.1})


def test_a_request_sent_while_earlier_ones_are_unanswered_waits_until_the_last_of_them_is():
    records = [record(10.000, 0.004), record(10.001, 0.006),  # the second left 3 ms before the first's answer
               record(10.005, 0.002),  # the first is answered; the second until 10.007: 2 ms behind
               record(10.020, 0.003),  # everything answered: 0
               record(10.0225, 0.010, status=None)]  # a timeout is in flight until it gives up: 0.5 ms behind
    behind = sent_behind(records)
    assert behind == pytest.approx({0: 0.0, 1: 0.003, 2: 0.002, 3: 0.0, 4: 0.0005})
    # Order of the list does not matter: each request is placed by its send time.
    assert sent_behind(records[::-1]) == pytest.approx({4: 0.0, 3: 0.003, 2: 0.002, 1: 0.0, 0: 0.0005})


def test_the_slowest_requests_are_told_apart_by_how_long_they_waited_behind_others():
    # 200 requests 10 ms apart taking 3 ms, one in ten sent 1 ms after the one before (2 ms behind it, 5 ms).
    records = []
    for i in range(200):
        start = i * 0.010
        records.append(record(start, 0.003))
        if i % 10 == 0:
            records.append(record(start + 0.001, 0.005, delay=0.0002, compute_ms=3.0))
    out = where_time_went(records)
    slow, middle = out["slowest_1pct"], out["middle_tenth"]
    assert out["timed_requests"] == 220
    assert out["sent_behind_share"] == pytest.approx(20 / 220)
    assert slow["sent_behind_share"] == 1.0 and slow["behind_ms"] == pytest.approx(2.0)
    assert middle["sent_behind_share"] == 0.0 and middle["behind_ms"] == 0.0
    assert slow["latency_ms"] == pytest.approx(5.2) and slow["send_delay_ms"] == pytest.approx(0.2)
    assert slow["server_stages_ms"] == pytest.approx(3.4)
    assert slow["rest_ms"] == pytest.approx(5.2 - 0.2 - 3.4)
    assert middle["compute_ms"] == pytest.approx(1.0) and middle["rest_ms"] == pytest.approx(3.0 - 1.4)


def test_nothing_to_take_apart_without_server_timing():
    bare = RequestRecord(sent_at_s=1.0, latency_s=0.003, status=200, version="1", service_s=0.003)
    assert where_time_went([bare]) == {}


def test_queueing_alone_on_a_schedule_whose_service_never_overlaps_is_the_service_itself():
    # 300 requests 10 ms apart, each answered in 2 ms (from an idle server): no request waits for another.
    records = [record(i * 0.010, 0.002) for i in range(300)]
    alone = queued_alone(records)
    assert alone["idle_requests"] == 300
    assert alone["p50_ms"] == pytest.approx(2.0) and alone["p99_ms"] == pytest.approx(2.0)
    assert alone["idle_service_p99_ms"] == pytest.approx(2.0)


def test_queueing_alone_adds_the_wait_of_requests_due_while_the_server_is_busy():
    # Pairs of requests due 1 ms apart, every 20 ms; the first of each found the server idle and took 4 ms. In
    # a queue of one server the second waits 3 ms and is answered 7 ms after it was due: half the requests.
    records = []
    for i in range(150):
        records.append(record(i * 0.020, 0.004))
        records.append(record(i * 0.020 + 0.001, 0.006))  # behind the first: not an idle server's time
    alone = queued_alone(records)
    assert alone["idle_requests"] == 150 and alone["idle_service_p50_ms"] == pytest.approx(4.0)
    assert alone["p99_ms"] == pytest.approx(7.0)
    assert alone["p50_ms"] == pytest.approx(5.5)  # the median of 150 at 4 ms and 150 at 7 ms


def test_queueing_alone_needs_a_hundred_requests_that_found_the_server_idle():
    assert queued_alone([record(i * 0.010, 0.002) for i in range(99)]) is None


def test_the_rest_is_split_at_the_app_where_the_server_says_its_whole_time():
    # Each answer: stages 1.4 ms, 2.0 ms in the app (0.6 outside the stages), 3.0 ms from the send: 1.0 outside.
    records = []
    for i in range(100):
        timed = record(i * 0.010, 0.003, delay=0.0005)
        records.append(dataclasses.replace(timed, server_ms={**timed.server_ms, "app": 2.0}))
    middle = where_time_went(records)["middle_tenth"]
    assert middle["server_stages_ms"] == pytest.approx(1.4)  # the app's time is not a stage
    assert middle["app_ms"] == pytest.approx(2.0)
    assert middle["rest_in_app_ms"] == pytest.approx(0.6) and middle["rest_outside_app_ms"] == pytest.approx(1.0)
    assert middle["rest_ms"] == pytest.approx(middle["rest_in_app_ms"] + middle["rest_outside_app_ms"])
    # A server that does not say it (an earlier version): the rest stays whole.
    assert "app_ms" not in where_time_went([record(i * 0.010, 0.003) for i in range(100)])["middle_tenth"]


def test_idle_gaps_are_left_before_each_request_in_turn_and_the_answers_taken_apart(model_server):
    """Against a real HTTP server on loopback (tests/bench/conftest.py) that answers every 5th request 500 and
    sends a Server-Timing header without APP_TIMING: each gap gets its requests, the gap it left is at least the
    gap asked, and without the app's time no split is made."""
    from bench.bench_serving import idle_gaps

    body = b'{"instances": [{"a": 1}, {"a": 2}]}'
    out = idle_gaps(model_server.url, [body], gaps_ms=(0.0, 20.0), requests=10)
    assert len(model_server.bodies) == 10 + 2 * 10
    answered = out["0"]["requests"] + out["20"]["requests"]
    assert out["failed_requests"] == 6 and answered == 20 - 4  # requests 5, 10, ...: 2 of the 10 warm ones
    assert 0.0 <= out["0"]["gap_ms"] < 5.0 and 20.0 <= out["20"]["gap_ms"] < 30.0
    assert out["20"]["p50_ms"] > 0 and "compute_ms" not in out["20"]  # the fake's header has no `app`
