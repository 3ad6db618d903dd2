"""The open-loop load of bench/loadgen.py sent by a compiled client (bench/native/openloop.c), to tell the
Python client's own lateness from the server's latency.

bench.loadgen sends from Python threads: on a shared core, a sending thread that wakes late, or a reply read
by a thread waiting for the interpreter, reads as the server's latency (bench-serving takes each request apart:
docs/serving.md). This client keeps the same rules (a fixed schedule, latency from each request's scheduled
send time, a request due while every connection is busy skipped and counted, a timeout a failure) from one C
thread with epoll and a timer at the next send's time, and returns the same `LoadResult`, so the same figures
come out of both. It opens its keep-alive connections before the schedule starts (bench.loadgen opens each on
its first request). Built on first use with the host's C compiler (components.native_build); `available()`
says whether it could be.

    result = run_load_native(url, bodies, rate_per_s=100, requests=3000)
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

from bench.loadgen import LoadResult, RequestRecord, parse_server_timing
from components import native_build

SOURCE = Path(__file__).with_name("native") / "openloop.c"
COMPILE_FLAGS = ("-O2", "-std=c11", "-Wall", "-Wextra")
SKIPPED, NO_RESPONSE = -1, 0  # openloop.c's status for a skipped request and for one that got no response


def build() -> Path:
    """The client program, compiled if it is not yet (RuntimeError with the compiler's output when it does not
    compile)."""
    return native_build.build(SOURCE, COMPILE_FLAGS, suffix="")


def available() -> str | None:
    """None when the client can be built here, else why not."""
    try:
        build()
    except RuntimeError as err:
        return str(err)
    return None


def run_load_native(url: str, bodies: Sequence[bytes], *, rate_per_s: float, requests: int, concurrency: int = 8,
                    timeout_s: float = 5.0) -> LoadResult:
    """POSTs bodies[i % len(bodies)] to `url` (http, HTTP/1.1) for request i = 0 .. requests - 1 at
    `rate_per_s`, over at most `concurrency` keep-alive connections, and waits for the answers (each at most
    `timeout_s`). The client runs on this process's cores (it inherits the affinity)."""
    if not rate_per_s > 0 or not timeout_s > 0:
        raise ValueError(f"rate_per_s and timeout_s must be > 0, got {rate_per_s!r} and {timeout_s!r}")
    if requests < 1 or concurrency < 1:
        raise ValueError(f"requests and concurrency must be at least 1, got {requests!r} and {concurrency!r}")
    if not bodies:
        raise ValueError("give at least one body")
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"the compiled client sends plain HTTP to host:port, got {url!r}")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    program = build()
    with tempfile.TemporaryDirectory(prefix="openloop-") as scratch:
        bodies_file, out_file = Path(scratch) / "bodies", Path(scratch) / "records.tsv"
        with open(bodies_file, "wb") as handle:
            for body in bodies:
                handle.write(b"%d\n" % len(body))
                handle.write(body)
        command = [str(program), parts.hostname, str(parts.port or 80), path, repr(float(rate_per_s)), str(requests),
                   str(concurrency), str(max(1, round(timeout_s * 1000))), str(bodies_file), str(out_file)]
        done = subprocess.run(command, capture_output=True, text=True,
                              timeout=requests / rate_per_s + timeout_s + 60)
        if done.returncode != 0:
            raise RuntimeError(f"{program.name} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        return read_records(out_file.read_text())


def read_records(text: str) -> LoadResult:
    """openloop.c's output as a LoadResult (records by send time; skipped requests counted, not recorded)."""
    lines = text.splitlines()
    label, _, value = lines[0].partition(" ")
    if label != "t0_epoch_ns":
        raise ValueError(f"not openloop output: {lines[0][:80]!r}")
    t0 = int(value) / 1e9
    records, skipped, last_s = [], 0, 0.0
    for line in lines[1:]:
        _, scheduled, sent, done, status, version, timing, error = line.split("\t")
        scheduled_s, sent_s, done_s = int(scheduled) / 1e9, int(sent) / 1e9, int(done) / 1e9
        code = int(status)
        if code == SKIPPED:
            skipped += 1
            continue
        last_s = max(last_s, done_s)
        records.append(RequestRecord(
            sent_at_s=t0 + sent_s, latency_s=done_s - scheduled_s, status=code if code != NO_RESPONSE else None,
            version=None if version == "-" else version, error="" if error == "-" else error,
            scheduled_at_s=t0 + scheduled_s, service_s=done_s - sent_s,
            server_ms=None if code == NO_RESPONSE or timing == "-" else parse_server_timing(timing)))
    return LoadResult.of(records, skipped=skipped, elapsed_s=last_s)
