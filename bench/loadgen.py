"""A bounded, open-loop load generator for the model server's predict endpoint.

Requests leave on a fixed schedule (one every 1 / rate_per_s seconds from the start), whatever the server's
latency, so a slow server shows up as latency and skips rather than as a lower send rate. A request's latency
runs from its scheduled send time, not from when a thread got round to sending it: a send delayed by a busy
client or a late tick counts against the request, as it would for the user who asked at that moment (the
time from the actual send is kept beside, as `service_s`). At most `concurrency` requests are in flight: a
request due while all slots are busy is counted as skipped, never queued, so memory and the backlog stay
bounded however slow the server gets; `unanswered` counts skipped and failed requests together, which is how a
benchmark should count them (a skipped request is one the server did not answer in time).

What the client itself spends inside that window is kept small, since it reads as the server's latency: each
request's body is encoded before its scheduled time (right after the request before it left), and the default
client is the standard library's http.client, one keep-alive connection per sending thread. Measured against
the model server at 25 requests/s, the earlier client (httpx, the body encoded once the request was due) added
about 1.4 ms at the median (bench/bench_serving.py keeps its figure beside: `client="httpx"`,
`build_ahead=False`). Encoding still holds the GIL on the scheduling thread (0.6 ms for 100 instances of the
criteo layout), when the request just handed over is being sent: a caller that can encodes its bodies
beforehand and passes `make_body`.

    result = run_load("http://127.0.0.1:8501/v1/models/ctr:predict", lambda i: [instances[i % len(instances)]],
                      rate_per_s=20, duration_s=600)
    print(result.to_json())
"""

from __future__ import annotations

import http.client
import json
import re
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

MODEL_VERSION_HEADER = "X-Model-Version"
JSON_HEADERS = {"Content-Type": "application/json"}
SERVER_TIMING_HEADER = "Server-Timing"


@dataclass(frozen=True)
class RequestRecord:
    sent_at_s: float  # epoch seconds when the request left
    latency_s: float  # from its scheduled send time until the response (or the error)
    status: int | None  # None when no response came (timeout, refused connection)
    version: str | None  # the X-Model-Version header of the response, if any
    error: str = ""  # the exception, for requests that got no response
    scheduled_at_s: float = 0.0  # epoch seconds when the schedule said it should leave
    service_s: float = 0.0  # from when it left until the response: the latency without the client's delays
    server_ms: dict[str, float] | None = None  # the response's Server-Timing stages (ms), where it had them


@dataclass
class LoadResult:
    num_requests: int  # requests sent (skipped ones are not sent)
    failed_requests: int  # non-200 responses, timeouts and connection errors
    skipped: int  # requests due while `concurrency` were already in flight
    latency_p50_ms: float | None  # over the 200 responses, from the scheduled send time; None when there were none
    latency_p99_ms: float | None
    versions: list[tuple[float, str | None]]  # (sent_at_s, X-Model-Version) of each 200 response, by send time
    elapsed_s: float
    records: list[RequestRecord] = field(default_factory=list)  # every sent request, by send time

    @classmethod
    def of(cls, records: list[RequestRecord], *, skipped: int, elapsed_s: float) -> LoadResult:
        """The result of a run that sent `records` (every sent request, any order) and skipped `skipped`."""
        records = sorted(records, key=lambda r: r.sent_at_s)
        answered = [r for r in records if r.status == 200]
        latencies_ms = np.array([r.latency_s * 1000.0 for r in answered])
        return cls(
            num_requests=len(records),
            failed_requests=len(records) - len(answered),
            skipped=skipped,
            latency_p50_ms=float(np.percentile(latencies_ms, 50)) if answered else None,
            latency_p99_ms=float(np.percentile(latencies_ms, 99)) if answered else None,
            versions=[(r.sent_at_s, r.version) for r in answered],
            elapsed_s=elapsed_s,
            records=records,
        )

    @property
    def unanswered(self) -> int:
        """Requests due that got no 200: the skipped ones and the failed ones."""
        return self.skipped + self.failed_requests

    def service_percentile_ms(self, q: float) -> float | None:
        """Percentile `q` of the 200 responses' time from the actual send (the definition before the scheduled
        send time was the origin); None when there were none."""
        values = [r.service_s * 1000.0 for r in self.records if r.status == 200]
        return float(np.percentile(values, q)) if values else None

    @property
    def status_counts(self) -> dict[str, int]:
        """Responses per status code, plus 'error' for requests that got none."""
        counts = Counter("error" if r.status is None else str(r.status) for r in self.records)
        return dict(sorted(counts.items()))

    def to_json(self, include_records: bool = False) -> dict[str, Any]:
        """A JSON-ready dict of the result; the per-request records only when asked for (they are large)."""
        out: dict[str, Any] = {
            "num_requests": self.num_requests,
            "failed_requests": self.failed_requests,
            "skipped": self.skipped,
            "unanswered": self.unanswered,
            "latency_p50_ms": self.latency_p50_ms,
            "latency_p99_ms": self.latency_p99_ms,
            "service_p99_ms": self.service_percentile_ms(99),
            "elapsed_s": self.elapsed_s,
            "status_counts": self.status_counts,
            "versions": [[sent_at, version] for sent_at, version in self.versions],
        }
        if include_records:
            out["records"] = [
                {"sent_at_s": r.sent_at_s, "scheduled_at_s": r.scheduled_at_s, "latency_ms": r.latency_s * 1000.0,
                 "service_ms": r.service_s * 1000.0, "status": r.status, "version": r.version, "error": r.error}
                for r in self.records
            ]
        return out


CLIENTS = ("http.client", "httpx")


@contextmanager
def _poster(url: str, client: str, concurrency: int, timeout_s: float
            ) -> Iterator[Callable[[bytes], tuple[int, str | None, str | None]]]:
    """A function POSTing a JSON body to `url` and returning (status, X-Model-Version, Server-Timing) once the
    response is read whole; callable from `concurrency` threads at once."""
    if client == "httpx":
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        with httpx.Client(timeout=timeout_s, limits=limits) as session:
            def post_httpx(body: bytes) -> tuple[int, str | None, str | None]:
                response = session.post(url, content=body, headers=JSON_HEADERS)
                return (response.status_code, response.headers.get(MODEL_VERSION_HEADER),
                        response.headers.get(SERVER_TIMING_HEADER))

            yield post_httpx
        return
    parts = urlsplit(url)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    local = threading.local()
    opened: list[http.client.HTTPConnection] = []
    opened_lock = threading.Lock()

    def connection() -> http.client.HTTPConnection:
        current = getattr(local, "connection", None)
        if current is not None and _closed_by_peer(current.sock):
            current.close()  # the server ended the idle keep-alive connection (uvicorn: after 5 s)
            current = None
        if current is None:
            current = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
            current.connect()
            # Headers and body leave in two writes: without this, the kernel holds the second for the first's ACK.
            current.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            local.connection = current
            with opened_lock:
                opened.append(current)
        return current

    def post(body: bytes) -> tuple[int, str | None, str | None]:
        current = connection()
        try:
            current.request("POST", path, body=body, headers=JSON_HEADERS)
            response = current.getresponse()
            response.read()
        except BaseException:
            current.close()  # a broken or timed-out connection is not reused: the next request opens another
            local.connection = None
            raise
        if response.will_close:
            current.close()
            local.connection = None
        return response.status, response.getheader(MODEL_VERSION_HEADER), response.getheader(SERVER_TIMING_HEADER)

    try:
        yield post
    finally:
        with opened_lock:
            for each in opened:
                each.close()


def parse_server_timing(value: str | None) -> dict[str, float] | None:
    """A Server-Timing header's metrics with a duration, {name: milliseconds} (W3C Server Timing: `name;dur=ms`,
    comma-separated, other parameters ignored); None without the header."""
    if value is None:
        return None
    out = {}
    for metric in re.split(r',(?=(?:[^"]*"[^"]*")*[^"]*$)', value):  # commas outside quoted strings
        name, *params = (part.strip() for part in metric.split(";"))
        for param in params:
            key, _, number = param.partition("=")
            if name and key.strip() == "dur":
                try:
                    out[name] = float(number.strip().strip('"'))
                except ValueError:
                    pass
    return out


def _closed_by_peer(sock: socket.socket | None) -> bool:
    """Whether an idle keep-alive connection has something to read, which between requests can only be its end
    (or a server's error for it): reusing it would fail the next request for a reason that is not its own."""
    if sock is None:
        return True
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def run_load(
    url: str,
    make_instances: Callable[[int], list[dict]] | None = None,
    *,
    make_body: Callable[[int], bytes] | None = None,
    rate_per_s: float,
    duration_s: float,
    concurrency: int = 8,
    timeout_s: float = 5.0,
    max_requests: int | None = None,
    stop_event: threading.Event | None = None,
    client: str = "http.client",
    build_ahead: bool = True,
) -> LoadResult:
    """POSTs {"instances": make_instances(i)} to `url` for request i = 0, 1, ... at `rate_per_s`.

    Sends for `duration_s` seconds, or until `max_requests` have been sent or `stop_event` is set, whichever
    comes first; then waits for the requests in flight (each at most `timeout_s`) and returns what they got.
    `make_instances` runs on the calling thread, in order, and its result is JSON-encoded there; an exception
    from either ends the run and propagates. `make_body` instead of `make_instances`: request i's body as sent
    (encoded beforehand by the caller: encoding a body of 100 instances holds the GIL for about 0.6 ms, which
    delays the send of the request before it). With `build_ahead` a request's body is encoded before its scheduled
    time (the first one before the schedule starts); without it, once the request is due, so the encoding
    counts in its latency. `client`: "http.client" (a keep-alive connection per sending thread; `timeout_s`
    bounds each socket operation) or "httpx" (one pooled client; `timeout_s` bounds each phase).
    """
    _check_positive("rate_per_s", rate_per_s)
    _check_positive("duration_s", duration_s)
    _check_positive("timeout_s", timeout_s)
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency!r}")
    if (make_instances is None) == (make_body is None):
        raise ValueError("give one of make_instances (the instances of request i) or make_body (its body)")
    if client not in CLIENTS:
        raise ValueError(f"client must be one of {', '.join(CLIENTS)}, got {client!r}")
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests must be at least 1 (or None for no bound), got {max_requests!r}")
    stop = stop_event or threading.Event()
    slots = threading.BoundedSemaphore(concurrency)
    records: list[RequestRecord] = []
    records_lock = threading.Lock()
    futures: list[Future[None]] = []
    num_sent = skipped = 0

    with _poster(url, client, concurrency, timeout_s) as post:

        def send(body: bytes, scheduled: float, scheduled_at: float) -> None:
            try:
                sent_at, started = time.time(), time.perf_counter()
                try:
                    status, version, timing = post(body)
                except (OSError, http.client.HTTPException, httpx.HTTPError) as err:
                    # Timeouts, refused or dropped connections: a failed request.
                    done = time.perf_counter()
                    record = RequestRecord(sent_at, done - scheduled, None, None, f"{type(err).__name__}: {err}",
                                           scheduled_at, done - started)
                else:
                    done = time.perf_counter()
                    record = RequestRecord(sent_at, done - scheduled, status, version, "", scheduled_at,
                                           done - started, parse_server_timing(timing))
                with records_lock:
                    records.append(record)
            finally:
                slots.release()

        def encode(index: int) -> bytes:
            if make_body is not None:
                return make_body(index)
            return json.dumps({"instances": make_instances(index)}).encode()

        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="loadgen") as pool:
            body = encode(0) if build_ahead else None
            start = time.perf_counter()
            # The schedule in epoch seconds, from one reading of both clocks: reading them again at every send
            # would move each request's scheduled time by whatever ran between the two readings.
            epoch_start = time.time()
            tick = 0
            while max_requests is None or num_sent < max_requests:
                offset_s = tick / rate_per_s
                if offset_s >= duration_s:
                    break
                # A late tick (the loop was descheduled) fires at once: the schedule, not the loop, sets the rate,
                # and the request's latency counts from its scheduled time.
                scheduled = start + offset_s
                if stop.wait(max(0.0, scheduled - time.perf_counter())):
                    break
                tick += 1
                if not slots.acquire(blocking=False):
                    skipped += 1
                    continue
                try:
                    if body is None:
                        body = encode(num_sent)
                except BaseException:
                    slots.release()
                    raise
                futures.append(pool.submit(send, body, scheduled, epoch_start + offset_s))
                num_sent += 1
                body = None
                if build_ahead and (max_requests is None or num_sent < max_requests):
                    body = encode(num_sent)  # the next request's, while this one is on its way
        elapsed_s = time.perf_counter() - start
    for future in futures:
        future.result()  # a bug in `send` surfaces here instead of as a request missing from the counts

    return LoadResult.of(records, skipped=skipped, elapsed_s=elapsed_s)
