"""Where a benchmark result came from: the command that wrote it, the commit its code was at and the machine it
ran on. Every script that writes bench/results/*.json merges `provenance(command)` into its result (its own keys
win), so that a figure can be traced to a rerunnable command and compared only with runs of the same code and
host; tests/bench/test_result_files.py checks that every result file carries them.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent


def provenance(command: str) -> dict[str, Any]:
    """The command given, the commit of the repository holding bench/ (None without git or a repository),
    whether tracked files other than bench/results' differ from it, the machine (platform.machine()) and the
    host's CPU, cores, memory and Python."""
    commit = _git("rev-parse", "HEAD")
    # Result files are the benchmarks' output, not their code: one written earlier in the same run (a plot
    # before its JSON) or by the run before leaves the code as committed.
    status = (_git("status", "--porcelain", "--untracked-files=no", "--", ":(top)", ":(top,exclude)bench/results")
              if commit is not None else None)
    return {
        "command": command,
        "commit": commit,
        "commit_dirty": None if status is None else status != "",
        "machine": platform.machine(),
        "host": {"cpu": _cpu_model(), "cpu_flags": _cpu_flags(), "cpu_count": os.cpu_count(),
                 "memory_gib": _memory_gib(), "python": platform.python_version()},
    }


def _git(*args: str) -> str | None:
    """git's stripped output in bench/'s repository, or None when git is missing or the command fails there."""
    try:
        done = subprocess.run(["git", *args], cwd=BENCH_DIR, capture_output=True, text=True, timeout=30,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)
    return model or platform.processor()


# The vector instruction sets a host has of these: TensorFlow's CPU kernels pick their code by them, so the same
# seeded training can end on different weights on two hosts (on MovieLens, AVX-512 and AVX2 kept different
# epochs; docs/real_data.md). Results are comparable only between hosts with the same set.
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")


def _cpu_flags() -> list[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
    flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
    return [flag for flag in CPU_FLAGS if flag in flags]


def _memory_gib() -> float | None:
    # The GPU hosts' images (bench/gpu_bench_scale.sh) carry JAX but not always psutil: a result without the
    # memory beats no result.
    try:
        import psutil
    except ImportError:
        return None
    return round(psutil.virtual_memory().total / 2**30, 1)
