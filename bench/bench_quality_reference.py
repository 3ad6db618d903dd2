"""What a model told the generated criteo day's planted form reaches at a given number of rows: the reference
for the quality benches' gap to the planted AUC.

    make bench-quality-reference         # -> bench/results/quality_reference.json
    make bench-quality-reference BENCH_QUALITY_REFERENCE_ARGS='--minutes 60 --out /tmp/reference.json'

The generated day's clicks follow a planted logistic model (components/synthetic.py PlantedModel): a bias, an
effect for each of the 60 most popular values of each categorical feature (none for the tail), a linear effect of
each dense feature after a fixed transform and of its being missing, one tanh term of two dense features, and
three pairwise products of categorical values. A learner that knows that form, and only has to estimate its
parameters from the rows, is scikit-learn's logistic regression over exactly those terms: a one-hot column per
categorical value and per value pair of the three interacting pairs, the dense features transformed as the
generator transforms them, their missing flags, and the tanh term. Two such learners, both with their L2 strength
chosen by logloss on the last 10 % of the training rows (never the test rows):
- `structured_lr`: every value seen at least `--min-count` times (the rest share a column per feature);
- `structured_lr_head`: told also which values carry an effect (each feature's 60 most frequent training values,
  and the pairs of them), the others sharing a column per feature.
The first is what the form alone allows at this many rows, the second what knowing the form and where the signal
lies allows; neither is a bound on every learner, both are far more than a product model is told.

Rows: `--minutes` minutes of `--rows-per-minute` generated rows (seed 7, the generator's defaults) for training,
then `--test-minutes` later minutes for the test, whose planted AUC (the true probabilities) is the ceiling.
Keys: `rows`, `test_rows`, `planted_auc`, `structured_lr` and `structured_lr_head` (each `auc`, `gap_to_planted`,
`regularization_c`, `columns`, `validation_logloss` by C).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np

from bench.provenance import provenance
from components.config import GenerateConfig
from components.schema import CATEGORICAL_FEATURES, DENSE_FEATURES, LABEL
from components.synthetic import HEAD_VALUES, INTERACTIONS, generate_minute

REGULARIZATION_GRID = (0.005, 0.01, 0.02, 0.04, 0.08)
VALIDATION_FRACTION = 0.1


def one_hot_columns(values: np.ndarray, n_train: int, min_count: int, top: int | None) -> tuple[np.ndarray, int]:
    """Per row, its value's column: 1 + the value's index among those kept (seen `min_count` times in the training
    rows, and with `top` among the `top` most frequent), 0 for the rest. Returns (columns, width)."""
    unique, inverse = np.unique(values, return_inverse=True)
    counts = np.bincount(inverse[:n_train], minlength=len(unique))
    kept = counts >= min_count
    if top is not None:
        head = np.zeros(len(unique), dtype=bool)
        head[np.argsort(-counts, kind="stable")[:top]] = True
        kept &= head
    index = np.zeros(len(unique), dtype=np.int64)
    index[kept] = np.arange(1, kept.sum() + 1)
    return index[inverse], int(kept.sum()) + 1


def design(table, n_train: int, min_count: int, top: int | None):
    """The sparse design matrix of the planted form's terms (the module's docstring)."""
    import scipy.sparse as sp

    n = table.num_rows
    categorical = [np.asarray(table[name].fill_null("").to_numpy(zero_copy_only=False)).astype(str)
                   for name in CATEGORICAL_FEATURES]
    blocks, heads = [], []
    for values in categorical:
        columns, width = one_hot_columns(values, n_train, min_count, top)
        blocks.append(sp.csr_matrix((np.ones(n), (np.arange(n), columns)), shape=(n, width)))
        heads.append(columns > 0)
    for a, b in INTERACTIONS:
        pairs = np.char.add(np.char.add(categorical[a], "|"), categorical[b])
        if top is not None:  # pairs of two head values only
            pairs = np.where(heads[a] & heads[b], pairs, "")
        columns, width = one_hot_columns(pairs, n_train, min_count, None)
        blocks.append(sp.csr_matrix((np.ones(n), (np.arange(n), columns)), shape=(n, width)))
    dense = np.stack([np.asarray(table[name].to_numpy(zero_copy_only=False), dtype=float)
                      for name in DENSE_FEATURES], axis=1)
    missing = np.isnan(dense)
    filled = np.nan_to_num(dense)
    centered = np.where(missing, 0.0, (np.sign(filled) * np.log1p(np.abs(filled)) - 2.0) / 1.5)
    tanh = np.tanh(centered[:, 1] * centered[:, 4])  # the generator's one non-linear term
    blocks.append(sp.csr_matrix(np.column_stack([centered, missing.astype(float), tanh])))
    return sp.hstack(blocks).tocsr()


def fit(x, labels: np.ndarray, n_train: int, test_labels: np.ndarray) -> dict[str, Any]:
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import log_loss, roc_auc_score

    train, test = x[:n_train], x[n_train:]
    cut = int(n_train * (1 - VALIDATION_FRACTION))
    by_c = {}
    for c in REGULARIZATION_GRID:
        model = LogisticRegression(C=c, max_iter=500).fit(train[:cut], labels[:cut])
        by_c[str(c)] = float(log_loss(labels[cut:n_train], model.predict_proba(train[cut:])[:, 1]))
        print(f"  C {c}: validation logloss {by_c[str(c)]:.5f}", flush=True)
    best = float(min(by_c, key=by_c.get))
    model = LogisticRegression(C=best, max_iter=500).fit(train, labels[:n_train])
    return {"auc": float(roc_auc_score(test_labels, model.predict_proba(test)[:, 1])), "regularization_c": best,
            "columns": int(x.shape[1]), "validation_logloss": by_c}


def main() -> int:
    import pyarrow as pa
    from sklearn.metrics import roc_auc_score

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=int, default=200, help="training minutes (default 200: 900,000 rows)")
    parser.add_argument("--test-minutes", type=int, default=20)
    parser.add_argument("--rows-per-minute", type=int, default=4500)
    parser.add_argument("--min-count", type=int, default=5, help="structured_lr's admission count (default 5)")
    parser.add_argument("--out", default="bench/results/quality_reference.json")
    args = parser.parse_args()
    started = time.monotonic()
    config = GenerateConfig(minutes=args.minutes + args.test_minutes, rows_per_minute=args.rows_per_minute)
    first = datetime(2026, 1, 1)
    slices = [generate_minute(config, index, first + timedelta(minutes=index)) for index in range(config.minutes)]
    table = pa.concat_tables([s.table for s in slices])
    probability = np.concatenate([s.probability for s in slices])
    labels = np.asarray(table[LABEL].to_numpy(), dtype=np.int64)
    n_train = args.minutes * args.rows_per_minute
    test_labels = labels[n_train:]
    planted = float(roc_auc_score(test_labels, probability[n_train:]))
    print(f"{n_train} training rows, {len(test_labels)} test rows, planted AUC {planted:.4f}", flush=True)
    out: dict[str, Any] = {"rows": n_train, "test_rows": len(test_labels), "planted_auc": planted,
                           "head_values": HEAD_VALUES}
    for key, min_count, top in (("structured_lr", args.min_count, None), ("structured_lr_head", 1, HEAD_VALUES)):
        print(f"{key}:", flush=True)
        result = fit(design(table, n_train, min_count, top), labels, n_train, test_labels)
        result["gap_to_planted"] = planted - result["auc"]
        result["min_count"] = min_count
        out[key] = result
        print(f"{key}: AUC {result['auc']:.4f}, gap to planted {result['gap_to_planted']:.4f}", flush=True)
    command = "make bench-quality-reference" + (
        f" BENCH_QUALITY_REFERENCE_ARGS='{os.environ['BENCH_QUALITY_REFERENCE_ARGS']}'"
        if os.environ.get("BENCH_QUALITY_REFERENCE_ARGS") else "")
    result = {**provenance(command), "benchmark": "quality_reference",
              "settings": {"minutes": args.minutes, "test_minutes": args.test_minutes,
                           "rows_per_minute": args.rows_per_minute, "min_count": args.min_count,
                           "regularization_grid": list(REGULARIZATION_GRID)},
              **out, "seconds": time.monotonic() - started}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
