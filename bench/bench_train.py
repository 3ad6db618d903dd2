"""Training speed: DCNv2-small (26 tables, dim 16, 3 cross layers, MLP 512-256-128) trained by
`trainer.train.train_model` from block TFRecords, with a small vocabulary and with >= 40 M embedding
parameters, XLA on and off, in the same run. Writes bench/results/train.json.

    make bench-train

ex/s is train_model's own measure: training rows per second over the epoch, without the first step (tracing
and compilation) and without validation. Every run's speed flags (TrainResult.speed_flags) are recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

from bench.provenance import provenance
from components.config import TrainConfig
from components.schema import CATEGORICAL_FEATURES, NUM_RESERVED_ROWS
from tests.trainer.synthetic import random_rows, write_block_files

NUM_TRAIN_ROWS = 2048 * 64
NUM_FILES = 4
BLOCK_ROWS = 1024
SMALL_VOCAB = 10_000  # values per feature: 26 x 10,002 x 16 = 4.2 M embedding parameters
LARGE_VOCAB = 100_000  # 26 x 100,002 x 16 = 41.6 M embedding parameters
DCNV2_SMALL = TrainConfig(
    embedding_dim=16, num_cross_layers=3, mlp_units=(512, 256, 128), batch_size=2048, epochs=1,
    cross_projection_dim=0,  # full-rank cross layers, as in this bench's earlier results
    jit_compile=False, mixed_precision=True, micro_batches=1, row_sparse_updates=True,
)
# name -> (config, values per feature). XLA on and off under the best other flags, float32 beside bfloat16,
# and the large vocabulary with dense embedding updates, to show what the row-sparse path saves.
VARIANTS: dict[str, tuple[TrainConfig, int]] = {
    "small": (DCNV2_SMALL, SMALL_VOCAB),
    "small_xla": (dataclasses.replace(DCNV2_SMALL, jit_compile=True), SMALL_VOCAB),
    "small_float32": (dataclasses.replace(DCNV2_SMALL, mixed_precision=False), SMALL_VOCAB),
    "large": (DCNV2_SMALL, LARGE_VOCAB),
    "large_xla": (dataclasses.replace(DCNV2_SMALL, jit_compile=True), LARGE_VOCAB),
    "large_dense_updates": (dataclasses.replace(DCNV2_SMALL, row_sparse_updates=False), LARGE_VOCAB),
}


def embedding_parameters(num_values: int, config: TrainConfig) -> int:
    return len(CATEGORICAL_FEATURES) * (num_values + NUM_RESERVED_ROWS) * config.embedding_dim


def write_data(num_values: int, directory: Path) -> tuple[list[str], list[str]]:
    rows = random_rows(NUM_TRAIN_ROWS, num_values, seed=1)
    train_files = write_block_files(rows, directory / "train", NUM_FILES, BLOCK_ROWS)
    eval_files = write_block_files(rows.slice(0, BLOCK_ROWS), directory / "eval", 1, BLOCK_ROWS)
    return train_files, eval_files


def run(name: str, config: TrainConfig, num_values: int, files: tuple[list[str], list[str]], directory: Path) -> dict:
    from trainer.train import train_model

    sizes = {feature: num_values + NUM_RESERVED_ROWS for feature in CATEGORICAL_FEATURES}
    started = time.perf_counter()
    result = train_model(config, sizes, *files, directory / f"{name}-checkpoint")
    entry = {
        "name": name,
        "ex_per_s": result.examples_per_second,
        "embedding_parameters": embedding_parameters(num_values, config),
        "flags": result.speed_flags,
        "train_rows": result.num_train_examples,
        "wall_s": time.perf_counter() - started,
    }
    print(json.dumps(entry), flush=True)
    return entry


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="run only these named variants (default: all)")
    args = parser.parse_args()
    chosen = args.only or list(VARIANTS)
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; expected some of {sorted(VARIANTS)}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        data: dict[int, tuple[list[str], list[str]]] = {}
        for name in chosen:
            config, num_values = VARIANTS[name]
            if num_values not in data:
                data[num_values] = write_data(num_values, Path(tmp) / f"data-{num_values}")
            runs.append(run(name, config, num_values, data[num_values], Path(tmp)))
    by_name = {entry["name"]: entry for entry in runs}
    small = [by_name[n] for n in ("small", "small_xla", "small_float32") if n in by_name]
    large = [by_name[n] for n in ("large", "large_xla") if n in by_name]
    result: dict[str, object] = {}
    if small:
        best = max(small, key=lambda entry: entry["ex_per_s"])
        result.update(ex_per_s=best["ex_per_s"], flags=best["flags"])
    if large:
        best = max(large, key=lambda entry: entry["ex_per_s"])
        result.update(
            ex_per_s_large_vocab=best["ex_per_s"], flags_large_vocab=best["flags"],
            embedding_parameters_large_vocab=best["embedding_parameters"],
        )
    result.update(
        {
            "runs": runs,
            "model": "DCNv2-small: 26 tables, dim 16, 3 cross layers, MLP 512-256-128",
            "train_rows": NUM_TRAIN_ROWS, "files": NUM_FILES, "block_rows": BLOCK_ROWS,
            "note": "ex_per_s / ex_per_s_large_vocab: the fastest run of that vocabulary with row-sparse "
                    "updates (its flags beside it; every run in runs); one epoch each, train_model's measure (no "
                    "first step, no validation); 2 shared CPU cores, so compare runs of the same invocation",
            "machine": platform.machine(), "python": sys.version.split()[0], "command": "make bench-train",
        }
    )
    result = {**provenance(result["command"]), **result}
    out = Path(__file__).parent / "results" / "train.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
