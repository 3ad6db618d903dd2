"""The train step on the JAX backend (`train.backend: jax`): what a GPU host whose image carries JAX and not
TensorFlow runs.

Keras' backend is chosen once per process and the pipeline's process imports TensorFlow, so the pipeline calls
`train_in_jax_process`, which runs `train_model_jax` in a child process with KERAS_BACKEND=jax and gives back
the `TrainResult` `trainer.train.train_model` would. The child imports no TensorFlow: it reads the block
TFRecords with the numpy reader (trainer.parallel_reader's worker processes, trainer.block_reader), trains the
model of trainer.models with the optimizer, metrics, early stopping, progress saves and calibration of
trainer.train, and writes the same checkpoint (model.keras, the weights file deltas start from, the manifest
last). The export step loads that model.keras on TensorFlow and writes the usual SavedModel.

What differs from the TensorFlow step:
- Embedding gradients are dense under JAX, so each step reads and writes every row of the tables' Adagrad
  accumulators; rows a step did not touch keep their exact values (their gradient is zero), so deltas stay
  row-sparse.
- With several reader workers the batches of an epoch come in the order the workers finish them: a resumed run
  skips as many batches as were applied, not the same ones. Each worker drops its last partial batch.
- XLA is always on: without it every op is dispatched from Python.

    python -m trainer.jax_train REQUEST RESULT_DIR     # the child; REQUEST is a pickled JaxTrainRequest
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from components.block_codec import BLOCK_LAYOUT
from components.config import TrainConfig
from components.feature_spec import FeatureSpec
from trainer.processes import free_loopback_address, join_from_environment, process_environment

logger = logging.getLogger(__name__)

# Reader worker processes by default: enough to keep a GPU fed (bench/results/gpu.json), never more than files.
DEFAULT_READER_WORKERS = 8
RESULT_FILE = "result.json"
EVAL_FILE = "eval.npz"
_STEP_MARK = "ctr-jax-train-step "


@dataclass(frozen=True)
class JaxTrainRequest:
    """`train_model`'s arguments, for the child process."""

    config: TrainConfig
    table_sizes: dict[str, int]
    train_files: list[str]
    eval_files: list[str]
    checkpoint_dir: str
    version: str | None
    warm_start: Any  # trainer.train.WarmStart | None
    layout: str
    num_rows: int | None
    spec: FeatureSpec | None
    log_every_steps: int | None  # None: no StepMetricsLogger was passed


def train_in_jax_process(
    config: TrainConfig,
    table_sizes: Mapping[str, int],
    train_files: Sequence[str],
    eval_files: Sequence[str],
    checkpoint_dir: Path,
    callbacks: Sequence[Any] = (),
    *,
    version: str | None = None,
    warm_start: Any = None,
    layout: str = BLOCK_LAYOUT,
    num_rows: int | None = None,
    spec: FeatureSpec | None = None,
) -> Any:
    """`trainer.train.train_model`, run by `train_model_jax` in a child process with KERAS_BACKEND=jax; the
    returned TrainResult's model is the checkpoint loaded in this process. `callbacks` may only be
    StepMetricsLogger instances (the child cannot call into this process): they receive the child's step and
    epoch metrics as they come."""
    from trainer.train import StepMetricsLogger, TrainResult, load_checkpoint

    others = [c for c in callbacks if not isinstance(c, StepMetricsLogger)]
    if others:
        raise ValueError(f"train.backend=jax trains in a child process and takes StepMetricsLogger callbacks only; "
                         f"received {[type(c).__name__ for c in others]}")
    loggers = list(callbacks)
    every = min((c.every_n_steps for c in loggers), default=None)
    request = JaxTrainRequest(
        config=config, table_sizes=dict(table_sizes), train_files=[str(f) for f in train_files],
        eval_files=[str(f) for f in eval_files], checkpoint_dir=str(checkpoint_dir), version=version,
        warm_start=warm_start, layout=layout, num_rows=num_rows, spec=spec, log_every_steps=every,
    )
    if not isinstance(config.processes, int) or config.processes < 1:
        raise ValueError(f"train.processes={config.processes!r} must be a number of processes, 1 or more")
    with tempfile.TemporaryDirectory(prefix="ctr-jax-train-") as scratch:
        if config.launcher == "scheduler":
            job = Path(checkpoint_dir).parent / f"{Path(checkpoint_dir).name}-job"
            wait_for_scheduled_processes(request, config, job)
            result_dir = job
        else:
            _run_children(request, config.processes, loggers, Path(scratch))
            result_dir = Path(scratch)
        summary = json.loads((result_dir / RESULT_FILE).read_text())
        summary["averaged_epochs"] = tuple(summary.get("averaged_epochs", ()))
        with np.load(result_dir / EVAL_FILE) as data:
            eval_labels, eval_predictions = data["labels"], data["predictions"]
    return TrainResult(model=load_checkpoint(Path(checkpoint_dir)), eval_labels=eval_labels,
                       eval_predictions=eval_predictions, **summary)


JOB_REQUEST = "request.pkl"
JOB_FAILED = "failed.txt"


def wait_for_scheduled_processes(request: JaxTrainRequest, config: TrainConfig, job: Path) -> None:
    """train.launcher=scheduler: writes the request into `job` (beside the checkpoint directory, on storage every
    host mounts) and waits for the processes a cluster scheduler starts on it, each running
    `python -m trainer.jax_train <job>/request.pkl <job>` with the job's environment (trainer/processes.py), to
    write RESULT_FILE there (the first process, after the checkpoint); raises with what a process wrote to
    JOB_FAILED, or after `config.scheduler_timeout_s`."""
    import shutil

    shutil.rmtree(job, ignore_errors=True)  # a run before this one's results
    job.mkdir(parents=True)
    partial = job / f".{JOB_REQUEST}.partial"
    partial.write_bytes(pickle.dumps(request))
    os.replace(partial, job / JOB_REQUEST)
    logger.info("waiting for %d train processes from the cluster scheduler: each runs `python -m trainer.jax_train "
                "%s %s` with KERAS_DISTRIBUTION_JOB_ADDRESSES, KERAS_DISTRIBUTION_NUM_PROCESSES=%d and its index "
                "(KERAS_DISTRIBUTION_PROCESS_ID or JOB_COMPLETION_INDEX)", config.processes, job / JOB_REQUEST, job,
                config.processes)
    deadline = time.monotonic() + config.scheduler_timeout_s
    while not (job / RESULT_FILE).exists():
        if (job / JOB_FAILED).exists():
            raise RuntimeError(f"a train process started by the cluster scheduler failed; its report "
                               f"({job / JOB_FAILED}):\n{(job / JOB_FAILED).read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no train process wrote {job / RESULT_FILE} within train.scheduler_timeout_s="
                f"{config.scheduler_timeout_s:g} s: start {config.processes} processes running `python -m "
                f"trainer.jax_train {job / JOB_REQUEST} {job}` (docker/kubernetes/train-job.yaml), or train with "
                "train.launcher=local")
        time.sleep(0.5)


@dataclass(frozen=True)
class JaxIncrementRequest:
    """`trainer.incremental.train_increment`'s arguments, for the child process."""

    parent_checkpoint: str
    train_files: list[str]
    holdout_files: list[str]
    checkpoint_dir: str
    arguments: dict[str, Any]  # the keyword arguments


class MinuteProcess:
    """A child process with KERAS_BACKEND=jax (no TensorFlow) that trains minutes one after another
    (`python -m trainer.jax_train --minutes`): requests go in on its stdin, one line each, and answers come back
    on its stdout. It outlives a minute, so a minute whose parent is the checkpoint the previous minute saved
    trains the model that minute kept in memory, with its compiled steps (trainer.incremental keeps it), as the
    TensorFlow step worker does. Its log goes to a file, whose end is quoted when it fails."""

    def __init__(self) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="ctr-jax-minutes-", suffix=".log", delete=False)  # noqa: SIM115
        self.child = subprocess.Popen([sys.executable, "-m", "trainer.jax_train", "--minutes"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                      env={**os.environ, "KERAS_BACKEND": "jax"})

    def alive(self) -> bool:
        return self.child.poll() is None

    def run(self, request: JaxIncrementRequest) -> dict[str, Any]:
        assert self.child.stdin is not None and self.child.stdout is not None
        with tempfile.TemporaryDirectory(prefix="ctr-jax-increment-") as scratch:
            request_file = Path(scratch) / "request.pkl"
            request_file.write_bytes(pickle.dumps(request))
            self.child.stdin.write(json.dumps({"request": str(request_file), "result_dir": scratch}) + "\n")
            self.child.stdin.flush()
            answer = self.child.stdout.readline()
            if not answer:  # the child died
                code = self.child.wait()
                raise RuntimeError(f"the JAX minute process (python -m trainer.jax_train --minutes) exited with code "
                                   f"{code}; the end of its log:\n{self.log_tail()}")
            reply = json.loads(answer)
            if reply["error"]:
                raise RuntimeError(f"the JAX minute process failed on this minute:\n{reply['error']}")
            return json.loads((Path(scratch) / RESULT_FILE).read_text())

    def log_tail(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.alive():
            self.child.kill()
        self.child.wait()
        Path(self.log.name).unlink(missing_ok=True)


_minutes: MinuteProcess | None = None
_minutes_lock = threading.Lock()


def stop_minute_process() -> None:
    """Stops the kept JAX minute process, if one runs (the next minute starts a new one)."""
    global _minutes
    with _minutes_lock:
        if _minutes is not None:
            _minutes.stop()
            _minutes = None


atexit.register(stop_minute_process)


def train_increment_in_jax_process(parent_checkpoint: Path, train_files: Sequence[str],
                                   holdout_files: Sequence[str], checkpoint_dir: Path, **arguments: Any
                                   ) -> dict[str, Any]:
    """`trainer.incremental.train_increment` (a minute run's training) on the JAX backend, in a kept child
    process with KERAS_BACKEND=jax that imports no TensorFlow (MinuteProcess, started by the first minute and
    again after one that died); returns what it returns, with `seconds.process` the time outside the child's own
    laps (its start, when this minute started it) and `minute_process_started`."""
    global _minutes
    request = JaxIncrementRequest(parent_checkpoint=str(parent_checkpoint), train_files=[str(f) for f in train_files],
                                  holdout_files=[str(f) for f in holdout_files], checkpoint_dir=str(checkpoint_dir),
                                  arguments=dict(arguments))
    started = time.monotonic()
    with _minutes_lock:
        fresh = _minutes is None or not _minutes.alive()
        if fresh:
            if _minutes is not None:
                _minutes.stop()
            _minutes = MinuteProcess()
        assert _minutes is not None
        result = _minutes.run(request)
    result["seconds"]["process"] = round(time.monotonic() - started - sum(result["seconds"].values()), 3)
    result["minute_process_started"] = fresh
    return result


def _run_children(request: Any, processes: int, loggers: Sequence[Any], scratch: Path) -> None:
    """Runs `python -m trainer.jax_train` on `request` as `processes` children joined into one job (one: no
    job), relaying the first one's step metrics to `loggers`; raises with the log of the first to fail."""
    with contextlib.ExitStack() as stack:
        request_file = scratch / "request.pkl"
        request_file.write_bytes(pickle.dumps(request))
        coordinator = free_loopback_address() if processes > 1 else ""
        children, logs = [], []
        for index in range(processes):
            env = {**os.environ, "KERAS_BACKEND": "jax"}
            if processes > 1:
                env.update(process_environment(coordinator, processes, index))
            logs.append(stack.enter_context(open(scratch / f"stderr-{index}.log", "w+")))
            children.append(stack.enter_context(subprocess.Popen(
                [sys.executable, "-m", "trainer.jax_train", str(request_file), str(scratch)],
                stdout=subprocess.PIPE if index == 0 else subprocess.DEVNULL, stderr=logs[-1], text=True, env=env,
            )))
        relay = threading.Thread(target=_relay_steps, args=(children[0].stdout, loggers), daemon=True)
        relay.start()
        failed = _wait_all(children)
        relay.join()
        if failed is not None:
            index, code = failed
            logs[index].seek(0)
            log = logs[index].read()
            which = f"process {index} of {processes} of " if processes > 1 else ""
            raise RuntimeError(f"{which}the JAX train step (python -m trainer.jax_train, KERAS_BACKEND=jax) exited "
                               f"with code {code}; the end of its log:\n{log[-4000:]}")


def _relay_steps(stdout: Any, loggers: Sequence[Any]) -> None:
    """Hands the step and epoch metrics the first process prints to this process's StepMetricsLoggers."""
    for line in stdout:
        if not line.startswith(_STEP_MARK):
            continue
        message = json.loads(line[len(_STEP_MARK):])
        for callback in loggers:
            if message["epoch_end"] or message["step"] % callback.every_n_steps == 0:
                callback.step = message["step"]
                callback.log_fn(message["metrics"], message["step"])


def _wait_all(children: Sequence[subprocess.Popen[str]]) -> tuple[int, int] | None:
    """Waits for every child; the first to fail (index, exit code) stops the others, which would otherwise wait
    for it in a collective forever. None when all exited with 0."""
    while True:
        codes = [child.poll() for child in children]
        failed = next(((index, code) for index, code in enumerate(codes) if code not in (None, 0)), None)
        if failed is not None:
            for child in children:
                if child.poll() is None:
                    child.kill()
            for child in children:
                child.wait()
            return failed
        if all(code == 0 for code in codes):
            return None
        time.sleep(0.2)


def train_model_jax(
    config: TrainConfig,
    table_sizes: Mapping[str, int],
    train_files: Sequence[str],
    eval_files: Sequence[str],
    checkpoint_dir: Path,
    callbacks: Sequence[Any] = (),
    *,
    version: str | None = None,
    warm_start: Any = None,
    layout: str = BLOCK_LAYOUT,
    num_rows: int | None = None,
    spec: FeatureSpec | None = None,
    reader_workers: int | None = None,
    steps_per_execution: int = 1,
    to_device: Callable[[Any], Any] | None = None,
) -> Any:
    """`trainer.train.train_model` on the JAX backend, in this process (KERAS_BACKEND=jax; no TensorFlow):
    the same arguments, checkpoint and TrainResult.

    `reader_workers`: block reader processes (default: up to DEFAULT_READER_WORKERS, one per file at most, and
    one when the epoch holds fewer than 4 batches a worker). `steps_per_execution` > 1 runs that many steps per
    call into the compiled step (callbacks, progress saves included, then count calls, not steps).
    `to_device`: what turns a batch in the readers' shared memory into the step's input (default: a completed
    jax.device_put to the default device).
    """
    import jax
    import keras

    from trainer.arguments import even_batch_size, resolve_batch_size
    from trainer.block_reader import block_batches
    from trainer.calibration import calibrate
    from trainer.devices import (
        distribution,
        held_out_metrics,
        host_copy,
        resolve_devices,
        shard_rows,
        table_rows,
        whole_batches,
    )
    from trainer.early_stopping import BestEpoch
    from trainer.model_inputs import CRITEO_INPUTS, model_inputs
    from trainer.models import build_model
    from trainer.parallel_reader import parallel_block_batches
    from trainer.processes import (
        HostCopy,
        first_process_decides,
        process_share,
        resolve_processes,
        split_files,
        take,
    )
    from trainer.progress import ProgressCheckpoint, clear_progress, read_progress
    from trainer.tiered_tables import TABLES_DIR, TieredTables, tiered_layer
    from trainer.train import (
        MIXED_PRECISION_POLICY,
        PROGRESS_DIR,
        StepMetricsLogger,
        ThroughputMeter,
        TrainResult,
        compile_model,
        fit_tiered_epoch,
        input_hash,
        micro_batch_size_of,
        progress_every,
        progress_tables,
        restore_best,
        save_tiered_progress,
        speed_flags_of,
        update_best,
        warm_start_model,
        write_training_checkpoint,
    )

    if keras.backend.backend() != "jax":
        raise RuntimeError(f"train_model_jax needs the JAX backend (KERAS_BACKEND=jax), this process has "
                           f"{keras.backend.backend()!r}; from a TensorFlow process call train_in_jax_process")
    if layout != BLOCK_LAYOUT:
        raise ValueError(f"train.backend=jax reads block samples ({BLOCK_LAYOUT!r}) only; these are {layout!r}: "
                         "write them with features.samples_layout=block or train with train.backend=tensorflow")
    inputs = model_inputs(spec) if spec is not None else CRITEO_INPUTS
    processes = resolve_processes(config.processes)
    primary = jax.process_index() == 0
    devices = resolve_devices(config.devices)
    if processes > 1 and devices != jax.device_count():
        raise ValueError(f"train.processes={processes} trains on the devices of every process: set train.devices to 0 "
                         f"or {jax.device_count()} (they show {jax.device_count()} in all), not {config.devices}")
    config = dataclasses.replace(config, batch_size=resolve_batch_size(config.batch_size, num_rows), devices=devices)
    micro_batch_size = micro_batch_size_of(config)
    if num_rows and config.micro_batches == 1:
        micro_batch_size = even_batch_size(num_rows, micro_batch_size)
    if devices > 1:  # a batch splits evenly across the devices
        micro_batch_size = max(devices, micro_batch_size // devices * devices)
        spec_options = inputs.embedding_options(spec) if spec is not None else {}
        spec_hashed = spec_options.get("hashed_features", [])
        hot = spec_options.get("tiered_tables", {})
        sharded_rows = table_rows(config, table_sizes, list(inputs.tables),
                                  [inputs.tables[i] for i in [*spec_hashed, *hot]])
        # A tiered table's hot slots, sharded like the table when a tier is as large (trainer/devices.py).
        sharded_hot_rows = sum(-(-rows // devices) * devices for rows in hot.values()) \
            if any(rows > config.shard_table_rows for rows in hot.values()) else 0
        mesh = distribution(devices, sharded_rows > config.shard_table_rows, sharded_hot_rows > 0)
    else:
        sharded_rows, sharded_hot_rows, mesh = 0, 0, None

    def in_scope() -> Any:
        return mesh.scope() if mesh is not None else contextlib.nullcontext()

    workers = reader_workers or min(DEFAULT_READER_WORKERS, os.cpu_count() or 1)
    if num_rows:
        workers = min(workers, max(1, num_rows // (4 * micro_batch_size)))
    workers = max(1, min(workers, len(train_files)))
    # Several processes: each reads its own files when their rows are known (equal steps), else the same stream.
    split = split_files(train_files, processes, micro_batch_size, workers) if processes > 1 else None
    if split is not None:
        my_files, local_devices, workers, steps_per_epoch = split
    elif processes > 1:  # one reader each: every process reads the same batches in the same (seeded) order
        workers = 1
    transfer = to_device or (host_copy if devices > 1 else device_put_batch)

    checkpoint_dir = Path(checkpoint_dir)
    progress_dir = checkpoint_dir / PROGRESS_DIR
    identity = input_hash(config, table_sizes, train_files, eval_files)
    resumed = read_progress(progress_dir, identity)
    keras.utils.set_random_seed(config.seed)
    previous_policy = keras.config.dtype_policy()
    if config.mixed_precision:
        keras.config.set_dtype_policy(MIXED_PRECISION_POLICY)
    warm_start_summary: dict[str, int] | None = None
    tiered: TieredTables | None = None

    def eval_batches() -> Iterator[Any]:
        return block_batches(eval_files, config.batch_size, inputs=inputs)

    try:
        with in_scope():
            model = build_model(config, table_sizes, spec)
            compile_model(model, dataclasses.replace(config, jit_compile=True), steps_per_execution=steps_per_execution)
            if resumed is not None or processes > 1:
                model.optimizer.build(model.trainable_variables)
            layer = tiered_layer(model)
            if layer is not None:  # tables on disk with a hot tier (trainer/tiered_tables.py), as on TensorFlow
                if config.average_epochs:
                    raise ValueError("train.average_epochs averages whole tables, which a tiered table (storage: "
                                     "tiered) never holds in memory; set train.average_epochs=false")
                if steps_per_execution != 1:
                    raise ValueError(f"tiered tables (storage: tiered) apply their hot tiers' plans between steps: "
                                     f"train with steps_per_execution=1, not {steps_per_execution}")
                tiered = TieredTables(model, layer, inputs.tables, progress_dir / TABLES_DIR)
                # Batches stay numpy until the hot tiers have rewritten their ids; Keras puts them on the device.
                transfer = host_copy
            if resumed is not None:
                model.load_weights(progress_dir / resumed.weights)
                if tiered is not None:
                    tiered.restore(progress_dir / progress_tables(resumed.global_step))
            elif warm_start is not None:
                warm_start_summary = warm_start_model(model, warm_start, tiered, config.seed, inputs.tables)
            elif tiered is not None:
                tiered.create(config.seed)
        host: HostCopy | None = None
        if processes > 1:  # the first process keeps an unsharded copy for what needs the whole table
            copy = None
            if primary:
                copy = build_model(config, table_sizes, spec)
                compile_model(copy, dataclasses.replace(config, jit_compile=True))
            host = HostCopy(model, copy)
        kept_model = host.model if host is not None else model  # None on the other processes

        with in_scope():
            meter = ThroughputMeter()
            saver = ProgressCheckpoint(
                progress_dir, identity, progress_every(config, tiered), start=resumed,
                save_weights=host.save_weights if host is not None else None if tiered is None else
                lambda model, path: save_tiered_progress(model, path, tiered, saver))
            best = BestEpoch(progress_dir, identity, config.early_stopping_patience, config.early_stopping_min_delta,
                             average=config.average_epochs)
            for callback in callbacks:
                if isinstance(callback, StepMetricsLogger) and resumed is not None:
                    callback.step = resumed.global_step
            history: dict[str, list[float]] = {}
            first_epoch = resumed.epoch if resumed else 0
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Your input ran out of data")
                for epoch in range(first_epoch, config.epochs):
                    skip = resumed.batches_done if resumed is not None and epoch == resumed.epoch else 0
                    if split is not None:  # this process's files, its share of every global batch
                        local = parallel_block_batches(
                            my_files, micro_batch_size // processes, workers, transfer, shuffle=True,
                            seed=config.seed + epoch * processes + jax.process_index(),
                            shuffle_buffer_blocks=config.shuffle_buffer_blocks, inputs=inputs)
                        train_data: Iterator[Any] = take(
                            whole_batches(itertools.islice(local, skip, None), local_devices),
                            steps_per_epoch - skip, source=local)
                    else:
                        train_data = parallel_block_batches(
                            train_files, micro_batch_size, workers, transfer, shuffle=True, seed=config.seed + epoch,
                            shuffle_buffer_blocks=config.shuffle_buffer_blocks, inputs=inputs,
                        )
                        if skip:
                            train_data = itertools.islice(train_data, skip, None)
                        if devices > 1:
                            train_data = whole_batches(train_data, devices)
                        if processes > 1:
                            train_data = process_share(train_data, jax.process_index(), processes)
                    if tiered is None:
                        fitted = model.fit(train_data, validation_data=eval_batches() if devices == 1 else None,
                                           initial_epoch=epoch, epochs=epoch + 1,
                                           callbacks=[meter, saver, *callbacks], verbose=0).history
                    else:
                        fitted = fit_tiered_epoch(model, tiered, train_data, eval_batches(), epoch,
                                                  [meter, saver, *callbacks],
                                                  score=held_out_metrics if devices > 1 else None)
                    logs = {name: float(values[-1]) for name, values in fitted.items()}
                    if host is None:
                        if devices > 1 and tiered is None:  # the tiered epoch scored its held-out rows itself
                            logs.update(held_out_metrics(model, eval_batches()))
                        stop = update_best(best, epoch, logs, model, tiered, progress_dir)
                    else:  # the first process scores its gathered copy and decides for all
                        host.sync()
                        stop = False
                        if host.model is not None:
                            with host.local():
                                logs.update(held_out_metrics(host.model, eval_batches()))
                                stop = best.update(epoch, logs, host.model)
                        stop = first_process_decides(stop)
                    for name, value in logs.items():
                        history.setdefault(name, []).append(value)
                    if stop:
                        break
        if kept_model is None:  # another process scores, calibrates and writes the checkpoint
            return None
        # The rest runs on the kept model: the sharded one in its scope, or the first process's unsharded copy.
        with in_scope() if host is None else host.local():
            best_epoch = restore_best(best, kept_model, tiered, progress_dir)
            averaged_epochs = tuple(best.averaged_epochs)
            calibration = None
            if config.calibrate:
                rows: Any = itertools.islice(block_batches(train_files, config.batch_size, inputs=inputs),
                                             -(-config.calibration_rows // config.batch_size))
                held_out: Any = eval_batches() if config.calibrate_on == "held_out" else None
                if tiered is not None:
                    rows = tiered.applied(rows)
                    held_out = tiered.applied(held_out) if held_out is not None else None
                calibration = calibrate(kept_model, rows, held_out, config.calibration_min_clicks)
            labels, predictions = [], []
            for features, batch_labels in eval_batches() if tiered is None else tiered.applied(eval_batches()):
                # A sharded model: a direct call, which takes a batch of any number of rows.
                predicted = (model(features, training=False) if devices > 1 and host is None
                             else kept_model.predict_on_batch(features))
                predictions.append(np.asarray(predicted).reshape(-1))
                labels.append(batch_labels)
    finally:
        keras.config.set_dtype_policy(previous_policy)
    eval_labels = np.concatenate(labels).astype(np.float32)
    eval_predictions = np.concatenate(predictions).astype(np.float32)
    num_train_examples = meter.num_examples_by_epoch[-1] if meter.num_examples_by_epoch else 0
    speed_flags = {**speed_flags_of(dataclasses.replace(config, jit_compile=True), 1),
                   "backend": "jax", "row_sparse_updates": False, "reader_workers": workers,
                   "steps_per_execution": steps_per_execution, "device": _device_kind(jax), "devices": devices,
                   "processes": processes,
                   # Several processes: "split" (each its own files) or "shared" (each the same stream).
                   "process_files": "split" if split is not None else "shared" if processes > 1 else None,
                   "steps_per_epoch": split[3] if split is not None else None,
                   "sharded_table_rows": sharded_rows if sharded_rows > config.shard_table_rows else 0,
                   "sharded_hot_rows": sharded_hot_rows,
                   # This process's shards (every process holds as many when the table is sharded).
                   "shard_rows": shard_rows(model)}
    kept = best_epoch - first_epoch if best_epoch is not None and best_epoch >= first_epoch else -1

    table_files = tiered.commit(checkpoint_dir) if tiered is not None else []
    write_training_checkpoint(
        kept_model, checkpoint_dir, config=config, version=version or identity, spec=spec, table_sizes=table_sizes,
        train_files=train_files, eval_files=eval_files,
        warm_start=warm_start if warm_start_summary is not None else None, warm_start_summary=warm_start_summary,
        num_train_examples=num_train_examples, num_eval_examples=len(eval_labels), history=history, kept=kept,
        best_epoch=best_epoch, first_epoch=first_epoch, speed_flags=speed_flags, global_step=saver.global_step,
        resumed_from_step=resumed.global_step if resumed else None, calibration=calibration,
        table_files=table_files,
        # Checked by the tests: the JAX step must run where TensorFlow is not installed.
        extra={"averaged_epochs": list(averaged_epochs),
               "tiered_tables": {name: table.hot_rows for name, table in (spec.tables() if spec else {}).items()
                                 if table.tiered},
               "tensorflow_imported": any(module is not None and (name == "tensorflow"
                                                                  or name.startswith("tensorflow."))
                                          for name, module in list(sys.modules.items()))})
    clear_progress(progress_dir)
    return TrainResult(
        model=kept_model, history=history, num_train_examples=num_train_examples,
        examples_per_second=meter.examples_per_second(), eval_labels=eval_labels, eval_predictions=eval_predictions,
        speed_flags=speed_flags, global_step=saver.global_step,
        resumed_from_step=resumed.global_step if resumed else None, warm_start=warm_start_summary,
        calibration=calibration, best_epoch=best_epoch, averaged_epochs=averaged_epochs,
        tiered_tables=tiered.counters() if tiered is not None else None,
    )


def device_put_batch(batch: Any) -> Any:
    """A batch of the readers' shared memory on the default device, as a copy that has completed: the reader
    reuses the slot as soon as this returns."""
    import jax

    if jax.default_backend() == "cpu":  # the CPU client may alias numpy memory instead of copying it
        batch = jax.tree.map(np.array, batch)
    return jax.block_until_ready(jax.device_put(batch))


def _device_kind(jax: Any) -> str:
    device = jax.devices()[0]
    return f"{device.platform}: {getattr(device, 'device_kind', device)} x {jax.device_count()}"


def _child_main(request_file: str, result_dir: str) -> int:
    """The child of train_in_jax_process: trains, writes RESULT_FILE and EVAL_FILE into `result_dir`, and
    reports step metrics on stdout (lines starting with _STEP_MARK); everything else goes to stderr."""
    # As on a GPU host without TensorFlow, where it is installed too: Keras imports whatever TensorFlow it finds
    # (keras.utils.set_random_seed seeds it), seconds and memory this process has no use for.
    sys.modules.setdefault("tensorflow", None)  # type: ignore[arg-type]
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not mix with the metric lines
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    request: JaxTrainRequest = pickle.loads(Path(request_file).read_bytes())
    join_from_environment()  # several processes: before any JAX computation

    from trainer.train import StepMetricsLogger

    def emit(metrics: dict[str, float], step: int, epoch_end: bool = False) -> None:
        channel.write(_STEP_MARK + json.dumps({"step": step, "metrics": metrics, "epoch_end": epoch_end}) + "\n")

    class ReportedSteps(StepMetricsLogger):
        def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
            emit({name: float(value) for name, value in (logs or {}).items()}, self.step, epoch_end=True)

    callbacks = [ReportedSteps(emit, request.log_every_steps)] if request.log_every_steps else []
    started = time.perf_counter()
    result = train_model_jax(
        request.config, request.table_sizes, request.train_files, request.eval_files,
        Path(request.checkpoint_dir), callbacks, version=request.version, warm_start=request.warm_start,
        layout=request.layout, num_rows=request.num_rows, spec=request.spec,
    )
    if result is None:  # not the first of several processes: that one reports
        logger.info("JAX train step done in %.1f s", time.perf_counter() - started)
        channel.close()
        return 0
    logger.info("JAX train step done in %.1f s, %.0f examples/s", time.perf_counter() - started,
                result.examples_per_second)
    out = Path(result_dir)
    np.savez(out / EVAL_FILE, labels=result.eval_labels, predictions=result.eval_predictions)
    fields = ("history", "num_train_examples", "examples_per_second", "speed_flags", "global_step",
              "resumed_from_step", "warm_start", "calibration", "best_epoch", "averaged_epochs", "tiered_tables")
    partial = out / f".{RESULT_FILE}.partial"  # renamed last: a waiting launcher reads a whole file
    partial.write_text(json.dumps({name: getattr(result, name) for name in fields}))
    os.replace(partial, out / RESULT_FILE)
    channel.close()
    return 0


def _minutes_main() -> int:
    """The child of MinuteProcess: one JSON line a minute on stdin ({"request", "result_dir"}), the minute
    trained (trainer.incremental.train_increment, which keeps its model for the next minute), RESULT_FILE
    written, and one JSON line on stdout ({"error": null or the traceback}); it ends when stdin closes."""
    import traceback

    sys.modules.setdefault("tensorflow", None)  # type: ignore[arg-type]  # as in _child_main
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from trainer.incremental import train_increment

    for line in sys.stdin:
        order = json.loads(line)
        error = None
        try:
            request = pickle.loads(Path(order["request"]).read_bytes())
            result = train_increment(Path(request.parent_checkpoint), request.train_files, request.holdout_files,
                                     Path(request.checkpoint_dir), **request.arguments)
            (Path(order["result_dir"]) / RESULT_FILE).write_text(json.dumps(result))
        except Exception:  # noqa: BLE001 -- reported to the parent, which raises it; the process serves on
            error = traceback.format_exc()
            logger.error("minute failed: %s", error)
        channel.write(json.dumps({"error": error}) + "\n")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--minutes"]:
        sys.exit(_minutes_main())
    if len(sys.argv) != 3:
        sys.exit("usage: python -m trainer.jax_train REQUEST RESULT_DIR (run by train_in_jax_process, or by a "
                 "cluster scheduler), or python -m trainer.jax_train --minutes (run by train_increment_in_jax_process)")
    try:
        sys.exit(_child_main(sys.argv[1], sys.argv[2]))
    except Exception:
        import traceback

        # A launcher waiting on the result directory (train.launcher=scheduler) learns of the failure from this.
        with open(Path(sys.argv[2]) / JOB_FAILED, "a") as report:
            report.write(f"process {os.environ.get('KERAS_DISTRIBUTION_PROCESS_ID', '0')}:\n{traceback.format_exc()}")
        raise
