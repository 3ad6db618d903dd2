"""The tiered tables of one `train_model` run: their stores, hot tiers and the streams through which `fit`,
`evaluate`, calibration and the held-out predictions see slot ids.

A feature spec table with `storage: tiered` lives on local disk (trainer/row_store.py) with `hot_rows` rows in
memory (trainer/hot_tier.py); the model's CategoricalEmbedding holds only those slots (trainer/layers/hot_table.py).
`TieredTables` is what `train_model` needs on top of that library:

- the live stores under `<checkpoint>/progress/tables/<table>.rows`, made from the uniform initializer (seeded
  by the run's seed and the table's index) or, when warm-started, from the parent checkpoint's store with the
  reset rows drawn afresh; never whole in memory;
- `training(dataset)` and `applied(dataset)`: a tf.data pipeline's batches as numpy through a TieredBatches
  stream, for `fit` (with the callback it returns) or for code that calls the model batch by batch;
- `snapshot(directory)` / `restore(directory)`: the tables as of the last applied step, for progress saves and
  the best epoch (a copy of each file: a reflink or `copy_file_range`, never through memory);
- `commit(checkpoint_dir)`: the final tables into `<checkpoint>/tables/<table>.rows`, listed in its manifest.

`in_memory_model(model, tables_dir)` is the other way round: the same model with every table in memory, its
rows read from the stores a chunk at a time, for the export (serving reads a whole table today).
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import keras
import numpy as np

from trainer.hot_tier import HotTier
from trainer.layers.categorical_embedding import CategoricalEmbedding
from trainer.model_inputs import CATEGORICAL_INPUT
from trainer.optimizers import INITIAL_ACCUMULATOR_VALUE
from trainer.row_store import CREATE_CHUNK_ROWS, RowStore, uniform_initializer
from trainer.tiered_training import HotTierCallback, TieredBatches, VariableSlots, accumulator_of

TABLES_DIR = "tables"
STORE_SUFFIX = ".rows"


def tiered_layer(model: keras.Model) -> CategoricalEmbedding | None:
    """The model's CategoricalEmbedding when it has tiered tables, else None."""
    layer = getattr(model, "embedding", None)
    if isinstance(layer, CategoricalEmbedding) and layer.tiered_tables:
        return layer
    return None


def store_name(table: str) -> str:
    return table + STORE_SUFFIX


class TieredTables:
    """The stores and hot tiers of `layer`'s tiered tables (table index -> name in `names`), live in `directory`."""

    def __init__(self, model: keras.Model, layer: CategoricalEmbedding, names: Sequence[str], directory: Path,
                 ahead: int = 2) -> None:
        self.model = model
        self.layer = layer
        self.names = {table: names[table] for table in layer.tiered_tables}
        self.directory = Path(directory)
        self.ahead = ahead
        self.stores: dict[int, RowStore] = {}
        self.tiers: dict[int, HotTier] = {}
        self.slots: dict[int, VariableSlots] = {}
        self.totals: dict[str, dict[str, int]] = {}  # counters of tiers and stores already closed

    # --- the stores ---------------------------------------------------------------------------------------

    def path(self, table: int) -> Path:
        return self.directory / store_name(self.names[table])

    def create(self, seed: int, parent_tables: Path | None = None,
               reset_rows: Mapping[int, Sequence[int]] | None = None,
               parent_rows: Mapping[int, np.ndarray] | None = None) -> dict[str, int]:
        """New live stores: rows from the uniform initializer (seed + table index), or, from `parent_tables` (a
        checkpoint's tables directory) or `parent_rows` (table index -> the parent's rows, where it held the
        table in memory), the parent's rows with the rows in `reset_rows` (table index -> row ids) and the rows
        past the parent's table drawn afresh; accumulators at the optimizer's initial value either way (a warm
        start starts a new optimizer, as for tables in memory). Returns warm-start counts."""
        self.close()
        self.directory.mkdir(parents=True, exist_ok=True)
        counts = {"rows_kept": 0, "rows_reset": 0, "rows_new": 0}
        for table in self.layer.tiered_tables:
            num_rows = self.layer.table_sizes[table]
            dim = self.layer.embedding_dim
            fresh = uniform_initializer(dim, seed + table)
            parent_path = parent_tables / store_name(self.names[table]) if parent_tables is not None else None
            if parent_path is not None and not parent_path.exists():
                raise FileNotFoundError(f"The warm start's checkpoint has no store of tiered table "
                                        f"{self.names[table]!r} at {parent_path}; set train.warm_start=false to "
                                        "train from scratch")
            if parent_path is None and (parent_rows or {}).get(table) is None:
                self.stores[table] = RowStore.create(self.path(table), num_rows, dim, fresh,
                                                     initial_accumulator=INITIAL_ACCUMULATOR_VALUE)
                continue
            with (RowStore.open(parent_path, writable=False) if parent_path is not None
                  else ArrayRows(np.asarray(parent_rows[table]))) as parent:  # type: ignore[index]
                if parent.embedding_dim != dim:
                    raise ValueError(f"The parent's tiered table {self.names[table]!r} has dimension "
                                     f"{parent.embedding_dim}, this model {dim}; warm start needs the same "
                                     "dimension: set train.warm_start=false to train from scratch")
                reset = np.unique(np.asarray(list((reset_rows or {}).get(table, ())), dtype=np.int64))
                chunks = warm_chunks(parent, num_rows, fresh, reset)
                self.stores[table] = RowStore.write_new(self.path(table), num_rows, dim, chunks)
                kept = min(num_rows, parent.num_rows)
                resets = int(np.count_nonzero(reset < kept))
                counts["rows_kept"] += kept - resets
                counts["rows_reset"] += resets
                counts["rows_new"] += max(0, num_rows - parent.num_rows)
        self.new_tiers()
        return counts

    def open(self) -> None:
        """Opens the live stores as they are on disk (after `restore`), with empty hot tiers."""
        self.close()
        for table in self.layer.tiered_tables:
            self.stores[table] = RowStore.open(self.path(table))
        self.new_tiers()

    def hot_paths(self) -> set[str]:
        """The paths of the hot slots' variables (what a warm start leaves to the stores)."""
        return {self.layer.hot_table(table).embeddings.path for table in self.layer.tiered_tables}

    def new_tiers(self) -> None:
        self.tiers = {table: HotTier(store, self.layer.tiered_tables[table]) for table, store in self.stores.items()}

    def close(self) -> None:
        self.totals = self.counters()
        for store in self.stores.values():
            store.close()
        self.stores, self.tiers = {}, {}

    # --- streams ------------------------------------------------------------------------------------------

    def slot_access(self) -> dict[int, VariableSlots]:
        if not self.slots:
            optimizer = self.model.optimizer
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            for table in self.layer.tiered_tables:
                variable = self.layer.hot_table(table).embeddings
                self.slots[table] = VariableSlots(variable, accumulator_of(optimizer, variable))
        return self.slots

    def stream(self, dataset: Any, training: bool) -> tuple[TieredBatches, HotTierCallback]:
        batches = TieredBatches(numpy_batches(dataset), self.layer, self.tiers, key=CATEGORICAL_INPUT,
                                training=training, ahead=self.ahead)
        callback = HotTierCallback(batches)
        callback.slots = self.slot_access()
        return batches, callback

    def training(self, dataset: Any) -> tuple[Iterator[Any], HotTierCallback]:
        """An iterator of `dataset`'s batches for `fit`, and the callback that must go with it."""
        batches, callback = self.stream(dataset, training=True)
        return iter(batches), callback

    def evaluate(self, model: keras.Model, dataset: Any) -> dict[str, float]:
        """`model.evaluate` over `dataset` through the hot tiers, as Keras names held-out metrics ("val_" first)."""
        batches, callback = self.stream(dataset, training=False)
        logs = model.evaluate(iter(batches), callbacks=[callback], verbose=0, return_dict=True)
        return {f"val_{name}": float(value) for name, value in logs.items()}

    def applied(self, dataset: Any) -> Iterator[tuple[Any, Any]]:
        """`dataset`'s batches with each one's rows loaded into the hot tiers before it is yielded, for code
        that calls the model itself (calibration, the held-out predictions). Read it to the end, or close it."""
        batches, callback = self.stream(dataset, training=False)
        finished = False
        try:
            for batch in batches:
                callback.apply_next()
                yield batch
            finished = True
        finally:
            if not finished:  # stopped early: plans made ahead and never applied
                callback.reset()

    # --- snapshots ----------------------------------------------------------------------------------------

    def flush(self) -> None:
        """Every dirty slot written back: the stores then hold the tables as of the last applied step."""
        slots = self.slot_access()
        for table, tier in self.tiers.items():
            tier.flush(slots[table])

    def snapshot(self, directory: Path) -> None:
        """Flushes, then copies each live store into `directory` (replaced whole: files under temporary names,
        then the directory renamed into place)."""
        self.flush()
        directory = Path(directory)
        partial = directory.with_name(f".{directory.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        for table, store in self.stores.items():
            store.snapshot(partial / store_name(self.names[table]))
        if directory.exists():
            shutil.rmtree(directory)
        partial.rename(directory)

    def restore(self, directory: Path) -> None:
        """The live stores replaced by the snapshot in `directory`, with empty hot tiers. The hot slots' values in
        the model are not written back (the weights restored with the snapshot replace them)."""
        self.close()
        for table in self.layer.tiered_tables:
            source = Path(directory) / store_name(self.names[table])
            if not source.exists():
                raise FileNotFoundError(f"No snapshot of tiered table {self.names[table]!r} at {source}: the "
                                        "progress or best epoch it belongs to is incomplete; delete "
                                        f"{Path(directory).parent} to train from the start")
            with RowStore.open(source, writable=False) as snapshot:
                snapshot.snapshot(self.path(table))
        self.open()

    def commit(self, checkpoint_dir: Path) -> list[str]:
        """Flushes and moves the live stores into `checkpoint_dir/tables` (a rename: no copy); returns their
        names relative to `checkpoint_dir`, for its manifest."""
        self.flush()
        target = Path(checkpoint_dir) / TABLES_DIR
        target.mkdir(parents=True, exist_ok=True)
        paths = {table: self.path(table) for table in self.stores}
        self.close()
        files = []
        for table, path in paths.items():
            name = store_name(self.names[table])
            path.replace(target / name)
            files.append(f"{TABLES_DIR}/{name}")
        return files

    def counters(self) -> dict[str, dict[str, int]]:
        """Per table: what its hot tiers and stores did over the run (TierCounters as `tier_*`, StoreCounters as
        `store_*`), summed over the tiers made after each restore."""
        out = {name: dict(values) for name, values in self.totals.items()}
        for table, tier in self.tiers.items():
            current = {**{f"tier_{k}": v for k, v in dataclasses.asdict(tier.counters).items()},
                       **{f"store_{k}": v for k, v in dataclasses.asdict(tier.store.counters).items()}}
            total = out.setdefault(self.names[table], {})
            for key, value in current.items():
                total[key] = total.get(key, 0) + int(value)
        return out


def warm_chunks(parent: RowStore | ArrayRows, num_rows: int, fresh: Any, reset: np.ndarray,
                chunk_rows: int = CREATE_CHUNK_ROWS) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(values, accumulators) chunks of a warm-started table: the parent's rows, `fresh(start, stop)` for the
    reset rows and the rows past the parent's table, accumulators at their initial value."""
    for start in range(0, num_rows, chunk_rows):
        stop = min(num_rows, start + chunk_rows)
        values = np.asarray(fresh(start, stop), dtype=np.float32)
        kept_stop = min(stop, parent.num_rows)
        if kept_stop > start:
            old, _ = parent.read(np.arange(start, kept_stop))
            keep = np.ones(kept_stop - start, dtype=bool)
            inside = reset[(reset >= start) & (reset < kept_stop)]
            keep[inside - start] = False
            values[:kept_stop - start][keep] = old[keep]
        yield values, np.full_like(values, INITIAL_ACCUMULATOR_VALUE)


class ArrayRows:
    """An in-memory table read like a RowStore (`read`, `num_rows`, `embedding_dim`), for a warm start from a parent
    that held the table in memory."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values
        self.num_rows, self.embedding_dim = values.shape

    def read(self, rows: np.ndarray) -> tuple[np.ndarray, None]:
        return np.asarray(self.values[rows], dtype=np.float32), None

    def __enter__(self) -> ArrayRows:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def store_reader(path: Path) -> Callable[[np.ndarray], np.ndarray]:
    """A function of row ids -> their values in the store at `path` (opened for each call, read only)."""

    def read(rows: np.ndarray) -> np.ndarray:
        with RowStore.open(path, writable=False) as store:
            return store.read(np.asarray(rows, dtype=np.int64))[0]

    return read


def checkpoint_tables(checkpoint_dir: Path, tiered: Mapping[str, int],
                      counters: Mapping[str, Mapping[str, int]] | None = None) -> dict[str, dict[str, Any]]:
    """What the table report (components/table_report.py) takes of a checkpoint's tiered tables (name -> hot
    rows): a reader of each store's rows, its hot rows, its bytes of values, and the training's counters."""
    out = {}
    for name, hot_rows in tiered.items():
        path = Path(checkpoint_dir) / TABLES_DIR / store_name(name)
        with RowStore.open(path, writable=False) as store:
            values_bytes = store.num_rows * store.embedding_dim * 4
        out[name] = {"rows": store_reader(path), "hot_rows": hot_rows, "bytes": values_bytes,
                     "counters": dict((counters or {}).get(name, {}))}
    return out


def numpy_batches(dataset: Any) -> Iterable[tuple[Any, Any]]:
    """A tf.data dataset's (features, label) batches as numpy; anything else as it is."""
    as_numpy = getattr(dataset, "as_numpy_iterator", None)
    return as_numpy() if as_numpy is not None else dataset


def in_memory_model(model: keras.Model, tables_dir: Path, table_names: Sequence[str]) -> keras.Model:
    """`model` with its tiered tables in memory: the same class and config without `tiered_tables`, every weight
    copied, each tiered table's rows read from `tables_dir` (`<table_names[index]>.rows`) a chunk at a time into
    the concatenated table. The result holds every table whole: what the export and serving read today."""
    layer = tiered_layer(model)
    if layer is None:
        return model
    config = model.get_config()
    options = dict(config["embedding_options"])
    options.pop("tiered_tables", None)
    config["embedding_options"] = options
    plain = type(model).from_config(config)
    plain.build(model_input_shapes(model))
    by_path = {v.path: v for v in model.weights}
    new_layer = plain.embedding
    for variable in plain.weights:
        if variable.path == new_layer.embeddings.path:
            variable.assign(merged_table(layer, new_layer, tables_dir, table_names))
        elif variable.path in by_path:
            variable.assign(np.asarray(by_path[variable.path]))
        else:
            raise ValueError(f"The model with its tables in memory has a weight {variable.path!r} the tiered one "
                             "lacks; the two layouts differ beyond the tiered tables")
    return plain


def merged_table(tiered: CategoricalEmbedding, plain: CategoricalEmbedding, tables_dir: Path,
                 names: Sequence[str]) -> np.ndarray:
    """The concatenated table of `plain` (no tiered tables): `tiered`'s in-memory rows, and each tiered table's
    rows from its store."""
    values = np.zeros(tuple(plain.embeddings.shape), dtype=np.float32)
    old = np.asarray(tiered.embeddings) if tiered.num_rows else None
    for table in plain.tabled_features:
        size, start = plain.table_sizes[table], int(plain.offsets[table])
        if table in tiered.tiered_tables:
            path = Path(tables_dir) / store_name(names[table])
            if not path.exists():
                raise FileNotFoundError(f"No store of tiered table {names[table]!r} at {path}: the checkpoint's "
                                        "tables directory is incomplete")
            with RowStore.open(path, writable=False) as store:
                for chunk in range(0, size, CREATE_CHUNK_ROWS):
                    rows = np.arange(chunk, min(size, chunk + CREATE_CHUNK_ROWS))
                    values[start + rows] = store.read(rows)[0]
        elif old is not None:
            first = int(tiered.offsets[table])
            values[start:start + size] = old[first:first + size]
    return values


def model_input_shapes(model: keras.Model) -> Any:
    """The input shapes a built model was built with."""
    return model.get_build_config()["input_shape"]
