"""C sources compiled on first use with the host's C compiler (`CC`, default `cc`) into
~/.cache/ctr-pipeline/native (`CTR_NATIVE_CACHE`), one build per source hash, flags and machine: the serving
row reader (serving/native/rows.c) and the hot tier's planner (trainer/native/hot_tier.c), both libraries, and
the benchmarks' open-loop client (bench/native/openloop.c), a program. Each library's caller keeps a pure-Python
path for hosts without a compiler."""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

CACHE_ENV = "CTR_NATIVE_CACHE"


def library_path(source: Path, flags: Sequence[str], suffix: str = ".so") -> Path:
    """Where the library (or, with `suffix` "", the program) built from `source` lives: named by the source's
    stem and hash, the flags and the machine."""
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "ctr-pipeline" / "native")
    return root / f"{source.stem}-{digest}-{platform.machine()}{suffix}"


def build(source: Path, flags: Sequence[str], suffix: str = ".so") -> Path:
    """Compiles `source` with `flags` if it is not built yet; returns the build's path (`library_path`). Written
    to a temporary name and renamed, so a process never loads a half-written build. RuntimeError (with the
    compiler's output) when it does not compile."""
    target = library_path(source, flags, suffix)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    compiler = shlex.split(os.environ.get("CC") or "cc")
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [*compiler, *flags, str(source), "-o", str(built)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise RuntimeError(f"{shlex.join(command)} did not run: {err}") from None
        if done.returncode != 0:
            raise RuntimeError(f"{shlex.join(command)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target
