"""Block TFRecord encoding speed: the project's deterministic encoder against tfx-bsl's generic encoder on the
same rows, in the same run. Writes bench/results/block_encode.json.

    make bench-encode
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from bench.provenance import provenance
from components.block_codec import encode_blocks, frame_records
from components.schema import DENSE_INPUT_DIM, NUM_CATEGORICAL

NUM_ROWS = 262_144
BLOCK_ROWS = 1024
REPEATS = 5


def tfx_bsl_encode(labels, dense, categorical, block_rows):
    from tfx_bsl.coders.example_coder import RecordBatchToExamplesEncoder

    n = len(labels)
    starts = np.arange(0, n, block_rows)
    sizes = np.diff(np.append(starts, n))

    def packed(values, width, value_type):
        offsets = pa.array(np.append(starts, n) * width, pa.int32())
        return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1), value_type))

    batch = pa.RecordBatch.from_arrays(
        [pa.ListArray.from_arrays(pa.array(np.arange(len(sizes) + 1), pa.int32()), pa.array(sizes, pa.int64())),
         packed(labels, 1, pa.float32()), packed(dense, DENSE_INPUT_DIM, pa.float32()),
         packed(categorical, NUM_CATEGORICAL, pa.int64())],
        names=["num_rows", "label", "dense", "categorical"],
    )
    return RecordBatchToExamplesEncoder().encode(batch)


def best_rows_per_second(fn) -> float:
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        frame_records(fn())
        times.append(time.perf_counter() - started)
    return NUM_ROWS / min(times)


def main() -> int:
    rng = np.random.default_rng(0)
    labels = (rng.random(NUM_ROWS) < 0.2).astype(np.float32)
    dense = rng.normal(size=(NUM_ROWS, DENSE_INPUT_DIM)).astype(np.float32)
    categorical = rng.zipf(1.2, size=(NUM_ROWS, NUM_CATEGORICAL)).clip(max=1 << 20).astype(np.int64)
    ours = best_rows_per_second(lambda: encode_blocks(labels, dense, categorical, BLOCK_ROWS))
    reference = best_rows_per_second(lambda: tfx_bsl_encode(labels, dense, categorical, BLOCK_ROWS))
    result = {
        "rows": NUM_ROWS, "block_rows": BLOCK_ROWS, "repeats": REPEATS,
        "rows_per_s": ours, "tfx_bsl_rows_per_s": reference, "ratio": ours / reference,
        "note": "best of repeats, encode + TFRecord framing, one core; compare the ratio, not absolute speeds",
        "machine": platform.machine(), "python": sys.version.split()[0],
        "command": "make bench-encode",
    }
    result = {**provenance(result["command"]), **result}
    out = Path(__file__).parent / "results" / "block_encode.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
