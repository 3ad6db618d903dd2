"""A day of minute checkpoints over one tiered table, with the chain's spans and without them: what a minute's
checkpoint writes, and what a table made from the chain late in the day costs (a minute run in a new process,
`materialize`). No training: each minute writes its rows into a live store as a minute run's flush does, then
both chains' files of that minute are written from it (trainer/tiered_tables.py, `write_minute_table`: with the
parent checkpoint, the span the binary counter places; without, the overlay alone, as before spans). Writes
bench/results/chain_spans.json.

    make bench-chain-spans                     a day of 1,440 minutes over a table of 4 M rows (~10 min)

Keys, per chain (`spans`: spans read from the live store; `spans_from_pieces`: the same spans merged from the
pieces they replace; `overlays_only`):

    write_s_p50, write_s_p99, write_s_max   a minute's checkpoint files of the table, written (seconds)
    write_s_max_minute                      the minute that took the longest
    bytes_written                           every minute's files of the table, summed
    pieces_at_<p>, piece_bytes_at_<p>       the pieces (overlays, spans) the chain from minute p crosses, and
                                            their bytes: what reading the table as of minute p reads besides
                                            the daily store
    materialize_s_at_<p>                    the table as of minute p made as a store (the daily store copied,
                                            then each piece written over it); the pieces were just written, so
                                            they are read from the page cache

and `write_amplification` (the spans' bytes_written over the overlays'), `materialize_ratio_at_<p>` (overlays
over spans), `same_table` (each span chain's table equal to the overlays' at every minute made, row for row)
and `span_minutes_pieces_over_store` (the minutes that write a span: a minute's files with its span merged from
the pieces over the same minute's read from the store; the median ratio, the ratio of the sums, and each way's
slowest minute). Each minute writes the three chains in this order, so the pieces were written minutes ago at
most and are read from the page cache, as a minute run's recent pieces would be.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_tiers import HASH_MULTIPLIER, RESERVED, SEED, zipf_ranks
from bench.provenance import provenance
from components.manifest import write_manifest
from trainer.row_store import RowStore
from trainer.tiered_tables import materialize, table_chain, write_minute_table

RESULT = Path(__file__).parent / "results" / "chain_spans.json"
CHAINS = ("spans", "spans_from_pieces", "overlays_only")
SPAN_FROM = {"spans": "store", "spans_from_pieces": "pieces"}  # where each chain's spans read their records
TABLE = "C1"
CHUNK_ROWS = 1 << 20


def new_store(path: Path, num_rows: int, dim: int, seed: int) -> None:
    """A daily store: values drawn uniform, accumulators at 0.1, written a chunk at a time."""
    rng = np.random.default_rng(seed)

    def chunks():
        for start in range(0, num_rows, CHUNK_ROWS):
            count = min(CHUNK_ROWS, num_rows - start)
            yield (rng.uniform(-0.05, 0.05, (count, dim)).astype(np.float32),
                   np.full((count, dim), 0.1, np.float32))

    path.parent.mkdir(parents=True, exist_ok=True)
    RowStore.write_new(path, num_rows, dim, chunks()).close()


def minute_rows(rng: np.random.Generator, lookups: int, num_rows: int, exponent: float) -> np.ndarray:
    """The distinct rows a minute's `lookups` ids read: Zipf ranks scattered over the table as bench-tiers'."""
    usable = num_rows - RESERVED
    ranks = zipf_ranks(rng, lookups, usable, exponent)
    return np.unique(RESERVED + (ranks * HASH_MULTIPLIER) % usable)


def chain_facts(checkpoint: Path) -> tuple[int, int]:
    _, pieces = table_chain(checkpoint, TABLE)
    return len(pieces), int(sum(piece.stat().st_size for piece in pieces))


def tables_equal(left: Path, right: Path, num_rows: int) -> bool:
    with RowStore.open(left, writable=False) as a, RowStore.open(right, writable=False) as b:
        for start in range(0, num_rows, CHUNK_ROWS):
            rows = np.arange(start, min(num_rows, start + CHUNK_ROWS))
            (va, aa), (vb, ab) = a.read(rows), b.read(rows)
            if not (np.array_equal(va, vb) and np.array_equal(aa, ab)):
                return False
    return True


def run(work: Path, num_rows: int, dim: int, minutes: int, lookups: int, exponent: float,
        at: list[int]) -> dict[str, Any]:
    day = work / "day"
    new_store(day / "tables" / f"{TABLE}.rows", num_rows, dim, SEED)
    write_manifest(day, kind="checkpoint", version="day", files=[f"tables/{TABLE}.rows"])
    live_path = work / "live" / f"{TABLE}.rows"
    live_path.parent.mkdir(parents=True)
    with RowStore.open(day / "tables" / f"{TABLE}.rows", writable=False) as base:
        base.snapshot(live_path)
    rng = np.random.default_rng(SEED + 1)
    parents = {chain: day for chain in CHAINS}
    seconds: dict[str, list[float]] = {chain: [] for chain in CHAINS}
    written = dict.fromkeys(CHAINS, 0)
    facts: dict[str, dict[str, Any]] = {chain: {} for chain in CHAINS}
    live = RowStore.open(live_path)
    try:
        for minute in range(1, minutes + 1):
            rows = minute_rows(rng, lookups, num_rows, exponent)
            values, accumulators = live.read(rows)
            # What a minute's training does to the rows it read: Adagrad's step, in short.
            gradient = rng.normal(0.0, 0.01, values.shape).astype(np.float32)
            accumulators += gradient * gradient
            values -= 0.05 * gradient / np.sqrt(accumulators)
            live.write(rows, values, accumulators)
            live.flush()
            for chain in CHAINS:
                directory = work / chain / f"m{minute:04d}"
                start = time.perf_counter()
                files = write_minute_table(directory / "tables", TABLE, rows, live,
                                           parents[chain] if chain in SPAN_FROM else None,
                                           span_from=SPAN_FROM.get(chain, "store"))
                inputs, extra = files.manifest()
                write_manifest(directory, kind="checkpoint", version=f"m{minute}", files=files.files,
                               inputs={"parent_checkpoint": str(parents[chain]), **inputs}, extra=extra)
                seconds[chain].append(time.perf_counter() - start)
                written[chain] += sum((directory / name).stat().st_size for name in files.files)
                parents[chain] = directory
            if minute in at:
                for chain in CHAINS:
                    pieces, piece_bytes = chain_facts(parents[chain])
                    start = time.perf_counter()
                    destination = work / f"made-{chain}-{minute}.rows"
                    materialize(parents[chain], TABLE, destination)
                    facts[chain].update({f"pieces_at_{minute}": pieces, f"piece_bytes_at_{minute}": piece_bytes,
                                         f"materialize_s_at_{minute}": time.perf_counter() - start})
                same = tables_equal(work / f"made-spans-{minute}.rows", work / f"made-overlays_only-{minute}.rows",
                                    num_rows)
                same_pieces = tables_equal(work / f"made-spans_from_pieces-{minute}.rows",
                                           work / f"made-overlays_only-{minute}.rows", num_rows)
                for chain in CHAINS:
                    (work / f"made-{chain}-{minute}.rows").unlink()
                facts["spans"][f"same_table_at_{minute}"] = same
                facts["spans_from_pieces"][f"same_table_at_{minute}"] = same_pieces
                print(json.dumps({"minute": minute, **{chain: {k: v for k, v in facts[chain].items()
                                                               if k.endswith(f"_{minute}")} for chain in CHAINS}}),
                      flush=True)
            elif minute % 60 == 0:
                print(f"[bench-chain-spans] minute {minute}/{minutes}: a minute's files written in "
                      f"{seconds['spans'][-1]:.3f} s with spans from the store, "
                      f"{seconds['spans_from_pieces'][-1]:.3f} s from the pieces, "
                      f"{seconds['overlays_only'][-1]:.3f} s without", flush=True)
    finally:
        live.close()
    result: dict[str, Any] = {}
    for chain in CHAINS:
        times = np.asarray(seconds[chain])
        result[chain] = {"write_s_p50": float(np.percentile(times, 50)),
                         "write_s_p99": float(np.percentile(times, 99)),
                         "write_s_max": float(times.max()), "write_s_max_minute": int(times.argmax()) + 1,
                         "bytes_written": int(written[chain]), **facts[chain]}
    result["write_amplification"] = written["spans"] / written["overlays_only"]
    for minute in at:
        result[f"materialize_ratio_at_{minute}"] = (result["overlays_only"][f"materialize_s_at_{minute}"]
                                                    / result["spans"][f"materialize_s_at_{minute}"])
    result["same_table"] = all(result[chain][f"same_table_at_{minute}"] for minute in at for chain in SPAN_FROM)
    # The two ways of writing a span, minute by minute in the same run (the minutes that write one).
    spanning = [m - 1 for m in range(1, minutes + 1) if (m & -m) >= 2]
    store_s, pieces_s = (np.asarray(seconds[chain])[spanning] for chain in SPAN_FROM)
    result["span_minutes_pieces_over_store"] = {
        "p50": float(np.percentile(pieces_s / store_s, 50)), "sum": float(pieces_s.sum() / store_s.sum()),
        "max_s_store": float(store_s.max()), "max_s_pieces": float(pieces_s.max())}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table-rows", type=int, default=4_000_000, help="rows of the table (default 4,000,000)")
    parser.add_argument("--dim", type=int, default=16, help="embedding width (default 16)")
    parser.add_argument("--minutes", type=int, default=1_440, help="minutes after the daily store (default 1,440)")
    parser.add_argument("--lookups", type=int, default=60_000,
                        help="ids a minute reads, one per example (default 60,000: a minute of 60 K rows)")
    parser.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ids (default 1.05)")
    parser.add_argument("--at", type=int, action="append",
                        help="minutes at which the tables are made from both chains (default 60, 720, 1023, 1024 "
                             "and the last)")
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    at = sorted({m for m in (args.at or [60, 720, 1023, 1024, args.minutes]) if 0 < m <= args.minutes})
    command = "make bench-chain-spans" + (f" BENCH_CHAIN_SPANS_ARGS='{' '.join(sys.argv[1:])}'"
                                          if sys.argv[1:] else "")
    work = Path(tempfile.mkdtemp(prefix="bench-chain-spans-", dir=args.work))
    try:
        result = run(work, args.table_rows, args.dim, args.minutes, args.lookups, args.zipf, at)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {**provenance(command), "table_rows": args.table_rows, "dim": args.dim, "minutes": args.minutes,
              "lookups_per_minute": args.lookups, "zipf": args.zipf, "at": at, **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({chain: result[chain] for chain in CHAINS}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
