"""The feature spec: every column a pipeline reads, its kind and its per-feature settings, as data.

A spec is a YAML file (or a preset name: components/feature_specs/<name>.yaml), read once at the edge with
`load_spec`, checked, frozen and passed down. Validation suites, the Spark features and samples, the TFRecord
layout, the model's inputs, the export signature, serving's checks and deltas derive from it; its `hash` goes
into every manifest. No module outside this one names a column.

    name: avazu                          # what manifests and MLflow call it
    source:                              # the raw minute partitions' layout
      format: csv                        # tsv | csv | parquet
      header: true                       # tsv/csv: a header line names the columns
      columns: [id, click, hour, ...]    # file columns in order (required without a header)
      encoding: utf-8                    # tsv/csv: the encoding of the files `ingest` reads (default utf-8)
    label: {column: click}               # binary 0/1
    features:
      - {name: hour, kind: timestamp, format: "%y%m%d%H", derive: [hour_of_day, day_of_week]}
      - {names: [C1, banner_pos, site_id], kind: categorical, dtype: string}
      - {name: price, kind: dense}
      - {name: tags, kind: multi_categorical, separator: "|", max_length: 10, pooling: mean}
      - {name: clicked_items, kind: sequence, separator: "^", max_length: 20, shares: item_id}

Kinds and their keys (every key but `name`/`names` and `kind` is optional):

- dense: `transform` log_standardize (signed log1p, clipped at the `clip_quantile` and 1 - `clip_quantile`
  quantiles, standardized; the default), standardize (the same without log1p) or buckets: the value's
  quantile bucket (`num_buckets`, default 16, boundaries from the daily run's data) becomes a categorical
  feature `<name>_bucket` whose embedding the model reads instead of the value (a missing value has the
  missing row, so `missing_indicator` applies to the other transforms only); `missing_indicator` (default
  true).
- categorical (one value a row, string or integer id): `dtype` string | int, `min_count` (admission),
  `evict_after_days`, `max_rows`, `embedding_dim`, `hashing` ({functions, buckets, combiner}: the admitted
  rows are compressed into `functions` small tables, for very-high-cardinality features), `table` (share
  the vocabulary and embedding table of another categorical feature), `storage` memory | tiered (tiered: the
  table and its optimizer state on local disk while training, `hot_rows` of them in memory, default
  DEFAULT_HOT_ROWS; not hashed; lists of ids that share it are remapped to the hot tier too; docs/tiers.md).
- multi_categorical (several values a row, e.g. tags): `separator` (or a list column), `max_length`,
  `pooling` sum | mean, and the table keys of a categorical feature (`table` to share one).
- sequence (ordered ids, newest last): `separator` (or a list column), `max_length`, `shares` (required: the
  categorical feature whose vocabulary and embedding table the ids use, e.g. history items use the item
  table; that feature is the target of DIN's and DIEN's attention), `history` (below).
- a history (a sequence computed from the log instead of read from a column):
  `{name: liked_items, kind: sequence, shares: item_id, max_length: 20,
    history: {key: user_id, value: item_id, positive_only: true}}`: for each row, the values of the
  categorical feature `value` (default: `shares`; it must read the `shares` table) in the last `max_length`
  rows with the same `key` (a categorical feature, e.g. the user) whose time is strictly before the row's
  time, oldest first, newest last; with `positive_only`, rows whose label is 1 only. The time is the spec's
  timestamp in whole seconds (the minute of the partition when the spec has none). Rows at the same time
  never see each other, so a row sees neither its own label nor a later one (ties: same time = not before;
  earlier rows at one time are ordered by value). Spark computes it in the daily and the minute runs with
  the same rule (spark_jobs/history.py), seeded by a history state (each key's last values at a minute)
  that every run carries forward. It has no column in the raw files (no `column`, no `separator`); serving
  takes it in the request like any sequence.
- timestamp (at most one): `format` unix_seconds | unix_millis | a strptime pattern ("%Y-%m-%d %H:%M:%S",
  "%y%m%d%H"), `derive` [hour_of_day, day_of_week]: each a categorical feature named <name>_<derived>.

Settings a spec leaves unset (min_count, evict_after_days, max_rows, embedding_dim) come from the pipeline
config (features.min_count, features.evict_after_days, features.max_rows_per_feature, train.embedding_dim),
so `--set features.min_count=2` still applies to every feature that does not pin its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, get_args

from components.config import PipelineConfig
from components.errors import ConfigError

PRESET_DIR = Path(__file__).with_name("feature_specs")

# Reserved rows of every vocabulary (table): admitted values start at NUM_RESERVED_ROWS.
RARE_ROW = 0  # values seen fewer than min_count times, and values never seen (out of vocabulary)
MISSING_ROW = 1  # empty field; also the padding of multi-valued and sequence features
NUM_RESERVED_ROWS = 2

Kind = Literal["dense", "categorical", "multi_categorical", "sequence", "timestamp"]
SourceFormat = Literal["tsv", "csv", "parquet"]
DenseTransformKind = Literal["log_standardize", "standardize", "buckets"]
CategoricalDtype = Literal["string", "int"]
Pooling = Literal["sum", "mean"]
HashCombiner = Literal["sum", "concat"]
TableStorage = Literal["memory", "tiered"]
Derived = Literal["hour_of_day", "day_of_week"]
TimestampFormat = str  # unix_seconds | unix_millis | a strptime pattern

KINDS: tuple[str, ...] = get_args(Kind)
# Names the model's inputs and the block TFRecords use for their own keys: no feature may take them.
RESERVED_NAMES = frozenset({"label", "dense", "categorical", "num_rows", "minute"})
DERIVED_VOCABULARIES: dict[str, tuple[str, ...]] = {
    "hour_of_day": tuple(str(h) for h in range(24)),
    "day_of_week": tuple(str(d) for d in range(7)),  # 0 = Monday
}
# The derivation of a dense feature's quantile bucket (transform: buckets): the categorical feature
# <name>_bucket, whose values are the bucket numbers "0" .. str(num_buckets - 1).
BUCKET_DERIVATION = "buckets"
BUCKET_SUFFIX = "_bucket"
# The hot tier of a tiered table whose spec sets no `hot_rows`: 131,072 rows (16 MiB with their accumulators at
# dimension 16), several times the distinct rows of the largest batch the batch size chosen from the rows takes.
DEFAULT_HOT_ROWS = 131_072


class FeatureSpecError(ConfigError):
    """A feature spec is malformed: the message names the key and the value."""


DEFAULT_ENCODING = "utf-8"


@dataclass(frozen=True)
class SourceSpec:
    format: SourceFormat = "tsv"
    header: bool = False
    columns: tuple[str, ...] = ()
    # Text formats: the field separator (tab for tsv, comma for csv unless set).
    delimiter: str = ""
    # Text formats: the encoding of the files a team ingests (`ctr-pipeline ingest` writes raw partitions as UTF-8).
    encoding: str = DEFAULT_ENCODING

    @property
    def field_delimiter(self) -> str:
        return self.delimiter or ("\t" if self.format == "tsv" else ",")

    @property
    def file_name(self) -> str:
        return f"part-00000.{self.format}"


@dataclass(frozen=True)
class LabelSpec:
    column: str


@dataclass(frozen=True)
class HashingSpec:
    functions: int = 2
    buckets: int = 16_384
    combiner: HashCombiner = "sum"


@dataclass(frozen=True)
class DenseFeature:
    name: str
    column: str
    transform: DenseTransformKind = "log_standardize"
    clip_quantile: float = 0.001
    missing_indicator: bool = True
    num_buckets: int = 16  # transform: buckets
    kind: str = field(default="dense", init=False)

    @property
    def bucketized(self) -> bool:
        return self.transform == "buckets"


@dataclass(frozen=True)
class CategoricalFeature:
    name: str
    column: str
    dtype: CategoricalDtype = "string"
    table: str = ""  # the table (vocabulary and embedding) it reads; its own name unless shared
    min_count: int | None = None
    evict_after_days: int | None = None
    max_rows: int | None = None
    embedding_dim: int | None = None
    hashing: HashingSpec | None = None
    # Where the table lives while training: in memory, or on local disk with `hot_rows` rows in memory
    # (trainer/tiered_tables.py, docs/tiers.md).
    storage: TableStorage = "memory"
    hot_rows: int | None = None
    # Set for features computed from the timestamp (hour_of_day, day_of_week): their fixed values.
    derived_from: str = ""
    derivation: str = ""
    kind: str = field(default="categorical", init=False)


@dataclass(frozen=True)
class MultiCategoricalFeature:
    name: str
    column: str
    max_length: int
    separator: str = ""  # empty: the column holds a list
    pooling: Pooling = "mean"
    dtype: CategoricalDtype = "string"
    table: str = ""
    min_count: int | None = None
    evict_after_days: int | None = None
    max_rows: int | None = None
    embedding_dim: int | None = None
    hashing: HashingSpec | None = None
    kind: str = field(default="multi_categorical", init=False)


@dataclass(frozen=True)
class HistorySpec:
    """A sequence computed from the log: `value`s of the earlier rows with the same `key` (see the module doc)."""

    key: str  # the categorical feature whose rows share a history (the user)
    value: str = ""  # the categorical feature the sequence lists; empty: the sequence's `shares`
    positive_only: bool = False  # only rows whose label is 1


@dataclass(frozen=True)
class SequenceFeature:
    name: str
    column: str
    max_length: int
    shares: str  # the categorical feature whose table the ids use (the attention target)
    separator: str = ""
    history: HistorySpec | None = None  # computed by Spark from earlier rows, not read from `column`
    kind: str = field(default="sequence", init=False)

    @property
    def table(self) -> str:
        return self.shares


@dataclass(frozen=True)
class TimestampFeature:
    name: str
    column: str
    format: TimestampFormat = "unix_seconds"
    derive: tuple[Derived, ...] = ()
    kind: str = field(default="timestamp", init=False)

    def parse(self, value: Any) -> datetime:
        """A raw value as a UTC datetime (naive times are UTC). Raises ValueError naming the format."""
        if isinstance(value, int | float) and not isinstance(value, bool):
            text = repr(value)
        elif isinstance(value, str):
            text = value.strip()
        else:
            raise ValueError(f"expected a timestamp in format {self.format!r}, got {value!r}")
        if self.format == "unix_seconds":
            return datetime.fromtimestamp(float(text), UTC)
        if self.format == "unix_millis":
            return datetime.fromtimestamp(float(text) / 1000.0, UTC)
        return datetime.strptime(text, self.format).replace(tzinfo=UTC)

    def epoch_seconds(self, value: Any) -> int:
        """A raw value as whole seconds since 1970-01-01 UTC (what the serving signature takes)."""
        return int(self.parse(value).timestamp() // 1)


def derive_time(epoch_seconds: Any, derivation: str) -> Any:
    """hour_of_day (0..23) or day_of_week (0 = Monday .. 6) of UTC epoch seconds (ints or numpy arrays),
    by integer arithmetic: Spark, the sample writer and the serving graph compute the same thing."""
    if derivation == "hour_of_day":
        return (epoch_seconds // 3600) % 24
    if derivation == "day_of_week":
        return (epoch_seconds // 86400 + 3) % 7  # 1970-01-01 was a Thursday
    raise ValueError(f"unknown derivation {derivation!r}; expected one of {', '.join(DERIVED_VOCABULARIES)}")


Feature = DenseFeature | CategoricalFeature | MultiCategoricalFeature | SequenceFeature | TimestampFeature
TableFeature = CategoricalFeature | MultiCategoricalFeature


@dataclass(frozen=True)
class TableSpec:
    """One vocabulary and its embedding table, read by every feature listed in `features`."""

    name: str
    features: tuple[str, ...]
    min_count: int
    evict_after_days: int
    max_rows: int
    embedding_dim: int
    hashing: HashingSpec | None = None
    # Fixed values (derived features): admitted from their first occurrence, never evicted.
    fixed_values: tuple[str, ...] = ()
    storage: TableStorage = "memory"
    hot_rows: int = 0  # the hot tier's rows of a tiered table; 0 in memory

    @property
    def tiered(self) -> bool:
        return self.storage == "tiered"


@dataclass(frozen=True)
class FeatureDefaults:
    """What the pipeline config supplies for settings a spec leaves unset (`of` reads them from a config; the
    values live only there)."""

    min_count: int
    evict_after_days: int
    max_rows: int
    embedding_dim: int

    @classmethod
    def of(cls, config: PipelineConfig | None = None) -> FeatureDefaults:
        config = config or PipelineConfig()
        return cls(min_count=config.features.min_count, evict_after_days=config.features.evict_after_days,
                   max_rows=config.features.max_rows_per_feature, embedding_dim=config.train.embedding_dim)


@dataclass(frozen=True)
class FeatureSpec:
    name: str
    source: SourceSpec
    label: LabelSpec
    features: tuple[Feature, ...]
    description: str = ""
    # Settings the spec leaves unset; `with_defaults` fills them from the pipeline config.
    defaults: FeatureDefaults = field(default_factory=FeatureDefaults.of)

    def with_defaults(self, defaults: FeatureDefaults) -> FeatureSpec:
        return dataclasses.replace(self, defaults=defaults)

    # --- selections by kind (declaration order; derived timestamp features after the declared ones) ---
    @property
    def dense(self) -> tuple[DenseFeature, ...]:
        return tuple(f for f in self.features if isinstance(f, DenseFeature))

    @property
    def categorical(self) -> tuple[CategoricalFeature, ...]:
        """Single-valued categorical features, derived ones included."""
        return tuple(f for f in self.features if isinstance(f, CategoricalFeature))

    @property
    def multi_categorical(self) -> tuple[MultiCategoricalFeature, ...]:
        return tuple(f for f in self.features if isinstance(f, MultiCategoricalFeature))

    @property
    def sequences(self) -> tuple[SequenceFeature, ...]:
        return tuple(f for f in self.features if isinstance(f, SequenceFeature))

    @property
    def histories(self) -> tuple[SequenceFeature, ...]:
        """The sequences computed from earlier rows (`history:`), which have no raw column."""
        return tuple(f for f in self.sequences if f.history is not None)

    @property
    def lists(self) -> tuple[MultiCategoricalFeature | SequenceFeature, ...]:
        """Multi-valued and sequence features, in declaration order: one padded id list each."""
        return tuple(f for f in self.features if isinstance(f, MultiCategoricalFeature | SequenceFeature))

    @property
    def scaled_dense(self) -> tuple[DenseFeature, ...]:
        """The dense features the model reads as values (the dense input): all but the bucketized ones."""
        return tuple(f for f in self.dense if not f.bucketized)

    @property
    def dense_input_dim(self) -> int:
        """Width of the model's dense input: one value per scaled dense feature, then one missing flag per
        scaled dense feature that has one."""
        return len(self.scaled_dense) + sum(1 for f in self.scaled_dense if f.missing_indicator)

    @property
    def timestamp(self) -> TimestampFeature | None:
        found = [f for f in self.features if isinstance(f, TimestampFeature)]
        return found[0] if found else None

    @property
    def dense_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.dense)

    @property
    def categorical_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.categorical)

    def feature(self, name: str) -> Feature:
        for candidate in self.features:
            if candidate.name == name:
                return candidate
        raise KeyError(f"feature spec {self.name!r} has no feature {name!r}; it has {list(self.names)}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.features)

    def request_instance(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        """One raw row (column -> text, or a list for list columns; None when empty) as the instance a client
        sends to serving: dense values as numbers, ids as text, multi-valued and sequence features as lists
        (the newest `max_length`), the timestamp as written. Derived features are left out: serving derives
        them from the timestamp."""
        out: dict[str, Any] = {}
        for feature in self.features:
            if getattr(feature, "derived_from", ""):
                continue
            value = raw.get(feature.column)
            if value is None or (isinstance(value, float) and value != value):
                out[feature.name] = None
            elif isinstance(feature, DenseFeature):
                out[feature.name] = float(value)
            elif isinstance(feature, MultiCategoricalFeature | SequenceFeature):
                items = list(value) if not isinstance(value, str) else (
                    [v for v in value.split(feature.separator) if v] if feature.separator else [value])
                out[feature.name] = [str(v) for v in items][-feature.max_length:]
            elif isinstance(feature, TimestampFeature) and feature.format in ("unix_seconds", "unix_millis"):
                out[feature.name] = int(float(value))
            else:
                out[feature.name] = str(value)
        return out

    @property
    def input_columns(self) -> tuple[str, ...]:
        """The raw columns the spec reads (label first), each once, in first-use order."""
        out = [self.label.column]
        for feature in self.features:
            if getattr(feature, "history", None) is not None:
                continue
            if not getattr(feature, "derived_from", "") and feature.column not in out:
                out.append(feature.column)
        return tuple(out)

    def tables(self) -> dict[str, TableSpec]:
        """Every vocabulary/embedding table, by name, in first-declaration order, defaults filled in."""
        defaults = self.defaults
        owners: dict[str, TableFeature] = {}
        readers: dict[str, list[str]] = {}
        for feature in self.features:
            if isinstance(feature, CategoricalFeature | MultiCategoricalFeature):
                table = feature.table or feature.name
                if table == feature.name:
                    owners[table] = feature
                readers.setdefault(table, []).append(feature.name)
            elif isinstance(feature, SequenceFeature):
                readers.setdefault(feature.shares, []).append(feature.name)
        out = {}
        for table, owner in owners.items():
            fixed = self.fixed_values(owner)
            out[table] = TableSpec(
                name=table, features=tuple(readers[table]),
                min_count=1 if fixed else _or(owner.min_count, defaults.min_count),
                evict_after_days=0 if fixed else _or(owner.evict_after_days, defaults.evict_after_days),
                max_rows=_or(owner.max_rows, defaults.max_rows),
                embedding_dim=_or(owner.embedding_dim, defaults.embedding_dim),
                hashing=owner.hashing, fixed_values=fixed,
                **_storage(owner),
            )
        return out

    def fixed_values(self, feature: TableFeature) -> tuple[str, ...]:
        """The values of a derived feature's table (hours, days, bucket numbers); () for a counted one."""
        derivation = getattr(feature, "derivation", "")
        if derivation == BUCKET_DERIVATION:
            source = self.feature(feature.derived_from)  # type: ignore[union-attr]
            return tuple(str(b) for b in range(source.num_buckets))  # type: ignore[union-attr]
        return DERIVED_VOCABULARIES[derivation] if derivation else ()

    def table_of(self, feature_name: str) -> str:
        feature = self.feature(feature_name)
        if isinstance(feature, SequenceFeature):
            return feature.shares
        if isinstance(feature, CategoricalFeature | MultiCategoricalFeature):
            return feature.table or feature.name
        raise KeyError(f"feature {feature_name!r} is {feature.kind}, which has no table")

    def as_dict(self) -> dict[str, Any]:
        """The spec as plain data (what `hash` and MLflow's spec.json hold; `spec_from_dict` reads it back);
        declared features only."""
        return {
            "name": self.name,
            "description": self.description,
            "source": _source_dict(self.source),
            "label": dataclasses.asdict(self.label),
            "features": [_feature_dict(f) for f in self.features if not getattr(f, "derived_from", "")],
        }

    def hash(self) -> str:
        """A short hash of everything a reader must agree on: the spec, its tables' resolved settings and the
        reserved rows. Two specs with the same hash read and write the same files."""
        description = {
            "spec": self.as_dict(),
            "tables": {name: _table_dict(t) for name, t in sorted(self.tables().items())},
            "reserved_rows": {"rare": RARE_ROW, "missing": MISSING_ROW},
        }
        return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _storage(owner: TableFeature) -> dict[str, Any]:
    """A table's storage settings from the feature that owns it (tiered: `hot_rows` or DEFAULT_HOT_ROWS)."""
    if getattr(owner, "storage", "memory") != "tiered":
        return {}
    return {"storage": "tiered", "hot_rows": _or(owner.hot_rows, DEFAULT_HOT_ROWS)}  # type: ignore[union-attr]


def _table_dict(table: TableSpec) -> dict[str, Any]:
    """A table's settings as the hash sees them: storage only where it is not the default, so that specs that
    do not tier a table keep the hash they had."""
    out = dataclasses.asdict(table)
    if not table.tiered:
        del out["storage"], out["hot_rows"]
    return out


def _source_dict(source: SourceSpec) -> dict[str, Any]:
    """The source as plain data; the encoding only when it is not UTF-8: it says how `ingest` reads a team's files,
    not how the raw partitions (always UTF-8) are read, so the default leaves the spec's hash as it was."""
    out = _plain(dataclasses.asdict(source))
    if out.get("encoding") == DEFAULT_ENCODING:
        del out["encoding"]
    return out


def _feature_dict(feature: Feature) -> dict[str, Any]:
    out = dataclasses.asdict(feature)
    for key in ("derived_from", "derivation"):
        out.pop(key, None)
    if out.get("storage") == "memory":  # the default, left out: the spec's hash stays as it was
        del out["storage"]
    if "hot_rows" in out and out["hot_rows"] is None:
        del out["hot_rows"]
    return _plain(out)


def _plain(entry: dict[str, Any]) -> dict[str, Any]:
    """Tuples as lists (the same JSON), so that `spec_from_dict` reads what `as_dict` wrote."""
    return {key: list(value) if isinstance(value, tuple) else value for key, value in entry.items()}


# ----------------------------------------------------------------------------------------------------------
# Loading

def preset_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in PRESET_DIR.glob("*.yaml")))


def spec_for(config: PipelineConfig) -> FeatureSpec:
    """The feature spec `config` names (features.spec), its unset settings filled from `config`. Read anew on each
    call: a run reads it once (pipelines.context.RunContext.spec)."""
    return load_spec(config.features.spec).with_defaults(FeatureDefaults.of(config))


def load_spec(name_or_path: str) -> FeatureSpec:
    """A preset by name (criteo, avazu, taobao, events) or a YAML file by path, checked and frozen. A name without
    a .yaml/.yml suffix that names a preset is the preset, even where a file or folder of that name exists (a
    team's data folder is often named after its layout)."""
    import yaml

    path = Path(name_or_path)
    preset = PRESET_DIR / f"{name_or_path}.yaml"
    if path.suffix not in {".yaml", ".yml"} and "/" not in name_or_path and preset.is_file():
        path = preset
    elif path.is_dir():
        raise FeatureSpecError(
            f"features.spec={name_or_path!r} is a directory; expected a preset name ({', '.join(preset_names())}) "
            "or a feature spec YAML file (a path ending in .yaml)"
        )
    elif path.suffix in {".yaml", ".yml"} or path.exists():
        if not path.exists():
            raise FeatureSpecError(f"features.spec={name_or_path!r}: the file {str(path)!r} does not exist")
    else:
        raise FeatureSpecError(
            f"features.spec={name_or_path!r} is neither a preset ({', '.join(preset_names())}) nor a "
            "YAML file (give a path ending in .yaml)"
        )
    try:
        data = yaml.safe_load(path.read_text())  # safe: plain data only, no tags that build objects
    except yaml.YAMLError as err:
        raise FeatureSpecError(f"feature spec {str(path)!r} is not valid YAML: {err}") from err
    return spec_from_dict(data, origin=str(path))


_TOP_KEYS = {"name", "description", "source", "label", "features"}
_SOURCE_KEYS = {f.name for f in dataclasses.fields(SourceSpec)}
_LABEL_KEYS = {"column"}
_HASHING_KEYS = {f.name for f in dataclasses.fields(HashingSpec)}
_HISTORY_KEYS = {f.name for f in dataclasses.fields(HistorySpec)}
_KIND_CLASSES: dict[str, type] = {
    "dense": DenseFeature, "categorical": CategoricalFeature, "multi_categorical": MultiCategoricalFeature,
    "sequence": SequenceFeature, "timestamp": TimestampFeature,
}
_INTERNAL_KEYS = {"kind", "derived_from", "derivation"}


def spec_from_dict(data: Any, origin: str = "<dict>") -> FeatureSpec:
    """Builds and checks a spec from plain data (a parsed YAML mapping)."""
    where = f"feature spec {origin}"
    if not isinstance(data, Mapping):
        raise FeatureSpecError(f"{where}: expected a mapping with keys {sorted(_TOP_KEYS)}, got {data!r}")
    _no_unknown(data, _TOP_KEYS, where)
    for key in ("name", "label", "features"):
        if key not in data:
            raise FeatureSpecError(f"{where}: the key {key!r} is required")
    name = data["name"]
    if not isinstance(name, str) or not name:
        raise FeatureSpecError(f"{where}: name must be a non-empty string, got {name!r}")
    source = _source(data.get("source") or {}, where)
    label = _label(data["label"], where)
    raw_features = data["features"]
    if not isinstance(raw_features, list) or not raw_features:
        raise FeatureSpecError(f"{where}: features must be a non-empty list, got {raw_features!r}")
    features: list[Feature] = []
    for index, entry in enumerate(raw_features):
        features.extend(_features(entry, f"{where}: features[{index}]"))
    features.extend(_derived(features))
    spec = FeatureSpec(name=name, source=source, label=label, features=tuple(features),
                       description=str(data.get("description") or ""))
    _check(spec, where)
    return spec


def _no_unknown(entry: Mapping[str, Any], allowed: set[str], where: str) -> None:
    for key in entry:
        if key not in allowed:
            raise FeatureSpecError(f"{where}: unknown key {key!r} (value {entry[key]!r}); allowed: {sorted(allowed)}")


def _source(entry: Any, where: str) -> SourceSpec:
    if not isinstance(entry, Mapping):
        raise FeatureSpecError(f"{where}: source must be a mapping, got {entry!r}")
    _no_unknown(entry, _SOURCE_KEYS, f"{where}: source")
    values = dict(entry)
    if "columns" in values:
        values["columns"] = _names(values["columns"], f"{where}: source.columns")
    source = SourceSpec(**values)
    _literal(source.format, SourceFormat, f"{where}: source.format")
    if not isinstance(source.header, bool):
        raise FeatureSpecError(f"{where}: source.header must be true or false, got {source.header!r}")
    if not isinstance(source.encoding, str) or not _known_encoding(source.encoding):
        raise FeatureSpecError(f"{where}: source.encoding={source.encoding!r} is not an encoding Python knows; give "
                               "one such as utf-8, utf-16, latin-1 or cp1252")
    if source.format != "parquet" and not source.header and not source.columns:
        raise FeatureSpecError(
            f"{where}: source.format={source.format!r} without a header needs source.columns (the file's "
            "columns in order)"
        )
    return source


def _known_encoding(name: str) -> bool:
    import codecs

    try:
        codecs.lookup(name)
    except LookupError:
        return False
    return True


def _label(entry: Any, where: str) -> LabelSpec:
    if isinstance(entry, str):
        entry = {"column": entry}
    if not isinstance(entry, Mapping):
        raise FeatureSpecError(f"{where}: label must be a column name or {{column: NAME}}, got {entry!r}")
    _no_unknown(entry, _LABEL_KEYS, f"{where}: label")
    column = entry.get("column")
    if not isinstance(column, str) or not column:
        raise FeatureSpecError(f"{where}: label.column must name a column, got {column!r}")
    return LabelSpec(column=column)


def _names(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise FeatureSpecError(f"{where}: expected a list of names, got {value!r}")
    return tuple(value)


def _features(entry: Any, where: str) -> list[Feature]:
    if not isinstance(entry, Mapping):
        raise FeatureSpecError(f"{where}: expected a mapping with name and kind, got {entry!r}")
    kind = entry.get("kind")
    if kind not in _KIND_CLASSES:
        raise FeatureSpecError(f"{where}: unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
    cls = _KIND_CLASSES[kind]
    allowed = {f.name for f in dataclasses.fields(cls)} - _INTERNAL_KEYS | {"kind", "names"}
    _no_unknown(entry, allowed, where)
    if ("name" in entry) == ("names" in entry):
        raise FeatureSpecError(f"{where}: give exactly one of name (one feature) or names (several alike), got "
                               f"{ {k: entry.get(k) for k in ('name', 'names')} }")
    names = (entry["name"],) if "name" in entry else _names(entry["names"], f"{where}: names")
    settings = {k: v for k, v in entry.items() if k not in {"kind", "name", "names"}}
    if "column" in settings and len(names) > 1:
        raise FeatureSpecError(f"{where}: column={settings['column']!r} cannot be shared by names {list(names)}")
    if settings.get("hashing", ...) is None:  # as_dict writes an unset hashing as null
        del settings["hashing"]
    if "hashing" in settings:
        hashing = settings["hashing"]
        if not isinstance(hashing, Mapping):
            raise FeatureSpecError(f"{where}: hashing must be a mapping {sorted(_HASHING_KEYS)}, got {hashing!r}")
        _no_unknown(hashing, _HASHING_KEYS, f"{where}: hashing")
        settings["hashing"] = HashingSpec(**hashing)
    if "derive" in settings:
        settings["derive"] = _names(settings["derive"], f"{where}: derive")
    if settings.get("history", ...) is None:
        del settings["history"]
    if "history" in settings:
        settings["history"] = _history(settings, names, where)
    out = []
    for name in names:
        if not isinstance(name, str) or not name or not name.replace("_", "").isalnum():
            raise FeatureSpecError(f"{where}: name must be letters, digits and _, got {name!r}")
        values = {"name": name, "column": settings.get("column", name), **settings}
        try:
            feature = cls(**values)
        except TypeError as err:  # a required key is missing
            missing = sorted({f.name for f in dataclasses.fields(cls) if f.init and f.default is dataclasses.MISSING
                              and f.default_factory is dataclasses.MISSING} - set(values))
            raise FeatureSpecError(f"{where} ({name!r}, kind {kind}): missing required key(s) {missing}") from err
        _check_feature(feature, f"{where} ({name!r})")
        out.append(feature)
    return out


def _history(settings: Mapping[str, Any], names: tuple[str, ...], where: str) -> HistorySpec:
    history = settings["history"]
    if not isinstance(history, Mapping):
        raise FeatureSpecError(f"{where}: history must be a mapping {sorted(_HISTORY_KEYS)}, e.g. {{key: user_id, "
                               f"value: item_id, positive_only: true}}, got {history!r}")
    _no_unknown(history, _HISTORY_KEYS, f"{where}: history")
    for key, unset in (("column", names[0]), ("separator", "")):
        if settings.get(key, unset) != unset:  # as_dict writes the unset values: they read back
            raise FeatureSpecError(f"{where}: a history sequence is computed from earlier rows, so it reads no "
                                   f"{key} (got {key}={settings[key]!r}); drop {key}")
    key, value = history.get("key"), history.get("value") or settings.get("shares", "")
    positive_only = history.get("positive_only", False)
    if not isinstance(key, str) or not key or not isinstance(value, str):
        raise FeatureSpecError(f"{where}: history.key (and history.value) must name categorical features, got "
                               f"key={key!r}, value={history.get('value')!r}")
    if not isinstance(positive_only, bool):
        raise FeatureSpecError(f"{where}: history.positive_only must be true or false, got {positive_only!r}")
    return HistorySpec(key=key, value=value, positive_only=positive_only)


_TYPES: dict[str, type | tuple[type, ...]] = {
    "min_count": int, "evict_after_days": int, "max_rows": int, "embedding_dim": int, "max_length": int,
    "num_buckets": int, "clip_quantile": (int, float), "missing_indicator": bool, "separator": str, "table": str,
    "shares": str, "column": str, "format": str, "hot_rows": int, "storage": str,
}


def _check_feature(feature: Feature, where: str) -> None:
    for item in dataclasses.fields(feature):
        value = getattr(feature, item.name)
        expected = _TYPES.get(item.name)
        if expected and value is not None and (not isinstance(value, expected) or isinstance(value, bool)
                                               and expected is not bool):
            raise FeatureSpecError(f"{where}: {item.name} must be {getattr(expected, '__name__', 'a number')}, "
                                   f"got {value!r}")
    for key in ("min_count", "max_rows", "embedding_dim", "max_length", "num_buckets", "hot_rows"):
        value = getattr(feature, key, None)
        if value is not None and value < 1:
            raise FeatureSpecError(f"{where}: {key} must be at least 1, got {value!r}")
    if getattr(feature, "evict_after_days", None) is not None and feature.evict_after_days < 0:  # type: ignore[union-attr]
        raise FeatureSpecError(f"{where}: evict_after_days must be 0 (never) or more, got {feature.evict_after_days!r}")  # type: ignore[union-attr]
    if isinstance(feature, DenseFeature):
        _literal(feature.transform, DenseTransformKind, f"{where}: transform")
        if feature.bucketized and feature.num_buckets < 2:
            raise FeatureSpecError(f"{where}: transform 'buckets' needs num_buckets >= 2, got {feature.num_buckets!r}")
        if not 0 <= feature.clip_quantile < 0.5:
            raise FeatureSpecError(f"{where}: clip_quantile must be in [0, 0.5), got {feature.clip_quantile!r}")
    if isinstance(feature, CategoricalFeature | MultiCategoricalFeature):
        _literal(feature.dtype, CategoricalDtype, f"{where}: dtype")
        if feature.hashing is not None:
            _literal(feature.hashing.combiner, HashCombiner, f"{where}: hashing.combiner")
            if feature.hashing.functions < 1 or feature.hashing.buckets < 1:
                raise FeatureSpecError(f"{where}: hashing needs functions >= 1 and buckets >= 1, got "
                                       f"{feature.hashing!r}")
    if isinstance(feature, CategoricalFeature):
        _literal(feature.storage, TableStorage, f"{where}: storage")
        if feature.hot_rows is not None and feature.storage != "tiered":
            raise FeatureSpecError(f"{where}: hot_rows={feature.hot_rows} sizes the hot tier of a tiered table; set "
                                   "storage: tiered too, or drop hot_rows")
        if feature.storage == "tiered" and feature.hashing is not None:
            raise FeatureSpecError(f"{where}: a table is either hashed (hashing) or tiered (storage: tiered), not "
                                   "both; drop one of them")
    if isinstance(feature, MultiCategoricalFeature):
        _literal(feature.pooling, Pooling, f"{where}: pooling")
    if isinstance(feature, TimestampFeature):
        for derived in feature.derive:
            _literal(derived, Derived, f"{where}: derive")


def _literal(value: Any, literal: Any, where: str) -> None:
    allowed = get_args(literal)
    if value not in allowed:
        raise FeatureSpecError(f"{where}: unknown value {value!r}; expected one of {', '.join(map(str, allowed))}")


def _derived(features: list[Feature]) -> list[Feature]:
    out: list[Feature] = []
    for feature in features:
        if isinstance(feature, TimestampFeature):
            for derived in feature.derive:
                name = f"{feature.name}_{derived}"
                out.append(CategoricalFeature(name=name, column=feature.column, derived_from=feature.name,
                                              derivation=derived))
        if isinstance(feature, DenseFeature) and feature.bucketized:
            out.append(CategoricalFeature(name=feature.name + BUCKET_SUFFIX, column=feature.column,
                                          derived_from=feature.name, derivation=BUCKET_DERIVATION))
    return out


_TABLE_KEYS = ("min_count", "evict_after_days", "max_rows", "embedding_dim", "hashing", "hot_rows")


def _check_history(feature: SequenceFeature, history: HistorySpec, by_name: Mapping[str, Feature],
                   spec: FeatureSpec, where: str) -> None:
    single = [f.name for f in spec.categorical if not f.derived_from]
    for role in ("key", "value"):
        named = getattr(history, role)
        target = by_name.get(named)
        if not isinstance(target, CategoricalFeature) or target.derived_from:
            raise FeatureSpecError(f"{where}: sequence {feature.name!r} has history.{role}={named!r}, which names no "
                                   f"categorical feature of the raw rows; categorical features: {single}")
    value = by_name[history.value]
    if (value.table or value.name) != feature.shares:  # type: ignore[union-attr]
        raise FeatureSpecError(f"{where}: sequence {feature.name!r} lists history.value={history.value!r}, which reads "
                               f"the table of {(value.table or value.name)!r}, but the sequence shares "  # type: ignore[union-attr]
                               f"{feature.shares!r}: list a feature of that table, or share its table")


def _check(spec: FeatureSpec, where: str) -> None:
    seen: set[str] = set()
    for feature in spec.features:
        if feature.name in seen or feature.name == spec.label.column:
            raise FeatureSpecError(f"{where}: duplicate feature name {feature.name!r}")
        if feature.name in RESERVED_NAMES:
            raise FeatureSpecError(f"{where}: feature name {feature.name!r} is reserved ({sorted(RESERVED_NAMES)} "
                                   f"name the model's inputs); give it another name and column={feature.name!r}")
        seen.add(feature.name)
    timestamps = [f.name for f in spec.features if isinstance(f, TimestampFeature)]
    if len(timestamps) > 1:
        raise FeatureSpecError(f"{where}: at most one timestamp feature, got {timestamps}")
    if not any(isinstance(f, DenseFeature | CategoricalFeature | MultiCategoricalFeature) for f in spec.features):
        raise FeatureSpecError(f"{where}: no model input: declare at least one dense or categorical feature")
    by_name = {f.name: f for f in spec.features}
    for feature in spec.features:
        if isinstance(feature, CategoricalFeature | MultiCategoricalFeature) and feature.table \
                and feature.table != feature.name:
            owner = by_name.get(feature.table)
            if not isinstance(owner, CategoricalFeature | MultiCategoricalFeature) or (owner.table or owner.name) \
                    != owner.name:
                raise FeatureSpecError(
                    f"{where}: feature {feature.name!r} has table={feature.table!r}, which is not a categorical "
                    "feature that owns its table"
                )
            pinned = [k for k in _TABLE_KEYS if getattr(feature, k, None) is not None]
            if getattr(feature, "storage", "memory") != "memory":
                pinned.append("storage")
            if pinned:
                raise FeatureSpecError(
                    f"{where}: feature {feature.name!r} shares the table of {feature.table!r}, so it cannot set "
                    f"{pinned}: set them on {feature.table!r}"
                )
            if owner.dtype != feature.dtype:
                raise FeatureSpecError(f"{where}: feature {feature.name!r} (dtype {feature.dtype}) shares the table "
                                       f"of {feature.table!r} (dtype {owner.dtype})")
        if isinstance(feature, SequenceFeature):
            owner = by_name.get(feature.shares)
            if not isinstance(owner, CategoricalFeature) or owner.derived_from:
                raise FeatureSpecError(
                    f"{where}: sequence {feature.name!r} has shares={feature.shares!r}, which names no "
                    f"categorical feature; categorical features: {list(spec.categorical_names)}"
                )
            if (owner.table or owner.name) != owner.name:
                raise FeatureSpecError(f"{where}: sequence {feature.name!r} shares {feature.shares!r}, which "
                                       f"itself reads the table of {owner.table!r}: name {owner.table!r} instead")
            if feature.history is not None:
                _check_history(feature, feature.history, by_name, spec, where)
    if spec.source.columns:
        missing = [c for c in spec.input_columns if c not in spec.source.columns]
        if missing:
            raise FeatureSpecError(f"{where}: columns {missing} are read by the spec but not in source.columns "
                                   f"{list(spec.source.columns)}")
