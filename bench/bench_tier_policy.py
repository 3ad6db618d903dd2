"""Which eviction policy the hot tier should have: the misses of least-recently-used eviction (the hot tier's
planner, trainer/hot_tier.py) against least-frequently-used eviction, on bench-tiers' stream of big-table ids,
and how many of those misses any policy must take. No training and no I/O: the planner is pure, and the LFU
side is a simulation beside it. Writes bench/results/tier_policy.json.

    make bench-tier-policy                     both Zipf exponents (1.05 and 0.8), about two minutes

Per exponent (under `zipf_<s>`), over one pass over the training rows as bench-tiers trains, and again under
`passes_<n>` over `--passes` passes (3 by default; a daily run trains up to 20 epochs, early stopping ending most
after 3 to 5), where a row's first read is a miss only in the first:

    lookups, distinct_rows        the big table's ids in the training rows, and how many distinct rows they read
    first_touch_misses            = distinct_rows: a row's first read misses under every policy
    lru_misses, lru_hit_rate      the planner's loads, batch by batch as the training makes its plans; the
                                  hit rate per lookup (a row read twice in a batch is loaded once)
    batch_rows                    the distinct rows of each batch, summed: what the planner maps
    lru_hit_rate_of_batch_rows    1 - lru_misses / batch_rows: the hit rate as bench-tiers and the table report
                                  count it (per row a plan maps)
    lfu_misses, lfu_hit_rate      LFU: a row's count of reads while resident (a new row starts at its reads in the
                                  batch that loads it), the fewest evicted first, ties by the older last use;
                                  the batch's own rows are never evicted
    static_top_hit_rate           the share of lookups the hot_rows most probable rows take (Zipf's CDF): what a
                                  cache that knew the distribution would hit on an endless stream
    avoidable_lru_misses          lru_misses - first_touch_misses: all that a better policy could save here
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_tiers import BATCH, HASH_MULTIPLIER, RECORD_BYTES, RESERVED, SEED, zipf_ranks
from bench.provenance import provenance
from trainer.hot_tier import HotTierPlanner

RESULT = Path(__file__).parent / "results" / "tier_policy.json"
NEVER = np.iinfo(np.int64).max


def stream(num_rows: int, table_rows: int, exponent: float) -> np.ndarray:
    """bench-tiers' big-table ids (bench_tiers.generate, scattered layout): the same draws from the same seed."""
    rng = np.random.default_rng(SEED)
    usable = table_rows - RESERVED
    ranks = zipf_ranks(rng, num_rows, usable, exponent)
    return RESERVED + (ranks * HASH_MULTIPLIER) % usable


def lru_misses(ids: np.ndarray, hot_rows: int) -> int:
    planner = HotTierPlanner(hot_rows)
    return sum(len(planner.plan(ids[start:start + BATCH]).load_rows) for start in range(0, len(ids), BATCH))


def lfu_misses(ids: np.ndarray, hot_rows: int) -> int:
    slot_of: dict[int, int] = {}
    row_of_slot = np.full(hot_rows, -1, dtype=np.int64)
    counts = np.zeros(hot_rows, dtype=np.int64)
    last_use = np.zeros(hot_rows, dtype=np.int64)
    used = misses = 0
    for batch, start in enumerate(range(0, len(ids), BATCH)):
        rows, reads = np.unique(ids[start:start + BATCH], return_counts=True)
        slots = np.fromiter((slot_of.get(int(r), -1) for r in rows), dtype=np.int64, count=len(rows))
        resident = slots >= 0
        counts[slots[resident]] += reads[resident]
        last_use[slots[resident]] = batch
        missing = np.flatnonzero(~resident)
        misses += len(missing)
        free = np.arange(used, min(hot_rows, used + len(missing)), dtype=np.int64)
        victims = np.empty(0, dtype=np.int64)
        if len(missing) > len(free):
            order = counts[:used] * (batch + 1) + last_use[:used]  # fewest reads first, then the oldest use
            order[slots[resident]] = NEVER
            victims = np.argpartition(order, len(missing) - len(free))[:len(missing) - len(free)]
            for slot in victims:
                del slot_of[int(row_of_slot[slot])]
        used += len(free)
        new_slots = np.concatenate([free, victims])
        slot_of.update(zip(rows[missing].tolist(), new_slots.tolist(), strict=True))
        row_of_slot[new_slots] = rows[missing]
        counts[new_slots] = reads[missing]
        last_use[new_slots] = batch
    return misses


def static_top_hit_rate(hot_rows: int, num_ranks: int, exponent: float) -> float:
    """P(rank < hot_rows) under zipf_ranks' continuous distribution."""
    if abs(exponent - 1.0) < 1e-9:
        return float(np.log(hot_rows + 1.0) / np.log(num_ranks + 1.0))
    return float(((hot_rows + 1.0) ** (1 - exponent) - 1) / ((num_ranks + 1.0) ** (1 - exponent) - 1))


def measure(num_rows: int, table_rows: int, hot_rows: int, exponent: float, passes: int) -> dict[str, Any]:
    ids = np.tile(stream(num_rows, table_rows, exponent), passes)
    distinct = len(np.unique(ids))
    batch_rows = sum(len(np.unique(ids[start:start + BATCH])) for start in range(0, len(ids), BATCH))
    lru, lfu = lru_misses(ids, hot_rows), lfu_misses(ids, hot_rows)
    return {
        "lookups": len(ids),
        "distinct_rows": distinct,
        "first_touch_misses": distinct,
        "lru_misses": lru,
        "lru_hit_rate": 1 - lru / len(ids),
        "batch_rows": batch_rows,
        "lru_hit_rate_of_batch_rows": 1 - lru / batch_rows,
        "lfu_misses": lfu,
        "lfu_hit_rate": 1 - lfu / len(ids),
        "static_top_hit_rate": static_top_hit_rate(hot_rows, table_rows - RESERVED, exponent),
        "avoidable_lru_misses": lru - distinct,
        "lfu_saves_of_lru_misses": (lru - lfu) / lru,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--zipf", type=float, action="append", help="Zipf exponents (default 1.05 and 0.8)")
    parser.add_argument("--train-rows", type=int, default=1_000_000, help="as bench-tiers' (default 1,000,000)")
    parser.add_argument("--hot-rows", type=int, default=131_072, help="as bench-tiers' (default 131,072)")
    parser.add_argument("--passes", type=int, default=3,
                        help="also measured over this many passes over the rows, as a daily run's epochs (default 3)")
    parser.add_argument("--memory-limit-mib", type=int, default=1024,
                        help="bench-tiers' limit, which sizes the table: 4x it in records (default 1,024)")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    table_rows = -(-4 * args.memory_limit_mib * 2**20 // RECORD_BYTES)
    command = "make bench-tier-policy" + (f" BENCH_TIER_POLICY_ARGS='{' '.join(sys.argv[1:])}'"
                                          if sys.argv[1:] else "")
    result: dict[str, Any] = {"table_rows": table_rows, "hot_rows": args.hot_rows, "batch_size": BATCH,
                              "train_rows": args.train_rows, "passes": args.passes}
    for exponent in args.zipf or [1.05, 0.8]:
        result[f"zipf_{exponent}"] = {
            **measure(args.train_rows, table_rows, args.hot_rows, exponent, 1),
            f"passes_{args.passes}": measure(args.train_rows, table_rows, args.hot_rows, exponent, args.passes)}
        print(json.dumps({f"zipf_{exponent}": result[f"zipf_{exponent}"]}), flush=True)
    result = {**provenance(command), **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
