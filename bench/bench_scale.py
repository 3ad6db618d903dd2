"""The pipeline's own JAX train step (trainer.jax_train.train_model_jax, what `train.backend: jax` runs) on the
criteo spec's DCNv2-small, from block TFRecords. Writes bench/results/scale.json (scale_small.json with
--small; BENCH_RESULTS names another folder).

    make bench-scale                                  # KERAS_BACKEND=jax; on a GPU host for absolute speeds
    make bench-scale BENCH_SCALE_ARGS=--small         # tiny sizes: checks that it runs

Per run (`runs`, one per device count of `--devices`, default 1, 2 and 4, as many as the host shows; with
several devices every batch is split across them and the table sharded row-wise, trainer/devices.py):
- end_to_end_ex_per_s: train_model_jax over `--passes` epochs of the block files (reader worker processes,
  trainer.parallel_reader, copying each batch to the device): its TrainResult.examples_per_second, which leaves
  out the first step (compilation), the held-out scoring after each epoch, and each epoch's reader start (the
  workers are started anew every epoch, and Keras peeks the generator's first batch before the epoch's clock
  starts); end_to_end_wall_s is the whole call (compilation, worker starts, scoring and the checkpoint's
  write included) and end_to_end_wall_ex_per_s the rows over it.
- steps_only_ex_per_s: the same compiled model (the TrainResult's) fitted on a few batches already in device
  memory, cycled: the step's own ceiling.
- reader_rows_per_s: the reader workers alone over the same passes, decoding into shared memory without a
  device copy, from the first pass's first batch on (the later passes' worker starts are inside it, unlike
  end_to_end_ex_per_s); reader_rows_per_s_with_start: with the first start too.

Also: `sharded_equals_unsharded`, the largest device count's run against one device's on the same batches
(one reader process, one pass over the first file) ending at the same weights (rtol 1e-4, atol 1e-5, the
padding rows of the sharded table left out), with `sharded_max_abs_difference`; and `delta_from_shards_s`, the
seconds to form a delta (components.delta.weight_arrays: the rows that changed) from the largest device count's
model, its table and accumulator gathered from the devices' shards, against the one-device run's weights.
`--cpu-devices N` makes a CPU host show N devices (XLA's forced host platform device count), to check the
several-device runs on a machine without GPUs; `--out` names the result file.

The files are written here without TensorFlow (components.block_codec), with the criteo spec's widths and
random ids; speed is all that is measured. This process blocks TensorFlow's import, as on a host without it.
Absolute speeds mean something only on a GPU; on a CPU this checks that the bench runs.
"""

from __future__ import annotations

import sys

sys.modules.setdefault("tensorflow", None)  # type: ignore[arg-type]  # a JAX host: see the docstring

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from bench.provenance import provenance  # noqa: E402
from components.block_codec import encode_blocks, frame_records  # noqa: E402
from components.feature_spec import NUM_RESERVED_ROWS, load_spec  # noqa: E402
from trainer.model_inputs import ModelInputs, model_inputs  # noqa: E402

SPEC = "criteo"
BLOCK_ROWS = 1024
FULL = {"batch_size": 65_536, "train_batches": 128, "files": 32, "num_values": 100_000, "steps": 200}
SMALL = {"batch_size": 512, "train_batches": 16, "files": 4, "num_values": 1_000, "steps": 10}
MODEL = "DCNv2-small: criteo spec (26 tables, dim 16), 3 full-rank cross layers, MLP 512-256-128"


def write_file(path: str, num_rows: int, num_values: int, seed: int, inputs: ModelInputs) -> int:
    """Random rows with a weak planted signal as one block TFRecord file of the spec's layout."""
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((num_rows, inputs.dense_dim)).astype(np.float32)
    categorical = rng.integers(NUM_RESERVED_ROWS, NUM_RESERVED_ROWS + num_values,
                               (num_rows, len(inputs.feature_tables)))
    lists = {item.key: rng.integers(NUM_RESERVED_ROWS, NUM_RESERVED_ROWS + num_values, (num_rows, item.length))
             for item in inputs.lists}
    labels = (rng.random(num_rows) < 1 / (1 + np.exp(1.5 - dense[:, 0]))).astype(np.float32)
    Path(path).write_bytes(frame_records(encode_blocks(labels, dense, categorical, BLOCK_ROWS, lists)))
    return num_rows


def write_files(directory: Path, num_rows: int, num_values: int, num_files: int, inputs: ModelInputs) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, num_rows, num_files + 1).astype(int)
    paths = [str(directory / f"part-{index:05d}.tfrecord") for index in range(num_files)]
    sizes = [int(stop - start) for start, stop in zip(bounds[:-1], bounds[1:], strict=True)]
    # spawn: this process runs JAX, whose threads a fork would copy mid-flight.
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(min(num_files, os.cpu_count() or 1), mp_context=spawn) as pool:
        list(pool.map(write_file, paths, sizes, [num_values] * num_files, range(num_files),
                      [inputs] * num_files))
    return paths


def reader_rows_per_second(files: list[str], batch_size: int, workers: int, inputs: ModelInputs,
                           passes: int) -> tuple[float, float]:
    """(rows/s from the first batch on, rows/s with the workers' start) of the reader workers alone over
    `passes` passes, decoding into shared memory without a device copy. The first figure is the one to set
    beside end_to_end_ex_per_s, which also leaves the start out."""
    from trainer.parallel_reader import parallel_block_batches

    started = time.perf_counter()
    first: tuple[float, int] | None = None
    num_rows = 0
    for index in range(passes):
        for labels in parallel_block_batches(files, batch_size, workers, lambda b: b[1], seed=index, inputs=inputs):
            num_rows += len(labels)
            if first is None:
                first = (time.perf_counter(), num_rows)
    ended = time.perf_counter()
    assert first is not None
    return (num_rows - first[1]) / (ended - first[0]), num_rows / (ended - started)


def device_description() -> str:
    import jax

    device = jax.devices()[0]
    return f"{device.platform}: {getattr(device, 'device_kind', device)} x {jax.device_count()}"


def device_run(train_files: list[str], eval_files: list[str], num_rows: int, sizes: dict, args: Any,
               scratch: Path, devices: int, reader_workers: int | None = None, passes: int | None = None,
               steps_only: bool = True, mixed_precision: bool | None = None) -> tuple[dict[str, Any], Any]:
    """(the run's figures, its TrainResult) on `devices` devices."""
    import keras

    from components.config import TrainConfig
    from trainer.jax_train import device_put_batch, train_model_jax
    from trainer.parallel_reader import parallel_block_batches

    spec = load_spec(SPEC)
    inputs = model_inputs(spec)
    config = TrainConfig(
        backend="jax", embedding_dim=16, num_cross_layers=3, mlp_units=(512, 256, 128), cross_projection_dim=0,
        batch_size=args.batch_size, epochs=passes or args.passes, early_stopping_patience=0, calibrate=False,
        mixed_precision=args.mixed_precision if mixed_precision is None else mixed_precision, jit_compile=True,
        checkpoint_every_steps=1 << 30, devices=devices, shard_table_rows=0,
    )
    table_sizes = {name: sizes["num_values"] + NUM_RESERVED_ROWS for name in inputs.tables}
    started = time.perf_counter()
    result = train_model_jax(config, table_sizes, train_files, eval_files, scratch / f"checkpoint-{devices}",
                             spec=spec, num_rows=num_rows, reader_workers=reader_workers or args.reader_workers,
                             steps_per_execution=args.steps_per_execution)
    wall = time.perf_counter() - started
    model = result.model
    if not steps_only:
        return {"devices": devices}, result

    # Steps only: a few batches placed in device memory once, then trained on in turn by the same model.
    batches = parallel_block_batches(train_files, result.speed_flags["micro_batch_size"], 1, device_put_batch,
                                     inputs=inputs)
    resident = list(itertools.islice(batches, 4))
    batches.close()
    cycled = itertools.cycle(resident)

    class InOrder(keras.callbacks.Callback):
        """A batch-end callback, so that Keras reads each step's logs on this thread, in order. Without any, it
        reads them on a thread pool while the next step runs, and on several CPU devices two programs' collectives
        then interleave: the fit hung in an all-reduce until XLA aborted it (bf16, 2 and 4 forced devices)."""

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            pass

    def fit(steps: int) -> float:
        begun = time.perf_counter()
        model.fit((batch for batch in cycled), steps_per_epoch=steps, epochs=1, callbacks=[InOrder()], verbose=0)
        keras.ops.convert_to_numpy(model.trainable_variables[-1])  # waits for the last step
        return time.perf_counter() - begun

    fit(2 * args.steps_per_execution)  # a new fit traces once more
    steps = max(sizes["steps"] // args.steps_per_execution, 1) * args.steps_per_execution
    steps_only = steps * result.speed_flags["micro_batch_size"] / fit(steps)
    return {"devices": devices, "steps_only_ex_per_s": steps_only,
            "end_to_end_ex_per_s": result.examples_per_second,
            "end_to_end_wall_s": wall, "end_to_end_rows": result.num_train_examples * args.passes,
            "end_to_end_wall_ex_per_s": result.num_train_examples * args.passes / wall,
            "speed_flags": result.speed_flags}, result


def sharded_check(train_files: list[str], eval_files: list[str], sizes: dict, args: Any, scratch: Path,
                  devices: int) -> dict[str, Any]:
    """`devices` devices against one on the same batches (one reader, one pass over the first file, float32):
    whether they end at the same weights, and the seconds to form a delta from the sharded model's weights."""
    from components.delta import weight_arrays

    num_rows = args.batch_size * sizes["train_batches"] // sizes["files"]
    runs = {d: device_run(train_files[:1], eval_files, num_rows, sizes, args, scratch / f"check-{d}", d,
                          reader_workers=1, passes=1, steps_only=False, mixed_precision=False)[1]
            for d in (1, devices)}
    single = [np.asarray(w) for w in runs[1].model.weights]

    def unpadded(weight: np.ndarray, like: np.ndarray) -> np.ndarray:  # the table's padding rows left out
        return weight if weight.ndim == 0 else weight[:len(like)]

    started = time.perf_counter()
    sharded = [np.asarray(w) for w in runs[devices].model.weights]  # gathered from the devices' shards
    arrays = weight_arrays(single, [unpadded(w, s) for w, s in zip(sharded, single, strict=True)])
    delta_s = time.perf_counter() - started
    pairs = [(unpadded(w, s), s) for w, s in zip(sharded, single, strict=True)]
    differences = [float(np.max(np.abs(w.astype(np.float64) - s))) if s.size else 0.0 for w, s in pairs]
    equal = all(np.allclose(w, s, rtol=1e-4, atol=1e-5) for w, s in pairs)
    return {"sharded_equals_unsharded": bool(equal), "sharded_max_abs_difference": max(differences),
            "sharded_check_devices": devices, "delta_from_shards_s": delta_s,
            "delta_rows_changed": int(sum(len(v) for k, v in arrays.items() if k.startswith("rows_")))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes, to check the bench runs on a CPU")
    parser.add_argument("--batch-size", type=int, help="rows per step (default 65536; 512 with --small)")
    parser.add_argument("--train-batches", type=int, help="rows written = batch size x this (default 128)")
    parser.add_argument("--reader-workers", type=int, default=min(12, os.cpu_count() or 1))
    parser.add_argument("--steps-per-execution", type=int, default=8)
    parser.add_argument("--passes", type=int, default=2, help="epochs over the files end to end")
    parser.add_argument("--no-mixed-precision", dest="mixed_precision", action="store_false")
    parser.add_argument("--devices", default="1,2,4", help="device counts to run, comma-separated (default 1,2,4)")
    parser.add_argument("--cpu-devices", type=int, default=0,
                        help="make a CPU host show this many devices (XLA's forced host platform device count)")
    parser.add_argument("--out", help="the result file's name (default scale.json; scale_small.json with --small)")
    args = parser.parse_args()
    if args.cpu_devices:  # before JAX starts
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.cpu_devices}").strip()
    import jax
    import keras

    if keras.backend.backend() != "jax":
        sys.exit(f"bench_scale measures the JAX train step: run it with KERAS_BACKEND=jax (make bench-scale sets "
                 f"it); this process has {keras.backend.backend()!r}")
    sizes = dict(SMALL if args.small else FULL)
    args.batch_size = args.batch_size or sizes["batch_size"]
    sizes["train_batches"] = args.train_batches or sizes["train_batches"]
    num_rows = args.batch_size * sizes["train_batches"]
    inputs = model_inputs(load_spec(SPEC))
    # bench/gpu_bench_scale.sh names itself (a GPU host has no make target's environment).
    command = os.environ.get("BENCH_COMMAND") or (
        "make bench-scale" + (f" BENCH_SCALE_ARGS='{' '.join(sys.argv[1:])}'" if sys.argv[1:] else ""))
    result: dict[str, Any] = {
        "command": command, "device": device_description(), "model": MODEL, "spec": SPEC, "rows": num_rows,
        "files": sizes["files"], "values_per_feature": sizes["num_values"], "batch_size": args.batch_size,
        "passes": args.passes, "reader_workers": args.reader_workers, "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0], "machine": platform.machine(),
    }
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        started = time.perf_counter()
        train_files = write_files(Path(tmp) / "train", num_rows, sizes["num_values"], sizes["files"], inputs)
        eval_files = write_files(Path(tmp) / "eval", 4 * BLOCK_ROWS, sizes["num_values"], 1, inputs)
        result["write_rows_per_s"] = num_rows / (time.perf_counter() - started)
        reader, reader_with_start = reader_rows_per_second(train_files, args.batch_size, args.reader_workers,
                                                           inputs, args.passes)
        counts = [int(d) for d in args.devices.split(",")]
        shown = jax.device_count()
        result["runs"] = [{**device_run(train_files, eval_files, num_rows, sizes, args, Path(tmp), d)[0],
                           "reader_rows_per_s": reader, "reader_rows_per_s_with_start": reader_with_start}
                          for d in counts if d <= shown]
        skipped = [d for d in counts if d > shown]
        if skipped:
            result["not_run"] = f"{skipped} devices: this host shows {shown}"
        if max(run["devices"] for run in result["runs"]) > 1:
            result.update(sharded_check(train_files, eval_files, sizes, args, Path(tmp),
                                        max(run["devices"] for run in result["runs"])))
    result["tensorflow_imported"] = any(module is not None and (name == "tensorflow" or name.startswith("tensorflow."))
                                        for name, module in list(sys.modules.items()))
    result = {**provenance(result["command"]), **result}
    name = args.out or ("scale_small.json" if args.small else "scale.json")
    out = Path(os.environ.get("BENCH_RESULTS", Path(__file__).parent / "results")) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
