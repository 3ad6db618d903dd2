"""Stop signals as one exception, and process groups stopped with nothing left behind (components.stopping)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from components.stopping import StopRequested, stop_on_signals, stop_process_group

pytestmark = pytest.mark.unit


def _wait_for_signal_delivery() -> None:
    # A signal sent to this process runs its Python handler at the next bytecode boundary of the main thread.
    for _ in range(100):
        time.sleep(0.01)


def test_the_first_stop_signal_raises_once_later_ones_are_ignored_and_handlers_come_back(caplog) -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with stop_on_signals():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            _wait_for_signal_delivery()
            raised = None
        except StopRequested as stop:
            raised = stop
            os.kill(os.getpid(), signal.SIGINT)  # arrives during the cleanup: must not cut it short
            _wait_for_signal_delivery()
    assert raised is not None and raised.signum == signal.SIGTERM and str(raised) == "SIGTERM"
    assert isinstance(raised, KeyboardInterrupt)  # so that no `except Exception` on its way swallows it
    assert "SIGINT while stopping: already stopping" in caplog.text
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_an_ignored_sighup_stays_ignored_under_nohup() -> None:
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with stop_on_signals():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
    finally:
        signal.signal(signal.SIGHUP, previous)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _group_leader(script: str) -> tuple[subprocess.Popen, int]:
    """A Python process in a session of its own running `script`, which prints one pid (a child's) and sleeps."""
    process = subprocess.Popen([sys.executable, "-c", script], start_new_session=True, stdout=subprocess.PIPE,
                               text=True)
    return process, int(process.stdout.readline())


def test_a_group_that_stops_on_sigterm_is_waited_for_not_killed() -> None:
    process, child = _group_leader("import subprocess, time; child = subprocess.Popen(['sleep', '60']); "
                                   "print(child.pid, flush=True); time.sleep(60)")
    killed = stop_process_group(process.pid, timeout_s=20)
    assert killed is False  # it ended on SIGTERM, before the timeout, and was not killed
    assert process.wait(1) == -signal.SIGTERM
    assert not _alive(child)


def test_what_ignores_sigterm_is_killed_after_the_timeout_even_a_descendant_in_a_group_of_its_own() -> None:
    # The leader ignores SIGTERM; its child sits in a session of its own (as PySpark's worker daemon sits in a
    # group of its own), which a signal to the leader's group does not reach.
    process, child = _group_leader(
        "import signal, subprocess, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "child = subprocess.Popen(['sleep', '60'], start_new_session=True); print(child.pid, flush=True); "
        "time.sleep(60)")
    try:
        started = time.monotonic()
        killed = stop_process_group(process.pid, timeout_s=1.0)
        took = time.monotonic() - started
    finally:
        for pid in (process.pid, child):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert killed is True
    assert took >= 1.0  # the timeout was waited out before SIGKILL (no upper bound: the machine may be busy)
    assert process.wait(1) == -signal.SIGKILL
    assert not _alive(child)


def test_stopping_a_group_that_is_gone_returns_at_once() -> None:
    process = subprocess.Popen(["true"], start_new_session=True)
    process.wait()
    assert stop_process_group(process.pid, timeout_s=5) is False


def test_a_signal_held_over_a_block_is_handled_once_the_block_is_whole() -> None:
    from components.stopping import signals_held

    steps = []
    with stop_on_signals():
        try:
            with signals_held((signal.SIGTERM, signal.SIGINT)):
                os.kill(os.getpid(), signal.SIGTERM)
                _wait_for_signal_delivery()
                steps.append("the block's work after the signal")
            steps.append("not reached")
        except StopRequested as stop:
            steps.append(stop.signum)
        # The handler outside is back: a second signal is the stop already under way, not a new one.
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    assert steps == ["the block's work after the signal", signal.SIGTERM]

    with stop_on_signals(), signals_held((signal.SIGTERM,)):  # no signal: nothing raised
        steps.append("quiet")
    assert steps[-1] == "quiet"
