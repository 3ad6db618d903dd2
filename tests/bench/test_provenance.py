"""bench/provenance.py: what every benchmark result says about the command, the commit and the machine."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import psutil
import pytest

from bench import provenance as provenance_module
from bench.provenance import provenance

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def test_provenance_names_this_checkouts_commit_and_host():
    result = provenance("make bench-x BENCH_X_ARGS='--small'")
    assert result["command"] == "make bench-x BENCH_X_ARGS='--small'"
    assert result["commit"] == git("rev-parse", "HEAD")
    assert len(result["commit"]) == 40
    assert result["commit_dirty"] is (git("status", "--porcelain", "--untracked-files=no") != "")
    assert result["machine"] == platform.machine()
    host = result["host"]
    assert host["cpu_count"] == os.cpu_count()
    assert host["memory_gib"] == round(psutil.virtual_memory().total / 2**30, 1)
    assert host["memory_gib"] > 0
    assert host["python"] == platform.python_version()
    assert isinstance(host["cpu"], str)
    # The instruction sets /proc/cpuinfo lists, of the ones that change TensorFlow's arithmetic.
    cpuinfo = Path("/proc/cpuinfo").read_text()
    listed = set(next(line for line in cpuinfo.splitlines() if line.startswith("flags")).split(":", 1)[1].split())
    assert host["cpu_flags"] == [flag for flag in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
                                 if flag in listed]


def test_provenance_outside_a_repository_has_no_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance_module, "BENCH_DIR", tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    result = provenance("python bench/bench_x.py")
    assert (result["commit"], result["commit_dirty"]) == (None, None)
    assert result["machine"] == platform.machine()


def test_provenance_without_git_has_no_commit(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no git on the path
    result = provenance("make bench-x")
    assert (result["commit"], result["commit_dirty"]) == (None, None)
    assert result["command"] == "make bench-x"
