"""DCNv2-small training throughput on a GPU host with the JAX backend and no TensorFlow. Writes
bench/results/gpu.json (gpu_small.json with --small, gpu_data_only.json with --data-only).

    make bench-gpu                                  # on the GPU host (KERAS_BACKEND=jax)
    make bench-gpu BENCH_GPU_ARGS=--small           # tiny sizes, to check the script on a CPU
    make bench-gpu BENCH_GPU_ARGS=--data-only       # only the TensorFlow-free data path: write, read

steps_only_ex_per_s: `model.fit` over a few batches already in device memory, cycled (`steps_per_execution`
steps per call into the compiled step).
end_to_end_ex_per_s: block TFRecords written on this host by components.block_codec (encode_blocks,
frame_records), read back by trainer.parallel_reader (numpy worker processes, no TensorFlow) into shared
memory, copied to the device and trained on by the same `model.fit`, over `--passes` passes of the files,
worker start-up included.
reader_rows_per_s: the same workers reading and decoding alone, without training: the input's ceiling;
one_process_reader_rows_per_s: trainer.block_reader in the main process, the baseline the workers beat.

Absolute speeds mean something only on the GPU; on a CPU this checks that the script runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench.provenance import provenance
from components.block_codec import encode_blocks, frame_records
from components.schema import DENSE_INPUT_DIM, NUM_CATEGORICAL, NUM_RESERVED_ROWS
from trainer.block_reader import block_batches
from trainer.parallel_reader import parallel_block_batches

BLOCK_ROWS = 1024
FULL = {"batch_size": 65_536, "steps": 200, "num_values": 100_000, "train_batches": 128, "files": 32}
SMALL = {"batch_size": 512, "steps": 5, "num_values": 1_000, "train_batches": 8, "files": 4}


def write_file(path: str, num_rows: int, num_values: int, seed: int) -> int:
    """Random rows (a weak planted signal; speed is all that is measured) as one block TFRecord shard."""
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((num_rows, DENSE_INPUT_DIM)).astype(np.float32)
    categorical = rng.integers(NUM_RESERVED_ROWS, NUM_RESERVED_ROWS + num_values, (num_rows, NUM_CATEGORICAL))
    labels = (rng.random(num_rows) < 1 / (1 + np.exp(1.5 - dense[:, 0]))).astype(np.float32)
    Path(path).write_bytes(frame_records(encode_blocks(labels, dense, categorical, BLOCK_ROWS)))
    return num_rows


def write_files(directory: Path, num_rows: int, num_values: int, num_files: int) -> dict[str, int]:
    """`num_files` shards written in parallel processes; returns {path: rows}."""
    directory.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, num_rows, num_files + 1).astype(int)
    paths = [str(directory / f"part-{index:05d}.tfrecord") for index in range(num_files)]
    sizes = [int(stop - start) for start, stop in zip(bounds[:-1], bounds[1:], strict=True)]
    with ProcessPoolExecutor(min(num_files, os.cpu_count() or 1)) as pool:
        written = list(pool.map(write_file, paths, sizes, [num_values] * num_files, range(num_files)))
    return dict(zip(paths, written, strict=True))


def reader_rows_per_second(files: list[str], batch_size: int, num_workers: int) -> float:
    started = time.perf_counter()
    num_rows = sum(len(labels) for labels in parallel_block_batches(files, batch_size, num_workers,
                                                                       to_device=lambda b: b[1]))
    return num_rows / (time.perf_counter() - started)


def one_process_rows_per_second(files: list[str], batch_size: int) -> float:
    """The plain numpy reader in this process: the baseline the workers are compared with."""
    started = time.perf_counter()
    num_rows = sum(len(labels) for _, labels in block_batches(files, batch_size, shuffle=True, drop_remainder=True))
    return num_rows / (time.perf_counter() - started)


def device_description() -> tuple[str, str]:
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        device = jax.devices()[0]
        return backend, f"{device.platform}: {getattr(device, 'device_kind', device)} x {jax.device_count()}"
    return backend, f"{platform.machine()} CPU, {os.cpu_count()} cores (backend {backend})"


def train_throughput(file_rows: dict[str, int], sizes: dict, args: argparse.Namespace) -> dict:
    import keras

    from components.config import TrainConfig
    from components.schema import CATEGORICAL_FEATURES
    from trainer.models import build_model
    from trainer.train import compile_model

    config = TrainConfig(
        embedding_dim=16, num_cross_layers=3, mlp_units=(512, 256, 128), batch_size=args.batch_size,
        cross_projection_dim=0,  # full-rank cross layers, as in this bench's earlier results
        jit_compile=True, mixed_precision=args.mixed_precision,
    )
    files = list(file_rows)
    keras.utils.set_random_seed(config.seed)
    keras.config.set_dtype_policy("mixed_bfloat16" if config.mixed_precision else "float32")
    model = build_model(config, {name: sizes["num_values"] + NUM_RESERVED_ROWS for name in CATEGORICAL_FEATURES})
    compile_model(model, config, steps_per_execution=args.steps_per_execution)

    if keras.backend.backend() == "jax":
        import jax

        def to_device(batch):
            # The transfer must finish before the reader reuses the batch's shared-memory slot.
            return jax.block_until_ready(jax.device_put(batch))
    else:  # a CPU check with another backend: a copy is enough

        def to_device(batch):
            features, labels = batch
            return {name: np.array(value) for name, value in features.items()}, np.array(labels)

    def fit(batches: Iterator[Any], steps: int) -> float:
        """Seconds for `steps` steps of model.fit over `batches`, the state synced back at the end."""
        started = time.perf_counter()
        model.fit((batch for batch in batches), steps_per_epoch=steps, epochs=1, verbose=0)
        keras.ops.convert_to_numpy(model.trainable_variables[-1])  # waits for the last step
        return time.perf_counter() - started

    # Steps only: a few batches placed in device memory once, then trained on in turn.
    resident = list(itertools.islice(parallel_block_batches(files, config.batch_size, 1, to_device), 4))
    if not resident:
        raise ValueError(f"the files hold fewer than batch_size={config.batch_size} rows; raise train_batches")
    cycled = itertools.cycle(resident)
    fit(cycled, 2 * args.steps_per_execution)  # compilation
    seconds = fit(cycled, sizes["steps"])
    steps_only = sizes["steps"] * config.batch_size / seconds

    # End to end: worker processes read and decode, the batches go to the device, the model trains;
    # `passes` passes over the files, worker start-up included.
    def passes() -> Iterator[Any]:
        for index in range(args.passes):
            yield from parallel_block_batches(files, config.batch_size, args.reader_workers, to_device,
                                              seed=1 + index)

    # Each worker drops its last partial batch: count the full ones its files give.
    shares = [files[w::args.reader_workers] for w in range(min(args.reader_workers, len(files)))]
    num_batches = args.passes * sum(sum(file_rows[f] for f in share) // config.batch_size for share in shares)
    seconds = fit(passes(), num_batches)
    end_to_end = num_batches * config.batch_size / seconds
    return {"steps_only_ex_per_s": steps_only, "end_to_end_ex_per_s": end_to_end,
            "end_to_end_rows": num_batches * config.batch_size,
            "flags": {"batch_size": config.batch_size, "jit_compile": True,
                      "mixed_precision": config.mixed_precision, "optimizer": "EmbeddingAdagrad",
                      "steps_per_execution": args.steps_per_execution}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes, to check the script on a CPU")
    parser.add_argument("--data-only", action="store_true",
                        help="write and read the files only (no Keras): the TensorFlow-free data path")
    parser.add_argument("--batch-size", type=int, help="rows per step (default 65536; 512 with --small)")
    parser.add_argument("--reader-workers", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--steps-per-execution", type=int, default=8)
    parser.add_argument("--passes", type=int, default=2, help="passes over the files end to end")
    parser.add_argument("--no-mixed-precision", dest="mixed_precision", action="store_false")
    args = parser.parse_args()
    sizes = SMALL if args.small else FULL
    args.batch_size = args.batch_size or sizes["batch_size"]
    num_rows = sizes["batch_size"] * sizes["train_batches"]
    command = "make bench-gpu" + (f" BENCH_GPU_ARGS='{' '.join(sys.argv[1:])}'" if sys.argv[1:] else "")
    result: dict[str, Any] = {"command": command, "rows": num_rows, "files": sizes["files"],
                              "values_per_feature": sizes["num_values"], "reader_workers": args.reader_workers,
                              "cpu_count": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        started = time.perf_counter()
        file_rows = write_files(Path(tmp), num_rows, sizes["num_values"], sizes["files"])
        result["write_rows_per_s"] = num_rows / (time.perf_counter() - started)
        files = list(file_rows)
        result["one_process_reader_rows_per_s"] = one_process_rows_per_second(files[:4], args.batch_size)
        result["reader_rows_per_s"] = reader_rows_per_second(files, args.batch_size, args.reader_workers)
        if not args.data_only:
            result["backend"], result["device"] = device_description()
            result.update(train_throughput(file_rows, sizes, args))
            if result["backend"] != "jax":
                result["warning"] = "not the JAX backend: run with KERAS_BACKEND=jax (make bench-gpu sets it)"
    result["tensorflow_imported"] = any(name == "tensorflow" or name.startswith("tensorflow.")
                                        for name, module in sys.modules.items() if module is not None)
    result.update({"model": "DCNv2-small: 26 tables, dim 16, 3 cross layers, MLP 512-256-128",
                   "python": sys.version.split()[0]})
    result = {**provenance(result["command"]), **result}
    name = "gpu_data_only.json" if args.data_only else "gpu_small.json" if args.small else "gpu.json"
    out = Path(os.environ.get("BENCH_RESULTS", Path(__file__).parent / "results")) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
