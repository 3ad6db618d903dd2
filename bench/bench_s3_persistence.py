"""How the stack's local S3 endpoint should survive a restart: moto's own recorder (every request appended to a log,
replayed at start) against the stack's snapshot of the buckets (pipelines/s3_server.py: live objects on disk,
restored at start). Both run as their own server processes on loopback, under the same model-store traffic, are
stopped and started again, and must give back the same objects. Writes bench/results/s3_persistence.json.

    make bench-s3-persistence                         two full versions, 20 minutes of deltas, about 5 minutes

The traffic, per full version: the version's files (`--full-mib`), then `--minutes` minute deltas
(`--delta-kib` each) while a model server watches the store at its defaults (`serving.watch_seconds` 0.1: a
HEAD of the change marker ten times a second; `serving.poll_seconds` 1.0: a listing every second); the version
before the last is deleted once a new one is up, as the store's retention does. The requests are sent back to
back, not at those rates: what is measured is what each mechanism keeps and how long a start takes.

Keys, per mechanism under `recorder` and `snapshot`: `disk_bytes` (the log, or the snapshot directory),
`disk_over_live` (that over the live objects' bytes), `restart_seconds` (process start until every object is
back: the replay request returned, or the snapshot's ready file), `objects_match` (every key with its bytes'
MD5 as before the stop); and `requests`, `live_bytes`, `live_objects` for the traffic.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

from bench.provenance import provenance

RESULT = Path(__file__).parent / "results" / "s3_persistence.json"
BUCKET = "models"
WATCH_PER_MINUTE = 600  # serving.watch_seconds = 0.1
LIST_PER_MINUTE = 60  # serving.poll_seconds = 1.0
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def client(port: int) -> Any:
    return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                        aws_access_key_id="bench", aws_secret_access_key="bench",
                        config=Config(retries={"max_attempts": 2}))


def wait_for_port(port: int, process: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the S3 server on port {port} exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"no S3 server on port {port} after {timeout:.0f} s")


def traffic(s3: Any, args: argparse.Namespace) -> int:
    """The model store's writes and a watching server's reads; returns the number of requests sent."""
    full = os.urandom(args.full_mib << 20)
    delta = os.urandom(args.delta_kib << 10)
    requests = 0
    for version in range(args.full_versions):
        s3.put_object(Bucket=BUCKET, Key=f"ctr/{version}/model.bin", Body=full)
        s3.put_object(Bucket=BUCKET, Key="ctr/_changed", Body=str(version).encode())
        requests += 2
        if version >= 2:
            s3.delete_object(Bucket=BUCKET, Key=f"ctr/{version - 2}/model.bin")
            requests += 1
        for minute in range(args.minutes):
            s3.put_object(Bucket=BUCKET, Key=f"ctr/{version}/deltas/{minute:04d}.bin", Body=delta)
            s3.put_object(Bucket=BUCKET, Key="ctr/_changed", Body=f"{version}/{minute}".encode())
            for _ in range(WATCH_PER_MINUTE):
                s3.head_object(Bucket=BUCKET, Key="ctr/_changed")
            for _ in range(LIST_PER_MINUTE):
                s3.list_objects_v2(Bucket=BUCKET, Prefix="ctr/")
            requests += 2 + WATCH_PER_MINUTE + LIST_PER_MINUTE
        if version >= 1:  # the deltas of the version before go with it
            for key in keys(s3, f"ctr/{version - 1}/deltas/"):
                s3.delete_object(Bucket=BUCKET, Key=key)
                requests += 1
    return requests


def keys(s3: Any, prefix: str = "") -> list[str]:
    return [item["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
            for item in page.get("Contents", [])]


def contents(s3: Any) -> dict[str, str]:
    """Every object's key -> MD5 of its bytes."""
    return {key: hashlib.md5(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()).hexdigest()
            for key in keys(s3)}


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def moto_server(port: int, log: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "MOTO_ENABLE_RECORDING": "True", "MOTO_RECORDER_FILEPATH": str(log)}
    return subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                            stdout=out.open("ab"), stderr=subprocess.STDOUT)


def snapshot_server(port: int, directory: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipelines.s3_server", "--port", str(port), "--snapshot",
                             str(directory), "--bucket", BUCKET], cwd=REPO, stdout=out.open("ab"),
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})


def wait_ready(directory: Path, process: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not (directory / "ready").is_file():
        if process.poll() is not None:
            raise RuntimeError(f"the snapshot server exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the snapshot server was not ready after {timeout:.0f} s")
        time.sleep(0.02)


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure_recorder(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    log, out = work / "recording.jsonl", work / "recorder-server.log"
    port = free_port()
    server = moto_server(port, log, out)
    try:
        wait_for_port(port, server)
        s3 = client(port)
        s3.create_bucket(Bucket=BUCKET)
        requests = traffic(s3, args) + 1
        before = contents(s3)
    finally:
        stop(server)
    disk = log.stat().st_size
    started = time.monotonic()
    server = moto_server(port, log, out)
    try:
        wait_for_port(port, server)
        import urllib.request

        urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/moto-api/recorder/replay-recording",
                                                      method="POST"), timeout=3600).read()
        restart = time.monotonic() - started
        after = contents(client(port))
    finally:
        stop(server)
    return {"requests": requests, "before": before, "disk_bytes": disk, "restart_seconds": round(restart, 2),
            "objects_match": after == before}


def measure_snapshot(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    directory, out = work / "snapshot", work / "snapshot-server.log"
    port = free_port()
    server = snapshot_server(port, directory, out)
    try:
        wait_ready(directory, server)
        s3 = client(port)
        requests = traffic(s3, args)
        before = contents(s3)
        live_bytes = sum(item["Size"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
                         for item in page.get("Contents", []))
    finally:
        stop(server)  # SIGTERM: the last snapshot, then exit
    disk = directory_bytes(directory)
    started = time.monotonic()
    server = snapshot_server(port, directory, out)
    try:
        wait_ready(directory, server)
        restart = time.monotonic() - started
        after = contents(client(port))
    finally:
        stop(server)
    return {"requests": requests, "before": before, "live_bytes": live_bytes, "disk_bytes": disk,
            "restart_seconds": round(restart, 2), "objects_match": after == before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full-versions", type=int, default=2)
    parser.add_argument("--minutes", type=int, default=20, help="minute deltas per full version")
    parser.add_argument("--full-mib", type=int, default=8)
    parser.add_argument("--delta-kib", type=int, default=256)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_s3_persistence"))
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    command = "make bench-s3-persistence" + (f" BENCH_S3_PERSISTENCE_ARGS='{' '.join(sys.argv[1:])}'"
                                             if sys.argv[1:] else "")
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    started = time.monotonic()
    measured = {"recorder": measure_recorder(args, args.work), "snapshot": measure_snapshot(args, args.work)}
    live = measured["snapshot"].pop("before")
    recorder_live = measured["recorder"].pop("before")
    if set(live) != set(recorder_live):
        raise RuntimeError(f"the two servers ended with different keys: {sorted(set(live) ^ set(recorder_live))}")
    live_bytes = measured["snapshot"].pop("live_bytes")
    for side in measured.values():
        side["disk_over_live"] = round(side["disk_bytes"] / live_bytes, 3)
    result: dict[str, Any] = {
        "full_versions": args.full_versions, "minutes": args.minutes, "full_mib": args.full_mib,
        "delta_kib": args.delta_kib, "requests": measured["snapshot"]["requests"], "live_objects": len(live),
        "live_bytes": live_bytes, **measured,
        "restart_ratio_recorder_over_snapshot": round(measured["recorder"]["restart_seconds"]
                                                      / measured["snapshot"]["restart_seconds"], 2),
        "seconds": round(time.monotonic() - started, 1)}
    result = {**provenance(command), **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({key: result[key] for key in ("requests", "live_bytes", "recorder", "snapshot")}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
