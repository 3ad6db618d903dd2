"""trainer/native/hot_tier.c under AddressSanitizer and UndefinedBehaviorSanitizer: a driver in C
(tests/trainer/native/hot_tier_driver.c) runs 3,000 batches through the planner and the map's calls, built with
the host's compiler and the sanitizers, any report fatal. Skips where the compiler has no sanitizer runtime."""

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from trainer.native_tier import SOURCE

pytestmark = pytest.mark.unit

DRIVER = Path(__file__).with_name("native") / "hot_tier_driver.c"


def test_the_planner_and_the_map_run_clean_under_the_sanitizers(tmp_path):
    binary = tmp_path / "hot_tier_driver"
    compiler = shlex.split(os.environ.get("CC") or "cc")
    command = [*compiler, "-std=c11", "-g", "-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
               f"-DHOT_TIER_SOURCE=\"{SOURCE}\"", str(DRIVER), "-o", str(binary)]
    try:
        built = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except OSError as err:
        pytest.skip(f"no C compiler ({err}): the hot tier plans in numpy here")
    if built.returncode != 0:
        if "asan" in built.stderr or "ubsan" in built.stderr or "sanitize" in built.stderr:
            pytest.skip(f"the compiler has no sanitizer runtime: {built.stderr.strip()[-300:]}")
        pytest.fail(f"{shlex.join(command)} failed: {built.stderr.strip()[-2000:]}")
    done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert done.stdout.startswith("ok: 3000 batches"), done.stdout
    loads = int(done.stdout.split()[3])
    assert loads > 20 * 3000  # the slots were evicted and reused many times over
