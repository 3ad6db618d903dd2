"""Early stopping on the held-out slice: the epoch with the best score is the one a run keeps.

`train_model` scores the held-out slice after every epoch. `BestEpoch` remembers the epoch with the highest
score (`val_auc`), saves its weights beside the run's progress, says when `patience` epochs in a row have not
beaten it by `min_delta`, and puts its weights back at the end, so the checkpoint, the calibration and the
export all start from the best epoch rather than the last one. Its record survives a killed run: a resumed
run compares against the best epoch from before the kill, not only against the epochs it ran itself.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import keras

BEST_STATE_FILE = "best.json"
METRIC = "val_auc"


@dataclass(frozen=True)
class Best:
    epoch: int  # 0-based
    value: float
    weights: str  # file name, in the directory
    identity: str  # the run's input hash, as in trainer.progress


class BestEpoch:
    def __init__(self, directory: Path, identity: str, patience: int, min_delta: float = 0.0) -> None:
        if patience < 0:
            raise ValueError(f"early_stopping_patience must be >= 0 (0 keeps the last epoch), got {patience}")
        if min_delta < 0:
            raise ValueError(f"early_stopping_min_delta must be >= 0, got {min_delta}")
        self.directory = Path(directory)
        self.identity = identity
        self.patience = patience
        self.min_delta = min_delta
        self.best: Best | None = self._read()
        self.last_epoch: int | None = None

    @property
    def enabled(self) -> bool:
        return self.patience > 0

    def update(self, epoch: int, logs: Mapping[str, Any], model: keras.Model) -> bool:
        """Records epoch `epoch`'s held-out score; True when training should stop here."""
        self.last_epoch = epoch
        if not self.enabled:
            return False
        value = float(logs.get(METRIC, math.nan))
        if math.isfinite(value) and (self.best is None or value > self.best.value + self.min_delta):
            self._write(model, Best(epoch, value, f"best-{epoch:04d}.weights.h5", self.identity))
            return False
        return self.best is not None and epoch - self.best.epoch >= self.patience

    def restore(self, model: keras.Model) -> int | None:
        """Loads the best epoch's weights into `model` when a later epoch ran after it; returns the best epoch
        (None when early stopping is off or no epoch had a finite score)."""
        if not self.enabled or self.best is None:
            return None
        if self.last_epoch is None or self.last_epoch != self.best.epoch:
            model.load_weights(self.directory / self.best.weights)
        return self.best.epoch

    def _read(self) -> Best | None:
        path = self.directory / BEST_STATE_FILE
        if not path.exists():
            return None
        best = Best(**json.loads(path.read_text()))
        if best.identity != self.identity or not (self.directory / best.weights).exists():
            return None
        return best

    def _write(self, model: keras.Model, best: Best) -> None:
        # Weights first, then the record naming them, each under a temporary name, then the older weights go:
        # a kill at any point leaves a record whose weights are on disk and are the epoch it names.
        self.directory.mkdir(parents=True, exist_ok=True)
        partial = self.directory / f".{uuid.uuid4().hex}.partial.weights.h5"
        model.save_weights(partial)
        os.replace(partial, self.directory / best.weights)
        state = self.directory / f".{uuid.uuid4().hex}.partial.json"
        state.write_text(json.dumps(asdict(best)))
        os.replace(state, self.directory / BEST_STATE_FILE)
        for old in self.directory.glob("best-*.weights.h5"):
            if old.name != best.weights:
                old.unlink()
        self.best = best
