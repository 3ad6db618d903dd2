"""Early stopping on the held-out slice: the epoch with the best score is the one a run keeps.

`train_model` scores the held-out slice after every epoch. `BestEpoch` remembers the epoch with the highest
score (`val_auc`), saves its weights beside the run's progress, says when `patience` epochs in a row have not
beaten it by `min_delta`, and puts its weights back at the end, so the checkpoint, the calibration and the
export all start from the best epoch rather than the last one. Its record survives a killed run: a resumed
run compares against the best epoch from before the kill, not only against the epochs it ran itself.

With `average` on, the epochs after the best one that did not beat it are saved too, and the model a run keeps
is the mean of the best epoch's weights and theirs (Polyak averaging of the epoch-end weights, as stochastic
weight averaging does it): on a small held-out slice, epochs within its noise of each other are ranked by
chance, and their mean is no worse a choice than any one of them while it smooths the one picked.
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
import numpy as np

BEST_STATE_FILE = "best.json"
METRIC = "val_auc"


@dataclass(frozen=True)
class Best:
    epoch: int  # 0-based
    value: float
    weights: str  # file name, in the directory
    identity: str  # the run's input hash, as in trainer.progress
    following: tuple[str, ...] = ()  # weight files of the later epochs that did not beat it (with `average`)


class BestEpoch:
    def __init__(self, directory: Path, identity: str, patience: int, min_delta: float = 0.0,
                 average: bool = False) -> None:
        if patience < 0:
            raise ValueError(f"early_stopping_patience must be >= 0 (0 keeps the last epoch), got {patience}")
        if min_delta < 0:
            raise ValueError(f"early_stopping_min_delta must be >= 0, got {min_delta}")
        self.directory = Path(directory)
        self.identity = identity
        self.patience = patience
        self.min_delta = min_delta
        self.average = average
        self.best: Best | None = self._read()
        self.last_epoch: int | None = None
        self.averaged_epochs: list[int] = []  # the epochs `restore` averaged (empty: one epoch kept as it was)

    @property
    def enabled(self) -> bool:
        return self.patience > 0

    def improves(self, logs: Mapping[str, Any]) -> bool:
        """Whether an epoch with these logs would become the best one (what `update` would save)."""
        value = float(logs.get(METRIC, math.nan))
        return self.enabled and math.isfinite(value) and (self.best is None or value > self.best.value + self.min_delta)

    def reloads(self) -> bool:
        """Whether `restore` puts back weights other than the model's (the best epoch is not the last one run)."""
        return self.enabled and self.best is not None and bool(
            self.best.following or self.last_epoch is None or self.last_epoch != self.best.epoch)

    def update(self, epoch: int, logs: Mapping[str, Any], model: keras.Model) -> bool:
        """Records epoch `epoch`'s held-out score; True when training should stop here."""
        self.last_epoch = epoch
        if not self.enabled:
            return False
        value = float(logs.get(METRIC, math.nan))
        if self.improves(logs):
            name = f"best-{epoch:04d}.weights.h5"
            self._write(model, Best(epoch, value, name, self.identity), name)
            return False
        if self.best is None:
            return False
        if self.average and epoch > self.best.epoch:
            name = f"epoch-{epoch:04d}.weights.h5"
            self._write(model, Best(self.best.epoch, self.best.value, self.best.weights, self.identity,
                                    (*self.best.following, name)), name)
        return epoch - self.best.epoch >= self.patience

    def restore(self, model: keras.Model) -> int | None:
        """Puts the kept weights into `model`: the best epoch's when a later epoch ran after it, or with `average`
        the mean of the best epoch's and the later epochs'; returns the best epoch (None when early stopping is
        off or no epoch had a finite score)."""
        if not self.enabled or self.best is None:
            return None
        if not self.reloads():
            return self.best.epoch
        if self.best.following:
            self._load_mean(model, [self.best.weights, *self.best.following])
            self.averaged_epochs = [self.best.epoch, *(int(name[6:10]) for name in self.best.following)]
        else:
            model.load_weights(self.directory / self.best.weights)
        return self.best.epoch

    def _load_mean(self, model: keras.Model, names: list[str]) -> None:
        """The mean of the weight files `names` into `model`, float weights only (others keep the last file's)."""
        total: list[np.ndarray] | None = None
        for name in names:
            model.load_weights(self.directory / name)
            values = [np.asarray(v) for v in model.weights]
            if total is None:
                total = [v.astype(np.float64) if np.issubdtype(v.dtype, np.floating) else v for v in values]
            else:
                total = [t + v if np.issubdtype(v.dtype, np.floating) else v
                         for t, v in zip(total, values, strict=True)]
        for variable, value in zip(model.weights, total or [], strict=True):
            if np.issubdtype(value.dtype, np.floating):
                variable.assign((value / len(names)).astype(variable.dtype))

    def _read(self) -> Best | None:
        path = self.directory / BEST_STATE_FILE
        if not path.exists():
            return None
        record = json.loads(path.read_text())
        best = Best(**{**record, "following": tuple(record.get("following", ()))})
        if best.identity != self.identity or not all((self.directory / name).exists()
                                                     for name in (best.weights, *best.following)):
            return None
        return best

    def _write(self, model: keras.Model, best: Best, name: str) -> None:
        """Saves `model`'s weights as `name`, then records `best`."""
        # Weights first, then the record naming them, each under a temporary name, then the older weights go:
        # a kill at any point leaves a record whose weights are on disk and are the epochs it names.
        self.directory.mkdir(parents=True, exist_ok=True)
        partial = self.directory / f".{uuid.uuid4().hex}.partial.weights.h5"
        model.save_weights(partial)
        os.replace(partial, self.directory / name)
        state = self.directory / f".{uuid.uuid4().hex}.partial.json"
        state.write_text(json.dumps(asdict(best)))
        os.replace(state, self.directory / BEST_STATE_FILE)
        kept = {best.weights, *best.following}
        for old in (*self.directory.glob("best-*.weights.h5"), *self.directory.glob("epoch-*.weights.h5")):
            if old.name not in kept:
                old.unlink()
        self.best = best
