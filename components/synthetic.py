"""Synthetic click logs in a feature spec's layout (the criteo preset's unless another is named), with labels
drawn from a planted model.

Because the true click probability of every row is known, the best achievable AUC on any slice is known too:
the generator saves the planted probabilities beside (not inside) the raw logs, and `planted_auc` scores a
slice with them. The data has what makes real CTR logs hard: Zipf-distributed categorical values of very
different cardinalities, values never seen before appearing every minute, heavy-tailed integer fields with
negative values and missing entries, and pairwise feature interactions.

The columns come from the spec (`RawShape`): its label, its dense and single-valued categorical columns (a value
drawn per row; categorical features of dtype int get integer ids), its multi-valued columns (1-3 values of a
vocabulary of their own), its sequence columns (ids of the column they share, the row's own value among them in a
share of the rows, which the planted model rewards), its timestamp column (the row's time in the minute, in the
spec's format) and any other column its source names (written empty). History sequences are not drawn: Spark
computes them from earlier rows. A list column without a separator is refused in a text layout.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from components.config import ConfigError, GenerateConfig
from components.feature_spec import FeatureSpec, SequenceFeature, SourceSpec, TimestampFeature, load_spec
from components.interval import parse_time
from components.layout import Layout

SUCCESS_MARKER = "_SUCCESS"
# The spec the generator writes when none is named.
DEFAULT_SPEC = "criteo"

# Distinct values per categorical feature, shaped like Criteo's (from 3 to 100 K); a spec with more categorical
# columns takes them again from the start.
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
# A sequence column: the share of rows whose own value is also in their sequence, and the planted logit of a row
# whose value is there.
SEQUENCE_TARGET_SHARE = 0.3
SEQUENCE_MATCH_EFFECT = 0.8
# A multi-valued column: its vocabulary, its rows with no value, the scale of its values' planted effects, and
# the feature index its planted effects and hashes are drawn under (apart from the categorical columns').
MULTI_VALUED_CARDINALITY = 30
MULTI_VALUED_MISSING_RATE = 0.05
MULTI_VALUED_SCALE = 0.4
MULTI_VALUED_FEATURE = 1000
# Share of the categorical features with no planted effect (6 of Criteo's 26), as in real logs.
UNINFORMATIVE_SHARE = 6 / 26
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


class GenerateSpecError(ConfigError):
    """A feature spec the generator cannot write rows for."""


@dataclass(frozen=True)
class ListColumn:
    """A multi-valued or sequence column the generator draws: `shares` is the index (in RawShape.categorical)
    of the categorical column whose ids a sequence lists, None for a multi-valued column's own values."""

    column: str
    max_length: int
    separator: str
    integer: bool
    shares: int | None = None


@dataclass(frozen=True)
class RawShape:
    """The raw columns the generator draws for a feature spec, and how its partition files are written."""

    spec_name: str
    label: str
    dense: tuple[str, ...]  # raw columns of the dense features
    categorical: tuple[str, ...]  # raw columns of the single-valued categorical features (not derived ones)
    integer_categorical: frozenset[str]  # those of dtype int
    timestamp: TimestampFeature | None
    columns: tuple[str, ...]  # the file's columns, in order
    source: SourceSpec
    lists: tuple[ListColumn, ...] = ()  # multi-valued and sequence columns (not the history ones Spark computes)

    @classmethod
    def of(cls, spec: FeatureSpec) -> RawShape:
        """The spec's columns, or GenerateSpecError when it reads a column the generator does not draw."""
        dense = _unique(f.column for f in spec.dense)
        # A column read both as a number and as an id is drawn as a number (its text is a valid id too).
        categorical = _unique(f.column for f in spec.categorical if not f.derived_from and f.column not in dense)
        if not dense and not categorical:
            raise GenerateSpecError(f"feature spec {spec.name!r} has no dense or categorical column to draw")
        integer = {f.column for f in spec.categorical if not f.derived_from and f.dtype == "int"}
        lists = []
        for feature in spec.lists:
            if getattr(feature, "history", None) is not None:
                continue  # computed by Spark from earlier rows
            if not feature.separator and spec.source.format != "parquet":
                raise GenerateSpecError(
                    f"feature spec {spec.name!r}: {feature.name} is a list column without a separator, which only "
                    f"Parquet stores; give it a separator (for instance \"|\") or source.format: parquet")
            if isinstance(feature, SequenceFeature):
                column = spec.feature(feature.shares).column
                lists.append(ListColumn(feature.column, feature.max_length, feature.separator, column in integer,
                                        shares=categorical.index(column)))
            else:
                lists.append(ListColumn(feature.column, feature.max_length, feature.separator,
                                        feature.dtype == "int"))
        columns = spec.source.columns or spec.input_columns
        unknown = [c for c in spec.input_columns if c not in columns]
        if unknown:  # spec_from_dict checks this; a hand-built spec may not have been
            raise GenerateSpecError(f"feature spec {spec.name!r} reads {unknown}, which its source.columns lack")
        return cls(spec_name=spec.name, label=spec.label.column, dense=dense, categorical=categorical,
                   integer_categorical=frozenset(integer), timestamp=spec.timestamp, columns=tuple(columns),
                   source=spec.source, lists=tuple(lists))


def _unique(names) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


@functools.cache
def default_shape() -> RawShape:
    """The shape of DEFAULT_SPEC (the criteo preset)."""
    return RawShape.of(load_spec(DEFAULT_SPEC))


# The partition file of DEFAULT_SPEC's layout (a spec's own: spec.source.file_name).
RAW_FILE = default_shape().source.file_name


@dataclass(frozen=True)
class PlantedModel:
    """The true click model. Effects are pure functions of ids, so any minute can be generated alone."""

    seed: int
    bias: float
    categorical_scale: np.ndarray  # [categorical columns] effect scale of each categorical feature
    dense_weight: np.ndarray  # [dense columns]
    dense_missing_effect: np.ndarray  # [dense columns]
    interaction_scale: float

    @property
    def interactions(self) -> tuple[tuple[int, int], ...]:
        """INTERACTIONS' pairs of features this model has."""
        return tuple((a, b) for a, b in INTERACTIONS if b < len(self.categorical_scale))

    @classmethod
    def create(cls, seed: int, num_categorical: int | None = None, num_dense: int | None = None) -> PlantedModel:
        """The model of `seed` for a spec of `num_categorical` and `num_dense` columns (default_shape's if
        unset)."""
        shape = default_shape()
        num_categorical = len(shape.categorical) if num_categorical is None else num_categorical
        num_dense = len(shape.dense) if num_dense is None else num_dense
        rng = np.random.default_rng([seed, 0xC7])
        scale = rng.uniform(0.1, 0.5, num_categorical)
        # uninformative features, as in real logs
        scale[rng.choice(num_categorical, round(num_categorical * UNINFORMATIVE_SHARE), replace=False)] = 0.0
        return cls(
            seed=seed,
            bias=-1.2,
            categorical_scale=scale,
            dense_weight=rng.normal(0.0, 0.25, num_dense),
            dense_missing_effect=rng.normal(0.0, 0.2, num_dense),
            interaction_scale=0.35,
        )

    def categorical_effect(self, feature: int, ids: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        effect = _hash_normal(self.seed, feature, ids)
        tail = (ranks >= HEAD_VALUES) | (ids < 0)
        effect = np.where(tail, 0.0, effect) * self.categorical_scale[feature]
        return np.where(ids < 0, 0.0, effect)

    def logit(self, ids: np.ndarray, ranks: np.ndarray, dense: np.ndarray) -> np.ndarray:
        logit = np.full(len(ids), self.bias)
        for f in range(ids.shape[1]):
            logit += self.categorical_effect(f, ids[:, f], ranks[:, f])
        missing = np.isnan(dense)
        scaled = np.where(missing, 0.0, np.sign(dense) * np.log1p(np.abs(dense)))
        centered = (scaled - 2.0) / 1.5
        logit += (np.where(missing, 0.0, centered) * self.dense_weight).sum(axis=1)
        logit += (missing * self.dense_missing_effect).sum(axis=1)
        if dense.shape[1] > 4:  # non-linear
            logit += 0.3 * np.tanh(np.where(missing[:, 1], 0.0, centered[:, 1]) * centered[:, 4])
        for a, b in self.interactions:
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


@functools.cache
def _zipf_cdf(cardinality: int, exponent: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, cardinality + 1) ** exponent
    return np.cumsum(weights) / weights.sum()


def zipf_ranks(cardinality: int, uniform: np.ndarray, exponent: float = ZIPF_EXPONENT) -> np.ndarray:
    """Uniform draws in [0, 1) -> popularity ranks in [0, cardinality), Zipf-distributed with `exponent`."""
    return np.minimum(np.searchsorted(_zipf_cdf(cardinality, exponent), uniform), cardinality - 1)


def _hashed(ids: np.ndarray, salt: int) -> np.ndarray:
    """Value ids -> the 32-bit hashes written for them (as uint64), salted by their feature."""
    return splitmix64(ids.astype(np.uint64) + np.uint64(salt << 40)) & np.uint64(0xFFFFFFFF)


def generate_minute(config: GenerateConfig, minute_index: int, minute: datetime,
                    shape: RawShape | None = None) -> MinuteSlice:
    """One minute of rows in `shape`'s columns (default_shape's if unset), drawn from (seed, minute_index)."""
    shape = shape or default_shape()
    num_categorical, num_dense = len(shape.categorical), len(shape.dense)
    planted = PlantedModel.create(config.seed, num_categorical, num_dense)
    rng = np.random.default_rng([config.seed, minute_index])
    n = config.rows_per_minute
    ids = np.empty((n, num_categorical), dtype=np.int64)
    ranks = np.empty((n, num_categorical), dtype=np.int64)
    for f in range(num_categorical):
        cardinality = CARDINALITIES[f % len(CARDINALITIES)]
        rank = zipf_ranks(cardinality, rng.random(n))
        value_id = _ids_of(rank, f)
        new = rng.random(n) < config.new_value_rate
        new_ids = (1 << 31) + minute_index * 100_000 + rng.integers(0, max(1, int(n * config.new_value_rate)), n)
        value_id = np.where(new, new_ids, value_id)
        rank = np.where(new, cardinality + 1, rank)
        missing = rng.random(n) < CATEGORICAL_MISSING_RATE[f % len(CATEGORICAL_MISSING_RATE)]
        ids[:, f] = np.where(missing, -1, value_id)
        ranks[:, f] = rank
    dense = np.empty((n, num_dense))
    for j in range(num_dense):
        values = np.floor(rng.lognormal(mean=0.5 + 0.4 * j % 3, sigma=1.2 + 0.15 * j, size=n))
        if j == 1:  # like Criteo's I2: small negative values occur
            values = values - 3.0 * (rng.random(n) < 0.1)
        values[rng.random(n) < DENSE_MISSING_RATE[j % len(DENSE_MISSING_RATE)]] = np.nan
        dense[:, j] = values
    logit = planted.logit(ids, ranks, dense)
    # List columns come from a stream of their own: a spec without them draws what it drew before they existed.
    list_rng = np.random.default_rng([config.seed, minute_index, 0x11])
    list_columns = {}
    for index, item in enumerate(shape.lists):
        values, effect = _draw_list(item, index, ids, list_rng, planted.seed)
        list_columns[item.column] = _list_array(item, values)
        logit += effect
    probability = 1.0 / (1.0 + np.exp(-logit))
    labels = (rng.random(n) < probability).astype(np.int8)

    drawn: dict[str, pa.Array] = {shape.label: pa.array(labels)}
    for j, name in enumerate(shape.dense):
        column = dense[:, j]
        drawn[name] = pa.array(np.nan_to_num(column).astype(np.int64), mask=np.isnan(column))
    for f, name in enumerate(shape.categorical):
        hashed = _hashed(ids[:, f], f)
        if name in shape.integer_categorical:
            drawn[name] = pa.array(hashed.astype(np.int64), mask=ids[:, f] < 0)
            continue
        text = pa.array(hex8(hashed.astype(np.uint32)), pa.binary()).cast(pa.string())
        drawn[name] = pa.array(text.to_numpy(zero_copy_only=False), pa.string(), mask=ids[:, f] < 0)
    drawn.update(list_columns)
    if shape.timestamp is not None:
        drawn[shape.timestamp.column] = _row_times(shape.timestamp, minute, config.seed, minute_index, n)
    columns = {name: drawn[name] if name in drawn else pa.nulls(n, pa.string()) for name in shape.columns}
    return MinuteSlice(minute, pa.table(columns), probability)


def _ids_of(ranks: np.ndarray, feature: int) -> np.ndarray:
    """Popularity ranks -> value ids of feature `feature`: a fixed permutation of the ranks."""
    return (ranks * 2_654_435_761 + feature) % (1 << 31)


def _draw_list(item: ListColumn, index: int, ids: np.ndarray, rng: np.random.Generator,
               seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """One list column's value ids per row (hashed as their feature's: an array per row, empty when missing) and
    its planted logit.

    A sequence lists ids of the categorical column it shares (`item.shares`), drawn by that column's popularity;
    for SEQUENCE_TARGET_SHARE of the rows it holds the row's own value too, and a row whose value is in its
    sequence gets SEQUENCE_MATCH_EFFECT (what attention over the sequence can find). A multi-valued column draws
    1-3 values of a vocabulary of its own, each with a planted effect, their mean added."""
    n = len(ids)
    if item.shares is not None:
        f = item.shares
        cardinality = CARDINALITIES[f % len(CARDINALITIES)]
        lengths = rng.integers(0, item.max_length + 1, n)
        drawn = _ids_of(zipf_ranks(cardinality, rng.random((n, item.max_length))), f)
        target = ids[:, f]
        planted = (rng.random(n) < SEQUENCE_TARGET_SHARE) & (target >= 0) & (lengths > 0)
        position = (rng.random(n) * np.maximum(lengths, 1)).astype(np.int64)
        drawn[planted, position[planted]] = target[planted]
        inside = np.arange(item.max_length) < lengths[:, None]
        matched = ((drawn == target[:, None]) & inside).any(axis=1) & (target >= 0)
        salt = f
        effect = SEQUENCE_MATCH_EFFECT * matched
    else:
        feature = MULTI_VALUED_FEATURE + index
        longest = min(3, item.max_length)
        lengths = np.where(rng.random(n) < MULTI_VALUED_MISSING_RATE, 0, rng.integers(1, longest + 1, n))
        drawn = _ids_of(zipf_ranks(MULTI_VALUED_CARDINALITY, rng.random((n, longest))), feature)
        inside = np.arange(longest) < lengths[:, None]
        weights = np.where(inside, _hash_normal(seed, feature, drawn), 0.0)
        effect = MULTI_VALUED_SCALE * weights.sum(axis=1) / np.maximum(lengths, 1)
        salt = feature
    hashed = _hashed(drawn, salt)
    return [row[:length] for row, length in zip(hashed, lengths, strict=True)], effect


def _list_array(item: ListColumn, values: list[np.ndarray]) -> pa.Array:
    """A list column as written: its values joined by the separator (text; null when empty), or a list per row
    (no separator: Parquet)."""
    if item.integer:
        tokens = [[str(int(v)) for v in row] for row in values]
    else:
        tokens = [hex8(row.astype(np.uint32)).astype(str).tolist() for row in values]
    if not item.separator:
        return pa.array([row or None for row in tokens], pa.list_(pa.string()))
    return pa.array([item.separator.join(row) if row else None for row in tokens], pa.string())


def _row_times(feature: TimestampFeature, minute: datetime, seed: int, minute_index: int, n: int) -> pa.Array:
    """Each row's time: a second of `minute` (in order), written in the feature's format. Drawn from a stream
    of its own, so the other columns are those of a spec without a timestamp."""
    seconds = np.sort(np.random.default_rng([seed, minute_index, 0x75]).integers(0, 60, n))
    epoch = int(minute.timestamp()) + seconds
    if feature.format == "unix_seconds":
        return pa.array(epoch, pa.int64())
    if feature.format == "unix_millis":
        return pa.array(epoch * 1000, pa.int64())
    texts = np.array([(minute + timedelta(seconds=int(s))).strftime(feature.format) for s in range(60)])
    return pa.array(texts[seconds], pa.string())


def write_raw_minute(table: pa.Table, directory: Path, shape: RawShape | None = None) -> Path:
    """Writes one minute partition in `shape`'s source layout (default_shape's: the Criteo TSV) atomically, then
    its _SUCCESS marker."""
    source = (shape or default_shape()).source
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / source.file_name
    tmp = directory / f".{source.file_name}.{uuid.uuid4().hex[:8]}.tmp"
    if source.format == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, tmp)
    else:
        # No quotes (ids are hex or digits; write_csv raises for a value holding the delimiter), header included:
        # Arrow quotes the header's names whatever the style.
        with open(tmp, "wb") as handle:
            if source.header:
                handle.write((source.field_delimiter.join(table.column_names) + "\n").encode())
            pacsv.write_csv(table, handle, pacsv.WriteOptions(include_header=False, delimiter=source.field_delimiter,
                                                              quoting_style="none"))
    os.replace(tmp, final)
    (directory / SUCCESS_MARKER).touch()
    return final


def planted_path(layout: Layout, minute: datetime) -> Path:
    return layout.root / "generated" / "planted" / f"date={minute:%Y-%m-%d}" / f"minute={minute:%H%M}.npy"


def write_minute(config: GenerateConfig, layout: Layout, minute_index: int, minute: datetime,
                 shape: RawShape | None = None) -> MinuteSlice:
    """Generates one minute in `shape`'s columns (default_shape's if unset; rows drawn from (seed,
    minute_index)) and writes its planted probabilities and its raw partition. Re-writing a minute overwrites
    it with the same bytes."""
    shape = shape or default_shape()
    piece = generate_minute(config, minute_index, minute, shape)
    # Planted first: once _SUCCESS marks the raw partition complete, its planted probabilities are there too.
    path = planted_path(layout, minute)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, np.stack([piece.table[shape.label].to_numpy().astype(np.float64), piece.probability]))
    write_raw_minute(piece.table, layout.raw_minute_dir(minute), shape)
    return piece


def generate(config: GenerateConfig, layout: Layout, progress=None, shape: RawShape | None = None) -> dict:
    """Writes config.minutes minute partitions from config.start in `shape`'s layout (RawShape.of(spec);
    default_shape's if unset); returns a summary with the planted AUC."""
    shape = shape or default_shape()
    start = parse_time(config.start).replace(second=0, microsecond=0)
    labels, probabilities = [], []
    for index in range(config.minutes):
        piece = write_minute(config, layout, index, start + timedelta(minutes=index), shape)
        labels.append(piece.table[shape.label].to_numpy())
        probabilities.append(piece.probability)
        if progress:
            progress(index + 1, config.minutes)
    from components.evaluation import roc_auc

    y, p = np.concatenate(labels), np.concatenate(probabilities)
    return {
        "spec": shape.spec_name,
        "start": start.isoformat(),
        "end": (start + timedelta(minutes=config.minutes)).isoformat(),
        "minutes": config.minutes,
        "rows": int(len(y)),
        "click_rate": float(y.mean()),
        "planted_auc": roc_auc(y, p),
    }


def planted_auc(layout: Layout, minutes: Iterable[datetime], file_name: str = RAW_FILE) -> float | None:
    """AUC of the planted probabilities on the given minutes (those still in the raw log, whose partition file
    is `file_name`: the spec's source.file_name)."""
    from components.evaluation import roc_auc

    labels, probabilities = [], []
    for minute in minutes:
        path = planted_path(layout, minute)
        if path.exists() and (layout.raw_minute_dir(minute) / file_name).exists():
            y, p = np.load(path)
            labels.append(y)
            probabilities.append(p)
    if not labels:
        return None
    return roc_auc(np.concatenate(labels), np.concatenate(probabilities))
