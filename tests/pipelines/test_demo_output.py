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


def test_the_example_request_is_the_held_out_rows_first_line_read_by_the_spec(tmp_path):
    """`make demo` sends the first row of a held-out minute as a client would: its fields as the spec names
    them (numbers as numbers, ids as text, empty fields as null), and checks the answer against its label."""
    from datetime import UTC, datetime

    from components.config import GenerateConfig
    from components.feature_spec import load_spec
    from components.layout import Layout
    from components.synthetic import generate
    from pipelines.demo import example_instance

    layout = Layout(tmp_path)
    generate(GenerateConfig(start="2026-01-01T00:00", minutes=1, rows_per_minute=30, seed=3), layout)
    minute = datetime(2026, 1, 1, tzinfo=UTC)
    spec = load_spec("criteo")
    fields = (layout.raw_minute_dir(minute) / "part-00000.tsv").read_text().split("\n", 1)[0].split("\t")
    instance, label = example_instance(layout, minute, spec)
    assert label == int(fields[0]) and list(instance) == list(spec.names)
    assert instance == {name: (None if value == "" else float(value) if name.startswith("I") else value)
                        for name, value in zip(spec.names, fields[1:], strict=True)}
