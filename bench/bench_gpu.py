"""DCNv2-small training throughput on a GPU host with the JAX backend and no TensorFlow. Writes
bench/results/gpu.json (gpu_small.json with --small, gpu_data_only.json with --data-only).

    make bench-gpu                                  # on the GPU host (KERAS_BACKEND=jax)
    make bench-gpu BENCH_GPU_ARGS=--small           # tiny sizes, to check the script on a CPU
    make bench-gpu BENCH_GPU_ARGS=--data-only       # only the TensorFlow-free data path: write, read

steps_only_ex_per_s: `train_on_batch` on batches already in device memory (each call waits for its step).
end_to_end_ex_per_s: block TFRecords written on this host by components.block_codec (encode_blocks,
frame_records), read back by trainer.block_reader (numpy, no TensorFlow) in reader threads that hand device
arrays to the training loop through a queue.
reader_rows_per_s: the same threads reading and decoding alone, without training: the input's ceiling.

Absolute speeds mean something only on the GPU; on a CPU this checks that the script runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from components.block_codec import encode_blocks, frame_records
from components.schema import DENSE_INPUT_DIM, NUM_CATEGORICAL, NUM_RESERVED_ROWS
from trainer.block_reader import block_batches

BLOCK_ROWS = 1024
FULL = {"batch_size": 65_536, "steps": 50, "num_values": 100_000, "train_batches": 48, "files": 16}
SMALL = {"batch_size": 512, "steps": 5, "num_values": 1_000, "train_batches": 8, "files": 4}


def write_files(directory: Path, num_rows: int, num_values: int, num_files: int, seed: int = 0) -> list[str]:
    """Random rows (a weak planted signal; speed is all that is measured) as block TFRecord shards."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, num_rows, num_files + 1).astype(int)
    paths = []
    for index, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        n = int(stop - start)
        dense = rng.standard_normal((n, DENSE_INPUT_DIM)).astype(np.float32)
        categorical = rng.integers(NUM_RESERVED_ROWS, NUM_RESERVED_ROWS + num_values, (n, NUM_CATEGORICAL))
        labels = (rng.random(n) < 1 / (1 + np.exp(1.5 - dense[:, 0]))).astype(np.float32)
        path = directory / f"part-{index:05d}.tfrecord"
        path.write_bytes(frame_records(encode_blocks(labels, dense, categorical, BLOCK_ROWS)))
        paths.append(str(path))
    return paths


def threaded_batches(
    files: list[str], batch_size: int, num_threads: int, to_device: Callable[[Any], Any], seed: int = 0
) -> Iterator[Any]:
    """Full batches from `files`, each thread reading its share of the files (shuffled blocks) and putting
    `to_device((features, labels))` on a bounded queue; ends when every thread is done."""
    shares = [files[i::num_threads] for i in range(num_threads)]
    shares = [share for share in shares if share]
    batches: queue.Queue = queue.Queue(maxsize=2 * len(shares))
    done = object()
    errors: list[BaseException] = []

    def produce(share: list[str], thread_seed: int) -> None:
        try:
            for features, labels in block_batches(share, batch_size, shuffle=True, seed=thread_seed,
                                                  drop_remainder=True):
                features = {"dense": features["dense"], "categorical": features["categorical"].astype(np.int32)}
                batches.put(to_device((features, labels)))
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, which raises it
            errors.append(err)
        finally:
            batches.put(done)

    threads = [threading.Thread(target=produce, args=(share, seed + i), daemon=True) for i, share in enumerate(shares)]
    for thread in threads:
        thread.start()
    remaining = len(threads)
    while remaining:
        item = batches.get()
        if item is done:
            remaining -= 1
            continue
        yield item
    if errors:
        raise errors[0]


def reader_rows_per_second(files: list[str], batch_size: int, num_threads: int) -> float:
    started = time.perf_counter()
    num_rows = sum(len(labels) for _, labels in threaded_batches(files, batch_size, num_threads, lambda b: b))
    return num_rows / (time.perf_counter() - started)


def device_description() -> tuple[str, str]:
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        device = jax.devices()[0]
        return backend, f"{device.platform}: {getattr(device, 'device_kind', device)} x {jax.device_count()}"
    return backend, f"{platform.machine()} CPU, {os.cpu_count()} cores (backend {backend})"


def train_throughput(files: list[str], sizes: dict, args: argparse.Namespace) -> dict:
    import keras

    from components.config import TrainConfig
    from components.schema import CATEGORICAL_FEATURES
    from trainer.models import build_model
    from trainer.train import compile_model

    config = TrainConfig(
        embedding_dim=16, num_cross_layers=3, mlp_units=(512, 256, 128), batch_size=sizes["batch_size"],
        jit_compile=True, mixed_precision=args.mixed_precision,
    )
    keras.utils.set_random_seed(config.seed)
    keras.config.set_dtype_policy("mixed_bfloat16" if config.mixed_precision else "float32")
    model = build_model(config, {name: sizes["num_values"] + NUM_RESERVED_ROWS for name in CATEGORICAL_FEATURES})
    compile_model(model, config)

    def to_device(batch):
        features, labels = batch
        return ({name: keras.ops.convert_to_tensor(value) for name, value in features.items()},
                keras.ops.convert_to_tensor(labels))

    # Steps only: a few batches placed in device memory once, then trained on in turn.
    resident = [to_device(batch) for batch in threaded_batches(files[:1], config.batch_size, 1, lambda b: b)][:4]
    if not resident:
        raise ValueError(
            f"the first file holds fewer than batch_size={config.batch_size} rows; raise train_batches or files"
        )
    for features, labels in resident[:2]:  # compilation
        model.train_on_batch(features, labels)
    started = time.perf_counter()
    for step in range(sizes["steps"]):
        features, labels = resident[step % len(resident)]
        model.train_on_batch(features, labels)
    steps_only = sizes["steps"] * config.batch_size / (time.perf_counter() - started)

    # End to end: read, decode, copy to the device and train, one pass over the files.
    num_rows, started = 0, None
    for features, labels in threaded_batches(files, config.batch_size, args.reader_threads, to_device, seed=1):
        model.train_on_batch(features, labels)
        if started is None:  # the clock starts after the first step, as train_model's does
            started = time.perf_counter()
            continue
        num_rows += config.batch_size
    end_to_end = num_rows / (time.perf_counter() - started) if started and num_rows else float("nan")
    return {"steps_only_ex_per_s": steps_only, "end_to_end_ex_per_s": end_to_end,
            "flags": {"batch_size": config.batch_size, "jit_compile": True,
                      "mixed_precision": config.mixed_precision, "optimizer": "EmbeddingAdagrad"}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes, to check the script on a CPU")
    parser.add_argument("--data-only", action="store_true",
                        help="write and read the files only (no Keras): the TensorFlow-free data path")
    parser.add_argument("--reader-threads", type=int, default=4)
    parser.add_argument("--no-mixed-precision", dest="mixed_precision", action="store_false")
    args = parser.parse_args()
    sizes = SMALL if args.small else FULL
    num_rows = sizes["batch_size"] * sizes["train_batches"]
    command = "make bench-gpu" + (f" BENCH_GPU_ARGS={' '.join(sys.argv[1:])}" if sys.argv[1:] else "")
    result: dict[str, Any] = {"command": command, "rows": num_rows, "files": sizes["files"],
                              "values_per_feature": sizes["num_values"], "reader_threads": args.reader_threads}
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        started = time.perf_counter()
        files = write_files(Path(tmp), num_rows, sizes["num_values"], sizes["files"])
        result["write_rows_per_s"] = num_rows / (time.perf_counter() - started)
        result["reader_rows_per_s"] = reader_rows_per_second(files, sizes["batch_size"], args.reader_threads)
        if not args.data_only:
            result["backend"], result["device"] = device_description()
            result.update(train_throughput(files, sizes, args))
            if result["backend"] != "jax":
                result["warning"] = "not the JAX backend: run with KERAS_BACKEND=jax (make bench-gpu sets it)"
    result["tensorflow_imported"] = any(name == "tensorflow" or name.startswith("tensorflow.")
                                        for name, module in sys.modules.items() if module is not None)
    result.update({"model": "DCNv2-small: 26 tables, dim 16, 3 cross layers, MLP 512-256-128",
                   "python": sys.version.split()[0]})
    name = "gpu_data_only.json" if args.data_only else "gpu_small.json" if args.small else "gpu.json"
    out = Path(__file__).parent / "results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
