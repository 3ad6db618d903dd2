"""Block TFRecords read and re-batched by worker processes into shared memory: the input of a GPU host
without TensorFlow (the JAX backend), where one Python thread decodes ~1.5 M rows/s and threads do not scale
(the decoder holds the GIL between small numpy calls).

Each worker runs `trainer.block_reader.block_batches` over its share of the files and writes every full batch
into a free slot of a shared-memory ring; the consumer turns a slot into a batch (`to_device`, e.g. a copy to
the GPU) and hands the slot back. Nothing is pickled but slot numbers, so the consumer's cost per batch is the
copy it asks for.

    for features, labels in parallel_block_batches(files, 65_536, num_workers=8, to_device=jax.device_put):
        ...

Workers are started with "spawn" (safe in a process whose JAX or CUDA runtime already has threads) and import
only numpy and the block reader.
"""

from __future__ import annotations

import multiprocessing
import queue
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np

from trainer.arguments import require_integer
from trainer.block_reader import Batch, block_batches, block_widths
from trainer.model_inputs import CRITEO_INPUTS, DENSE_INPUT, ModelInputs

# Row ids are below 2**31 in every table here; int32 halves the bytes copied to the device.
CATEGORICAL_DTYPE = np.int32
_DONE = -1


def _row_bytes(inputs: ModelInputs) -> int:
    """Bytes of one row in a slot: every column 4 bytes a value (float32 dense and label, int32 row ids)."""
    return 4 * (sum(block_widths(inputs).values()) + 1)


def parallel_block_batches(
    files: Sequence[str | Path],
    batch_size: int,
    num_workers: int,
    to_device: Callable[[Batch], Any] | None = None,
    shuffle: bool = True,
    seed: int = 0,
    shuffle_buffer_blocks: int = 64,
    slots_per_worker: int = 3,
    inputs: ModelInputs = CRITEO_INPUTS,
) -> Iterator[Any]:
    """Full batches of `batch_size` rows from `files` ({"dense": float32 [B, dense_dim], "categorical": int32
    [B, F], one int32 [B, max_length] per list feature}, label float32 [B], as `inputs`, the feature spec's
    model inputs, describes them), passed through `to_device` before their slot is reused.

    `to_device` must return data that no longer reads the arrays it is given (a device copy that has
    completed, or a host copy); by default the batch is copied into new numpy arrays. Worker w reads
    files[w::num_workers] (shuffled with seed + w when `shuffle`), so with one worker and shuffle=False the
    batches are those of block_batches(..., drop_remainder=True); each worker drops its own last partial
    batch. A worker's error (a corrupt file) is raised here with the worker's message.
    """
    if not files:
        raise ValueError("parallel_block_batches needs at least one file; received an empty list")
    require_integer("batch_size", batch_size)
    require_integer("num_workers", num_workers)
    require_integer("slots_per_worker", slots_per_worker)
    num_workers = min(num_workers, len(files))
    transfer = to_device or _copied
    context = multiprocessing.get_context("spawn")
    num_slots = num_workers * slots_per_worker
    memory = shared_memory.SharedMemory(create=True, size=num_slots * batch_size * _row_bytes(inputs))
    free: Any = context.Queue()
    ready: Any = context.Queue()
    for slot in range(num_slots):
        free.put(slot)
    workers = [
        context.Process(
            target=_work,
            args=(memory.name, [str(f) for f in files[w::num_workers]], batch_size, shuffle, seed + w,
                  shuffle_buffer_blocks, free, ready, inputs),
            daemon=True,
        )
        for w in range(num_workers)
    ]
    try:
        for worker in workers:
            worker.start()
        remaining = num_workers
        while remaining:
            slot, error = _next_ready(ready, workers)
            if slot == _DONE:
                if error:
                    raise RuntimeError(f"a block reader worker failed: {error}")
                remaining -= 1
                continue
            batch = transfer(_views(memory.buf, slot, batch_size, inputs))
            free.put(slot)
            yield batch
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
            worker.join()
        free.close()
        ready.close()
        memory.close()
        memory.unlink()


def _next_ready(ready: Any, workers: list) -> tuple[int, str | None]:
    """The next (slot, error) a worker reports; a worker that died without reporting (killed, out of
    memory) is an error rather than a hang."""
    while True:
        try:
            return ready.get(timeout=1.0)
        except queue.Empty:
            dead = [w for w in workers if w.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(
                    f"a block reader worker exited with code {dead[0].exitcode} without finishing its files"
                ) from None


def _views(buffer: Any, slot: int, batch_size: int, inputs: ModelInputs) -> Batch:
    offset = slot * batch_size * _row_bytes(inputs)
    features = {}
    for name, width in block_widths(inputs).items():
        features[name] = np.ndarray((batch_size, width), np.float32 if name == DENSE_INPUT else CATEGORICAL_DTYPE,
                                    buffer, offset)
        offset += features[name].nbytes
    labels = np.ndarray((batch_size,), np.float32, buffer, offset)
    return features, labels


def _copied(batch: Batch) -> Batch:
    features, labels = batch
    return {name: value.copy() for name, value in features.items()}, labels.copy()


def _work(memory_name: str, files: list[str], batch_size: int, shuffle: bool, seed: int,
          shuffle_buffer_blocks: int, free: Any, ready: Any, inputs: ModelInputs) -> None:
    memory = shared_memory.SharedMemory(name=memory_name)
    error = None
    try:
        for features, labels in block_batches(files, batch_size, shuffle=shuffle, seed=seed,
                                              shuffle_buffer_blocks=shuffle_buffer_blocks, drop_remainder=True,
                                              inputs=inputs):
            slot = free.get()
            out_features, out_labels = _views(memory.buf, slot, batch_size, inputs)
            for name, values in out_features.items():
                values[:] = features[name]
            out_labels[:] = labels
            del out_features, out_labels  # no view may outlive the mapping
            ready.put((slot, None))
    except Exception as err:  # noqa: BLE001 - reported to the consumer, which raises it
        error = f"{type(err).__name__}: {err}"
    finally:
        ready.put((_DONE, error))
        memory.close()
