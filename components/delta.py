"""Deltas: what changed in a model since its parent version, small enough to ship every minute. The format
is the contract between the incremental trainer, which writes deltas, and serving, which applies them.

A delta holds the vocabulary entries admitted since the parent (feature + KEY_SEPARATOR + value -> row), and
for every weight of the model the rows (along the first axis) whose values differ from the parent's, with
their new values. With row-sparse embedding updates a minute of traffic touches few embedding rows, so the
delta is those rows plus the dense layers. Applying the parent's full model and then its deltas in order
gives the trainer's weights bit for bit: unchanged rows are equal by construction, changed rows are copied.

On disk a delta is `delta.npz` (uncompressed, the arrays named as the SavedModel's `apply_delta` endpoint
takes them: trainer.export.delta_input_signature) and a manifest of kind "delta" naming its parent version,
the full version its chain starts from, the training step, the data span and the checksums.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from components.feature_state import FeatureState
from components.manifest import MANIFEST_NAME, commit_dir, read_manifest, staging_dir, write_manifest

DELTA_KIND = "delta"
FULL_KIND = "full_model"
DELTA_FILE = "delta.npz"
# A minute run's checkpoint also holds its weights as plain arrays (w000, w001, ... in weight_specs order),
# so the delta export reads them without rebuilding a Keras model.
WEIGHTS_FILE = "weights.npz"
CHECKPOINT_KIND = "checkpoint"
# Between feature name and value in the serving lookup keys (trainer.export): one table serves all features,
# and "C1" + "0" never meets "C10" + "" because the separator sits between them.
KEY_SEPARATOR = "\x1f"
# In the path of a tiered table's hot slots ("<model>/embedding/tiered_table_3/embeddings"): in a served model,
# its row cache.
TIERED_CACHE_MARK = "/tiered_table_"
# The path's tail of a linear part's per-value weights (trainer/layers/linear_logit.py: DeepFM, Wide & Deep), a
# concatenated table of width 1 laid out as the embedding's; a tiered table's store keeps each row's weight as
# the last column of its record.
LINEAR_PATH_TAIL = ("value_weights", "embeddings")


class DeltaError(ValueError):
    """A delta cannot be computed, or does not fit the model it is applied to."""


def rows_name(index: int) -> str:
    return f"rows_{index:03d}"


def values_name(index: int) -> str:
    return f"values_{index:03d}"


def changed_rows(parent: np.ndarray, current: np.ndarray) -> np.ndarray:
    """Indices along the first axis where any value differs (NaN-safe: NaN == NaN here); a scalar weight is
    one row, row 0."""
    if parent.shape != current.shape:
        raise DeltaError(f"a weight changed shape from {parent.shape} to {current.shape}; a delta cannot express "
                         "that: export a full model instead")
    if current.ndim == 0:
        same = parent == current or (np.isnan(parent) and np.isnan(current))
        return np.empty(0, np.int64) if same else np.zeros(1, np.int64)
    differ = (parent != current) & ~(np.isnan(parent) & np.isnan(current)) if current.dtype.kind == "f" else (
        parent != current)
    return np.flatnonzero(differ.reshape(len(current), -1).any(axis=1)).astype(np.int64)


def weight_arrays(parent: Sequence[np.ndarray], current: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """rows_i / values_i for every weight i: the rows that changed and their new values."""
    if len(parent) != len(current):
        raise DeltaError(f"the parent model has {len(parent)} weights and this one {len(current)}: not the same "
                         "model; export a full model instead")
    arrays: dict[str, np.ndarray] = {}
    for index, (old, new) in enumerate(zip(parent, current, strict=True)):
        arrays.update(changed_arrays(index, np.asarray(old), np.asarray(new)))
    return arrays


def changed_arrays(index: int, old: np.ndarray, new: np.ndarray) -> dict[str, np.ndarray]:
    """rows_<index> / values_<index>: the rows of weight `index` that changed from `old` to `new`, and their values."""
    rows = changed_rows(old, new)
    return {rows_name(index): rows, values_name(index): new.reshape(1)[rows] if new.ndim == 0 else new[rows]}


def served_weight_arrays(parent: Sequence[np.ndarray], current: Sequence[np.ndarray],
                         specs: Sequence[Mapping[str, Any]], served_specs: Sequence[Mapping[str, Any]],
                         table_sizes: Mapping[str, int], hashed: Sequence[str],
                         tiered_rows: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """rows_i / values_i for every weight i of the served model (`served_specs`: every table in memory) from a
    training model whose tiered tables live in stores (`parent` and `current` in the order of `specs`, where
    the concatenated table lacks the tiered tables and the hot slots are weights of their own).

    The concatenated table's changed rows move from the training layout to the served one (each table's rows
    keep their table-local ids; only the tables' offsets differ); each tiered table contributes the rows
    `tiered_rows[name]` = (table-local row ids, their values) read from its store, the rows the minute's
    batches read, not a diff of two tables. The hot slots are not served and have no entry. With a linear part
    (DeepFM, Wide & Deep) those values are records of the row's values then its linear weight: the embedding
    table takes their first columns, the linear part's table (LINEAR_PATH_TAIL) their last.

    A served model that keeps the tiered tables on disk itself (its weights include the row caches, named
    TIERED_CACHE_MARK: trainer.export RowSlots) has the training layout: the concatenated table's rows stay,
    the caches get no rows, and each tiered table's rows go in `tiered_rows_<name>` / `tiered_values_<name>`,
    which serving writes to its copy of the table and to the rows it has cached (serving/row_cache.py)."""
    from components.table_report import EMBEDDING_PATH_TAIL, table_offsets

    if any(TIERED_CACHE_MARK in str(spec["path"]) for spec in served_specs):
        return _tiered_served_arrays(parent, current, specs, served_specs, tiered_rows)
    by_path = {str(spec["path"]): index for index, spec in enumerate(specs)}
    missing = [spec["path"] for spec in served_specs if spec["path"] not in by_path]
    if missing:
        raise DeltaError(f"the served model has weights {missing} the trained one lacks: not the same model; export "
                         "a full model instead")
    train_offsets = table_offsets(table_sizes, [*hashed, *tiered_rows])
    served_offsets = table_offsets(table_sizes, hashed)
    arrays: dict[str, np.ndarray] = {}
    for index, spec in enumerate(served_specs):
        old, new = np.asarray(parent[by_path[spec["path"]]]), np.asarray(current[by_path[spec["path"]]])
        tail = tuple(str(spec["path"]).split("/")[-2:])
        if tail not in (EMBEDDING_PATH_TAIL, LINEAR_PATH_TAIL):
            arrays.update(changed_arrays(index, old, new))
            continue
        width = int(spec["shape"][1]) if len(spec["shape"]) > 1 else 1
        columns = slice(0, width) if tail == EMBEDDING_PATH_TAIL else slice(-width, None)
        changed = changed_rows(old, new)
        parts_rows, parts_values = [], []
        for name, start in train_offsets.items():
            size = int(table_sizes[name])
            local = changed[(changed >= start) & (changed < start + size)] - start
            parts_rows.append(local + served_offsets[name])
            parts_values.append(new[local + start])
        for name, (local, values) in tiered_rows.items():
            parts_rows.append(np.asarray(local, np.int64) + served_offsets[name])
            parts_values.append(np.asarray(values, new.dtype).reshape(len(local), -1)[:, columns])
        rows = np.concatenate(parts_rows).astype(np.int64) if parts_rows else np.zeros(0, np.int64)
        order = np.argsort(rows, kind="stable")
        values = (np.concatenate(parts_values) if parts_values else np.zeros((0, width), new.dtype))
        arrays[rows_name(index)], arrays[values_name(index)] = rows[order], values[order]
    return arrays


def _tiered_served_arrays(parent: Sequence[np.ndarray], current: Sequence[np.ndarray],
                          specs: Sequence[Mapping[str, Any]], served_specs: Sequence[Mapping[str, Any]],
                          tiered_rows: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    by_path = {str(spec["path"]): index for index, spec in enumerate(specs)}
    arrays: dict[str, np.ndarray] = {}
    for index, spec in enumerate(served_specs):
        path = str(spec["path"])
        if TIERED_CACHE_MARK in path:  # the row cache: serving fills it, deltas leave it
            arrays[rows_name(index)] = np.zeros(0, np.int64)
            arrays[values_name(index)] = np.zeros((0, *spec["shape"][1:]), np.dtype(spec["dtype"]))
            continue
        if path not in by_path:
            raise DeltaError(f"the served model has a weight {path!r} the trained one lacks: not the same model; "
                             "export a full model instead")
        arrays.update(changed_arrays(index, np.asarray(parent[by_path[path]]), np.asarray(current[by_path[path]])))
    for name, (rows, values) in tiered_rows.items():
        arrays[tiered_rows_name(name)] = np.asarray(rows, np.int64)
        arrays[tiered_values_name(name)] = np.asarray(values, np.float32)
    return arrays


def tiered_rows_name(table: str) -> str:
    return f"tiered_rows_{table}"


def tiered_values_name(table: str) -> str:
    return f"tiered_values_{table}"


def new_vocabulary_entries(parent: FeatureState, state: FeatureState) -> tuple[np.ndarray, np.ndarray]:
    """Lookup keys and rows of the values admitted in `state` that `parent` did not have. An admitted value
    that moved (only eviction moves one, and eviction starts a new chain) is refused."""
    keys: list[str] = []
    rows: list[int] = []
    for name in state.vocabularies:
        before = dict(zip(parent.vocabularies[name].values, parent.vocabularies[name].rows, strict=True))
        for value, row in zip(state.vocabularies[name].values, state.vocabularies[name].rows, strict=True):
            old = before.get(value)
            if old is None:
                keys.append(name + KEY_SEPARATOR + value)
                rows.append(row)
            elif old != row:
                raise DeltaError(f"{name} value {value!r} moved from row {old} to {row}: rows only move in the daily "
                                 "run, which starts a new chain with a full model")
    return np.array(keys, dtype=np.str_), np.array(rows, dtype=np.int64)


def delta_arrays(parent_weights: Sequence[np.ndarray], weights: Sequence[np.ndarray], parent_state: FeatureState,
                 state: FeatureState) -> dict[str, np.ndarray]:
    keys, rows = new_vocabulary_entries(parent_state, state)
    return {"vocab_keys": keys, "vocab_rows": rows, **weight_arrays(parent_weights, weights)}


def write_delta(directory: Path, arrays: Mapping[str, np.ndarray], *, version: str, parent: str, chain_root: str,
                weight_specs: Sequence[Mapping[str, Any]], extra: Mapping[str, Any],
                spec_hash: str | None = None) -> dict[str, Any]:
    """Writes `directory` (replacing an older one) atomically: delta.npz, then the manifest, then rename."""
    if int(version) <= int(parent):
        raise DeltaError(f"delta version {version} must be above its parent's, {parent}")
    staging = staging_dir(directory)
    with open(staging / DELTA_FILE, "wb") as handle:
        np.savez(handle, **arrays)
    changed = {spec["path"]: int(len(arrays[rows_name(i)])) for i, spec in enumerate(weight_specs)}
    manifest = write_manifest(
        staging, kind=DELTA_KIND, version=version, files=[DELTA_FILE], spec_hash=spec_hash,
        extra={"parent": parent, "chain_root": chain_root, "weight_specs": list(weight_specs),
               "rows_changed": changed, "num_vocabulary_entries": int(len(arrays["vocab_keys"])),
               "delta_bytes": (staging / DELTA_FILE).stat().st_size, **dict(extra)},
    )
    commit_dir(staging, directory)
    return manifest


def read_delta(directory: Path, weight_specs: Sequence[Mapping[str, Any]] | None = None,
               verify: bool = True) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The delta's manifest and arrays, after checking its checksums and, given the served model's
    `weight_specs`, that it was computed for a model of the same weights."""
    directory = Path(directory)
    manifest = read_manifest(directory, kind=DELTA_KIND, verify=verify)
    if weight_specs is not None and _shapes(manifest["weight_specs"]) != _shapes(weight_specs):
        raise DeltaError(f"delta {manifest['version']} in {directory} was computed for other weights than the "
                         "served model's; reload the full model of its chain")
    with np.load(directory / DELTA_FILE, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    for index, spec in enumerate(manifest["weight_specs"]):
        rows, values = arrays[rows_name(index)], arrays[values_name(index)]
        if len(rows) != len(values) or (len(rows) and (rows.min() < 0 or rows.max() >= max(1, _first(spec)))):
            raise DeltaError(f"delta {manifest['version']}: weight {spec['path']} has rows outside 0.."
                             f"{_first(spec) - 1} or {len(rows)} rows for {len(values)} values")
    return manifest, arrays


def weight_specs(model: Any) -> list[dict[str, Any]]:
    """A Keras model's weights in the order deltas number them: path, shape and dtype of each (no TensorFlow
    needed: the JAX train step writes them too)."""
    return [{"path": v.path, "shape": [int(d) for d in v.shape], "dtype": str(v.dtype)} for v in model.weights]


def save_weights(directory: Path, weights: Sequence[np.ndarray]) -> str:
    """Writes the weights as WEIGHTS_FILE into `directory` (a checkpoint being written); returns its name."""
    with open(Path(directory) / WEIGHTS_FILE, "wb") as handle:
        np.savez(handle, **{f"w{i:03d}": np.asarray(w) for i, w in enumerate(weights)})
    return WEIGHTS_FILE


def saved_weights(checkpoint_dir: Path) -> tuple[list[dict[str, Any]], list[np.ndarray]] | None:
    """(weight_specs, weights) from a checkpoint's WEIGHTS_FILE, or None when it has none (a daily one)."""
    manifest = read_manifest(checkpoint_dir, kind=CHECKPOINT_KIND)
    if WEIGHTS_FILE not in manifest["files"] or "weight_specs" not in manifest:
        return None
    with np.load(Path(checkpoint_dir) / WEIGHTS_FILE, allow_pickle=False) as data:
        return manifest["weight_specs"], [data[f"w{i:03d}"] for i in range(len(manifest["weight_specs"]))]


def delta_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in Path(directory).iterdir() if p.is_file() and p.name != MANIFEST_NAME)


def _first(spec: Mapping[str, Any]) -> int:
    return int(spec["shape"][0]) if spec["shape"] else 1


def _shapes(specs: Sequence[Mapping[str, Any]]) -> list[tuple[str, tuple[int, ...]]]:
    return [(spec["path"], tuple(spec["shape"])) for spec in specs]
