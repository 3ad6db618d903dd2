"""The load generator against a real HTTP server on loopback."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.loadgen import CLIENTS, parse_server_timing, run_load

pytestmark = pytest.mark.integration


def _instances(i: int) -> list[dict]:
    return [{"I1": i, "C1": f"{i:08x}"}]


def test_counts_failures_and_records_versions_for_a_fixed_number_of_requests(model_server):
    started = time.time()
    result = run_load(model_server.url, _instances, rate_per_s=100, duration_s=10, concurrency=8, max_requests=20)

    assert (result.num_requests, result.failed_requests, result.skipped) == (20, 4, 0)
    assert result.status_counts == {"200": 16, "500": 4}
    # The server saw exactly the 20 bodies make_instances built, once each.
    assert sorted(b["instances"][0]["I1"] for b in model_server.bodies) == list(range(20))
    assert model_server.bodies[0] == {"instances": _instances(model_server.bodies[0]["instances"][0]["I1"])}
    # Requests 1-10 are answered by version 7 and 11-20 by version 8; 2 of each ten are 500s without a version.
    assert Counter(version for _, version in result.versions) == {"7": 8, "8": 8}
    sent_at = [t for t, _ in result.versions]
    assert sent_at == sorted(sent_at)
    assert started <= sent_at[0] and sent_at[-1] <= time.time()
    # 20 requests at 100/s: the last is due 190 ms after the first (unpaced they would leave within a few ms;
    # a busy host can delay a worker's start, and so the first send time, by tens of ms).
    assert 0.1 <= result.records[-1].sent_at_s - result.records[0].sent_at_s < 2.0
    assert 0 < result.latency_p50_ms <= result.latency_p99_ms < 5000

    summary = json.loads(json.dumps(result.to_json()))
    assert {k: summary[k] for k in ("num_requests", "failed_requests", "skipped")} == {
        "num_requests": 20, "failed_requests": 4, "skipped": 0}
    assert summary["status_counts"] == {"200": 16, "500": 4}
    assert len(summary["versions"]) == 16 and "records" not in summary
    with_records = result.to_json(include_records=True)["records"]
    assert [r["status"] for r in with_records].count(500) == 4


def test_duration_bounds_the_schedule(model_server):
    # Ticks at 0, 20, ..., 180 ms fall inside 0.2 s: exactly 10 requests.
    result = run_load(model_server.url, _instances, rate_per_s=50, duration_s=0.2)
    assert (result.num_requests, result.failed_requests, result.skipped) == (10, 2, 0)
    assert len(model_server.bodies) == 10


def test_requests_beyond_the_concurrency_limit_are_skipped_not_queued(model_server):
    # Every answer takes 1 s, so the 2 slots stay busy through all 10 ticks of the 0.2 s run.
    model_server.delay_s = 1.0
    result = run_load(model_server.url, _instances, rate_per_s=50, duration_s=0.2, concurrency=2)
    assert (result.num_requests, result.skipped, result.failed_requests) == (2, 8, 0)
    assert result.unanswered == 8 and result.to_json()["unanswered"] == 8
    assert len(model_server.bodies) == 2
    assert result.latency_p50_ms >= 1000


@pytest.mark.parametrize("build_ahead", [True, False])
def test_latency_counts_from_the_scheduled_send_time(model_server, build_ahead):
    # Building request 1's body takes 60 ms on the sending thread. Built ahead, that is right after request 0 left
    # (at 0 ms), so request 1 (due at 10 ms) leaves at about 60 ms and request 2 (due at 20 ms) right after it;
    # built once due, request 1 leaves at about 70 ms and request 2 after it. Each one's latency includes the wait
    # since it was due; the time from the actual send does not.
    def slow_second(i: int) -> list[dict]:
        if i == 1:
            time.sleep(0.06)
        return _instances(i)

    result = run_load(model_server.url, slow_second, rate_per_s=100, duration_s=10, concurrency=8, max_requests=4,
                      build_ahead=build_ahead)
    records = {r.scheduled_at_s: r for r in result.records}
    zeroth, first, second = (records[t] for t in sorted(records)[:3])
    assert second.scheduled_at_s - first.scheduled_at_s == pytest.approx(0.01, abs=1e-6)
    late = 0.06 if build_ahead else 0.07
    assert first.sent_at_s - zeroth.scheduled_at_s >= late
    assert first.sent_at_s - first.scheduled_at_s >= late - 0.01
    assert second.sent_at_s - second.scheduled_at_s >= late - 0.02
    assert zeroth.sent_at_s - zeroth.scheduled_at_s < 0.03  # its body was built before it was due, or quickly
    for record in (first, second):
        assert record.latency_s == pytest.approx(record.service_s + (record.sent_at_s - record.scheduled_at_s),
                                                 abs=2e-3)
        assert record.latency_s >= record.service_s + late - 0.021
    assert result.service_percentile_ms(50) < result.latency_p50_ms


def test_a_body_is_built_before_its_request_is_due(model_server):
    # Every body takes 30 ms to build and requests are due every 50 ms: built ahead, each is ready when due
    # (the build overlaps the wait); built once due, each leaves 30 ms late.
    def slow(i: int) -> list[dict]:
        time.sleep(0.03)
        return _instances(i)

    ahead = run_load(model_server.url, slow, rate_per_s=20, duration_s=10, max_requests=6)
    due = run_load(model_server.url, slow, rate_per_s=20, duration_s=10, max_requests=6, build_ahead=False)
    ahead_delays = [r.sent_at_s - r.scheduled_at_s for r in ahead.records]
    due_delays = [r.sent_at_s - r.scheduled_at_s for r in due.records]
    assert max(ahead_delays) < 0.02 and min(due_delays) >= 0.03


@pytest.mark.parametrize("client", CLIENTS)
def test_a_connection_the_server_closed_while_idle_is_not_a_failed_request(closing_server, client):
    # Requests 0.3 s apart each find their thread's connection closed, and must open another.
    result = run_load(closing_server, _instances, rate_per_s=1 / 0.3, duration_s=10, concurrency=1, max_requests=4,
                      client=client)
    assert (result.num_requests, result.failed_requests) == (4, 0), result.records


def test_bodies_made_by_the_caller_are_sent_as_given(model_server):
    bodies = [json.dumps({"instances": _instances(i)}).encode() for i in range(5)]
    result = run_load(model_server.url, make_body=lambda i: bodies[i], rate_per_s=100, duration_s=10,
                      max_requests=5)
    assert result.num_requests == 5
    assert sorted(body["instances"][0]["I1"] for body in model_server.bodies) == list(range(5))
    with pytest.raises(ValueError, match="give one of make_instances"):
        run_load(model_server.url, _instances, make_body=lambda i: bodies[i], rate_per_s=10.0, duration_s=1.0)
    with pytest.raises(ValueError, match="give one of make_instances"):
        run_load(model_server.url, rate_per_s=10.0, duration_s=1.0)


def test_an_unknown_client_is_refused():
    with pytest.raises(ValueError, match="client must be one of http.client, httpx, got 'curl'"):
        run_load("http://127.0.0.1:9/", _instances, rate_per_s=10.0, duration_s=1.0, client="curl")


@pytest.mark.parametrize("client", CLIENTS)
def test_a_timeout_is_a_failed_request_without_a_version(model_server, client):
    model_server.delay_s = 1.0
    result = run_load(model_server.url, _instances, rate_per_s=10, duration_s=5, timeout_s=0.2, max_requests=1,
                      client=client)
    assert (result.num_requests, result.failed_requests) == (1, 1)
    assert result.versions == [] and result.latency_p50_ms is None
    (record,) = result.records
    assert (record.status, record.version) == (None, None)
    assert ("ReadTimeout" if client == "httpx" else "TimeoutError") in record.error
    assert result.status_counts == {"error": 1}


@pytest.mark.parametrize("client", CLIENTS)
def test_a_refused_connection_is_a_failed_request(client):
    with ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler) as closed:
        port = closed.server_address[1]
    result = run_load(f"http://127.0.0.1:{port}/", _instances, rate_per_s=100, duration_s=1, max_requests=3,
                      client=client)
    assert (result.num_requests, result.failed_requests) == (3, 3)
    refused = "ConnectError" if client == "httpx" else "ConnectionRefusedError"
    assert all(refused in r.error for r in result.records)


def test_stop_event_ends_the_run_early(model_server):
    already = threading.Event()
    already.set()
    result = run_load(model_server.url, _instances, rate_per_s=20, duration_s=30, stop_event=already)
    assert (result.num_requests, result.skipped) == (0, 0)

    stop = threading.Event()
    timer = threading.Timer(0.3, stop.set)
    timer.start()
    result = run_load(model_server.url, _instances, rate_per_s=20, duration_s=30, stop_event=stop)
    timer.join()
    # Ticks every 50 ms until the stop at 0.3 s: about 6 requests (7 counting the tick at 0.3 s itself).
    assert 3 <= result.num_requests <= 8
    assert result.elapsed_s < 30  # ended by the stop, not by the 30 s duration


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rate_per_s": 0}, "rate_per_s must be > 0, got 0"),
        ({"duration_s": -1.0}, r"duration_s must be > 0, got -1.0"),
        ({"timeout_s": 0.0}, r"timeout_s must be > 0, got 0.0"),
        ({"concurrency": 0}, "concurrency must be at least 1, got 0"),
        ({"max_requests": 0}, r"max_requests must be at least 1 \(or None for no bound\), got 0"),
    ],
)
def test_invalid_arguments_name_the_value(kwargs, match):
    arguments = {"rate_per_s": 10.0, "duration_s": 1.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        run_load("http://127.0.0.1:9/", _instances, **arguments)


def test_an_error_in_make_instances_propagates(model_server):
    def broken(i: int) -> list[dict]:
        if i == 2:
            raise KeyError(f"no instance {i}")
        return _instances(i)

    with pytest.raises(KeyError, match="no instance 2"):
        run_load(model_server.url, broken, rate_per_s=100, duration_s=1)
    assert len(model_server.bodies) == 2


@pytest.mark.parametrize("client", CLIENTS)
def test_each_answer_keeps_its_server_timing(model_server, client):
    result = run_load(model_server.url, lambda i: [{"I1": i}] * (1 + i % 3), rate_per_s=200, duration_s=5,
                      max_requests=10, client=client)
    assert len(result.records) == 10
    for record in result.records:
        if record.status == 200:
            assert record.server_ms is not None and record.server_ms["compute"] in (1.5, 2.5, 3.5)
            assert set(record.server_ms) == {"compute"}  # a metric without a duration is left out
        else:
            assert record.server_ms is None


def test_server_timing_is_read_as_the_w3c_header_writes_it():
    assert parse_server_timing(None) is None
    assert parse_server_timing("") == {}
    assert parse_server_timing("read;dur=0.021, compute;dur=2.310") == {"read": 0.021, "compute": 2.31}
    assert parse_server_timing('db;desc="a, b";dur=53, miss, cpu;dur="2.4"') == {"db": 53.0, "cpu": 2.4}
    assert parse_server_timing("app;dur=nope, total;dur=3") == {"total": 3.0}
