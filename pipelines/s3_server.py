"""The stack's S3 endpoint: moto's S3 server on loopback, with its buckets kept on disk across restarts.

moto keeps objects in memory only. This process restores every bucket and object from `--snapshot` at start,
then writes what changed back every `--every` seconds and once more when it is stopped (SIGTERM or SIGINT), so
the model store and MLflow's artifacts survive `ctr-pipeline stack down` / `up`. A SIGKILL loses at most the writes of
the last interval. Snapshot layout, all written through temporary names and renames:

    <snapshot>/objects/<sha256 of bucket/key>   an object's bytes
    <snapshot>/index.json                        {"buckets": {bucket: {key: {"etag", "file", "content_type"}}}}
    <snapshot>/ready                             this process's pid, once every object is restored (removed at
                                                 start and at stop): clients wait for it, not for the port

    python -m pipelines.s3_server --port 9000 --snapshot var/stack/s3 --bucket models --bucket mlflow
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("ctr.s3")

INDEX = "index.json"
READY = "ready"


def restored_by(snapshot: Path) -> int | None:
    """The pid of the server that finished restoring `snapshot`, if one did and is still serving it."""
    try:
        return int((snapshot / READY).read_text())
    except (FileNotFoundError, ValueError):
        return None


def _client(endpoint: str):
    import boto3
    from botocore.config import Config

    # moto accepts any credentials; these never leave loopback.
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="snapshot",
                        aws_secret_access_key="snapshot", config=Config(retries={"max_attempts": 2}))


def _object_file(bucket: str, key: str) -> str:
    return hashlib.sha256(f"{bucket}/{key}".encode()).hexdigest()


def read_index(snapshot: Path) -> dict[str, dict[str, dict[str, str]]]:
    path = snapshot / INDEX
    if not path.is_file():
        return {}
    return json.loads(path.read_text())["buckets"]


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def restore(client, snapshot: Path) -> int:
    """Creates every snapshotted bucket and puts its objects back. Returns the number of objects."""
    count = 0
    for bucket, objects in read_index(snapshot).items():
        client.create_bucket(Bucket=bucket)
        for key, entry in objects.items():
            body = (snapshot / "objects" / entry["file"]).read_bytes()
            client.put_object(Bucket=bucket, Key=key, Body=body, ContentType=entry.get("content_type") or
                              "binary/octet-stream")
            count += 1
    return count


def save(client, snapshot: Path) -> dict[str, int]:
    """Writes what changed since the last snapshot: new or changed objects (by ETag) first, then the index, then
    removes the files of deleted objects. Returns counts of written and removed objects."""
    old = read_index(snapshot)
    objects_dir = snapshot / "objects"
    objects_dir.mkdir(parents=True, exist_ok=True)
    new: dict[str, dict[str, dict[str, str]]] = {}
    written = 0
    for bucket in (b["Name"] for b in client.list_buckets().get("Buckets", [])):
        entries = new.setdefault(bucket, {})
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for item in page.get("Contents", []):
                key, etag = item["Key"], item["ETag"]
                previous = old.get(bucket, {}).get(key)
                if previous and previous["etag"] == etag and (objects_dir / previous["file"]).is_file():
                    entries[key] = previous
                    continue
                got = client.get_object(Bucket=bucket, Key=key)
                name = _object_file(bucket, key)
                _write_atomic(objects_dir / name, got["Body"].read())
                entries[key] = {"etag": etag, "file": name, "content_type": got.get("ContentType", "")}
                written += 1
    _write_atomic(snapshot / INDEX, json.dumps({"buckets": new}, indent=1, sort_keys=True).encode())
    kept = {entry["file"] for objects in new.values() for entry in objects.values()}
    removed = 0
    for path in objects_dir.iterdir():
        if path.name not in kept and not path.name.startswith("."):
            path.unlink()
            removed += 1
    return {"written": written, "removed": removed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--snapshot", required=True, help="directory the buckets are kept in")
    parser.add_argument("--every", type=float, default=5.0, help="seconds between snapshots")
    parser.add_argument("--bucket", action="append", default=[], help="a bucket to create if missing (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    from moto.server import ThreadedMotoServer

    # Handlers first: a stop that arrives while the buckets are restored still ends with a snapshot.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    snapshot = Path(args.snapshot)
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / READY).unlink(missing_ok=True)
    server = ThreadedMotoServer(ip_address=args.host, port=args.port, verbose=False)
    server.start()
    client = _client(f"http://{args.host}:{args.port}")
    restored = restore(client, snapshot)
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    for bucket in args.bucket:
        if bucket not in existing:
            client.create_bucket(Bucket=bucket)
    _write_atomic(snapshot / READY, str(os.getpid()).encode())
    log.info("S3 (moto) on http://%s:%d: %d objects restored from %s; buckets %s", args.host, args.port, restored,
             snapshot, sorted(existing | set(args.bucket)))
    while not stop.wait(args.every):
        _save_logged(client, snapshot)
    (snapshot / READY).unlink(missing_ok=True)
    _save_logged(client, snapshot, final=True)
    server.stop()
    return 0


def _save_logged(client, snapshot: Path, final: bool = False) -> dict[str, Any] | None:
    started = time.monotonic()
    try:
        counts = save(client, snapshot)
    except Exception:  # a failed snapshot must not stop the server; the next one retries
        log.exception("snapshot to %s failed", snapshot)
        return None
    if final or counts["written"] or counts["removed"]:
        log.info("snapshot%s: %d objects written, %d removed (%.1f s)", " (at stop)" if final else "",
                 counts["written"], counts["removed"], time.monotonic() - started)
    return counts


if __name__ == "__main__":
    raise SystemExit(main())
