"""Runs one small training in its own process, for the resume test: `python -m tests.trainer.resume_run
DATA_DIR CHECKPOINT_DIR [KILL_AT_STEP]` trains on DATA_DIR/train and DATA_DIR/eval (written by the test) and,
given KILL_AT_STEP, kills itself with SIGKILL right after that training step."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import keras
import tensorflow as tf

from components.config import TrainConfig
from tests.trainer.synthetic import table_sizes
from trainer.train import train_model

CONFIG = TrainConfig(embedding_dim=4, num_cross_layers=1, mlp_units=(8,), batch_size=200, epochs=2,
                     jit_compile=False, checkpoint_every_steps=4, shuffle_buffer_blocks=4)
NUM_VALUES = 20


class KillAt(keras.callbacks.Callback):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.kill_at, self.step = step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if self.step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    tf.config.experimental.enable_op_determinism()
    data, checkpoint = Path(sys.argv[1]), Path(sys.argv[2])
    callbacks = [KillAt(int(sys.argv[3]))] if len(sys.argv) > 3 else []
    result = train_model(CONFIG, table_sizes(NUM_VALUES), sorted(str(p) for p in (data / "train").iterdir()),
                         sorted(str(p) for p in (data / "eval").iterdir()), checkpoint, callbacks)
    print(f"resumed_from_step={result.resumed_from_step} global_step={result.global_step}")


if __name__ == "__main__":
    main()
