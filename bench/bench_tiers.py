"""A tiered table against the same table in memory: one table of ids drawn Zipf, at least 4x the memory the
training process is allowed, trained once with its rows in a store on disk behind a hot tier
(trainer/hot_tier.py) and once whole in memory, on the same batches from the same starting weights.
Writes bench/results/tiers.json.

    make bench-tiers                               both Zipf exponents (1.05 and 0.8), about 10 minutes
    make bench-tiers BENCH_TIERS_ARGS='--zipf 1.05 --train-rows 200000'

The memory limit: the tiered run's process is started in a memory cgroup of its own (cgroup v1
`memory.limit_in_bytes`, or v2 `memory.max`) whose limit is `--memory-limit-mib` (1,024 MiB); the cgroup's
limit counts the page cache its reads and writes fill, which the kernel reclaims under it. The in-memory run
has no limit: its table fits this machine's memory, so the two train the very same table on the same data.

The model: the big table (`--table-rows`, by default 4x the limit in records of `2 x 16` float32, values and
Adagrad accumulator) read by one column, three tables of 1,000 values read by three more, and a 64-unit layer;
labels from a planted logit (a fixed effect per id). Ids: rank r ~ r^-s, scattered over the table's rows by a
multiplicative hash (popular ids do not sit together; `--layout scattered`, the default), or, with `--layout
ranked`, rank r at row r: the layout the feature state gives a table on the day its values are first admitted
(components/feature_state.py ranks them by count, the most frequent on the lowest rows), where the popular rows
share the store's pages. Per run (under `zipf_<s>`): examples per second over the training (without its first
step) by the time inside the steps (`ex_per_s`, `speed_ratio`) and by the fit's time, what happens between steps
included (`fit_ex_per_s`, `fit_speed_ratio`), step time p50 / p99 (applying the plan included), the time applying
plans, the hot tier's hit rate, the store's rows and bytes read and written, the process's read and written bytes and
system calls (/proc/self/io), peak RSS, the cgroup's peak, held-out AUC, and a minute's delta (the next 60
batches trained, then the rows they changed gathered): its rows, bytes and seconds.

The store cuts a read or write of many rows across `io_threads` threads, and the hot tier writes behind while
it reads the next loads (trainer/row_store.py, trainer/hot_tier.py); beside the tiered run, the same tiered run
with `io_threads` 1 (every request on the producer's thread, the write-behind before the reads, as before) runs
by default under the same limit (`tiered_serial_io_*`, `io_threads_speedup`; `--no-serial-io` skips it). The
tiered store is made from the uniform initializer, so it draws each row until the row is first written (format
2: no disk read for a row's first load); `--written-store` writes every row at creation instead (format 1, the
store before).

The hot tier plans and the store indexes its log in C (trainer/native/hot_tier.c); beside the tiered run, the
same run with both in numpy (as where that file does not build) runs by default under the same limit
(`tiered_numpy_*`, `native_speedup`; `--no-numpy-tier` skips it).

The store appends the rows written back to a log after the table (trainer/row_store.py, "The log"); beside the
tiered run, the same run with the rows written back in place, a page of the store dirtied per row (the store
before the log), runs by default under the same limit (`tiered_in_place_*`, `log_speedup`; `--no-in-place` skips
it).

`--train-step`: the same comparison through the pipeline's train step, `trainer.train.train_model`, as a daily
run calls it: block TFRecord files written from the generated rows, a feature spec declaring the big table
`storage: tiered` with `hot_rows` (against the same spec with it in memory), and the trainer's defaults (the
default model, DCNv2, its layers, the batch size chosen from the rows, calibration, the checkpoint) except one
epoch. Per side: examples per second as the train step measures them (trainer.train.ThroughputMeter), the step's
whole wall time (the model built and its tables made, the epoch, the held-out slice scored, calibration, the
checkpoint written), AUC on the held-out rows, peak RSS and the process's I/O. Writes
bench/results/tiers_train_step.json.

    make bench-tiers BENCH_TIERS_ARGS='--train-step'

Beside the tiered runs, where JAX is installed, the same tiered run on the JAX backend in a process without
TensorFlow (as the JAX train step runs; `tiered_jax_*`; `--no-jax` skips it): its speed and, above all, its
memory, since TensorFlow's libraries alone map about 630 MiB of file pages into a process, which its peak RSS
counts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.provenance import provenance

RESULT = Path(__file__).resolve().parent / "results" / "tiers.json"
TRAIN_STEP_RESULT = Path(__file__).resolve().parent / "results" / "tiers_train_step.json"
BLOCK_ROWS = 4096  # rows per block in the --train-step files
DIM = 16
BATCH = 1024
SMALL_TABLES = 3
SMALL_VALUES = 1000
RESERVED = 2  # the rare and the missing row, never drawn here
MINUTE_BATCHES = 60
RECORD_BYTES = 2 * DIM * 4  # a row's values and its Adagrad accumulator, float32
HASH_MULTIPLIER = 2_654_435_761  # Knuth's multiplicative hash: scatters ranks over rows
SEED = 7


def zipf_ranks(rng: np.random.Generator, count: int, num_ranks: int, exponent: float) -> np.ndarray:
    """Ranks in [0, num_ranks) with p(r) ~ (r + 1)^-exponent, by the continuous inverse CDF."""
    u = rng.random(count)
    if abs(exponent - 1.0) < 1e-9:
        ranks = np.exp(u * np.log(num_ranks + 1.0)) - 1.0
    else:
        top = (num_ranks + 1.0) ** (1.0 - exponent)
        ranks = (1.0 + u * (top - 1.0)) ** (1.0 / (1.0 - exponent)) - 1.0
    return np.minimum(ranks.astype(np.int64), num_ranks - 1)


def effect(rows: np.ndarray, salt: int) -> np.ndarray:
    """A fixed effect in [-1, 1) per row id (a hash of the id, so no table of effects is kept)."""
    x = (rows.astype(np.uint64) + np.uint64(salt)) * np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(31)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(29)
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53) * 2.0 - 1.0


def generate(path: Path, num_rows: int, table_rows: int, exponent: float, seed: int, layout: str = "scattered"
             ) -> None:
    rng = np.random.default_rng(seed)
    usable = table_rows - RESERVED
    ranks = zipf_ranks(rng, num_rows, usable, exponent)
    big = RESERVED + (ranks if layout == "ranked" else (ranks * HASH_MULTIPLIER) % usable)
    small = RESERVED + zipf_ranks(rng, num_rows * SMALL_TABLES, SMALL_VALUES, 1.0).reshape(num_rows, SMALL_TABLES)
    logit = -1.2 + 1.5 * effect(big, 1) + sum(0.5 * effect(small[:, i], 10 + i) for i in range(SMALL_TABLES))
    labels = (rng.random(num_rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    np.savez(path, ids=np.column_stack([big, small]).astype(np.int64), labels=labels)


# --- the child: one training run -------------------------------------------------------------------------------


def child(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    from components.delta import changed_rows
    from components.evaluation import roc_auc
    from trainer.hot_tier import HotTier
    from trainer.layers.categorical_embedding import CategoricalEmbedding
    from trainer.optimizers import INITIAL_ACCUMULATOR_VALUE, EmbeddingAdagrad
    from trainer.row_store import RowStore, uniform_initializer
    from trainer.tiered_training import HotTierCallback, TieredBatches

    data = np.load(args.data)
    ids, labels = data["ids"], data["labels"]
    train_rows, eval_rows = args.train_rows, args.eval_rows
    minute_rows = MINUTE_BATCHES * BATCH
    train = slice(0, train_rows)
    held_out = slice(train_rows, train_rows + eval_rows)
    minute = slice(train_rows + eval_rows, train_rows + eval_rows + minute_rows)
    tiered = args.mode == "tiered"
    initializer = uniform_initializer(DIM, SEED)
    sizes = [args.table_rows] + [SMALL_VALUES + RESERVED] * SMALL_TABLES
    started = time.perf_counter()
    anonymous = PeakAnonymousMemory()

    keras.utils.set_random_seed(SEED)
    layer = CategoricalEmbedding(sizes, DIM, tiered_tables={0: args.hot_rows} if tiered else None,
                                 name="embedding")
    inputs = keras.Input((1 + SMALL_TABLES,), dtype="int64", name="categorical")
    hidden = keras.layers.Dense(64, activation="relu", name="hidden")(keras.layers.Flatten()(layer(inputs)))
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid", name="head")(hidden))
    model.compile(optimizer=EmbeddingAdagrad(learning_rate=0.02, embedding_learning_rate=0.2),
                  loss="binary_crossentropy")
    small = initializer(0, SMALL_TABLES * (SMALL_VALUES + RESERVED))  # the same small tables in both runs
    store = None
    if tiered:
        # The initializer itself: a store that draws each row until it is first written (format 2). Called by
        # ranges through a function instead, every row is written at creation (format 1: the store before).
        store = RowStore.create(Path(args.work) / "table.rows", args.table_rows, DIM,
                                (lambda start, stop: initializer(start, stop)) if args.written_store else initializer,
                                initial_accumulator=INITIAL_ACCUMULATOR_VALUE)
        if args.io_threads:
            store.io_threads = args.io_threads
        if args.in_place_writes:
            store.log_writes = False
        layer.embeddings.assign(small)
    else:
        table = np.empty((args.table_rows + len(small), DIM), np.float32)
        for start in range(0, args.table_rows, 1 << 20):
            stop = min(args.table_rows, start + (1 << 20))
            table[start:stop] = initializer(start, stop)
        table[args.table_rows:] = small
        layer.embeddings.assign(table)
        del table
    setup_s = time.perf_counter() - started

    def source(part: slice):
        for start in range(part.start, part.stop, BATCH):
            stop = min(part.stop, start + BATCH)
            yield ids[start:stop], labels[start:stop]

    class StepTimer(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []
            self.begin = self.last_end = self.first_end = 0.0

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self.begin = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.last_end = time.perf_counter()
            self.times.append(self.last_end - self.begin)
            if len(self.times) == 1:
                self.first_end = self.last_end

    def fit(part: slice, timer: StepTimer) -> tuple[float, float]:
        """Trains one pass over `part`; (seconds of the fit, seconds applying plans)."""
        steps = -(-(part.stop - part.start) // BATCH)
        begin = time.perf_counter()
        if tiered:
            stream = TieredBatches(source(part), layer, {0: tier}, key=None)
            callback = HotTierCallback(stream)
            model.fit(iter(stream), steps_per_epoch=steps, epochs=1, callbacks=[timer, callback], verbose=0)
            return time.perf_counter() - begin, callback.apply_seconds
        model.fit(source(part), steps_per_epoch=steps, epochs=1, callbacks=[timer], verbose=0)
        return time.perf_counter() - begin, 0.0

    def predict(part: slice) -> np.ndarray:
        steps = -(-(part.stop - part.start) // BATCH)
        if tiered:
            stream = TieredBatches(((x, y) for x, y in source(part)), layer, {0: tier}, key=None, training=False)
            return model.predict(iter(stream), steps=steps, callbacks=[HotTierCallback(stream)], verbose=0)
        return model.predict(((x,) for x, _ in source(part)), steps=steps, verbose=0)

    if tiered and args.numpy_tier:  # the planner and the log index in numpy, as where hot_tier.c does not build
        store.use_numpy_index()
    tier = HotTier(store, args.hot_rows, native=not args.numpy_tier) if tiered else None
    io_before = proc_io()
    timer = StepTimer()
    train_s, apply_s = fit(train, timer)
    io_after = proc_io()
    steps = np.asarray(timer.times)
    predictions = predict(held_out).reshape(-1)
    auc = roc_auc(labels[held_out], predictions)

    # A minute: the next batches trained, then the rows they changed gathered as a delta would carry them.
    if tiered:
        # The delta's rows are the rows the minute's batches trained (the dirty rows); the time runs from the
        # minute's last step, so it holds the flush that ends the fit (every dirty slot written to the store).
        minute_timer = StepTimer()
        minute_s, _ = fit(minute, minute_timer)
        touched = np.unique(ids[minute, 0])
        values, _ = store.read(touched)
        delta_s, delta_rows = time.perf_counter() - minute_timer.last_end, len(touched)
    else:
        parent = np.array(layer.embeddings.value[:args.table_rows])
        minute_s, _ = fit(minute, StepTimer())
        begin = time.perf_counter()
        current = np.asarray(layer.embeddings.value[:args.table_rows])
        changed = changed_rows(parent, current)
        values = current[changed]
        delta_s, delta_rows = time.perf_counter() - begin, len(changed)
        del parent, current
    timed = steps[1:] if len(steps) > 1 else steps
    result = {
        "mode": args.mode,
        "io_threads": store.io_threads if store is not None else None,
        "native_tier": (type(tier.planner).__name__ == "NativePlanner") if tier is not None else None,
        "setup_s": setup_s,
        "train_rows": train_rows,
        "train_s": train_s,
        "ex_per_s": (train_rows - BATCH) / float(timed.sum()) if len(timed) else float("nan"),
        # Rows over the fit's time from the end of its first step to the end of its last, what happens between
        # steps included (the in-memory side's batches made by its generator; the tiered side's wait for the
        # next planned batch), as the train step's ThroughputMeter counts. `ex_per_s` counts only the time
        # inside the steps (and, tiered, the plan applied before each).
        "fit_ex_per_s": (train_rows - BATCH) / (timer.last_end - timer.first_end) if len(steps) > 1 else float("nan"),
        "step_p50_ms": float(np.percentile(timed, 50) * 1e3),
        "step_p99_ms": float(np.percentile(timed, 99) * 1e3),
        "apply_s_per_step": apply_s / len(steps) if len(steps) else 0.0,
        "auc": float(auc),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_anonymous_bytes": anonymous.stop(),
        "process_io": {key: io_after.get(key, 0) - io_before.get(key, 0) for key in io_after},
        "minute": {"rows": minute_rows, "train_s": minute_s, "delta_rows": int(delta_rows),
                   "delta_bytes": int(values.nbytes + delta_rows * 8), "delta_s": delta_s},
    }
    if tiered:
        counters = tier.counters
        lookups = counters.rows_hit + counters.rows_loaded
        stats = store.counters
        result.update({
            "log_writes": store.log_writes,
            "store_disk_bytes": os.stat(store.path).st_blocks * 512,
            "hot_rows": args.hot_rows,
            "hit_rate": counters.rows_hit / lookups if lookups else None,
            "tier": {key: getattr(counters, key) for key in counters.__dataclass_fields__},
            "store": {key: getattr(stats, key) for key in stats.__dataclass_fields__},
        })
    return result


# --- --train-step: the pipeline's train step --------------------------------------------------------------------


def bench_spec(table_rows: int, hot_rows: int | None) -> dict[str, Any]:
    """The feature spec of the generated rows: the big table (tiered with `hot_rows`, else in memory) and the
    small ones, ids as integers (the samples hold row ids already)."""
    big: dict[str, Any] = {"name": "big", "kind": "categorical", "dtype": "int"}
    if hot_rows:
        big.update(storage="tiered", hot_rows=hot_rows)
    return {"name": "tiers_bench", "description": f"bench-tiers --train-step: one table of {table_rows} rows",
            "source": {"format": "csv", "header": True}, "label": {"column": "clicked"},
            "features": [big, {"names": [f"small_{i}" for i in range(SMALL_TABLES)], "kind": "categorical",
                               "dtype": "int"}]}


def write_block_samples(data: Path, directory: Path, train_rows: int, eval_rows: int) -> tuple[list[str], list[str]]:
    """The generated rows as block TFRecord files, as the samples step writes them: the training rows in four
    files (four parts, as Spark would write them), the held-out rows in one."""
    from components.block_codec import encode_blocks, frame_records

    loaded = np.load(data)
    ids, labels = loaded["ids"], loaded["labels"]
    directory.mkdir(parents=True, exist_ok=True)

    def write(name: str, start: int, stop: int) -> str:
        path = directory / name
        path.write_bytes(frame_records(encode_blocks(labels[start:stop], np.zeros((stop - start, 0), np.float32),
                                                     ids[start:stop], BLOCK_ROWS)))
        return str(path)

    bounds = np.linspace(0, train_rows, 5).astype(int)
    train = [write(f"train-{i:05d}.tfrecord", int(a), int(b)) for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:],
                                                                                          strict=True))]
    return train, [write("eval-00000.tfrecord", train_rows, train_rows + eval_rows)]


def train_step_child(args: argparse.Namespace) -> dict[str, Any]:
    """One `train_model` run (the --train-step module text) on the files under `args.data`."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from components.config import load_config
    from components.evaluation import roc_auc
    from components.feature_spec import spec_from_dict
    from trainer.train import train_model

    tiered = args.mode == "train-step-tiered"
    spec = spec_from_dict(bench_spec(args.table_rows, args.hot_rows if tiered else None))
    config = load_config({"train.epochs": 1}, environ={}).train
    files = json.loads((args.data / "files.json").read_text())
    table_sizes = {"big": args.table_rows, **{f"small_{i}": SMALL_VALUES + RESERVED for i in range(SMALL_TABLES)}}
    checkpoint = Path(args.work) / f"checkpoint-{args.mode}"
    anonymous = PeakAnonymousMemory()
    io_before = proc_io()
    begin = time.perf_counter()
    trained = train_model(config, table_sizes, files["train"], files["eval"], checkpoint, spec=spec,
                          num_rows=args.train_rows)
    wall_s = time.perf_counter() - begin
    io_after = proc_io()
    result = {
        "mode": args.mode,
        "wall_s": wall_s,
        "ex_per_s": trained.examples_per_second,
        "train_rows": trained.num_train_examples,
        "batch_size": resolve_batch(config.batch_size, args.train_rows),
        "global_step": trained.global_step,
        "model": config.model,
        "auc": float(roc_auc(trained.eval_labels, trained.eval_predictions)),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_anonymous_bytes": anonymous.stop(),
        "process_io": {key: io_after.get(key, 0) - io_before.get(key, 0) for key in io_after},
        "checkpoint_disk_bytes": sum(path.stat().st_blocks * 512 for path in checkpoint.rglob("*") if path.is_file()),
    }
    if tiered:
        counters = trained.tiered_tables["big"]
        lookups = counters["tier_rows_hit"] + counters["tier_rows_loaded"]
        result.update({"hot_rows": args.hot_rows, "hit_rate": counters["tier_rows_hit"] / lookups if lookups else None,
                       "tiered_tables": trained.tiered_tables})
    return result


def resolve_batch(batch_size: int, num_rows: int) -> int:
    from trainer.arguments import resolve_batch_size

    return resolve_batch_size(batch_size, num_rows)


class PeakAnonymousMemory:
    """The process's peak anonymous memory (resident, not backed by a file: RSS less its file and shared pages),
    sampled every 50 ms on a thread of its own. The peak RSS beside it also counts the pages of mapped files
    (TensorFlow's libraries, several hundred MiB), which the page cache may hold for other processes too."""

    def __init__(self) -> None:
        import psutil

        self.process = psutil.Process()
        self.peak = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.sample, name="peak-anonymous-memory", daemon=True)
        self.thread.start()

    def sample(self) -> None:
        while True:
            info = self.process.memory_info()
            self.peak = max(self.peak, info.rss - info.shared)
            if self.stopped.wait(0.05):
                return

    def stop(self) -> int:
        self.stopped.set()
        self.thread.join()
        return self.peak


def proc_io() -> dict[str, int]:
    """/proc/self/io: bytes the process read and wrote (rchar, wchar), those that reached the disk (read_bytes,
    write_bytes) and its read and write calls (syscr, syscw)."""
    try:
        lines = Path("/proc/self/io").read_text().splitlines()
    except OSError:
        return {}
    return {key: int(value) for key, value in (line.split(": ") for line in lines)}


# --- the parent: data, the cgroup, the runs --------------------------------------------------------------------


class MemoryCgroup:
    """A memory cgroup of its own for the tiered run's process: v1 (memory.limit_in_bytes) or v2 (memory.max)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        unified = Path("/sys/fs/cgroup/cgroup.controllers").exists()
        if unified:
            own = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                       if line.startswith("0::"))
            base = Path("/sys/fs/cgroup") / own.lstrip("/")
            self.limit_file, self.peak_file, self.kind = "memory.max", "memory.peak", "cgroup v2 memory.max"
        else:
            own = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                       if line.split(":")[1] == "memory")
            base = Path("/sys/fs/cgroup/memory") / own.lstrip("/")
            self.limit_file, self.peak_file = "memory.limit_in_bytes", "memory.max_usage_in_bytes"
            self.kind = "cgroup v1 memory.limit_in_bytes"
        self.path = base / f"ctr-bench-tiers-{os.getpid()}"
        try:
            self.path.mkdir()
            (self.path / self.limit_file).write_text(str(limit_bytes))
        except OSError as error:
            raise SystemExit(f"cannot make a memory cgroup at {self.path} ({error}); run as root on a host with a "
                             "writable cgroup memory controller, or pass --no-memory-limit (the result then says "
                             "no limit was applied)") from None

    def enter(self) -> None:
        """In the child, before it execs: join the cgroup."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int | None:
        try:
            return int((self.path / self.peak_file).read_text())
        except (OSError, ValueError):
            return None

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


def run_child(args: argparse.Namespace, mode: str, data: Path, work: Path,
              cgroup: MemoryCgroup | None, io_threads: int | None = None, in_place: bool = False,
              backend: str = "tensorflow", numpy_tier: bool = False) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", mode, "--data", str(data), "--work", str(work),
               "--table-rows", str(args.table_rows), "--hot-rows", str(args.hot_rows),
               "--train-rows", str(args.train_rows), "--eval-rows", str(args.eval_rows),
               "--io-threads", str(io_threads if io_threads is not None else args.io_threads),
               "--backend", backend]
    if args.written_store:
        command.append("--written-store")
    if in_place:
        command.append("--in-place-writes")
    if numpy_tier:
        command.append("--numpy-tier")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    print(f"[bench-tiers] {mode}: {' '.join(command[2:])}", flush=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True,
                          preexec_fn=cgroup.enter if cgroup is not None else None, timeout=3600)
    if done.returncode != 0:
        killed = " (killed: over the memory limit?)" if done.returncode in (-9, 137) else ""
        raise SystemExit(f"the {mode} run failed with status {done.returncode}{killed}:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if cgroup is not None:
        result["cgroup_peak_bytes"] = cgroup.peak_bytes()
    steps = (f"step p50 {result['step_p50_ms']:.1f} ms" if "step_p50_ms" in result
             else f"{result['wall_s']:.0f} s in all")
    label = mode + (" on JAX" if backend == "jax" else "") + (" (numpy planner and log index)" if numpy_tier else "")
    print(f"[bench-tiers] {label}: {result['ex_per_s']:.0f} ex/s, {steps}, "
          f"AUC {result['auc']:.4f}, peak RSS {result['peak_rss_bytes'] / 2**20:.0f} MiB (anonymous "
          f"{result['peak_anonymous_bytes'] / 2**20:.0f} MiB)", flush=True)
    return result


def run_tiered(args: argparse.Namespace, data: Path, work: Path, result: dict[str, Any],
               io_threads: int | None = None, in_place: bool = False, mode: str = "tiered",
               backend: str = "tensorflow", numpy_tier: bool = False) -> dict[str, Any]:
    """The tiered run in a memory cgroup of its own (so that its peak is its own); its store is removed after."""
    cgroup = None if args.no_memory_limit else MemoryCgroup(args.memory_limit_mib * 2**20)
    if cgroup is not None:
        result["memory_limit"] = cgroup.kind
    try:
        return run_child(args, mode, data, work, cgroup, io_threads, in_place, backend, numpy_tier)
    finally:
        if cgroup is not None:
            cgroup.remove()
        (work / "table.rows").unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--zipf", type=float, action="append", help="Zipf exponents (default 1.05 and 0.8)")
    parser.add_argument("--memory-limit-mib", type=int, default=1024)
    parser.add_argument("--no-memory-limit", action="store_true")
    parser.add_argument("--table-rows", type=int, default=0, help="default: 4x the limit in records")
    parser.add_argument("--hot-rows", type=int, default=131_072)
    parser.add_argument("--train-rows", type=int, default=1_000_000)
    parser.add_argument("--eval-rows", type=int, default=100_000)
    parser.add_argument("--layout", choices=("scattered", "ranked"), default="scattered",
                        help="where the popular ids sit in the table (see above)")
    parser.add_argument("--io-threads", type=int, default=0,
                        help="the store's io_threads in the tiered run (default: the store's own default)")
    parser.add_argument("--no-serial-io", action="store_true",
                        help="skip the tiered run with io_threads 1 (every store request on one thread, as "
                             "before the store cut its reads across threads) that runs beside it by default")
    parser.add_argument("--no-in-place", action="store_true",
                        help="skip the tiered run that writes rows back in place instead of to the store's log")
    parser.add_argument("--in-place-writes", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-numpy-tier", action="store_true",
                        help="skip the tiered run with the hot tier's planner and the store's log index in numpy "
                             "(as where trainer/native/hot_tier.c does not build) that runs beside it by default")
    parser.add_argument("--numpy-tier", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--written-store", action="store_true",
                        help="write every row of the tiered run's store at creation (format 1) instead of drawing "
                             "rows until first written (format 2, the default for a new table)")
    parser.add_argument("--no-jax", action="store_true",
                        help="skip the tiered run on the JAX backend (a process without TensorFlow, as the JAX "
                             "train step runs) that runs beside it by default where JAX is installed")
    parser.add_argument("--backend", choices=("tensorflow", "jax"), default="tensorflow", help=argparse.SUPPRESS)
    parser.add_argument("--train-step", action="store_true",
                        help="through the pipeline's train step (trainer.train.train_model) with the trainer's "
                             "defaults and one epoch; writes bench/results/tiers_train_step.json")
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/tiers.json, or "
                        "tiers_train_step.json with --train-step")
    parser.add_argument("--child", choices=("tiered", "memory", "train-step-tiered", "train-step-memory"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    limit = args.memory_limit_mib * 2**20
    if not args.table_rows:
        args.table_rows = -(-4 * limit // RECORD_BYTES)
    if args.out is None:
        args.out = TRAIN_STEP_RESULT if args.train_step else RESULT
    if args.child:
        if args.backend == "jax":  # as trainer/jax_train.py's child: Keras on JAX, TensorFlow never imported
            os.environ["KERAS_BACKEND"] = "jax"
            sys.modules.setdefault("tensorflow", None)  # type: ignore[arg-type]
        args.mode = args.child
        print(json.dumps(train_step_child(args) if args.child.startswith("train-step") else child(args)))
        return
    if args.train_step:
        train_step_main(args, limit)
        return
    command = "make bench-tiers" + (f" BENCH_TIERS_ARGS='{' '.join(sys.argv[1:])}'" if sys.argv[1:] else "")
    result: dict[str, Any] = {
        **run_settings(args, limit, command),
        "embedding_dim": DIM,
        "batch_size": BATCH,
        "store": "written at creation (format 1)" if args.written_store else "rows drawn until first written "
                 "(format 2)",
    }
    for exponent in args.zipf or [1.05, 0.8]:
        with tempfile.TemporaryDirectory(prefix="bench-tiers-") as scratch:
            work = Path(scratch)
            data = work / "data.npz"
            generate(data, args.train_rows + args.eval_rows + MINUTE_BATCHES * BATCH, args.table_rows, exponent,
                     SEED, args.layout)

            tiered = run_tiered(args, data, work, result)
            serial = None if args.no_serial_io else run_tiered(args, data, work, result, io_threads=1)
            in_place = None if args.no_in_place else run_tiered(args, data, work, result, in_place=True)
            numpy_run = None if args.no_numpy_tier else run_tiered(args, data, work, result, numpy_tier=True)
            jax = None if args.no_jax or importlib.util.find_spec("jax") is None else run_tiered(
                args, data, work, result, backend="jax")
            memory = run_child(args, "memory", data, work, None)
        result[f"zipf_{exponent}"] = {
            **goal_figures(tiered, memory, result),
            # The same over the fit's time between steps included (`fit_ex_per_s`); `speed_ratio` as before.
            "fit_speed_ratio": tiered["fit_ex_per_s"] / memory["fit_ex_per_s"],
            "delta_s_ratio": tiered["minute"]["delta_s"] / memory["minute"]["delta_s"],
            "tiered_io_threads": tiered["io_threads"],
            **({} if serial is None else {
                "tiered_serial_io_ex_per_s": serial["ex_per_s"],
                "serial_io_speed_ratio": serial["ex_per_s"] / memory["ex_per_s"],
                "tiered_serial_io_auc": serial["auc"],
                "io_threads_speedup": tiered["ex_per_s"] / serial["ex_per_s"],
                "serial_io_delta_s_ratio": serial["minute"]["delta_s"] / memory["minute"]["delta_s"],
            }),
            **({} if in_place is None else {
                "tiered_in_place_ex_per_s": in_place["ex_per_s"],
                "in_place_speed_ratio": in_place["ex_per_s"] / memory["ex_per_s"],
                "tiered_in_place_auc": in_place["auc"],
                "log_speedup": tiered["ex_per_s"] / in_place["ex_per_s"],
                "in_place_delta_s_ratio": in_place["minute"]["delta_s"] / memory["minute"]["delta_s"],
            }),
            **({} if numpy_run is None else {
                "tiered_numpy_ex_per_s": numpy_run["ex_per_s"],
                "numpy_speed_ratio": numpy_run["ex_per_s"] / memory["ex_per_s"],
                "tiered_numpy_auc": numpy_run["auc"],
                "native_speedup": tiered["ex_per_s"] / numpy_run["ex_per_s"],
            }),
            # The tiered run on JAX (no TensorFlow in the process): its own speed and memory; the speed ratio
            # above is TensorFlow's, against TensorFlow in memory.
            **({} if jax is None else {
                "tiered_jax_ex_per_s": jax["ex_per_s"],
                "tiered_jax_auc": jax["auc"],
                "tiered_jax_peak_rss_bytes": jax["peak_rss_bytes"],
                "tiered_jax_peak_anonymous_bytes": jax["peak_anonymous_bytes"],
                "tiered_jax_cgroup_peak_bytes": jax.get("cgroup_peak_bytes"),
            }),
            "tiered": tiered,
            **({} if jax is None else {"tiered_jax": jax}),
            **({} if serial is None else {"tiered_serial_io": serial}),
            **({} if in_place is None else {"tiered_in_place": in_place}),
            **({} if numpy_run is None else {"tiered_numpy": numpy_run}),
            "memory": memory,
        }
        print(json.dumps({k: v for k, v in result[f"zipf_{exponent}"].items() if not isinstance(v, dict)}),
              flush=True)
    result["goals"] = {
        "speed_ratio_at_1.05": ">= 0.5", "auc_difference_at_1.05": "<= 0.001",
        "peak_rss_under_limit": True, "minute_delta_cost": "tiered <= in memory",
    }
    result = {**provenance(command), **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"[bench-tiers] wrote {args.out}")


def run_settings(args: argparse.Namespace, limit: int, command: str) -> dict[str, Any]:
    """A result's settings, as both modes write them."""
    return {
        "command": command,
        "memory_limit_bytes": None if args.no_memory_limit else limit,
        "memory_limit": "none" if args.no_memory_limit else None,
        "table_rows": args.table_rows,
        "table_bytes": args.table_rows * RECORD_BYTES,
        "hot_rows": args.hot_rows,
        "layout": args.layout,
    }


def goal_figures(tiered: dict[str, Any], memory: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """The keys the issue's goals name, from a tiered and an in-memory run."""
    return {
        "tiered_ex_per_s": tiered["ex_per_s"],
        "memory_ex_per_s": memory["ex_per_s"],
        "speed_ratio": tiered["ex_per_s"] / memory["ex_per_s"],
        "tiered_auc": tiered["auc"],
        "memory_auc": memory["auc"],
        "peak_rss_bytes": tiered["peak_rss_bytes"],
        "peak_anonymous_bytes": tiered["peak_anonymous_bytes"],
        "memory_limit_bytes": result["memory_limit_bytes"],
        "table_bytes": result["table_bytes"],
        "hit_rate": tiered["hit_rate"],
    }


def train_step_main(args: argparse.Namespace, limit: int) -> None:
    """--train-step: per Zipf exponent, the tiered train step under the memory limit and the in-memory one."""
    command = "make bench-tiers BENCH_TIERS_ARGS='" + " ".join(sys.argv[1:]) + "'"
    result: dict[str, Any] = {
        **run_settings(args, limit, command),
        "through": "trainer.train.train_model, the trainer's defaults, train.epochs=1",
    }
    for exponent in args.zipf or [1.05, 0.8]:
        with tempfile.TemporaryDirectory(prefix="bench-tiers-") as scratch:
            work = Path(scratch)
            generate(work / "data.npz", args.train_rows + args.eval_rows, args.table_rows, exponent, SEED,
                     args.layout)
            train, held_out = write_block_samples(work / "data.npz", work, args.train_rows, args.eval_rows)
            (work / "files.json").write_text(json.dumps({"train": train, "eval": held_out}))
            tiered = run_tiered(args, work, work, result, mode="train-step-tiered")
            shutil.rmtree(work / "checkpoint-train-step-tiered", ignore_errors=True)
            memory = run_child(args, "train-step-memory", work, work, None)
        result[f"zipf_{exponent}"] = {
            **goal_figures(tiered, memory, result),
            "tiered_wall_s": tiered["wall_s"],
            "memory_wall_s": memory["wall_s"],
            "wall_ratio": memory["wall_s"] / tiered["wall_s"],
            "tiered": tiered,
            "memory": memory,
        }
        print(json.dumps({k: v for k, v in result[f"zipf_{exponent}"].items() if not isinstance(v, dict)}),
              flush=True)
    result["goals"] = {"speed_ratio_at_1.05": ">= 0.5", "auc_difference_at_1.05": "<= 0.001",
                       "peak_rss_under_limit": True}
    result = {**provenance(command), **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"[bench-tiers] wrote {args.out}")


if __name__ == "__main__":
    main()
