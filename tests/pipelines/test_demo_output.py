"""What `make demo` echoes of the Airflow run's output (pipelines.demo.run_logged)."""

from __future__ import annotations

import sys

from pipelines.demo import run_logged


def test_progress_lines_are_shown_whole_and_the_cpu_machines_gpu_probe_is_not(tmp_path, capsys):
    long = "[ctr daily] train: step 132 " + " ".join(f"metric_{i}=0.{i:04d}" for i in range(20))
    assert len(long) > 220
    lines = [
        f"[2026-01-01T00:00:00] {{logging_mixin.py:190}} INFO - {long} [ctr.progress] extra",
        "E0000 00:00:1.0 30535 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: UNKNOWN ERROR (303)",
        "[2026-01-01T00:00:01] ERROR - Task failed with exception",
        "a line nobody asked to see",
    ]
    script = "import sys\nfor line in sys.argv[1:]:\n    print(line)\n"
    log = tmp_path / "logs" / "run.log"
    assert run_logged([sys.executable, "-c", script, *lines], {}, log, show=("[ctr daily]", "ERROR")) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown == ["    " + long, "    [2026-01-01T00:00:01] ERROR - Task failed with exception"]
    assert log.read_text().splitlines() == lines  # the log keeps everything
