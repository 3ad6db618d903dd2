"""Clean stops for the long-running commands (`ctr-pipeline spark-connect`, `ctr-pipeline serve`): stop signals,
child processes.

A service manager or `docker stop` sends SIGTERM, a terminal's Ctrl-C sends SIGINT and a closed terminal
SIGHUP. Python's defaults differ: SIGTERM and SIGHUP end the process at once, skipping every `finally`, and
SIGINT raises KeyboardInterrupt only if it was not ignored when Python started (it is, for a `cmd &` of a
script). `stop_on_signals` gives all of them one path: StopRequested, raised once, in the main thread.

`stop_process_group` stops a child started in its own session (the Spark Connect JVM, which no signal sent to
its parent reaches) and returns only once nothing of it is left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopRequested(KeyboardInterrupt):
    """A stop signal arrived. A KeyboardInterrupt, so that no `except Exception` on its way swallows it and code
    that already stops cleanly on Ctrl-C does so on every stop signal."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


@contextlib.contextmanager
def stop_on_signals(signals: Iterable[signal.Signals] = STOP_SIGNALS) -> Iterator[None]:
    """Within the block, the first of `signals` raises StopRequested in the main thread; later ones are logged and
    ignored, so that they do not cut short the cleanup the first one started. Handlers are restored on exit.

    A SIGHUP that is ignored on entry stays ignored: the command was started under nohup to outlive its
    terminal. Outside the main thread (where Python cannot set handlers) this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopping = False

    def request_stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if stopping:
            log.warning("%s while stopping: already stopping", signal.Signals(signum).name)
            return
        stopping = True
        raise StopRequested(signum)

    previous: dict[signal.Signals, Any] = {}
    for sig in signals:
        if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
            continue
        previous[sig] = signal.signal(sig, request_stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def signals_held(signals: Iterable[signal.Signals] = STOP_SIGNALS) -> Iterator[None]:
    """Within the block, `signals` are noted instead of handled; on leaving, the first one noted is raised again,
    so that the handler in place outside (`stop_on_signals`' StopRequested) runs once the block's work is whole.
    For work that a stop must not cut in two: a child process started but not yet recorded would outlive its
    parent's stop, holding what it inherited (a listening socket). Outside the main thread this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: noted.append(signum)) for sig in signals
                if signal.getsignal(sig) != signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if noted:
            signal.raise_signal(noted[0])


def _process_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, process group, start time) of every process in /proc that has not exited (zombies are
    left out: they have exited, and only their parent's wait is missing)."""
    table: dict[int, tuple[int, int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command name in parentheses may hold spaces and ')': split after its last ')'.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        if fields[0] not in ("Z", "X"):
            table[int(entry.name)] = (int(fields[1]), int(fields[2]), fields[19])
    return table


def group_and_descendants(pgid: int) -> dict[int, str]:
    """pid -> start time of the live processes of process group `pgid` and of every descendant of theirs, in
    whatever group it is (PySpark moves its Python worker daemon into a group of its own)."""
    return _group_and_descendants(pgid, _process_table())


def _group_and_descendants(pgid: int, table: dict[int, tuple[int, int, str]]) -> dict[int, str]:
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found = {pid for pid, (_, group, _) in table.items() if group == pgid}
    pending = list(found)
    while pending:
        for child in children.get(pending.pop(), []):
            if child not in found:
                found.add(child)
                pending.append(child)
    return {pid: table[pid][2] for pid in found}


def stop_process_group(pgid: int, timeout_s: float) -> bool:
    """Sends SIGTERM to process group `pgid`, and SIGKILL to whatever of the group and its descendants is left
    after `timeout_s`; returns once none of them is left, True if it had to kill. Raises RuntimeError, naming
    the pids, if some outlive even SIGKILL for 10 s (stuck in the kernel)."""
    targets = group_and_descendants(pgid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    left = _wait_until_gone(pgid, targets, timeout_s)
    if not left:
        return False
    log.warning("process group %d still running %.0f s after SIGTERM (pids %s): killing it", pgid, timeout_s,
                sorted(left))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    left = _wait_until_gone(pgid, targets, 10.0)
    if left:
        raise RuntimeError(f"processes {sorted(left)} of process group {pgid} are still there 10 s after SIGKILL "
                           "(stuck in the kernel?); see `ps -o pid,stat,wchan -p` for what they wait on")
    return True


def _wait_until_gone(pgid: int, targets: dict[int, str], timeout_s: float) -> dict[int, str]:
    """Waits up to `timeout_s` for the group, its descendants and `targets` to be gone; returns what is left. A
    target counts by pid and start time, so that a pid the kernel has given to a new process is not waited for."""
    deadline = time.monotonic() + timeout_s
    while True:
        table = _process_table()
        left = _group_and_descendants(pgid, table)
        left.update((pid, start) for pid, start in targets.items() if pid in table and table[pid][2] == start)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def call_in_foreground(command: list[str], env: dict[str, str] | None = None, timeout_s: float = 8.0) -> int:
    """Runs `command` (a server: `airflow standalone`, `mlflow ui`, `tail -F`) in a process group of its own and
    returns its exit status. A stop signal to this process stops that group and every descendant of it (SIGKILL
    after `timeout_s`), so no child is left holding a port; the return is then 0, a requested stop."""
    process = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        with stop_on_signals():
            return process.wait()
    except StopRequested as stop:
        log.info("%s: stopping %s", signal.Signals(stop.signum).name, command[0])
        stop_process_group(process.pid, timeout_s)
        process.wait()
        return 0
