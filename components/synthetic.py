"""Synthetic click logs in the Criteo layout, with labels drawn from a planted model.

Because the true click probability of every row is known, the best achievable AUC on any slice is known too:
the generator saves the planted probabilities beside (not inside) the raw logs, and `planted_auc` scores a
slice with them. The data has what makes real CTR logs hard: Zipf-distributed categorical values of very
different cardinalities, values never seen before appearing every minute, heavy-tailed integer fields with
negative values and missing entries, and pairwise feature interactions.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from components.config import GenerateConfig
from components.interval import parse_time
from components.layout import Layout
from components.schema import CATEGORICAL_FEATURES, DENSE_FEATURES, LABEL, NUM_CATEGORICAL, NUM_DENSE

RAW_FILE = "part-00000.tsv"
SUCCESS_MARKER = "_SUCCESS"

# Distinct values per categorical feature, shaped like Criteo's (from 3 to 100 K).
CARDINALITIES = (
    1000, 500, 100_000, 50_000, 300, 20, 10_000, 600, 3, 50_000, 5_000, 80_000, 3_000,
    25, 10_000, 60_000, 10, 4_000, 2_000, 4, 70_000, 15, 15, 30_000, 60, 20_000,
)
ZIPF_EXPONENT = 1.15
# The most popular values of each feature carry the planted effects; the long tail and new values carry none,
# so the planted AUC is reachable by a model whose vocabulary admits only frequent values.
HEAD_VALUES = 60
CATEGORICAL_MISSING_RATE = np.array([0.0, 0.0, 0.03, 0.03, 0.0, 0.1, 0.0, 0.0, 0.0, 0.03, 0.0, 0.03, 0.0,
                                     0.0, 0.0, 0.03, 0.0, 0.0, 0.4, 0.4, 0.03, 0.0, 0.7, 0.03, 0.4, 0.4])
DENSE_MISSING_RATE = np.array([0.45, 0.0, 0.2, 0.2, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.77, 0.2])
# Pairs of categorical features whose values interact in the planted logit.
INTERACTIONS = ((5, 13), (8, 19), (16, 21))
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x: np.ndarray) -> np.ndarray:
    x = (x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
    return x ^ (x >> np.uint64(31))


def _hash_normal(seed: int, feature: int, ids: np.ndarray, salt: int = 0) -> np.ndarray:
    """A standard normal draw that is a pure function of (seed, feature, id, salt)."""
    base = np.uint64((seed * 1_000_003 + feature * 7919 + salt * 104_729) & 0xFFFFFFFF) << np.uint64(32)
    with np.errstate(over="ignore"):
        a = splitmix64(ids.astype(np.uint64) * np.uint64(2) + base)
        b = splitmix64(ids.astype(np.uint64) * np.uint64(2) + np.uint64(1) + base)
    u1 = (a >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    u2 = (b >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)


def hex8(values: np.ndarray) -> np.ndarray:
    """uint32 -> 8 lowercase hex digits (bytes), without a Python loop."""
    digits = np.frombuffer(b"0123456789abcdef", dtype="S1")
    as_bytes = values.astype(">u4").view(np.uint8).reshape(-1, 4)
    chars = np.empty((len(values), 8), dtype="S1")
    chars[:, 0::2] = digits[as_bytes >> 4]
    chars[:, 1::2] = digits[as_bytes & 15]
    return chars.view("S8").ravel()


@dataclass(frozen=True)
class PlantedModel:
    """The true click model. Effects are pure functions of ids, so any minute can be generated alone."""

    seed: int
    bias: float
    categorical_scale: np.ndarray  # [26] effect scale of each categorical feature
    dense_weight: np.ndarray  # [13]
    dense_missing_effect: np.ndarray  # [13]
    interaction_scale: float

    @classmethod
    def create(cls, seed: int) -> PlantedModel:
        rng = np.random.default_rng([seed, 0xC7])
        scale = rng.uniform(0.1, 0.5, NUM_CATEGORICAL)
        scale[rng.choice(NUM_CATEGORICAL, 6, replace=False)] = 0.0  # uninformative features, as in real logs
        return cls(
            seed=seed,
            bias=-1.2,
            categorical_scale=scale,
            dense_weight=rng.normal(0.0, 0.25, NUM_DENSE),
            dense_missing_effect=rng.normal(0.0, 0.2, NUM_DENSE),
            interaction_scale=0.35,
        )

    def categorical_effect(self, feature: int, ids: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        effect = _hash_normal(self.seed, feature, ids)
        tail = (ranks >= HEAD_VALUES) | (ids < 0)
        effect = np.where(tail, 0.0, effect) * self.categorical_scale[feature]
        return np.where(ids < 0, 0.0, effect)

    def logit(self, ids: np.ndarray, ranks: np.ndarray, dense: np.ndarray) -> np.ndarray:
        logit = np.full(len(ids), self.bias)
        for f in range(NUM_CATEGORICAL):
            logit += self.categorical_effect(f, ids[:, f], ranks[:, f])
        missing = np.isnan(dense)
        scaled = np.where(missing, 0.0, np.sign(dense) * np.log1p(np.abs(dense)))
        centered = (scaled - 2.0) / 1.5
        logit += (np.where(missing, 0.0, centered) * self.dense_weight).sum(axis=1)
        logit += (missing * self.dense_missing_effect).sum(axis=1)
        logit += 0.3 * np.tanh(np.where(missing[:, 1], 0.0, centered[:, 1]) * centered[:, 4])  # non-linear
        for a, b in INTERACTIONS:
            head = (ranks[:, a] < HEAD_VALUES) & (ranks[:, b] < HEAD_VALUES) & (ids[:, a] >= 0) & (ids[:, b] >= 0)
            ua = _hash_normal(self.seed, a, ids[:, a], salt=1)
            ub = _hash_normal(self.seed, b, ids[:, b], salt=2)
            logit += np.where(head, self.interaction_scale * ua * ub, 0.0)
        return logit


@dataclass(frozen=True)
class MinuteSlice:
    minute: datetime
    table: pa.Table  # the raw columns, nulls for missing values
    probability: np.ndarray  # planted click probability per row


def _zipf_cdf(cardinality: int) -> np.ndarray:
    weights = 1.0 / np.arange(1, cardinality + 1) ** ZIPF_EXPONENT
    return np.cumsum(weights) / weights.sum()


_CDFS: dict[int, np.ndarray] = {}


def generate_minute(config: GenerateConfig, minute_index: int, minute: datetime) -> MinuteSlice:
    planted = PlantedModel.create(config.seed)
    rng = np.random.default_rng([config.seed, minute_index])
    n = config.rows_per_minute
    ids = np.empty((n, NUM_CATEGORICAL), dtype=np.int64)
    ranks = np.empty((n, NUM_CATEGORICAL), dtype=np.int64)
    for f, cardinality in enumerate(CARDINALITIES):
        cdf = _CDFS.setdefault(cardinality, _zipf_cdf(cardinality))
        rank = np.minimum(np.searchsorted(cdf, rng.random(n)), cardinality - 1)
        # A value's id is a fixed permutation of its popularity rank.
        value_id = (rank * 2_654_435_761 + f) % (1 << 31)
        new = rng.random(n) < config.new_value_rate
        new_ids = (1 << 31) + minute_index * 100_000 + rng.integers(0, max(1, int(n * config.new_value_rate)), n)
        value_id = np.where(new, new_ids, value_id)
        rank = np.where(new, cardinality + 1, rank)
        missing = rng.random(n) < CATEGORICAL_MISSING_RATE[f]
        ids[:, f] = np.where(missing, -1, value_id)
        ranks[:, f] = rank
    dense = np.empty((n, NUM_DENSE))
    for j in range(NUM_DENSE):
        values = np.floor(rng.lognormal(mean=0.5 + 0.4 * j % 3, sigma=1.2 + 0.15 * j, size=n))
        if j == 1:  # like Criteo's I2: small negative values occur
            values = values - 3.0 * (rng.random(n) < 0.1)
        values[rng.random(n) < DENSE_MISSING_RATE[j]] = np.nan
        dense[:, j] = values
    probability = 1.0 / (1.0 + np.exp(-planted.logit(ids, ranks, dense)))
    labels = (rng.random(n) < probability).astype(np.int8)

    columns: dict[str, pa.Array] = {LABEL: pa.array(labels)}
    for j, name in enumerate(DENSE_FEATURES):
        column = dense[:, j]
        columns[name] = pa.array(np.nan_to_num(column).astype(np.int64), mask=np.isnan(column))
    for f, name in enumerate(CATEGORICAL_FEATURES):
        hashed = splitmix64(ids[:, f].astype(np.uint64) + np.uint64(f << 40)) & np.uint64(0xFFFFFFFF)
        text = pa.array(hex8(hashed.astype(np.uint32)), pa.binary()).cast(pa.string())
        columns[name] = pa.array(text.to_numpy(zero_copy_only=False), pa.string(), mask=ids[:, f] < 0)
    return MinuteSlice(minute, pa.table(columns), probability)


def write_raw_minute(table: pa.Table, directory: Path) -> Path:
    """Writes one minute partition in the Criteo TSV layout atomically, then its _SUCCESS marker."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / RAW_FILE
    tmp = directory / f".{RAW_FILE}.{uuid.uuid4().hex[:8]}.tmp"
    pacsv.write_csv(table, tmp, pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none"))
    os.replace(tmp, final)
    (directory / SUCCESS_MARKER).touch()
    return final


def planted_path(layout: Layout, minute: datetime) -> Path:
    return layout.root / "generated" / "planted" / f"date={minute:%Y-%m-%d}" / f"minute={minute:%H%M}.npy"


def write_minute(config: GenerateConfig, layout: Layout, minute_index: int, minute: datetime) -> MinuteSlice:
    """Generates one minute (rows drawn from (seed, minute_index)) and writes its planted probabilities and its
    raw partition. Re-writing a minute overwrites it with the same bytes."""
    piece = generate_minute(config, minute_index, minute)
    # Planted first: once _SUCCESS marks the raw partition complete, its planted probabilities are there too.
    path = planted_path(layout, minute)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, np.stack([piece.table[LABEL].to_numpy().astype(np.float64), piece.probability]))
    write_raw_minute(piece.table, layout.raw_minute_dir(minute))
    return piece


def generate(config: GenerateConfig, layout: Layout, progress=None) -> dict:
    """Writes config.minutes minute partitions from config.start; returns a summary with the planted AUC."""
    start = parse_time(config.start).replace(second=0, microsecond=0)
    labels, probabilities = [], []
    for index in range(config.minutes):
        piece = write_minute(config, layout, index, start + timedelta(minutes=index))
        labels.append(piece.table[LABEL].to_numpy())
        probabilities.append(piece.probability)
        if progress:
            progress(index + 1, config.minutes)
    from components.evaluation import roc_auc

    y, p = np.concatenate(labels), np.concatenate(probabilities)
    return {
        "start": start.isoformat(),
        "end": (start + timedelta(minutes=config.minutes)).isoformat(),
        "minutes": config.minutes,
        "rows": int(len(y)),
        "click_rate": float(y.mean()),
        "planted_auc": roc_auc(y, p),
    }


def planted_auc(layout: Layout, minutes: Iterable[datetime]) -> float | None:
    """AUC of the planted probabilities on the given minutes (those still in the raw log)."""
    from components.evaluation import roc_auc

    labels, probabilities = [], []
    for minute in minutes:
        path = planted_path(layout, minute)
        if path.exists() and (layout.raw_minute_dir(minute) / RAW_FILE).exists():
            y, p = np.load(path)
            labels.append(y)
            probabilities.append(p)
    if not labels:
        return None
    return roc_auc(np.concatenate(labels), np.concatenate(probabilities))
