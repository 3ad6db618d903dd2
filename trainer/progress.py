"""Training progress saved every N steps, so a training killed at any moment (SIGKILL, a lost node) resumes
from its last save instead of from scratch.

A save is `weights-<step>.weights.h5` (model and optimizer variables: Adagrad accumulators, iteration count)
plus `state.json` naming it, written in that order, each under a temporary name and renamed; older weight
files are removed only after `state.json` points past them. A kill at any point therefore leaves either the
previous save or the new one, never a state that names missing or half-written weights. `state.json` also
holds the hash of the run's inputs: progress left by another configuration or other files is ignored.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import keras

from trainer.arguments import require_integer

STATE_FILE = "state.json"


@dataclass(frozen=True)
class Progress:
    epoch: int  # the epoch in progress (or the next one, when batches_done is 0)
    batches_done: int  # training batches of that epoch already applied
    global_step: int  # training batches applied since the run began
    weights: str  # file name, in the progress directory
    identity: str  # hash of the run's inputs (config, tables, files)


def read_progress(directory: Path, identity: str) -> Progress | None:
    """The last save in `directory` for a run with this `identity`, or None (nothing saved, or saved by a run
    with other inputs)."""
    path = Path(directory) / STATE_FILE
    if not path.exists():
        return None
    progress = Progress(**json.loads(path.read_text()))
    if progress.identity != identity or not (Path(directory) / progress.weights).exists():
        return None
    return progress


def clear_progress(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


class ProgressCheckpoint(keras.callbacks.Callback):
    """Saves progress every `every_n_steps` training batches and at the end of every epoch.

    Works with `fit` called once per epoch (`initial_epoch=e, epochs=e + 1`), as trainer.train does; `start`
    is the progress a resumed run began from, so step counts go on where they stopped.
    `save_weights(model, path)`, when given, saves the trained model's weights to `path` its own way (from an
    unsharded copy gathered from several processes: trainer/processes.py) and returns False where another
    process writes them.
    """

    def __init__(self, directory: Path, identity: str, every_n_steps: int, start: Progress | None = None,
                 save_weights: Callable[[keras.Model, Path], bool] | None = None) -> None:
        super().__init__()
        require_integer("every_n_steps", every_n_steps)
        self.save_weights = save_weights
        self.directory = Path(directory)
        self.identity = identity
        self.every_n_steps = every_n_steps
        self.global_step = start.global_step if start else 0
        self.batches_done = start.batches_done if start else 0
        self.epoch = start.epoch if start else 0

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        for stale in self.directory.glob(".*.partial*"):  # left by a run killed while saving
            stale.unlink()

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        if epoch != self.epoch:
            self.epoch, self.batches_done = epoch, 0

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        self.global_step += 1
        self.batches_done += 1
        if self.global_step % self.every_n_steps == 0:
            self.save(self.epoch, self.batches_done)

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        self.epoch, self.batches_done = epoch + 1, 0
        self.save(self.epoch, 0)

    def save(self, epoch: int, batches_done: int) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"weights-{self.global_step:09d}.weights.h5"
        partial = self.directory / f".{uuid.uuid4().hex}.partial.weights.h5"
        if self.save_weights is None:
            self.model.save_weights(partial)
        elif not self.save_weights(self.model, partial):  # another process writes the progress
            return
        os.replace(partial, self.directory / name)
        progress = Progress(epoch, batches_done, self.global_step, name, self.identity)
        state = self.directory / f".{uuid.uuid4().hex}.partial.json"
        state.write_text(json.dumps(asdict(progress)))
        os.replace(state, self.directory / STATE_FILE)
        for old in self.directory.glob("weights-*.weights.h5"):
            if old.name != name:
                old.unlink()
