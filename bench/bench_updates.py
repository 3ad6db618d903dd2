"""What an embedding update costs as the table grows: the JAX train step's dense update against the TensorFlow
step's row-sparse one, on the same model and batches. Writes bench/results/updates.json.

    make bench-updates
    make bench-updates BENCH_UPDATES_ARGS="--rows 262144,1048576 --repeats 1"   # a quick look

Under JAX the gradient of an embedding lookup is a table-sized array (the batch's rows scattered into zeros), and
Adagrad then reads and writes every row of the table and of its accumulator each step; the TensorFlow step
(`train.row_sparse_updates`, the default) updates only the rows the batch read. So the JAX step's time grows with
the table's rows and the TensorFlow step's does not. This measures by how much: the criteo spec's DCNv2-small
(26 tables of dimension 16, one concatenated variable; 3 full-rank cross layers, MLP 512-256-128), its 26 tables
sharing `--rows` rows in all, batches of `--batch-size` rows of uniformly drawn ids (so a batch reads about as
many distinct rows whatever the table's size), the trainer's own optimizer and compile settings (XLA on under
JAX, as the JAX step always runs; the TensorFlow step's default of XLA off). Each (backend, rows) runs in a
process of its own; per step, the time from one step's end to the next (the loss read back, so the step has
finished), the median over `--steps` steps after `--warmup`. `--repeats` runs of every pair, alternating, give
the range. On a CPU the absolute times say little; how each backend's time grows with the rows is the result.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROWS = (262_144, 1_048_576, 4_194_304, 16_777_216)
BATCH_SIZE = 4096
STEPS = 30
WARMUP = 5
SPEC = "criteo"


def worker(backend: str, rows: int, batch_size: int, steps: int, warmup: int) -> dict[str, Any]:
    """In a process whose KERAS_BACKEND is `backend`: milliseconds per training step, median and quartiles."""
    import keras

    from components.config import TrainConfig
    from components.feature_spec import load_spec
    from trainer.model_inputs import model_inputs
    from trainer.models import build_model
    from trainer.train import compile_model

    inputs = model_inputs(load_spec(SPEC))
    tables = list(inputs.tables)
    sizes = {name: rows // len(tables) for name in tables}
    config = TrainConfig(backend=backend, embedding_dim=16, num_cross_layers=3, mlp_units=(512, 256, 128),
                         cross_projection_dim=0, batch_size=batch_size, jit_compile=backend == "jax")
    keras.utils.set_random_seed(1)
    model = build_model(config, sizes)
    compile_model(model, config)
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(4):
        categorical = np.stack([rng.integers(0, sizes[tables[t]], batch_size) for t in inputs.feature_tables], 1)
        features = {"dense": rng.standard_normal((batch_size, inputs.dense_dim)).astype(np.float32),
                    "categorical": categorical.astype(np.int64)}
        batches.append((features, (rng.random(batch_size) < 0.25).astype(np.float32)))
    ends: list[float] = []

    class StepEnds(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
            float((logs or {})["loss"])  # waits for the step
            ends.append(time.perf_counter())

    def cycled() -> Any:
        while True:
            yield from batches

    model.fit(cycled(), steps_per_epoch=warmup + steps + 1, epochs=1, callbacks=[StepEnds()], verbose=0)
    step_ms = np.diff(ends[warmup:]) * 1000.0
    table = next(v for v in model.weights if v.path.endswith("embedding/embeddings"))
    return {"backend": backend, "rows": int(table.shape[0]), "ms_per_step": float(np.median(step_ms)),
            "ms_per_step_q25": float(np.percentile(step_ms, 25)), "ms_per_step_q75": float(np.percentile(step_ms, 75)),
            "steps_timed": len(step_ms), "row_sparse_updates": backend == "tensorflow"}


def run_worker(backend: str, rows: int, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    command = [sys.executable, __file__, "--worker", backend, "--rows", str(rows), "--batch-size",
               str(args.batch_size), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{backend} at {rows:,} rows failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="table rows in all, comma-separated")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, help="where to write (default bench/results/updates.json)")
    parser.add_argument("--worker", choices=("jax", "tensorflow"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    if args.worker:
        print(json.dumps(worker(args.worker, rows_list[0], args.batch_size, args.steps, args.warmup)))
        return 0

    from bench.provenance import provenance

    started = time.perf_counter()
    runs = []
    for repeat in range(args.repeats):
        for rows in rows_list:
            for backend in (("jax", "tensorflow") if repeat % 2 == 0 else ("tensorflow", "jax")):
                run = {**run_worker(backend, rows, args), "repeat": repeat, "rows_asked": rows}
                print(json.dumps(run), flush=True)
                runs.append(run)
    by_rows = []
    for rows in rows_list:
        jax_ms = [r["ms_per_step"] for r in runs if r["rows_asked"] == rows and r["backend"] == "jax"]
        tf_ms = [r["ms_per_step"] for r in runs if r["rows_asked"] == rows and r["backend"] == "tensorflow"]
        ratios = [j / t for j, t in zip(jax_ms, tf_ms, strict=True)]
        by_rows.append({"rows": rows, "table_mib": rows * 16 * 4 / 2**20, "jax_ms_per_step": jax_ms,
                        "tensorflow_ms_per_step": tf_ms, "jax_over_tensorflow": ratios})
    # How each backend's step grows with the table: least squares over every run, ms per million rows.
    slopes = {}
    for backend in ("jax", "tensorflow"):
        points = [(r["rows_asked"] / 1e6, r["ms_per_step"]) for r in runs if r["backend"] == backend]
        x, y = np.array(points).T
        slopes[backend] = float(np.polyfit(x, y, 1)[0]) if len(set(x)) > 1 else None
    command = "make bench-updates" + (f" BENCH_UPDATES_ARGS='{' '.join(sys.argv[1:])}'" if sys.argv[1:] else "")
    result = {
        **provenance(command),
        "model": "DCNv2-small: criteo spec (26 tables, dim 16), 3 full-rank cross layers, MLP 512-256-128",
        "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
        "by_rows": by_rows, "ms_per_million_rows": slopes, "runs": runs,
        "wall_s": time.perf_counter() - started,
    }
    out = args.out or Path(__file__).parent / "results" / "updates.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({key: result[key] for key in ("by_rows", "ms_per_million_rows")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
