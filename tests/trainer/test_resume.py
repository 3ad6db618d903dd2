import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.trainer.synthetic import random_rows, write_block_files

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]


def run(data: Path, checkpoint: Path, kill_at: int | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "tests.trainer.resume_run", str(data), str(checkpoint)]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(command + ([str(kill_at)] if kill_at else []), cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def final_weights(checkpoint: Path) -> list[np.ndarray]:
    from trainer.train import load_checkpoint

    return [np.asarray(w) for w in load_checkpoint(checkpoint).weights]


def test_a_training_killed_with_sigkill_resumes_from_its_last_save_and_ends_where_an_unbroken_one_does(tmp_path):
    # 3000 rows in blocks of 250, batches of 200: 15 steps per epoch, 2 epochs; progress saved every 4 steps.
    write_block_files(random_rows(3000, 20, seed=1), tmp_path / "data" / "train", num_files=3, block_rows=250)
    write_block_files(random_rows(600, 20, seed=2), tmp_path / "data" / "eval", num_files=1, block_rows=250)

    unbroken = run(tmp_path / "data", tmp_path / "unbroken")
    assert unbroken.returncode == 0, unbroken.stderr[-3000:]
    assert "resumed_from_step=None global_step=30" in unbroken.stdout

    killed = run(tmp_path / "data", tmp_path / "killed", kill_at=22)  # epoch 2, 7 batches in
    assert killed.returncode == -9, killed.stderr[-3000:]
    progress = tmp_path / "killed" / "progress"
    state = json.loads((progress / "state.json").read_text())
    assert {k: state[k] for k in ("epoch", "batches_done", "global_step")} == {
        "epoch": 1, "batches_done": 5, "global_step": 20}
    # The progress, and the best epoch so far (epoch 1 of 2 ended before the kill) for early stopping.
    assert sorted(p.name for p in progress.iterdir()) == [
        "best-0000.weights.h5", "best.json", "state.json", "weights-000000020.weights.h5"]
    assert not (tmp_path / "killed" / "model.keras").exists()

    resumed = run(tmp_path / "data", tmp_path / "killed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed_from_step=20 global_step=30" in resumed.stdout
    assert not progress.exists()  # the final checkpoint supersedes the progress
    for got, expected in zip(final_weights(tmp_path / "killed"), final_weights(tmp_path / "unbroken"), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def test_progress_of_other_inputs_is_ignored(tmp_path):
    from trainer.progress import Progress, read_progress

    (tmp_path / "weights-000000004.weights.h5").write_bytes(b"")
    (tmp_path / "state.json").write_text(json.dumps(
        {"epoch": 0, "batches_done": 4, "global_step": 4, "weights": "weights-000000004.weights.h5",
         "identity": "abc"}))
    assert read_progress(tmp_path, "abc") == Progress(0, 4, 4, "weights-000000004.weights.h5", "abc")
    assert read_progress(tmp_path, "other") is None
    (tmp_path / "weights-000000004.weights.h5").unlink()
    assert read_progress(tmp_path, "abc") is None  # a state naming missing weights is not trusted
