"""The compiled open-loop client (bench/native/openloop.c) against a real HTTP server on loopback: the same rules
as bench.loadgen's Python client, the same LoadResult."""

from __future__ import annotations

import json
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.native_loadgen import available, read_records, run_load_native

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(available() is not None, reason=f"no C compiler here: {available()}")]


def _bodies(count: int) -> list[bytes]:
    return [json.dumps({"instances": [{"I1": i, "C1": f"{i:08x}"}]}).encode() for i in range(count)]


def test_counts_failures_versions_and_server_timing_for_a_fixed_number_of_requests(model_server):
    result = run_load_native(model_server.url, _bodies(20), rate_per_s=100, requests=20)
    assert (result.num_requests, result.failed_requests, result.skipped) == (20, 4, 0)
    assert result.status_counts == {"200": 16, "500": 4}
    assert Counter(version for _, version in result.versions) == {"7": 8, "8": 8}
    assert sorted(body["instances"][0]["I1"] for body in model_server.bodies) == list(range(20))
    scheduled = [r.scheduled_at_s for r in sorted(result.records, key=lambda r: r.scheduled_at_s)]
    assert [round(b - a, 6) for a, b in zip(scheduled, scheduled[1:], strict=False)] == [0.01] * 19
    for record in result.records:
        assert record.sent_at_s >= record.scheduled_at_s
        assert record.latency_s == pytest.approx(record.service_s + (record.sent_at_s - record.scheduled_at_s),
                                                 abs=1e-6)
        if record.status == 200:
            assert record.server_ms == {"compute": 1.5}
        else:
            assert record.server_ms is None and record.status == 500
    assert 0 < result.latency_p50_ms <= result.latency_p99_ms


def test_bodies_are_sent_in_turn(model_server):
    result = run_load_native(model_server.url, _bodies(3), rate_per_s=200, requests=7)
    assert result.num_requests == 7
    assert sorted(body["instances"][0]["I1"] for body in model_server.bodies) == [0, 0, 0, 1, 1, 2, 2]


def test_requests_beyond_the_connections_are_skipped_not_queued(model_server):
    # Every answer takes 1 s, so both connections stay busy through all 10 ticks of the 0.2 s schedule.
    model_server.delay_s = 1.0
    result = run_load_native(model_server.url, _bodies(10), rate_per_s=50, requests=10, concurrency=2)
    assert (result.num_requests, result.skipped, result.failed_requests) == (2, 8, 0)
    assert len(model_server.bodies) == 2
    assert result.latency_p50_ms >= 1000


def test_a_timeout_is_a_failed_request_without_a_version(model_server):
    model_server.delay_s = 1.0
    result = run_load_native(model_server.url, _bodies(1), rate_per_s=10, requests=1, timeout_s=0.2)
    (record,) = result.records
    assert (record.status, record.version, record.error) == (None, None, "timed out")
    assert 0.2 <= record.latency_s < 0.5
    assert result.status_counts == {"error": 1} and result.latency_p50_ms is None


def test_a_refused_connection_is_a_failed_request():
    with ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler) as closed:
        port = closed.server_address[1]
    result = run_load_native(f"http://127.0.0.1:{port}/", _bodies(3), rate_per_s=100, requests=3)
    assert (result.num_requests, result.failed_requests) == (3, 3)
    assert all(r.error == "connect: Connection refused" for r in result.records)


def test_a_connection_the_server_closed_while_idle_is_not_a_failed_request(closing_server):
    result = run_load_native(closing_server, _bodies(1), rate_per_s=1 / 0.3, requests=4, concurrency=1)
    assert (result.num_requests, result.failed_requests) == (4, 0), result.records


def test_a_body_larger_than_the_socket_buffer_is_written_whole(model_server):
    body = json.dumps({"instances": [{"I1": i, "C1": "x" * 200} for i in range(20_000)]}).encode()
    assert len(body) > 4_000_000
    result = run_load_native(model_server.url, [body], rate_per_s=10, requests=1)
    assert result.status_counts == {"200": 1}
    assert len(model_server.bodies[0]["instances"]) == 20_000


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rate_per_s": 0}, "rate_per_s and timeout_s must be > 0, got 0 and 5.0"),
        ({"requests": 0}, "requests and concurrency must be at least 1, got 0 and 8"),
        ({"bodies": []}, "give at least one body"),
        ({"url": "https://127.0.0.1:9/"}, "plain HTTP to host:port"),
    ],
)
def test_invalid_arguments_name_the_value(kwargs, match):
    arguments = {"url": "http://127.0.0.1:9/", "bodies": [b"{}"], "rate_per_s": 10.0, "requests": 1, **kwargs}
    url, bodies = arguments.pop("url"), arguments.pop("bodies")
    with pytest.raises(ValueError, match=match):
        run_load_native(url, bodies, **arguments)


def test_output_that_is_not_the_clients_is_refused():
    with pytest.raises(ValueError, match="not openloop output"):
        read_records("HTTP/1.1 200 OK\n")
