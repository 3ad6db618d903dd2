"""Where tracking calls wait while the tracking server does not answer: one append-only JSON-lines file per run.

A file's first line is its run (run key, name, tags, start time); each later line is one call (an "op": params,
metrics with their own timestamps, tags, a dataset, an artifact, the end status). Artifacts are copied beside
it, so a file the run later moves or deletes is still delivered. Writers and the one delivering a file take an
exclusive `flock` on it; a writer that finds the file it opened already delivered (unlinked) opens a new one,
so no call is written into a file nobody will read. A last line cut short by a crash is skipped on reading.

components.tracking writes here (Tracker) and delivers from here (deliver_outbox).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

SUFFIX = ".jsonl"
FILES_SUFFIX = ".files"


@dataclass
class PendingRun:
    """One run's waiting calls, read under the file's lock (held until the `take` block ends)."""
    path: Path
    header: dict[str, Any]
    ops: list[dict[str, Any]]
    handle: IO[str]

    def settle(self, delivered: int) -> None:
        """Removes the first `delivered` calls: the whole file (and its kept copies) when all were delivered."""
        for op in self.ops[:delivered]:  # only the copies of delivered calls: a writer may be adding one now
            if op.get("kept"):
                shutil.rmtree(Path(op["kept"]).parent, ignore_errors=True)
        if delivered >= len(self.ops):
            self.path.unlink()
            with contextlib.suppress(OSError):  # not empty: a writer kept a file for a call it is adding
                self.path.with_name(self.path.stem + FILES_SUFFIX).rmdir()
            return
        if delivered == 0:
            return
        self.handle.seek(0)
        self.handle.truncate()
        self.handle.write("".join(json.dumps(line) + "\n" for line in [self.header, *self.ops[delivered:]]))
        self.handle.flush()
        os.fsync(self.handle.fileno())


class Outbox:
    def __init__(self, directory: Path):
        self.directory = Path(directory)

    def path_for(self, run_key: str) -> Path:
        slug = re.sub(r"[^A-Za-z0-9]+", "_", run_key).strip("_")[:60]
        return self.directory / f"{slug}-{hashlib.sha256(run_key.encode()).hexdigest()[:12]}{SUFFIX}"

    def files_dir(self, run_key: str) -> Path:
        path = self.path_for(run_key)
        return path.with_name(path.stem + FILES_SUFFIX)

    def pending(self) -> list[Path]:
        """The waiting runs' files, oldest first."""
        if not self.directory.is_dir():
            return []
        paths = [p for p in self.directory.glob(f"*{SUFFIX}") if p.is_file()]
        return sorted(paths, key=lambda p: (p.stat().st_mtime, p.name))

    def count(self) -> tuple[int, int]:
        """(runs, calls) waiting."""
        runs = calls = 0
        for path in self.pending():
            lines = [line for line in path.read_text(errors="replace").splitlines()[1:] if line.strip()]
            runs, calls = runs + 1, calls + len(lines)
        return runs, calls

    def append(self, header: dict[str, Any], op: dict[str, Any]) -> Path:
        """Adds `op` to the run's file (writing `header` first if the file is new). Returns the file."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path_for(header["run_key"])
        while True:
            with open(path, "a", encoding="utf-8") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX)
                if os.fstat(handle.fileno()).st_nlink == 0:  # delivered and unlinked while we waited
                    continue
                if handle.tell() == 0:
                    handle.write(json.dumps(header) + "\n")
                handle.write(json.dumps(op) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
                return path

    def keep_file(self, run_key: str, source: Path) -> Path:
        """A copy of `source` (file or directory) that lives until the call naming it (as `kept`) is
        delivered."""
        target_root = self.files_dir(run_key)
        target_root.mkdir(parents=True, exist_ok=True)
        target = target_root / uuid.uuid4().hex / source.name
        target.parent.mkdir(parents=True)
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy2(source, target)
        return target

    @contextlib.contextmanager
    def take(self, path: Path) -> Iterator[PendingRun | None]:
        """The run in `path`, locked for delivery; None if another process holds it. The caller reports what it
        delivered with the run's `settle`."""
        try:
            handle = open(path, "r+", encoding="utf-8")  # noqa: SIM115 - closed below, after the lock is released
        except FileNotFoundError:
            yield None
            return
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield None
                return
            if os.fstat(handle.fileno()).st_nlink == 0:
                yield None
                return
            header, ops = _parse(path, handle)
            if header is None:
                yield None
                return
            yield PendingRun(path, header, ops, handle)


def _parse(path: Path, handle: IO[str]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    lines = handle.read().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("tracking outbox %s: line %d is not JSON (cut short by a crash?); skipped", path, number)
    if not records or "run_key" not in records[0]:
        log.warning("tracking outbox %s has no run header; left as it is", path)
        return None, []
    return records[0], records[1:]
