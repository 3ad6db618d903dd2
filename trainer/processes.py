"""Several training processes, on one host or many, joined into one mesh (`train.processes`, JAX backend).

The processes are joined by `keras.distribution.initialize` (over `jax.distributed`), which reads the job from
the environment a launcher or a cluster scheduler sets (the names below). Then `jax.devices()` lists the devices
of every process and trainer/devices.py's mesh spans them all: every global batch is split along its rows across
all devices, and a table above `train.shard_table_rows` rows is sharded row-wise across them, so each process
holds only its share of the table and of its Adagrad state while it trains.

How the data reaches them: when the samples manifest beside the files gives each file's rows, the files are
split between the processes (`assign_files`: balanced by rows, the same on every process), each process reads
only its own with its reader processes and feeds its share of every global batch (batch_size / processes
rows), and every process takes the same number of steps an epoch (`equal_steps`, computed alike on all of them
from the rows: a collective waits for all, so a process that ran out of batches first would hang the others).
The rows past that count are left out of the epoch (the shuffle changes which every epoch). Otherwise (no
manifest, or fewer files than processes) every process reads the same training stream (one reader process each,
so the seeded shuffle gives every process the same batches in the same order) and keeps its own contiguous share
of the rows of each global batch (`process_share`), which costs read bandwidth and not memory, and trains as one
process would on the same batches. Either way Keras makes the global batch from the shares
(`jax.make_array_from_process_local_data`).

What needs the whole table goes through the first process: at each epoch's end and at every progress save the
weights and the optimizer's state are gathered (`jax.experimental.multihost_utils.process_allgather`) into an
unsharded copy of the model on the first process (`HostCopy`), which scores the held-out rows, keeps the best
epoch, saves progress and writes the checkpoint, exactly as one process does. The early-stopping decision is
the first process's, broadcast to the others. So the first process holds the whole table at those moments;
training itself never does.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# keras.distribution.initialize reads these (keras/src/distribution/distribution_lib.py); for JAX only the first
# address, the coordinator's (process 0), is used.
ADDRESSES_ENV = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
COUNT_ENV = "KERAS_DISTRIBUTION_NUM_PROCESSES"
INDEX_ENV = "KERAS_DISTRIBUTION_PROCESS_ID"
# What a Kubernetes Indexed Job sets in each pod: taken as the process index when INDEX_ENV is not set.
JOB_INDEX_ENV = "JOB_COMPLETION_INDEX"


def process_environment(coordinator: str, count: int, index: int) -> dict[str, str]:
    """The environment of process `index` of `count` whose coordinator (process 0) listens at `coordinator`
    ("host:port")."""
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"process {index} of {count}: the index must be in [0, {count})")
    return {ADDRESSES_ENV: coordinator, COUNT_ENV: str(count), INDEX_ENV: str(index)}


def free_loopback_address() -> str:
    """A loopback "host:port" no one listens on now (for the coordinator of processes started on this host)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def join_from_environment() -> int:
    """Joins the job the environment names (COUNT_ENV > 1) and returns the process count; 1 (nothing joined)
    when the environment names no job. Must run before any JAX computation."""
    count = int(os.environ.get(COUNT_ENV, "1") or "1")
    if count <= 1:
        return 1
    if INDEX_ENV not in os.environ and JOB_INDEX_ENV in os.environ:
        os.environ[INDEX_ENV] = os.environ[JOB_INDEX_ENV]
    if not os.environ.get(ADDRESSES_ENV) or INDEX_ENV not in os.environ:
        raise ValueError(f"{COUNT_ENV}={count} needs {ADDRESSES_ENV} (the coordinator's host:port, process 0) and "
                         f"{INDEX_ENV} or {JOB_INDEX_ENV} (this process's index, 0 to {count - 1}) in the "
                         "environment")
    import keras

    keras.distribution.initialize()
    return count


def resolve_processes(requested: int) -> int:
    """`train.processes` as the step runs it: the processes joined in this job, which must be what the config
    asks for."""
    import jax

    if not isinstance(requested, int) or requested < 1:
        raise ValueError(f"train.processes={requested!r} must be a number of processes, 1 or more")
    joined = jax.process_count()
    if joined != requested:
        raise ValueError(f"train.processes={requested}, but this train step runs in a job of {joined} process(es) "
                         f"({COUNT_ENV}={os.environ.get(COUNT_ENV, 'unset')}): start it with "
                         "trainer.jax_train.train_in_jax_process, or set the job's environment to match")
    return joined


def process_share(batches: Iterable[tuple[Any, Any]], index: int, count: int) -> Iterator[tuple[Any, Any]]:
    """Process `index`'s rows of each global (features, labels) batch: the `index`-th of `count` equal
    contiguous parts (the batch holds a multiple of `count` rows; trainer.devices.whole_batches sees to it)."""
    for features, labels in batches:
        rows = len(labels)
        if rows % count:
            raise ValueError(f"a global batch of {rows} rows cannot be split evenly across {count} processes")
        share = slice(index * rows // count, (index + 1) * rows // count)
        yield {name: values[share] for name, values in features.items()}, labels[share]


def rows_by_file(files: Sequence[str]) -> list[int] | None:
    """Each file's rows, from the samples manifest beside it (its `shards`: file and rows); None when a file
    has no such manifest entry (the files then cannot be split between processes with equal steps)."""
    from components.manifest import ManifestError, read_manifest

    shards: dict[Path, dict[str, int]] = {}
    rows = []
    for name in files:
        path = Path(name)
        if path.parent not in shards:
            try:
                manifest = read_manifest(path.parent, kind="samples", verify=False)
            except ManifestError:
                return None
            shards[path.parent] = {shard["file"]: int(shard["rows"]) for shard in manifest.get("shards", [])}
        if path.name not in shards[path.parent]:
            return None
        rows.append(shards[path.parent][path.name])
    return rows


def assign_files(rows: Sequence[int], count: int) -> list[list[int]]:
    """The file indices each of `count` processes reads: largest files first, each to the process with the
    fewest rows so far (ties: the lowest index); every process computes the same assignment."""
    if len(rows) < count:
        raise ValueError(f"{len(rows)} files cannot give each of {count} processes a file of its own")
    shares: list[list[int]] = [[] for _ in range(count)]
    totals = [0] * count
    for index in sorted(range(len(rows)), key=lambda i: (-rows[i], i)):
        process = min(range(count), key=lambda p: (totals[p], p))
        shares[process].append(index)
        totals[process] += rows[index]
    return [sorted(share) for share in shares]


def equal_steps(rows: Sequence[int], shares: Sequence[Sequence[int]], batch_size: int, workers: int) -> int:
    """Steps every process can take in an epoch on batches of `batch_size` rows of its own files, read by up to
    `workers` reader processes each: each reader drops its last partial batch, so a process whose files hold R
    rows yields at least floor(R / batch_size) - workers + 1 full batches (the least over the processes)."""
    least = min(sum(rows[i] for i in share) // batch_size for share in shares)
    return max(0, least - max(1, workers) + 1)


def split_files(files: Sequence[str], count: int, batch_size: int, workers: int
                ) -> tuple[list[str], int, int, int] | None:
    """This process's share of a global batch size `batch_size` when the files are split between `count`
    processes: (its files, its devices, its reader processes, the steps every process takes an epoch); None when
    they cannot be split (a file's rows unknown, fewer files than processes, or too few rows for a step)."""
    import jax

    rows = rows_by_file(files)
    if rows is None or len(files) < count:
        return None
    shares = assign_files(rows, count)
    workers = max(1, min([workers, *(len(share) for share in shares)]))
    steps = equal_steps(rows, shares, batch_size // count, workers)
    if steps < 1:
        return None
    local_devices = jax.local_device_count()
    return [files[i] for i in shares[jax.process_index()]], local_devices, workers, steps


def take(batches: Iterator[Any], steps: int, source: Any = None) -> Iterator[Any]:
    """The first `steps` batches of `batches`, then `batches` and `source` (the reader generator under it, whose
    reader processes stop) closed."""
    try:
        for _, batch in zip(range(steps), batches, strict=False):
            yield batch
    finally:
        for generator in (batches, source):
            close = getattr(generator, "close", None)
            if close is not None:
                close()


def gather(variables: Sequence[Any]) -> list[np.ndarray]:
    """The whole value of each variable, on every process (a collective: every process calls it, in the same
    order)."""
    from jax.experimental import multihost_utils

    return [np.asarray(multihost_utils.process_allgather(v.value, tiled=True)) for v in variables]


def first_process_decides(flag: bool) -> bool:
    """The first process's `flag`, on every process (a collective)."""
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag, dtype=np.bool_)))


class HostCopy:
    """An unsharded copy of a sharded model on the first process (`model` None on the others), built the same
    way, so its weights and optimizer variables come in the same order and shapes; `sync` gathers the sharded
    model's values into it."""

    def __init__(self, sharded: Any, copy: Any | None) -> None:
        self.sharded = sharded
        self.model = copy
        if copy is not None:
            with self.local():
                copy.optimizer.build(copy.trainable_variables)
            pairs = ((copy.weights, sharded.weights), (copy.optimizer.variables, sharded.optimizer.variables))
            for mine, theirs in pairs:
                shapes = [tuple(v.shape) for v in mine], [tuple(v.shape) for v in theirs]
                if shapes[0] != shapes[1]:
                    raise ValueError(f"the host copy's variables differ from the sharded model's: {shapes}")

    @contextlib.contextmanager
    def local(self) -> Iterator[None]:
        """Outside the sharded model's distribution: what the copy does (a save creates variables) must not be
        distributed across the processes, which the other processes would wait on forever."""
        from keras import distribution as keras_distribution

        current = keras_distribution.distribution()
        keras_distribution.set_distribution(None)
        try:
            yield
        finally:
            keras_distribution.set_distribution(current)

    def save_weights(self, trained: Any, path: Path) -> bool:
        """ProgressCheckpoint's `save_weights`: gathers `trained` (the sharded model) and saves the copy's weights
        to `path` on the first process; False on the others."""
        if trained is not self.sharded:
            raise ValueError("HostCopy.save_weights saves the sharded model it was made for")
        self.sync()
        if self.model is None:
            return False
        with self.local():
            self.model.save_weights(path)
        return True

    def sync(self) -> None:
        """Gathers the sharded model's weights and optimizer state into the copy (every process calls it)."""
        weights = gather(self.sharded.weights)
        state = gather(self.sharded.optimizer.variables)
        if self.model is None:
            return
        with self.local():
            for variable, value in zip(self.model.weights, weights, strict=True):
                variable.assign(value)
            for variable, value in zip(self.model.optimizer.variables, state, strict=True):
                variable.assign(value)
