"""Where a tiered table's step time goes: the same small model and Zipf ids as bench-tiers, in one process, its
variants alternated round by round on fresh batches of the same stream. Writes bench/results/tier_step.json.

    make bench-tier-step                       ~3 minutes
    make bench-tier-step BENCH_TIER_STEP_ARGS='--rounds 5 --steps 500'

bench-tiers finds the tiered step at about half the in-memory step's speed at s = 1.05, the gap inside the step
(docs/tiers.md). Its candidates: the second variable a tiered layer reads and updates (the hot slots beside the
in-memory tables), or the hot tier's own work, planning and reading the next batch on a producer thread
(trainer/hot_tier.py `prepare`) and applying the plan between steps (`apply`). The variants:

- `memory`: the table in memory (CategoricalEmbedding, one variable of every row);
- `slots`: the tiered layer (its HotTable of `--hot-rows` slots beside the small tables' variable) fed slot ids
  directly, no tier and no producer: what the second variable costs;
- `one_variable`: one in-memory variable of `--hot-rows` rows plus the small tables fed the same slot ids: a
  layer whose hot slots shared the small tables' variable;
- `tiered`: through TieredBatches and a HotTier over a RowStore of `--table-rows` rows (its defaults: I/O
  threads, the log), as bench-tiers' tiered run, without a memory limit;
- `tiered_io_1`: the same with the store's `io_threads` at 1 (writes and reads on the producer's thread);
- `tiered_numpy`: `tiered` with the hot tier's planner and the store's log index in numpy (HotTier(native=False),
  RowStore.use_numpy_index), as on a host where trainer/native/hot_tier.c does not build: a model, store and
  tier of its own.

Per variant and round (`--steps` steps of 1,024 rows; the first step of each fit left out): step time p50 and
mean by a callback around each step (the plan applied inside it, as bench-tiers counts), the process's CPU time
per step and that of the training thread and TensorFlow's compute threads (psutil's per-thread times, the
names from /proc/self/task), and, tiered, the producer's CPU time in `prepare` (its thread's clock) and the time
applying plans per step. The first round
warms every variant up (the hot tier fills, functions are traced) and is reported apart (`warm_up`); the figures
are the ranges over the other rounds, and each variant's p50 over `memory`'s in the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_tiers import (
    BATCH,
    DIM,
    HASH_MULTIPLIER,
    RESERVED,
    SEED,
    SMALL_TABLES,
    SMALL_VALUES,
    effect,
    zipf_ranks,
)
from bench.provenance import provenance

RESULT = Path(__file__).resolve().parent / "results" / "tier_step.json"
VARIANTS = ("memory", "slots", "one_variable", "tiered", "tiered_io_1", "tiered_numpy")


def thread_times() -> dict[int, tuple[str, float]]:
    """Per thread of this process: its name (comm) and CPU seconds (user + system, psutil)."""
    import psutil

    out = {}
    for thread in psutil.Process().threads():
        try:
            name = Path(f"/proc/self/task/{thread.id}/comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        out[thread.id] = (name, thread.user_time + thread.system_time)
    return out


def thread_seconds(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds between two `thread_times`, as the training thread's, TensorFlow's compute threads' and the
    rest's (a thread that ended between the two is not counted)."""
    main = threading.main_thread().native_id
    out = {"training_thread": 0.0, "tf_compute": 0.0, "other": 0.0}
    for tid, (name, seconds) in after.items():
        spent = seconds - before.get(tid, (name, 0.0))[1]
        group = "training_thread" if tid == main else "tf_compute" if name.startswith("tf_Compute") else "other"
        out[group] += spent
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table-rows", type=int, default=2_000_000)
    parser.add_argument("--hot-rows", type=int, default=131_072)
    parser.add_argument("--zipf", type=float, default=1.05)
    parser.add_argument("--steps", type=int, default=300, help="steps of each fit")
    parser.add_argument("--rounds", type=int, default=3, help="rounds measured, after one that warms up")
    parser.add_argument("--out", default=str(RESULT))
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    from trainer.hot_tier import HotTier
    from trainer.layers.categorical_embedding import CategoricalEmbedding
    from trainer.optimizers import INITIAL_ACCUMULATOR_VALUE, EmbeddingAdagrad
    from trainer.row_store import RowStore, uniform_initializer
    from trainer.tiered_training import HotTierCallback, TieredBatches

    class TimedTier(HotTier):
        """A HotTier that counts the CPU time of `prepare` on the thread that calls it (the producer's)."""

        prepare_seconds = 0.0

        def prepare(self, row_ids: np.ndarray, training: bool = True) -> Any:
            start = time.thread_time()
            try:
                return super().prepare(row_ids, training)
            finally:
                self.prepare_seconds += time.thread_time() - start

    class StepTimer(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []
            self.begin = 0.0

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self.begin = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.times.append(time.perf_counter() - self.begin)

    fits = (args.rounds + 1) * len(VARIANTS)
    num_rows = fits * args.steps * BATCH
    rng = np.random.default_rng(SEED)
    usable = args.table_rows - RESERVED
    big = RESERVED + (zipf_ranks(rng, num_rows, usable, args.zipf) * HASH_MULTIPLIER) % usable
    small = RESERVED + zipf_ranks(rng, num_rows * SMALL_TABLES, SMALL_VALUES, 1.0).reshape(num_rows, SMALL_TABLES)
    ids = np.column_stack([big, small]).astype(np.int64)
    logit = -1.2 + 1.5 * effect(big, 1) + sum(0.5 * effect(small[:, i], 10 + i) for i in range(SMALL_TABLES))
    labels = (rng.random(num_rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    slot_ids = big % args.hot_rows  # the slot-fed variants: a fixed map of the ids, the same repeats

    def model_of(layer: CategoricalEmbedding) -> keras.Model:
        inputs = keras.Input((1 + SMALL_TABLES,), dtype="int64", name="categorical")
        hidden = keras.layers.Dense(64, activation="relu", name="hidden")(keras.layers.Flatten()(layer(inputs)))
        model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid", name="head")(hidden))
        model.compile(optimizer=EmbeddingAdagrad(learning_rate=0.02, embedding_learning_rate=0.2),
                      loss="binary_crossentropy")
        return model

    keras.utils.set_random_seed(SEED)
    sizes = [args.table_rows] + [SMALL_VALUES + RESERVED] * SMALL_TABLES
    layers = {
        "memory": CategoricalEmbedding(sizes, DIM, name="embedding"),
        "slots": CategoricalEmbedding(sizes, DIM, tiered_tables={0: args.hot_rows}, name="embedding"),
        "one_variable": CategoricalEmbedding([args.hot_rows] + sizes[1:], DIM, name="embedding"),
        "tiered": CategoricalEmbedding(sizes, DIM, tiered_tables={0: args.hot_rows}, name="embedding"),
        "tiered_numpy": CategoricalEmbedding(sizes, DIM, tiered_tables={0: args.hot_rows}, name="embedding"),
    }
    models = {name: model_of(layer) for name, layer in layers.items()}
    work = Path(tempfile.mkdtemp(prefix="bench-tier-step-"))
    store = RowStore.create(work / "table.rows", args.table_rows, DIM, uniform_initializer(DIM, SEED),
                            initial_accumulator=INITIAL_ACCUMULATOR_VALUE)
    default_io_threads = store.io_threads
    tier = TimedTier(store, args.hot_rows)
    numpy_store = RowStore.create(work / "numpy.rows", args.table_rows, DIM, uniform_initializer(DIM, SEED),
                                  initial_accumulator=INITIAL_ACCUMULATOR_VALUE)
    numpy_store.use_numpy_index()
    numpy_tier = TimedTier(numpy_store, args.hot_rows, native=False)

    def source(start: int, slots: bool):
        for begin in range(start, start + args.steps * BATCH, BATCH):
            batch = ids[begin:begin + BATCH]
            if slots:
                batch = batch.copy()
                batch[:, 0] = slot_ids[begin:begin + BATCH]
            yield batch, labels[begin:begin + BATCH]

    def fit(variant: str, start: int) -> dict[str, Any]:
        timer = StepTimer()
        cpu, threads = time.process_time(), thread_times()
        applied = prepared = None
        if variant.startswith("tiered"):
            store.io_threads = 1 if variant == "tiered_io_1" else default_io_threads
            model, variant_tier = ("tiered_numpy", numpy_tier) if variant == "tiered_numpy" else ("tiered", tier)
            before = variant_tier.prepare_seconds
            stream = TieredBatches(source(start, slots=False), layers[model], {0: variant_tier}, key=None)
            callback = HotTierCallback(stream)
            models[model].fit(iter(stream), steps_per_epoch=args.steps, epochs=1, callbacks=[timer, callback],
                              verbose=0)
            applied, prepared = callback.apply_seconds, variant_tier.prepare_seconds - before
        else:
            models[variant].fit(source(start, slots=variant != "memory"), steps_per_epoch=args.steps, epochs=1,
                                callbacks=[timer], verbose=0)
        cpu = time.process_time() - cpu
        by_thread = thread_seconds(threads, thread_times())
        steps = np.asarray(timer.times[1:]) * 1e3
        out = {"step_p50_ms": float(np.median(steps)), "step_mean_ms": float(steps.mean()),
               "cpu_ms_per_step": cpu * 1e3 / args.steps,
               **{f"{group}_cpu_ms_per_step": seconds * 1e3 / args.steps for group, seconds in by_thread.items()}}
        if applied is not None:
            out.update(apply_ms_per_step=applied * 1e3 / args.steps,
                       prepare_cpu_ms_per_step=prepared * 1e3 / args.steps)
        return out

    rounds: list[dict[str, Any]] = []
    started = time.perf_counter()
    for index in range(args.rounds + 1):
        measured = {}
        for position, variant in enumerate(VARIANTS):
            measured[variant] = fit(variant, (index * len(VARIANTS) + position) * args.steps * BATCH)
        for variant in VARIANTS:
            measured[variant]["p50_over_memory"] = measured[variant]["step_p50_ms"] / measured["memory"]["step_p50_ms"]
        rounds.append(measured)
        print(f"round {index}{' (warm-up)' if index == 0 else ''}: " + ", ".join(
            f"{variant} p50 {measured[variant]['step_p50_ms']:.2f} ms" for variant in VARIANTS), flush=True)
    counters = tier.counters
    lookups = counters.rows_hit + counters.rows_loaded
    numpy_counters = numpy_tier.counters
    ranges = {variant: {key: [min(r[variant][key] for r in rounds[1:]), max(r[variant][key] for r in rounds[1:])]
                        for key in rounds[1][variant]} for variant in VARIANTS}
    command = "make bench-tier-step" + (f" BENCH_TIER_STEP_ARGS='{os.environ['BENCH_TIER_STEP_ARGS']}'"
                                        if os.environ.get("BENCH_TIER_STEP_ARGS") else "")
    result = {
        **provenance(command),
        "benchmark": "tier_step",
        "settings": {"table_rows": args.table_rows, "hot_rows": args.hot_rows, "zipf": args.zipf,
                     "steps": args.steps, "rounds": args.rounds, "batch": BATCH,
                     "io_threads_default": default_io_threads, "cpu_count": os.cpu_count(),
                     "python": sys.version.split()[0]},
        "ranges": ranges,
        "hit_rate": counters.rows_hit / lookups if lookups else None,
        "native_planner": type(tier.planner).__name__ == "NativePlanner",
        "numpy_hit_rate": (numpy_counters.rows_hit / (numpy_counters.rows_hit + numpy_counters.rows_loaded)
                           if numpy_counters.plans_made else None),
        "warm_up": rounds[0],
        "rounds": rounds[1:],
        "seconds": time.perf_counter() - started,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({variant: {"step_p50_ms": ranges[variant]["step_p50_ms"],
                                "p50_over_memory": ranges[variant]["p50_over_memory"]} for variant in VARIANTS}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
