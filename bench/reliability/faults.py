"""Faults during minute runs: the tracking server away, the training task SIGKILLed, a corrupt checkpoint, the
object store answering 500s and refusing connections during a publish.

Each case runs minute runs of a real chain (bench.reliability.chain) whose tracking goes to a real `mlflow
server`, breaks one thing, and records what the runs did, what was lost and how long until a minute published
again without anyone's help.

    PYTHONPATH=. python -m bench.reliability.faults --out /tmp/faults.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.bench_freshness import answers, free_port
from bench.reliability.chain import TRAINED, Chain, no_loss

REPO = Path(__file__).resolve().parents[2]


class Process:
    """A server this bench starts (in its own process group) and kills."""

    def __init__(self, name: str, command: list[str], log_path: Path, ready: Callable[[], bool],
                 env: dict[str, str] | None = None):
        self.name, self.command, self.log_path, self.ready, self.env = name, command, log_path, ready, env
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120.0) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                            start_new_session=True, env=self.env)
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start; its log {self.log_path}:\n"
                                   f"{self.log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.3)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, sig)
            self.process.wait(60)


def mlflow_server(work: Path, port: int) -> Process:
    root = work / "mlflow-server"
    root.mkdir(parents=True, exist_ok=True)
    return Process("mlflow", [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                              "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                              "--serve-artifacts", "--artifacts-destination", (root / "artifacts").as_uri()],
                   root / "server.log", lambda: answers(f"http://127.0.0.1:{port}/health"))


class FaultyProxy:
    """A TCP proxy in front of a server that can pass bytes through ("ok"), answer every request with an HTTP
    500 ("500"), or close every connection at once ("down"). Changing the mode cuts the open connections."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.mode = "ok"
        self.requests = {"ok": 0, "500": 0, "down": 0}
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopped = False
        self._armed: tuple[str, int] | None = None
        self.passed = 0  # requests passed through (counted by their request line)
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, mode: str, after_requests: int) -> None:
        """Passes `after_requests` more requests through, then switches to `mode` (in the middle of a publish)."""
        self._armed = (mode, self.passed + after_requests)

    def set_mode(self, mode: str) -> None:
        self._armed = None
        self.mode = mode
        with self._lock:
            for connection in list(self._open):
                _close(connection)
            self._open.clear()

    def stop(self) -> None:
        self._stopped = True
        self.set_mode("down")
        _close(self._listener)

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        mode = self.mode
        self.requests[mode] += 1
        if mode == "down":
            _close(client)
            return
        if mode == "500":
            client.settimeout(5)
            try:
                client.recv(65536)
                body = b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
                client.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/xml\r\n"
                               b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
            except OSError:
                pass
            _close(client)
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
        except OSError:
            _close(client)
            return
        with self._lock:
            self._open.update((client, upstream))
        sockets = [client, upstream]
        try:
            while True:
                readable, _, _ = select.select(sockets, [], [], 30)
                if not readable:
                    break
                for source in readable:
                    data = source.recv(65536)
                    if not data:
                        raise OSError("closed")
                    if source is client and data.split(b" ", 1)[0] in METHODS:
                        self.passed += 1
                        if self._armed and self.passed > self._armed[1]:
                            self.set_mode(self._armed[0])
                            raise OSError("fault injected")
                    (upstream if source is client else client).sendall(data)
        except (OSError, ValueError):
            pass
        finally:
            with self._lock:
                self._open.discard(client)
                self._open.discard(upstream)
            _close(client)
            _close(upstream)


METHODS = {b"GET", b"PUT", b"POST", b"HEAD", b"DELETE"}


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


def _case(name: str, description: str, expected: str, observed: str, as_expected: bool, *,
          lost: dict[str, int] | None = None, recover_s: float | None = None, manual: bool = False,
          **detail: Any) -> dict[str, Any]:
    return {"group": "faults", "case": name, "description": description, "expected": expected,
            "observed": observed, "as_expected": as_expected, "lost": lost or no_loss(), "manual_recovery": manual,
            "recover_s": None if recover_s is None else round(recover_s, 1), "detail": detail}


def tracking_server_away(chain: Chain, server: Process, away_minutes: int = 2) -> dict[str, Any]:
    """The tracking server SIGKILLed; `away_minutes` minute runs while it is away; started again; one more run."""
    from mlflow.tracking import MlflowClient

    from components.tracking import RUN_KEY_TAG, outbox_dir
    from components.tracking_outbox import Outbox

    minute = chain.deliver_good()
    baseline_outcome, _, baseline_s = chain.run(minute, run_id=f"tracking-up-{minute:%H%M}")
    server.kill()
    away: list[tuple[str, str, float]] = []
    minutes = []
    for _ in range(away_minutes):
        minute = chain.deliver_good()
        minutes.append(minute)
        away.append(chain.run(minute, run_id=f"tracking-away-{minute:%H%M}"))
    waiting = Outbox(outbox_dir(chain.config)).count()
    server.start()
    back_at = time.monotonic()
    minute = chain.deliver_good()
    minutes.append(minute)
    back = chain.run(minute, run_id=f"tracking-back-{minute:%H%M}")
    recover_s = time.monotonic() - back_at
    left = Outbox(outbox_dir(chain.config)).count()
    client = MlflowClient(chain.config.tracking_uri)
    experiment = client.get_experiment_by_name(chain.config.tracking.experiment)
    runs = {r.data.tags.get(RUN_KEY_TAG): r for r in client.search_runs([experiment.experiment_id])}
    tracked = [f"ctr_incremental/tracking-away-{m:%H%M}" for m in minutes[:-1]]
    missing = [key for key in tracked if key not in runs or "publish.freshness_s" not in runs[key].data.metrics]
    unfinished = [key for key in tracked if key in runs and runs[key].info.status != "FINISHED"]
    published = [o for o, _, _ in away] + [back[0]]
    learned = chain.learned()
    not_learned = [m.isoformat() for m in minutes if m.isoformat() not in learned]
    overhead = max(s for _, _, s in away) - baseline_s
    ok = (baseline_outcome == TRAINED and all(o == TRAINED for o in published) and not missing and not unfinished
          and left == (0, 0) and overhead < 15)
    return _case(
        "tracking_server_away", f"the MLflow server SIGKILLed for {away_minutes} minute runs, then started again",
        "every minute publishes on time (each run at most 15 s slower); the runs' tracking waits in the outbox and "
        "is delivered by the first run after the server is back",
        f"{sum(o == TRAINED for o in published)} of {len(published)} minutes published; runs took "
        f"{', '.join(f'{s:.1f}' for _, _, s in away)} s away against {baseline_s:.1f} s with the server up; "
        f"{waiting[1]} calls of {waiting[0]} runs waited, {left[1]} left after; {len(missing)} runs missing in MLflow, "
        f"{len(unfinished)} not FINISHED",
        ok, lost=no_loss(minutes=len(not_learned)), recover_s=recover_s,
        seconds_with_server=round(baseline_s, 1), seconds_away=[round(s, 1) for _, _, s in away],
        calls_waiting=waiting[1], missing_runs=missing, not_learned=not_learned)


def sigkill_training(chain: Chain, work: Path) -> dict[str, Any]:
    """A minute run in its own process (as an Airflow task is), SIGKILLed in the middle of its train step; then
    run again (Airflow's retry)."""
    minute = chain.deliver_good()
    from components.config import load_config
    from components.interval import Interval

    defaults = load_config(environ={}).flat()
    overrides = [f"{k}={v}" for k, v in chain.config.flat().items() if defaults.get(k) != v]
    command = [sys.executable, "-u", "-m", "pipelines.cli", "run", "incremental", "--minute",
               minute.strftime("%Y-%m-%dT%H:%M")] + [a for o in overrides for a in ("--set", o)]
    log_path = work / f"killed-{minute:%H%M}.log"
    killed_at = None
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO,
                                   start_new_session=True)
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            if b"step train started" in line:
                time.sleep(1.0)  # into the step: the parent checkpoint loaded, rows being trained on
                os.killpg(process.pid, signal.SIGKILL)
                killed_at = time.monotonic()
                break
        process.wait(60)
    if killed_at is None:
        return _case("sigkill_training", "SIGKILL of a minute run during its train step", "", "the run never "
                     f"reached its train step; log {log_path}", False)
    half = chain.layout.incremental_dir(Interval.minute(minute.isoformat())) / "checkpoint"
    left_half = half.is_dir() and not (half / "manifest.json").is_file()
    outcome, error, _ = chain.run(minute, run_id=f"retry-{minute:%H%M}")
    recover_s = time.monotonic() - killed_at
    learned = chain.learned().get(minute.isoformat(), [])
    ok = outcome == TRAINED and len(learned) == 1
    return _case(
        "sigkill_training", "SIGKILL of a minute run's process one second into its train step, then the run again",
        "the killed run publishes nothing; its retry trains from the parent (never a half-written checkpoint) "
        "and publishes the minute once",
        f"killed run left {'a checkpoint without manifest' if left_half else 'no partial checkpoint'}; retry "
        f"{outcome}{': ' + error if error else ''}; minute learned by {learned}",
        ok, lost=no_loss(minutes=int(not learned)), recover_s=recover_s, log=str(log_path))


def corrupt_checkpoint(chain: Chain) -> dict[str, Any]:
    """The newest version's training checkpoint damaged on disk; the next minutes run."""
    from pipelines.daily import MODEL_NAME

    store = chain.store
    newest = store.latest(MODEL_NAME)
    checkpoint = Path(store.manifest(MODEL_NAME, newest)["training_state"]["checkpoint"])
    target = next(p for p in sorted(checkpoint.iterdir()) if p.name != "manifest.json" and p.is_file())
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    started = time.monotonic()
    outcomes = []
    minutes = []
    for _ in range(2):
        minute = chain.deliver_good()
        minutes.append(minute)
        outcomes.append(chain.run(minute, run_id=f"corrupt-{minute:%H%M}"))
    learned = chain.learned()
    recovered = [o for o, _, _ in outcomes].count(TRAINED)
    not_learned = [m.isoformat() for m in minutes if m.isoformat() not in learned]
    twice = sorted(m for m, versions in learned.items() if len(versions) > 1)
    retracted = newest in store.retracted(MODEL_NAME)
    return _case(
        "corrupt_checkpoint", f"one byte flipped in {target.name} of the newest version's checkpoint ({newest})",
        "the damage is detected (checksum) before anything trains on it; the damaged version is retracted "
        "(serving moves back to its parent) and minute runs go on from the newest version that verifies, "
        "learning its minutes again, once",
        "; ".join(f"{m:%H:%M} {o}{': ' + e if e else ''}" for m, (o, e, _) in zip(minutes, outcomes, strict=True))
        + f"; {newest} retracted: {retracted}; minutes learned twice by standing versions: {twice}",
        recovered == len(minutes) and not not_learned and retracted and not twice,
        lost=no_loss(minutes=len(not_learned)),
        recover_s=(time.monotonic() - started) if recovered else None, manual=not recovered,
        damaged=str(target), not_learned=not_learned)


def disk_full_during_samples(chain: Chain) -> dict[str, Any]:
    """The minute's samples written to a 64 KB filesystem (a tmpfs mounted on their directory): the write runs
    out of space; then the space comes back (unmounted) and the run is retried."""
    from components.interval import Interval

    minute = chain.deliver_good()
    samples = chain.layout.incremental_dir(Interval.minute(minute.isoformat())) / "samples"
    samples.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(samples)],
                             capture_output=True, text=True)
    if mounted.returncode:
        return _case("disk_full_during_samples", "the samples' filesystem full during their write", "",
                     f"not tried: mounting a tmpfs needs root ({mounted.stderr.strip()})", False)
    try:
        outcome, error, _ = chain.run(minute, run_id=f"disk-full-{minute:%H%M}")
        leftovers = sorted(p.name for p in samples.iterdir())
    finally:
        subprocess.run(["umount", str(samples)], check=True)
    freed_at = time.monotonic()
    retry, retry_error, _ = chain.run(minute, run_id=f"disk-freed-{minute:%H%M}")
    learned = chain.learned().get(minute.isoformat(), [])
    ok = outcome != TRAINED and retry == TRAINED and len(learned) == 1 and ("space" in error.lower())
    return _case(
        "disk_full_during_samples", "the minute's samples written to a filesystem with 64 KB free, then space freed "
        "and the run retried",
        "the run fails naming the full disk, publishes nothing and leaves no complete-looking samples; the retry "
        "publishes the minute once",
        f"run {outcome}: {error}; left in the samples directory: {leftovers}; retry {retry}"
        f"{': ' + retry_error if retry_error else ''}; learned by {learned}",
        ok, lost=no_loss(minutes=int(not learned)), recover_s=time.monotonic() - freed_at)


def object_store_errors(work: Path) -> list[dict[str, Any]]:
    """A version published to S3 (moto, the stack's S3 server) through a proxy that answers 500s, then refuses
    connections, then passes again: nothing half-published is listed, and the retried publish lands whole."""
    from components.manifest import write_manifest
    from components.model_store import S3ModelStore

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "reliability")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "reliability")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    port = free_port()
    snapshot = work / "s3"
    s3 = Process("s3", [sys.executable, "-m", "pipelines.s3_server", "--port", str(port), "--snapshot",
                        str(snapshot), "--bucket", "models"], work / "s3.log",
                 lambda: (snapshot / "ready").is_file() and answers(f"http://127.0.0.1:{port}/models"))
    s3.start()
    proxy = FaultyProxy(port)
    results = []
    try:
        store = S3ModelStore("s3://models/reliability", endpoint_url=f"http://127.0.0.1:{proxy.port}")
        for index, mode in enumerate(("500", "down")):
            version = f"20260101{index:04d}"
            source = work / f"version-{version}"
            source.mkdir(parents=True)
            files = []
            for part in range(8):
                (source / f"part-{part}.bin").write_bytes(os.urandom(256 * 1024))
                files.append(f"part-{part}.bin")
            write_manifest(source, kind="delta", version=version, files=files, spec_hash="reliability")
            proxy.arm(mode, after_requests=4)  # the fault starts after the first objects are uploaded
            started = time.monotonic()
            try:
                store.publish("ctr", version, source)
                first = "published (the fault was not seen)"
            except Exception as err:  # noqa: BLE001 - the store's and botocore's several kinds
                first = f"failed after {time.monotonic() - started:.1f} s: {type(err).__name__}: {str(err)[:160]}"
            proxy.set_mode("ok")
            listed_during = version in store.versions("ctr")
            retry_started = time.monotonic()
            store.publish("ctr", version, source)
            fetched = store.fetch("ctr", version, work / f"fetched-{version}")
            whole = sorted(p.name for p in fetched.iterdir()) == sorted([*files, "manifest.json"])
            results.append(_case(
                f"object_store_{'answers_500' if mode == '500' else 'refuses_connections'}_during_publish",
                f"the S3 endpoint {'answers every request with HTTP 500' if mode == '500' else 'closes connections'}"
                " from the 5th request of a publish (8 objects, then its manifest), then recovers; the publish is "
                "retried",
                "the publish fails with the endpoint's error; the version is not listed (its manifest goes last); "
                "the retried publish lands it whole, checksums verified",
                f"first publish {first}; listed while broken: {listed_during}; retry published it, "
                f"{'whole' if whole else 'NOT whole'}", (not listed_during) and whole and first.startswith("failed"),
                recover_s=time.monotonic() - retry_started, requests_seen=dict(proxy.requests)))
    finally:
        proxy.stop()
        s3.kill(signal.SIGTERM)
    return results


def run_fault_cases(work: Path, *, rows_per_minute: int = 2000,
                    progress: Callable[[str], None] = print) -> dict[str, Any]:
    started = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    results = object_store_errors(work)
    for case in results:
        progress(f"faults: {case['case']:45s} {'ok' if case['as_expected'] else 'NOT AS EXPECTED'}: {case['observed']}")
    port = free_port()
    server = mlflow_server(work, port)
    server.start()
    try:
        chain = Chain.start(work / "chain", rows_per_minute=rows_per_minute, progress=progress,
                            overrides={"tracking.tracking_uri": f"http://127.0.0.1:{port}"})
        for run_case in (lambda: tracking_server_away(chain, server), lambda: sigkill_training(chain, work),
                         lambda: corrupt_checkpoint(chain), lambda: disk_full_during_samples(chain)):
            case = run_case()
            results.append(case)
            progress(f"faults: {case['case']:45s} {'ok' if case['as_expected'] else 'NOT AS EXPECTED'}: "
                     f"{case['observed']}")
    finally:
        server.kill()
    return {"cases": results, "seconds": round(time.monotonic() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--keep", metavar="DIR")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="reliability-faults-"))
    result = run_fault_cases(work)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
