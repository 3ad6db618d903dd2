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
- `commit(checkpoint_dir)`: the final tables into `<checkpoint>/tables/<table>.rows`, listed in its manifest;
- for a minute run, `restore_chain` (live stores made from a checkpoint's chain) and `write_overlays`: a
  minute's checkpoint holds, per tiered table, only the rows its batches read (`<table>.overlay.npz`: rows,
  values, accumulators) on top of its parent checkpoint's table, and where the chain's binary counter places
  one, a span of its last minutes (`<table>.span.npz`, `write_minute_table`), or, written after the minute's
  publish, in `tables/spans/` with a manifest of its own (`write_spans`); `table_chain`, `ChainRows` and
  `materialize` read a table as of any checkpoint (the daily store, then the pieces after it).

`in_memory_model(model, checkpoint_dir, table_names)` is the other way round: the same model with every table in
memory, its rows read from the checkpoint's tables a chunk at a time, for the export (serving reads a whole
table today).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import keras
import numpy as np

from components.feature_spec import NUM_RESERVED_ROWS
from trainer.hot_tier import HotTier
from trainer.keras_internals import micro_steps
from trainer.layers.categorical_embedding import CategoricalEmbedding
from trainer.model_inputs import CATEGORICAL_INPUT
from trainer.optimizers import INITIAL_ACCUMULATOR_VALUE
from trainer.row_store import CREATE_CHUNK_ROWS, RowOverlay, RowStore, UniformRows, uniform_initializer
from trainer.tiered_training import (
    HotTierCallback,
    TieredBatches,
    VariableSlots,
    linear_layer,
    linear_part,
    list_items,
    variable_slots,
    whole_steps,
)

TABLES_DIR = "tables"
STORE_SUFFIX = ".rows"
PRELOAD_SUFFIX = ".preload.npy"


def tiered_lists(model: keras.Model, layer: CategoricalEmbedding) -> dict[str, int]:
    """The model's list inputs (key -> table) that read a tiered table of `layer`: the bags it pools and the
    behaviour sequence an attention model reads (trainer/models)."""
    lists = {bag["key"]: int(bag["table"]) for bag in getattr(model, "bags", ())}
    sequence_key, item_feature = getattr(model, "sequence_key", None), getattr(model, "item_feature", None)
    if sequence_key is not None and item_feature is not None:
        lists[sequence_key] = layer.feature_tables[item_feature]
    return {key: table for key, table in lists.items() if table in layer.tiered_tables}


def tiered_layer(model: keras.Model) -> CategoricalEmbedding | None:
    """The model's CategoricalEmbedding when it has tiered tables, else None."""
    layer = getattr(model, "embedding", None)
    if isinstance(layer, CategoricalEmbedding) and layer.tiered_tables:
        return layer
    return None


def store_name(table: str) -> str:
    return table + STORE_SUFFIX


def preload_name(table: str) -> str:
    """The served table's rows to load into its row cache before the first request (`preload_rows`)."""
    return table + PRELOAD_SUFFIX


def preload_rows(vocabularies: Iterable[Any], limit: int, reserved: int = NUM_RESERVED_ROWS) -> np.ndarray:
    """What a served row cache holds before the first request, so that a server just started does not load
    the rows nearly every request reads (docs/tiers.md, "Under open-loop load"): the `reserved` rows (the shared
    rare row and the missing row, which every rare value and empty field reads), then the rows that the table's
    vocabularies (components.feature_state.Vocabulary, one per feature reading the table) counted most, most
    first (ties: the lower row first); at most `limit` rows in all."""
    counts: dict[int, int] = {}
    for vocabulary in vocabularies:
        for row, count in zip(vocabulary.rows, vocabulary.counts, strict=True):
            counts[row] = counts.get(row, 0) + int(count)
    rows = np.fromiter(counts, dtype=np.int64, count=len(counts))
    totals = np.fromiter(counts.values(), dtype=np.int64, count=len(counts))
    order = np.lexsort((rows, -totals))  # by count, most first; then by row
    return np.concatenate([np.arange(reserved, dtype=np.int64), rows[order][rows[order] >= reserved]]
                          )[:max(0, int(limit))]


@dataclasses.dataclass(frozen=True)
class ChainFiles:
    """What `TieredTables.write_overlays` wrote into a minute's checkpoint: its files (relative to the checkpoint),
    its tables' position in their chain (None where the parent's is not known), the checkpoint its spans apply
    to (None: no span) and each span's rows."""

    files: list[str]
    position: int | None = None
    span_parent: Path | None = None
    span_rows: dict[str, int] = dataclasses.field(default_factory=dict)

    def manifest(self) -> tuple[dict[str, str], dict[str, int]]:
        """(inputs, extra) for the checkpoint's manifest."""
        inputs = {SPAN_PARENT: str(self.span_parent)} if self.span_parent is not None else {}
        extra = {CHAIN_POSITION: self.position} if self.position is not None else {}
        return inputs, extra


class TieredTables:
    """The stores and hot tiers of `layer`'s tiered tables (table index -> name in `names`), live in `directory`."""

    def __init__(self, model: keras.Model, layer: CategoricalEmbedding, names: Sequence[str], directory: Path,
                 ahead: int = 2) -> None:
        self.model = model
        self.layer = layer
        self.names = {table: names[table] for table in layer.tiered_tables}
        self.lists = tiered_lists(model, layer)  # list inputs reading a tiered table: remapped too
        # A linear part (DeepFM, Wide & Deep) reads the same slots: a store's record is then the row's values and
        # its linear weight, `width` columns (and as many accumulators).
        self.linear = linear_layer(model, layer)
        self.width = layer.embedding_dim + (1 if self.linear is not None else 0)
        self.directory = Path(directory)
        self.ahead = ahead
        self.stores: dict[int, RowStore] = {}
        self.tiers: dict[int, HotTier] = {}
        self.slots: dict[int, VariableSlots] = {}
        self.totals: dict[str, dict[str, int]] = {}  # counters of tiers and stores already closed
        # Per tiered table, the distinct rows of each training batch: the rows the steps may have changed.
        self.touched_parts: dict[int, list[np.ndarray]] = {table: [] for table in layer.tiered_tables}
        self.live_lock: IO[str] | None = None  # held from open_live to release_live (or unlock_live)

    # --- the stores ---------------------------------------------------------------------------------------

    def path(self, table: int) -> Path:
        return self.directory / store_name(self.names[table])

    def create(self, seed: int, parent_checkpoint: Path | None = None,
               reset_rows: Mapping[int, Sequence[int]] | None = None,
               parent_rows: Mapping[int, np.ndarray] | None = None) -> dict[str, int]:
        """New live stores: rows from the uniform initializer (seed + table index), or, from the tiered tables of
        `parent_checkpoint` (a daily or a minute checkpoint: `ChainRows`) or `parent_rows` (table index -> the
        parent's rows, where it held the table in memory), the parent's rows with the rows in `reset_rows`
        (table index -> row ids) and the rows past the parent's table drawn afresh; accumulators at the
        optimizer's initial value either way (a warm start starts a new optimizer, as for tables in memory).
        Returns warm-start counts."""
        self.close()
        self.directory.mkdir(parents=True, exist_ok=True)
        counts = {"rows_kept": 0, "rows_reset": 0, "rows_new": 0}
        for table in self.layer.tiered_tables:
            num_rows = self.layer.table_sizes[table]
            dim = self.width
            fresh = self.initializer(table, seed)
            if parent_checkpoint is None and (parent_rows or {}).get(table) is None:
                self.stores[table] = RowStore.create(self.path(table), num_rows, dim, fresh,
                                                     initial_accumulator=INITIAL_ACCUMULATOR_VALUE)
                continue
            with (ChainRows(parent_checkpoint, self.names[table], scratch=self.directory)
                  if parent_checkpoint is not None
                  else ArrayRows(np.asarray(parent_rows[table]))) as parent:  # type: ignore[index]
                if parent.embedding_dim != dim:
                    raise ValueError(f"The parent's tiered table {self.names[table]!r} has records of "
                                     f"{parent.embedding_dim} columns, this model {dim} (its embedding_dim"
                                     f"{', and a linear weight' if self.linear is not None else ''}); warm start "
                                     "needs the same model and dimension: set train.warm_start=false to train "
                                     "from scratch")
                reset = np.unique(np.asarray(list((reset_rows or {}).get(table, ())), dtype=np.int64))
                self.stores[table] = warm_store(self.path(table), parent, num_rows, fresh, reset)
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
        """The paths of the hot slots' variables (what a warm start leaves to the stores), the linear part's too."""
        layers = [self.layer, *([self.linear] if self.linear is not None else [])]
        return {layer.hot_table(table).embeddings.path for layer in layers for table in self.layer.tiered_tables}

    def initializer(self, table: int, seed: int) -> UniformRows:
        """Table `table`'s fresh rows: uniform, seeded by `seed` + the table's index; a linear weight (the record's
        last column, with a linear part) zeros, as LinearLogit's weights start."""
        return uniform_initializer(self.width, seed + table, zero_columns=self.width - self.layer.embedding_dim)

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
            self.slots = variable_slots(self.model, self.layer, optimizer)
        return self.slots

    def stream(self, dataset: Any, training: bool,
               phase: Mapping[str, int] | None = None) -> tuple[TieredBatches, HotTierCallback]:
        """`phase`: a training stream's `step_phase()` (micro-batches), else one batch a step."""
        source = numpy_batches(dataset)
        batches = TieredBatches(self.recorded(source) if training else source, self.layer, self.tiers,
                                key=CATEGORICAL_INPUT, training=training, ahead=self.ahead, lists=self.lists,
                                **(phase or {}))
        callback = HotTierCallback(batches)
        callback.slots = self.slot_access()
        return batches, callback

    def recorded(self, source: Iterable[tuple[Any, Any]]) -> Iterator[tuple[Any, Any]]:
        """`source`'s batches, recording the rows each reads of each tiered table (`touched`)."""
        columns = {table: self.layer.tiered_columns(table) for table in self.layer.tiered_tables}
        for features, label in source:
            ids = np.asarray(features[CATEGORICAL_INPUT])
            for table, table_columns in columns.items():
                self.touched_parts[table].append(np.unique(ids[:, table_columns]))
            for name, table in self.lists.items():
                items = np.asarray(features[name])
                self.touched_parts[table].append(np.unique(items[list_items(items)]))
            yield features, label

    def touched(self) -> dict[str, np.ndarray]:
        """Per tiered table (by name), the rows training batches read since the tables were made, and the rows
        `reset_rows` drew afresh: a superset of the rows that changed (a minute's delta of the table)."""
        return {self.names[table]: np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
                for table, parts in self.touched_parts.items()}

    def reset_rows(self, rows_by_table: Mapping[int, Sequence[int]], seed: int) -> int:
        """Writes fresh initial values (uniform, seed + table index) into rows of the live stores (newly admitted
        values' rows), their accumulators unchanged, as trainer.incremental.reset_rows does for tables in memory;
        call before any stream. Returns how many rows."""
        count = 0
        for table, rows in rows_by_table.items():
            if table not in self.stores or not len(rows):
                continue
            rows = np.unique(np.asarray(rows, dtype=np.int64))
            values = self.initializer(table, seed).rows(rows)
            _, accumulators = self.stores[table].read(rows)
            self.stores[table].write(rows, values, accumulators)
            self.touched_parts[table].append(rows)  # changed here, so a delta carries them
            count += len(rows)
        return count

    def step_phase(self) -> dict[str, int]:
        """Micro-batches per optimizer step (`steps`: the optimizer's `gradient_accumulation_steps`,
        train.micro_batches, or 1), and how many of the step under way the optimizer has taken (`offset`)."""
        steps = int(getattr(self.model.optimizer, "gradient_accumulation_steps", None) or 1)
        return {"steps": steps, "offset": micro_steps(self.model.optimizer) % steps if steps > 1 else 0}

    def training(self, dataset: Any) -> tuple[Iterator[Any], HotTierCallback]:
        """An iterator of `dataset`'s batches for `fit`, and the callback that must go with it. With
        micro-batches (train.micro_batches > 1) the epoch ends with an optimizer step: at most
        micro_batches - 1 micro-batches at its end are left out, so that no gradient is still being accumulated
        on a hot slot when the next stream's plans may give it another row."""
        phase = self.step_phase()
        if phase["steps"] > 1:
            dataset = whole_steps(numpy_batches(dataset), **phase)
        batches, callback = self.stream(dataset, training=True, phase=phase)
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
        self.directory.mkdir(parents=True, exist_ok=True)
        for table in self.layer.tiered_tables:
            source = Path(directory) / store_name(self.names[table])
            if not source.exists():
                raise FileNotFoundError(f"No snapshot of tiered table {self.names[table]!r} at {source}: the "
                                        "progress or best epoch it belongs to is incomplete; delete "
                                        f"{Path(directory).parent} to train from the start")
            with RowStore.open(source, writable=False) as snapshot:
                snapshot.snapshot(self.path(table))
        self.open()

    def restore_chain(self, checkpoint_dir: Path) -> None:
        """The live stores made from a checkpoint's tables (a daily one's stores, or a minute's chain: its base
        store and the overlays after it, `materialize`), with empty hot tiers."""
        self.close()
        self.directory.mkdir(parents=True, exist_ok=True)
        for table in self.layer.tiered_tables:
            materialize(checkpoint_dir, self.names[table], self.path(table))
        self.open()

    def open_live(self, parent_checkpoint: Path) -> bool:
        """Opens the live stores in this object's directory for a minute run on `parent_checkpoint`: as they are
        when their state file says they hold that checkpoint's tables (the previous minute of the chain left
        them), else made from its chain (`restore_chain`). The state file is removed first, so a run that fails
        from here on leaves stores the next run rebuilds. Holds the chain's lock (`lock_live`) until
        `release_live` or `unlock_live`: a second minute run of the chain meanwhile is refused. Returns whether
        they were reused."""
        self.unlock_live()
        self.live_lock = lock_live(self.directory)
        state = self.directory / LIVE_STATE
        try:
            identity = checkpoint_identity(parent_checkpoint)
            reused = (state.exists() and json.loads(state.read_text()) == identity
                      and all(self.path(table).exists() for table in self.layer.tiered_tables))
            state.unlink(missing_ok=True)
            if reused:
                self.open()
            else:
                self.restore_chain(parent_checkpoint)
        except BaseException:
            self.unlock_live()
            raise
        return reused

    def release_live(self, checkpoint_dir: Path) -> None:
        """Flushes and closes the live stores, recording that they hold the tables of `checkpoint_dir` (the
        minute's checkpoint, written): the next minute on it trains them in place."""
        self.flush()
        self.close()
        partial = self.directory / f".{LIVE_STATE}.partial"
        partial.write_text(json.dumps(checkpoint_identity(checkpoint_dir)))
        partial.replace(self.directory / LIVE_STATE)
        self.unlock_live()

    def unlock_live(self) -> None:
        """Lets the next minute run of the chain open the live stores (a run that failed after `open_live`
        calls this; a process that ends releases the lock with it)."""
        if self.live_lock is not None:
            fcntl.flock(self.live_lock, fcntl.LOCK_UN)
            self.live_lock.close()
            self.live_lock = None

    def write_overlays(self, checkpoint_dir: Path, parent_checkpoint: Path | None = None,
                       max_span_bytes: int | None = None) -> ChainFiles:
        """Flushes, then writes into `checkpoint_dir/tables` each tiered table's overlay, and its span where the
        chain places one (`write_minute_table`; `max_span_bytes` None: SPAN_MEMORY_BYTES). The live stores stay
        open."""
        self.flush()
        touched = self.touched()
        bound = SPAN_MEMORY_BYTES if max_span_bytes is None else max_span_bytes
        written = [write_minute_table(Path(checkpoint_dir) / TABLES_DIR, name, touched[name], self.stores[table],
                                      parent_checkpoint, bound) for table, name in self.names.items()]
        return ChainFiles(files=[file for part in written for file in part.files],
                          position=next((part.position for part in written), None),
                          span_parent=next((part.span_parent for part in written if part.span_parent), None),
                          span_rows={name: rows for part in written for name, rows in part.span_rows.items()})

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
        if self.directory.is_dir() and not any(self.directory.iterdir()):
            self.directory.rmdir()
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


def warm_store(path: Path, parent: RowStore | ArrayRows | ChainRows, num_rows: int, fresh: UniformRows,
               reset: np.ndarray, chunk_rows: int = CREATE_CHUNK_ROWS) -> RowStore:
    """A warm-started table's store at `path`: the parent's rows, `fresh`'s rows for the reset rows and the rows
    past the parent's table, accumulators at their initial value.

    Where the parent draws the rows it never wrote from `fresh` too (a store of format 2 with the same
    initializer: the same seed), so does the new store: it writes only the rows the parent has written (less the
    reset ones), and a warm start costs the rows ever trained, not the table's size. Otherwise every row is
    written (format 1)."""
    if getattr(parent, "fresh", None) == fresh:
        return RowStore.create_fresh(path, num_rows, fresh, INITIAL_ACCUMULATOR_VALUE,
                                     written=written_chunks(parent, num_rows, reset, chunk_rows))
    return RowStore.write_new(path, num_rows, fresh.embedding_dim,
                              warm_chunks(parent, num_rows, fresh, reset, chunk_rows))


def written_chunks(parent: RowStore | ChainRows, num_rows: int, reset: np.ndarray, chunk_rows: int
                   ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(rows, values, initial accumulators) of the rows the parent has written, less `reset`, a chunk at a time."""
    for start in range(0, min(num_rows, parent.num_rows), chunk_rows):
        rows = np.arange(start, min(num_rows, parent.num_rows, start + chunk_rows))
        values, _, written = parent.read_marked(rows)
        keep = written & ~np.isin(rows, reset)
        if keep.any():
            yield rows[keep], values[keep], np.full_like(values[keep], INITIAL_ACCUMULATOR_VALUE)


def warm_chunks(parent: RowStore | ArrayRows | ChainRows, num_rows: int, fresh: Any, reset: np.ndarray,
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


OVERLAY_SUFFIX = ".overlay.npz"
LIVE_STATE = "state.json"
LIVE_LOCK = ".lock"
# Checkpoints a chain of minute overlays may cross before its base store: a bound against a cycle.
MAX_CHAIN = 100_000
# Overlays (bytes of their files) a ChainRows merges in memory; a longer chain is written out as a store.
CHAIN_MEMORY_BYTES = 64 * 2**20
SPAN_SUFFIX = ".span.npz"
# A minute checkpoint's manifest: its tables' position in their chain (minutes past the daily store), and, where
# it holds spans, the checkpoint they apply to (inputs).
CHAIN_POSITION = "tables_chain_position"
SPAN_PARENT = "tables_span_parent"
# The records (values and accumulators) a span may gather in memory; a larger one is not written.
SPAN_MEMORY_BYTES = 256 * 2**20
# Where a span's records come from (`write_minute_table`): the live store, or the pieces it replaces.
SPAN_SOURCES = ("store", "pieces")
# A minute checkpoint's spans written after its publish (`write_spans`): `tables/spans/`, with their manifest.
SPANS_DIR = "spans"
SPANS_KIND = "spans"


def overlay_name(table: str) -> str:
    return table + OVERLAY_SUFFIX


def span_name(table: str) -> str:
    return table + SPAN_SUFFIX


def write_overlay(path: Path, rows: np.ndarray, values: np.ndarray, accumulators: np.ndarray) -> str:
    """rows (ascending), values and accumulators of a table's changed rows, as `path` (written under a temporary
    name, then renamed); returns its name."""
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "wb") as handle:
        np.savez(handle, rows=np.asarray(rows, np.int64), values=np.asarray(values, np.float32),
                 accumulators=np.asarray(accumulators, np.float32))
    partial.replace(path)
    return path.name


def write_minute_table(target: Path, name: str, rows: np.ndarray, store: RowStore,
                       parent_checkpoint: Path | None, max_span_bytes: int = SPAN_MEMORY_BYTES,
                       span_from: str = "store") -> ChainFiles:
    """A minute checkpoint's files of tiered table `name`, into `target` (its `tables` directory): the overlay,
    `rows` (the rows the minute's batches read, ascending) with their values and accumulators from `store` (the
    live store, flushed: the table as of this minute); and with `parent_checkpoint`, the span the chain's binary
    counter places at this minute (`span_pieces`; none when `max_span_bytes` is 0: the position is recorded all
    the same), its records read from the live store (`span_from` "store": `write_span`) or merged from the
    pieces it replaces ("pieces": `merge_span`). `files` are relative to the checkpoint."""
    if span_from not in SPAN_SOURCES:
        raise ValueError(f"span_from must be one of {', '.join(SPAN_SOURCES)}, got {span_from!r}")
    target.mkdir(parents=True, exist_ok=True)
    values, accumulators = store.read(rows)
    files = [write_overlay(target / overlay_name(name), rows, values, accumulators)]
    if parent_checkpoint is None:
        return ChainFiles(files=[f"{TABLES_DIR}/{files[0]}"])
    position, at, pieces = span_pieces(parent_checkpoint, name)
    span_rows = None
    if at is not None and max_span_bytes > 0:
        if span_from == "pieces":
            span_rows = merge_span(target / span_name(name), [target / overlay_name(name), *pieces], max_span_bytes)
        else:
            span_rows = write_span(target / span_name(name), pieces, rows, store, max_span_bytes)
    if span_rows is None:
        return ChainFiles(files=[f"{TABLES_DIR}/{files[0]}"], position=position)
    return ChainFiles(files=[f"{TABLES_DIR}/{file}" for file in (*files, span_name(name))], position=position,
                      span_parent=at, span_rows={name: span_rows})


def read_overlays(checkpoint_dir: Path) -> dict[str, dict[str, np.ndarray]]:
    """A minute checkpoint's overlays by table name ({} for a checkpoint without them)."""
    out = {}
    for path in sorted((Path(checkpoint_dir) / TABLES_DIR).glob("*" + OVERLAY_SUFFIX)):
        with np.load(path, allow_pickle=False) as data:
            out[path.name[:-len(OVERLAY_SUFFIX)]] = {key: data[key] for key in data.files}
    return out


def lock_live(directory: Path) -> IO[str]:
    """An exclusive lock on a chain's live stores (flock on `directory/.lock`), held by the minute run that trains
    them: two minute runs of one chain at once would train and write the same stores. The lock file names its
    holder for the error the next one gets; the kernel releases the lock when the holder's process ends."""
    directory.mkdir(parents=True, exist_ok=True)
    handle = open(directory / LIVE_LOCK, "a+")  # noqa: SIM115 (held until unlock_live)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise RuntimeError(
            f"The tiered tables' live stores in {directory} are being trained by another minute run ({holder}). "
            "The minute runs of one chain train its live stores one at a time (the incremental DAG allows one "
            "active run): wait for that run to end, or stop it; a run whose process has ended holds no lock."
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since "
                 f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")
    handle.flush()
    return handle


def live_directory(checkpoint_dir: Path, name: str) -> Path:
    """Where the minute runs of a chain keep their live stores: beside the checkpoint that holds the chain's base
    store of table `name` (the daily run's)."""
    base, _ = table_chain(checkpoint_dir, name)
    daily = base.parent.parent
    return daily.with_name(f".{daily.name}.tables-live")


def live_stores_of(checkpoint_dir: Path, names: Sequence[str]) -> Path | None:
    """The live stores' directory of the chain `checkpoint_dir` belongs to, if they hold exactly its tables of
    `names` (their state file names it, and every store is there); None otherwise."""
    if not names:
        return None
    directory = live_directory(checkpoint_dir, names[0])
    state = directory / LIVE_STATE
    try:
        held = json.loads(state.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if held != checkpoint_identity(checkpoint_dir):
        return None
    return directory if all((directory / store_name(name)).exists() for name in names) else None


def checkpoint_identity(checkpoint_dir: Path) -> dict[str, Any]:
    """What names a checkpoint's tables: its resolved path and its manifest's files (with their checksums)."""
    from components.manifest import read_manifest

    manifest = read_manifest(checkpoint_dir, kind="checkpoint", verify=False)
    return {"checkpoint": str(Path(checkpoint_dir).resolve()), "files": manifest["files"]}


def table_chain(checkpoint_dir: Path, name: str) -> tuple[Path, list[Path]]:
    """Where table `name` of a checkpoint lives: (the base store, the pieces after it, oldest first). A daily
    checkpoint holds the store; a minute's holds an overlay on its parent checkpoint's table (the manifest's
    `inputs.parent_checkpoint`), or a span over several minutes (`chain_link`), followed back to a store."""
    pieces: list[Path] = []
    directory = Path(checkpoint_dir)
    for _ in range(MAX_CHAIN):
        piece, parent = chain_link(directory, name)
        if parent is None:
            return piece, pieces[::-1]
        pieces.append(piece)
        directory = parent
    raise ValueError(f"The tables of {checkpoint_dir} chain through more than {MAX_CHAIN} checkpoints")


def chain_link(directory: Path, name: str) -> tuple[Path, Path | None]:
    """One step back along table `name`'s chain from checkpoint `directory`: (the piece it holds, the checkpoint
    that piece applies to). A daily checkpoint: (its store, None). A minute's with a span (`write_span`): (the
    span, `inputs.tables_span_parent`), which skips the minutes the span holds; else (its overlay, its parent)."""
    from components.manifest import read_manifest

    directory = Path(directory)
    base = directory / TABLES_DIR / store_name(name)
    if base.exists():
        return base, None
    inputs = read_manifest(directory, kind="checkpoint", verify=False).get("inputs", {})
    span = directory / TABLES_DIR / span_name(name)
    if inputs.get(SPAN_PARENT) and span.exists():
        return span, Path(inputs[SPAN_PARENT])
    later = written_spans(directory)
    if later is not None and span_name(name) in later["files"]:
        return directory / TABLES_DIR / SPANS_DIR / span_name(name), Path(later["inputs"][SPAN_PARENT])
    overlay = directory / TABLES_DIR / overlay_name(name)
    parent = inputs.get("parent_checkpoint")
    if not overlay.exists() or not parent:
        raise FileNotFoundError(f"Checkpoint {directory} holds neither a store nor an overlay of tiered table "
                                f"{name!r} (tables/{store_name(name)}, tables/{overlay_name(name)}); it was "
                                "not written with that table tiered: retrain its daily run")
    return overlay, Path(parent)


def chain_position(checkpoint_dir: Path, name: str) -> int | None:
    """How many minutes checkpoint `checkpoint_dir`'s table `name` is past its chain's daily store: 0 for the
    checkpoint that holds the store, a minute's `tables_chain_position` (its manifest) else; None for a minute
    written without one (before spans were written: its chain gets none)."""
    from components.manifest import read_manifest

    if (Path(checkpoint_dir) / TABLES_DIR / store_name(name)).exists():
        return 0
    position = read_manifest(checkpoint_dir, kind="checkpoint", verify=False).get(CHAIN_POSITION)
    return int(position) if position is not None else None


def written_spans(checkpoint_dir: Path) -> dict[str, Any] | None:
    """The manifest of the spans written into minute checkpoint `checkpoint_dir` after its publish
    (`write_spans`), or None where there is none yet: its span files count only once it is written, last."""
    from components.manifest import MANIFEST_NAME, read_manifest

    directory = Path(checkpoint_dir) / TABLES_DIR / SPANS_DIR
    if not (directory / MANIFEST_NAME).is_file():
        return None
    return read_manifest(directory, kind=SPANS_KIND, verify=False)


def write_spans(checkpoint_dir: Path, max_span_bytes: int = SPAN_MEMORY_BYTES) -> dict[str, int]:
    """The spans the chain's binary counter places at minute checkpoint `checkpoint_dir`, one per tiered table
    (its overlays name them), merged from the pieces each replaces (`merge_span`: the minute's overlay and its
    parent's chain; no live store), into `tables/spans/` with a manifest of their own (kind "spans": the
    checkpoint they apply to, their rows), written last. A chain read before that crosses the minutes' overlays,
    one read after it the span (`chain_link`): the table is the same either way, so this can run after the
    minute's delta is published, off its time (pipelines/incremental.py, the `spans` step). Returns each span
    written and its rows; {} where the minute places none (an odd position, a chain without positions, spans
    over `max_span_bytes`, or 0), or where the checkpoint holds its spans already (written with them)."""
    from components.manifest import read_manifest, write_manifest

    checkpoint_dir = Path(checkpoint_dir)
    manifest = read_manifest(checkpoint_dir, kind="checkpoint", verify=False)
    parent = manifest.get("inputs", {}).get("parent_checkpoint")
    tables = checkpoint_dir / TABLES_DIR
    names = sorted(path.name[:-len(OVERLAY_SUFFIX)] for path in tables.glob("*" + OVERLAY_SUFFIX))
    if not parent or max_span_bytes <= 0 or manifest.get("inputs", {}).get(SPAN_PARENT):
        return {}
    directory = tables / SPANS_DIR
    rows: dict[str, int] = {}
    applies_to: Path | None = None
    for name in names:
        _, at, pieces = span_pieces(Path(parent), name)
        if at is None:
            continue
        directory.mkdir(exist_ok=True)
        written = merge_span(directory / span_name(name), [tables / overlay_name(name), *pieces], max_span_bytes)
        if written is not None:
            rows[name], applies_to = written, at
    if rows:
        write_manifest(directory, kind=SPANS_KIND, version=str(manifest.get("version", "")),
                       files=[span_name(name) for name in rows], inputs={SPAN_PARENT: str(applies_to)},
                       extra={"span_rows": rows})
    return rows


def span_pieces(parent_checkpoint: Path, name: str) -> tuple[int | None, Path | None, list[Path]]:
    """For a minute checkpoint written on `parent_checkpoint`: (its position in table `name`'s chain, the
    checkpoint its span applies to, the pieces of the parent's chain the span replaces), or (position, None, [])
    where it writes no span.

    The spans follow a binary counter: the minute at position p spans its last p & -p minutes (the lowest set bit
    of p: minute 1 none, 2 two, 3 none, 4 four, ..., 1,024 the first 1,024), so a chain read from minute p
    crosses one piece per set bit of p, at most 11 in a day of 1,440 minutes, where without spans it crosses p.
    Every row a chain holds is written into at most one span per bit: about log2(p) times over a day, each time
    merged from pieces already written (the minutes between hold no other span that the walk could cross)."""
    parent_position = chain_position(parent_checkpoint, name)
    if parent_position is None:
        return None, None, []
    position = parent_position + 1
    length = position & -position
    if length < 2:
        return position, None, []
    target = position - length
    pieces: list[Path] = []
    directory = Path(parent_checkpoint)
    for _ in range(length):
        at = chain_position(directory, name)
        if at is None or at < target:
            return position, None, []  # a chain whose positions do not add up: no span
        if at == target:
            return position, directory, pieces
        piece, parent = chain_link(directory, name)
        if parent is None:
            return position, None, []
        pieces.append(piece)
        directory = parent
    return position, None, []


def write_span(path: Path, pieces: Sequence[Path], rows: np.ndarray, store: RowStore,
               max_bytes: int = SPAN_MEMORY_BYTES) -> int | None:
    """The span at `path`: every row of `pieces` and `rows` (the minute's own), with their values and
    accumulators read from `store` (the live store, which holds the table as of this minute). Written only when
    its records fit in `max_bytes` of memory (the records are gathered in memory, as an overlay's are); returns
    its rows, or None where it is not written (the chain then keeps the minutes the span would hold). The rows
    are counted before anything is read from the store, and a union that grows over the bound is given up at
    once (`span_union`)."""
    max_rows = max_bytes // (store.embedding_dim * 4 * 2)
    parts = pieces_rows(pieces, max_rows)
    union = None if parts is None else span_union([np.asarray(rows, np.int64), *parts], max_rows)
    if union is None:
        return None
    values, accumulators = store.read(union)
    write_overlay(path, union, values, accumulators)
    return int(len(union))


def merge_span(path: Path, pieces: Sequence[Path], max_bytes: int = SPAN_MEMORY_BYTES) -> int | None:
    """The same span as `write_span`, merged from the pieces themselves: `pieces` newest first (the minute's own
    overlay, then its parent's chain as `span_pieces` gives it), each row's newest values and accumulators. A
    row's values in the live store change only in a minute that reads it, and that minute's overlay holds them,
    so the newest piece holding a row holds its values as of this minute: the span needs no live store, and
    any process can write it once the minute's overlay is written. Same bound and return as `write_span`."""
    if not pieces:
        return None
    with np.load(pieces[0], allow_pickle=False) as data:
        width = max(1, int(data["values"].shape[-1]))
    max_rows = max_bytes // (width * 4 * 2)
    parts = pieces_rows(pieces, max_rows)
    if parts is None or span_union(parts, max_rows) is None:
        return None
    merged = RowOverlay.merged(read_overlay(piece) for piece in reversed(pieces))
    write_overlay(path, merged.rows, merged.arrays["values"], merged.arrays["accumulators"])
    return int(len(merged))


def pieces_rows(pieces: Sequence[Path], max_rows: int) -> list[np.ndarray] | None:
    """Each piece's row ids (the largest file first), or None as soon as one alone is over `max_rows`."""
    parts = []
    for piece in sorted(pieces, key=lambda path: path.stat().st_size, reverse=True):
        with np.load(piece, allow_pickle=False) as data:
            parts.append(data["rows"])
        if len(parts[-1]) > max_rows:
            return None
    return parts


def span_union(parts: Sequence[np.ndarray], max_rows: int) -> np.ndarray | None:
    """The union of `parts` (row ids), or None as soon as it is known to be over `max_rows`: a part over the
    bound alone, then the union grown from the largest part down. A span left out costs its pieces' row ids, not
    their union (4.2 s for minute 1,024's in bench-chain-spans' first run, which took the whole union first)."""
    if any(len(part) > max_rows for part in parts):
        return None
    if sum(len(part) for part in parts) <= max_rows:
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
    ordered = sorted(parts, key=len, reverse=True)
    union = np.unique(ordered[0])
    for part in ordered[1:]:
        union = np.union1d(union, part)
        if len(union) > max_rows:
            return None
    return union


def materialize(checkpoint_dir: Path, name: str, destination: Path) -> None:
    """Table `name` as of `checkpoint_dir` as a store at `destination`: the base store copied (RowStore.snapshot),
    then each overlay's rows written over it in place, oldest first."""
    base, overlays = table_chain(checkpoint_dir, name)
    with RowStore.open(base, writable=False) as store:
        store.snapshot(destination)
    with RowStore.open(destination) as store:
        # In place, not through the log: one bulk merge, and the store that comes out holds no log to index (a
        # log copied with the base is merged into the table by the first write).
        store.log_writes = False
        for overlay in overlays:
            rows, fields = read_overlay(overlay)
            if len(rows):
                store.write(rows, fields["values"], fields["accumulators"])
        store.flush()


class ChainRows:
    """A checkpoint's tiered table read like a RowStore (`read`, `num_rows`, `embedding_dim`): its base store, with
    the overlays after it applied to what is read.

    Overlays of up to `max_overlay_bytes` in all (their files' sizes) are merged in memory (RowOverlay.merged)
    and the base is read on demand. A longer chain (a day of minutes' overlays can hold millions of rows) is
    written out as a store in `scratch` instead (`materialize`: the base copied, then one overlay at a time
    written over it), read from there and removed at `close`: memory bounded by one overlay, at the cost of a
    copy of the table on the same disk. Without `scratch` the overlays are always merged in memory."""

    def __init__(self, checkpoint_dir: Path, name: str, scratch: Path | None = None,
                 max_overlay_bytes: int = CHAIN_MEMORY_BYTES) -> None:
        base, overlays = table_chain(checkpoint_dir, name)
        self.overlay = RowOverlay()
        self.scratch_store: Path | None = None
        if scratch is not None and sum(path.stat().st_size for path in overlays) > max_overlay_bytes:
            Path(scratch).mkdir(parents=True, exist_ok=True)
            self.scratch_store = Path(scratch) / f".chain-{name}{STORE_SUFFIX}"
            materialize(checkpoint_dir, name, self.scratch_store)
            self.store = RowStore.open(self.scratch_store, writable=False)
        else:
            self.store = RowStore.open(base, writable=False)
            self.overlay = RowOverlay.merged(read_overlay(path) for path in overlays)
        self.num_rows, self.embedding_dim = self.store.num_rows, self.store.embedding_dim
        self.fresh = self.store.fresh  # the base's initializer, where it draws the rows it never wrote

    def read(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        values, accumulators, _ = self.read_marked(rows)
        return values, accumulators

    def read_marked(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`read`, and whether each row was ever written: in the base, or by an overlay."""
        rows = np.asarray(rows, dtype=np.int64)
        values, accumulators, written = self.store.read_marked(rows)
        self.overlay.apply(rows, values=values, accumulators=accumulators)
        if len(self.overlay):
            written |= np.isin(rows, self.overlay.rows)
        return values, accumulators, written

    def close(self) -> None:
        self.store.close()
        if self.scratch_store is not None:
            self.scratch_store.unlink(missing_ok=True)
            self.scratch_store = None

    def __enter__(self) -> ChainRows:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_overlay(path: Path) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """One overlay file: (rows, {"values", "accumulators"})."""
    with np.load(path, allow_pickle=False) as data:
        return data["rows"], {"values": data["values"], "accumulators": data["accumulators"]}


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


@contextmanager
def checkpoint_tables(checkpoint_dir: Path, tiered: Mapping[str, int],
                      counters: Mapping[str, Mapping[str, int]] | None = None,
                      embedding_dim: int | None = None) -> Iterator[dict[str, dict[str, Any]]]:
    """What the table report (components/table_report.py) takes of a checkpoint's tiered tables (name -> hot
    rows), while the block runs: a reader of each table's rows (their first `embedding_dim` columns: a model
    with a linear part keeps each row's linear weight after them; None: every column), its hot rows, its bytes
    of values (the records', linear weights included), and the training's counters. A minute's tables are read
    from the chain's live stores when those hold this checkpoint's tables (the minute that wrote it left them so:
    `live_stores_of`), else from its chain (ChainRows, opened once), whose overlays, a day of minutes' rows by
    evening, it would merge in memory."""
    live = live_stores_of(checkpoint_dir, list(tiered))
    tables: dict[str, RowStore | ChainRows] = {
        name: (RowStore.open(live / store_name(name), writable=False) if live is not None
               else ChainRows(checkpoint_dir, name)) for name in tiered}
    try:
        yield {name: {"rows": lambda rows, table=table: table.read(rows)[0][:, :embedding_dim],
                      "hot_rows": tiered[name],
                      "bytes": table.num_rows * table.embedding_dim * 4,
                      "counters": dict((counters or {}).get(name, {}))} for name, table in tables.items()}
    finally:
        for table in tables.values():
            table.close()


def numpy_batches(dataset: Any) -> Iterable[tuple[Any, Any]]:
    """A tf.data dataset's (features, label) batches as numpy; anything else as it is."""
    as_numpy = getattr(dataset, "as_numpy_iterator", None)
    return as_numpy() if as_numpy is not None else dataset


def in_memory_model(model: keras.Model, checkpoint_dir: Path, table_names: Sequence[str]) -> keras.Model:
    """`model` with its tiered tables in memory: the same class and config without `tiered_tables`, every weight
    copied, each tiered table's rows read from `checkpoint_dir`'s tables (ChainRows: a daily checkpoint's store,
    or a minute's overlays on it) a chunk at a time into the concatenated table. The result holds every table
    whole: what the export and serving read today."""
    layer = tiered_layer(model)
    if layer is None:
        return model
    plain = rebuilt(model, {})
    new_layer = plain.embedding
    plain_table = new_layer.embeddings.path if new_layer.num_rows else None
    given = {plain_table: merged_table(layer, new_layer, checkpoint_dir, table_names,
                                       columns=slice(0, layer.embedding_dim))}
    linear, plain_linear = linear_layer(model, layer), linear_part(plain)
    if linear is not None and plain_linear is not None:  # the linear weights: each record's last column
        given[plain_linear.embeddings.path] = merged_table(linear, plain_linear, checkpoint_dir, table_names,
                                                           columns=slice(layer.embedding_dim, None))
    copy_weights(model, plain, given)
    return plain


def with_cache_rows(model: keras.Model, cache_rows: Mapping[int, int]) -> keras.Model:
    """`model` with its tiered tables' HotTables resized to `cache_rows` (table index -> slots; the serving row
    cache), every other weight copied; the slots start empty (serving loads rows into them on demand)."""
    layer = tiered_layer(model)
    if layer is None or dict(layer.tiered_tables) == dict(cache_rows):
        return model
    resized = rebuilt(model, dict(cache_rows))
    copy_weights(model, resized, {})
    return resized


def rebuilt(model: keras.Model, tiered_tables: Mapping[int, int]) -> keras.Model:
    """A new, built model of `model`'s class and config with `tiered_tables` in place of its own."""
    config = model.get_config()
    config["embedding_options"] = {**config["embedding_options"], "tiered_tables": dict(tiered_tables)}
    if not tiered_tables:
        del config["embedding_options"]["tiered_tables"]
    other = type(model).from_config(config)
    other.build(model_input_shapes(model))
    return other


def copy_weights(source: keras.Model, target: keras.Model, given: Mapping[str | None, np.ndarray]) -> None:
    """`target`'s weights from `source`'s of the same path (from `given` by path first); a tiered table's hot
    slots, which the two may size differently, are left as they are."""
    by_path = {v.path: v for v in source.weights}
    for variable in target.weights:
        if variable.path in given:
            variable.assign(given[variable.path])
        elif "/tiered_table_" in variable.path:
            continue
        elif variable.path in by_path:
            variable.assign(np.asarray(by_path[variable.path]))
        else:
            raise ValueError(f"The rebuilt model has a weight {variable.path!r} the trained one lacks; the two "
                             "layouts differ beyond the tiered tables")


def merged_table(tiered: CategoricalEmbedding, plain: CategoricalEmbedding, checkpoint_dir: Path,
                 names: Sequence[str], columns: slice = slice(None)) -> np.ndarray:
    """The concatenated table of `plain` (no tiered tables): `tiered`'s in-memory rows, and each tiered table's
    rows from its store, their `columns` (a record's first embedding_dim columns for the embedding, its last for
    a linear part's weights)."""
    values = np.zeros(tuple(plain.embeddings.shape), dtype=np.float32)
    old = np.asarray(tiered.embeddings) if tiered.num_rows else None
    for table in plain.tabled_features:
        size, start = plain.table_sizes[table], int(plain.offsets[table])
        if table in tiered.tiered_tables:
            # The base store a chunk at a time, then each overlay over it, oldest first: the table is in memory
            # here anyway, and the overlays are never merged.
            base, overlays = table_chain(checkpoint_dir, names[table])
            with RowStore.open(base, writable=False) as store:
                for chunk in range(0, size, CREATE_CHUNK_ROWS):
                    rows = np.arange(chunk, min(size, chunk + CREATE_CHUNK_ROWS))
                    values[start + rows] = store.read(rows)[0][:, columns]
            for overlay in overlays:
                rows, fields = read_overlay(overlay)
                values[start + rows] = fields["values"][:, columns]
        elif old is not None:
            first = int(tiered.offsets[table])
            values[start:start + size] = old[first:first + size]
    return values


def model_input_shapes(model: keras.Model) -> Any:
    """The input shapes a built model was built with."""
    return model.get_build_config()["input_shape"]
