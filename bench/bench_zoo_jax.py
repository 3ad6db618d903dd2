"""Every model of the zoo on the JAX backend (a GPU host without TensorFlow): trained on the behaviour-sequence
data of tests/trainer/test_model_zoo.py (the target item in the user's history triples the click odds; best
AUC ~0.86 with the history, ~0.69 without), scored on held-out rows, saved and reloaded. Writes
bench/results/zoo_jax.json.

    make bench-zoo-jax          # KERAS_BACKEND=jax
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import keras
import numpy as np

from bench.provenance import provenance
from tests.trainer.synthetic import roc_auc, table_sizes
from tests.trainer.test_model_zoo import NUM_ITEMS, SMALL, history_rows
from trainer.models import MODEL_BUILDERS, build_model
from trainer.train import compile_model


def main() -> int:
    train_x, train_y = history_rows(40_000, seed=1)
    test_x, test_y = history_rows(10_000, seed=2)
    runs = []
    for name in sorted(MODEL_BUILDERS):
        config = dataclasses.replace(SMALL, model=name, jit_compile=True, epochs=3)
        keras.utils.set_random_seed(0)
        model = build_model(config, table_sizes(NUM_ITEMS))
        compile_model(model, config)
        started = time.perf_counter()
        model.fit(train_x, train_y, batch_size=config.batch_size, epochs=config.epochs, verbose=0)
        seconds = time.perf_counter() - started
        predicted = model.predict(test_x, batch_size=4096, verbose=0).reshape(-1)
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"zoo-{name}.keras"
        model.save(path)
        reloaded = keras.saving.load_model(path).predict(test_x, batch_size=4096, verbose=0).reshape(-1)
        runs.append({"model": name, "auc": roc_auc(test_y, predicted), "fit_s": seconds,
                     "reloaded_max_abs_difference": float(np.abs(predicted - reloaded).max())})
        print(json.dumps(runs[-1]), flush=True)
    import jax

    device = jax.devices()[0] if keras.backend.backend() == "jax" else None
    result = {"runs": runs, "backend": keras.backend.backend(),
              "device": f"{device.platform}: {getattr(device, 'device_kind', device)}" if device else "cpu",
              "train_rows": 40_000, "test_rows": 10_000, "epochs": 3, "command": "make bench-zoo-jax"}
    result = {**provenance(result["command"]), **result}
    out = Path(os.environ.get("BENCH_RESULTS", Path(__file__).parent / "results")) / "zoo_jax.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
