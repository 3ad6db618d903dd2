"""The native row reader (serving/native/rows.c) under libFuzzer with AddressSanitizer and
UndefinedBehaviorSanitizer (tools/fuzz_native_rows.sh builds tests/serving/fuzz/rows_fuzzer.c against it): a
short run finds nothing, and the same harness finds bugs planted in a copy of rows.c. Skipped where there is no
clang with libFuzzer's runtime (tools/ensure_env.sh installs it with apt-get where it runs as root)."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "fuzz_native_rows.sh"
SOURCE = ROOT / "serving" / "native" / "rows.c"
SEEDS = ROOT / "tests" / "serving" / "fuzz" / "corpus"
SHORT_RUN_SECONDS = 25
# A planted bug was found in 3-35 s in 17 runs (build included); a run stops at its first finding.
PLANTED_RUN_SECONDS = 120
NO_LIBFUZZER, BUILD_FAILED = 77, 2  # the script's exit statuses
# Lines that begin a finding's report in libFuzzer's output, the report itself running to the end.
REPORT_START = re.compile(r"==ERROR:|runtime error:|invariant broken|ERROR: libFuzzer|deadly signal")


@dataclass(frozen=True)
class FuzzRun:
    returncode: int
    output: str
    reproducers: list[Path]
    binary: Path

    def report(self) -> str:
        """The finding as libFuzzer printed it: from the sanitizer's (or the harness') first line, 60 lines."""
        lines = self.output.splitlines()
        start = next((i for i, line in enumerate(lines) if REPORT_START.search(line)), max(0, len(lines) - 60))
        return "\n".join(lines[start:start + 60])

    def describe(self) -> str:
        again = "; ".join(f"{self.binary} {path}" for path in self.reproducers) or "no reproducer written"
        return f"exit status {self.returncode}, reproducers {[str(p) for p in self.reproducers]} (again: {again})\n" \
               f"{self.report()}"


def fuzz(directory: Path, seconds: int, source: Path = SOURCE) -> FuzzRun:
    """tools/fuzz_native_rows.sh for `seconds` against `source`, its build, corpus and reproducers in
    `directory`. Skips the test where there is no clang with libFuzzer's runtime."""
    env = {**os.environ, "FUZZ_DIR": str(directory), "FUZZ_ROWS_SOURCE": str(source)}
    done = subprocess.run(["bash", str(SCRIPT), str(seconds)], env=env, capture_output=True, text=True,
                          timeout=seconds + 300)
    output = done.stdout + done.stderr
    if done.returncode == NO_LIBFUZZER:
        pytest.skip(output.strip().splitlines()[-1])
    if done.returncode == BUILD_FAILED:
        pytest.fail(f"the fuzzing harness did not build:\n{output[-4000:]}")
    crashes = directory / "crashes"
    reproducers = sorted(crashes.iterdir()) if crashes.is_dir() else []
    return FuzzRun(done.returncode, output, reproducers, directory / "rows_fuzzer")


def test_a_short_fuzzing_run_finds_nothing(tmp_path):
    """About 25 s of fuzzing (0.6 to 1 million bodies here) from the seeds: no sanitizer report, no broken
    invariant, no timeout; the reproducer and the report are in the failure's message otherwise."""
    seeds_before = sorted(SEEDS.iterdir())
    run = fuzz(tmp_path, SHORT_RUN_SECONDS)
    assert run.returncode == 0 and not run.reproducers, f"fuzzing rows.c found a bug: {run.describe()}"
    seeds = [path for path in SEEDS.iterdir() if path.stat().st_size > 0]  # libFuzzer skips empty files
    found = re.search(rf"(\d+) files found in {re.escape(str(SEEDS))}", run.output)
    assert found and int(found.group(1)) == len(seeds), run.output[-3000:]
    executed = int(re.search(r"stat::number_of_executed_units: (\d+)", run.output).group(1))
    assert executed > 20_000, f"only {executed} bodies in {SHORT_RUN_SECONDS} s:\n{run.output[-3000:]}"
    assert sorted(SEEDS.iterdir()) == seeds_before  # the seeds are only read


# (what the bug is, rows.c's line, the line with the bug, what must be reported)
PLANTED_BUGS = [
    # found by mutation: a body must end within a \u escape
    ("a read past the body's end in a \\u escape", "    if (end - p < 4) return -1;\n",
     "    if (end - p < 3) return -1;\n", r"AddressSanitizer: heap-buffer-overflow"),
    # found on the seeds: decoded bytes differ from what the harness' own decoder gives
    ("a surrogate pair decoded one code point off", "((uint32_t)low - 0xDC00)", "((uint32_t)low - 0xDC01)",
     r"invariant broken .*string 0: read 4 bytes f09f97bf, the string decodes to 4 bytes f09f9880"),
]


@pytest.mark.parametrize(("bug", "line", "planted", "expected"), PLANTED_BUGS, ids=[bug[0] for bug in PLANTED_BUGS])
def test_a_bug_planted_in_a_copy_of_rows_c_is_found(tmp_path, bug, line, planted, expected):
    text = SOURCE.read_text()
    assert text.count(line) == 1, f"{line.strip()!r} is not in rows.c exactly once: plant {bug!r} on a line it has"
    copy = tmp_path / "rows.c"
    copy.write_text(text.replace(line, planted))
    run = fuzz(tmp_path / "run", PLANTED_RUN_SECONDS, copy)
    assert run.returncode == 1 and run.reproducers, f"{bug} was not found in {PLANTED_RUN_SECONDS} s:\n" \
                                                    f"{run.output[-3000:]}"
    assert re.search(expected, run.output), run.describe()
