"""Serving a model whose tiered tables stay on disk: a row cache in the SavedModel, filled on demand.

A full model exported with tiered tables (storage: tiered; trainer.export RowSlots) holds, per such table, a
cache of `cache_rows` slots and a map row id -> slot; its store (trainer/row_store.py) ships beside it, and the
manifest's `tiered_serving` names both. `TieredRows.run` first calls the model's cached endpoint on the
request's packed arguments (trainer.export CACHED_ENDPOINTS): one graph call that looks up the row ids the
request reads of each tiered table and, when all of them are cached, answers it; a request whose rows are cached
takes one call, as a table in memory does. Otherwise that call's row ids say what to load: the ones not cached
are read from the store (least recently used slots out, never a slot the request reads), and one call of the
loaded endpoint (trainer.export LOADED_ENDPOINTS) writes them into every table's cache and runs the model on the
inputs the first call preprocessed (its `input_*` outputs): two calls. Loading writes the cache, so that call
runs under the replica's write lock (no request reads the cache meanwhile, and no other load can evict a row
before the answer).

Exports made before the loaded endpoint write the rows by the `load_all_slots` endpoint, then run the request
under the read lock, preprocessing it again: three calls (if another request's loads evicted one of its rows in
between, it loads again). Exports before that endpoint load each table by its own `load_slots_<table>` call;
those made before the cached endpoint ask for the rows through `tiered_rows` first, then run the request.

Before the first request (`TieredRows.preload`, from the model's warm-up), each cache is filled with the rows
the export lists as its `preload` (trainer.tiered_tables.preload_rows: the reserved rows, then the rows
training counted most, up to the cache's size), so that a server just started does not load, request by
request, the rows nearly every request reads.

Eviction is a segmented LRU (SLRU; the main region of Caffeine's W-TinyLFU): a row loaded by a request enters a
probation segment; read again by a later request, it moves to a protected segment of at most PROTECTED_SHARE of
the cache, whose least recently used row, when it is full, goes back to probation's most recent end. A load
evicts probation's least recently used rows first, and protected ones only when probation holds too few that
the request does not read. Rows a single request read once pass through probation without pushing out the rows
every request reads; the preload's most counted rows start in the protected segment (in a plain LRU cache
smaller than the rows requests read, they were gone within the first pass of bench-row-cache's requests).

Deltas: a minute's delta carries a tiered table's changed rows as `tiered_rows_<table>` / `tiered_values_<table>`
(components.delta.served_weight_arrays). The store is the full version's file and is never written: the
rows changed since the full version are read before the store, and written into the slots of the rows already
cached. Given a scratch directory (the server's: serving.watcher passes its cache directory), they are kept in
a sparse store of their own there (`DeltaRows`: a day of minutes' rows on disk, a flag per row in memory),
removed with the model; without one, in memory (`RowOverlay`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from components.config import ServingConfig
from components.delta import tiered_rows_name, tiered_values_name
from serving.tensorflow_internals import direct_call
from trainer.row_store import RowOverlay, RowStore

LOAD_ALL_SLOTS_ENDPOINT = "load_all_slots"
# Exports before it: the rows a packed batch reads (before the cached endpoints), and one load per table.
TIERED_ROWS_ENDPOINT = "tiered_rows"
LOAD_SLOTS_ENDPOINT = "load_slots"
# A cached endpoint's outputs that are the model's inputs (trainer.export MODEL_INPUT_PREFIX).
MODEL_INPUT_PREFIX = "input_"
# Loads a request may need when other requests' loads keep evicting its rows; then it fails.
MAX_LOADS = 8
PRELOAD_CHUNK_ROWS = 65_536  # rows of each table a graph call writes while a model preloads its caches
# The protected segment's share of a row cache (SLRU) by default: rows read by more than one request, and the
# preload's most counted rows. The config's default (serving.row_cache_protected_share), the share Caffeine's main
# region keeps.
PROTECTED_SHARE = ServingConfig.row_cache_protected_share
# A loaded model's directory of delta rows under the scratch directory: this prefix, the process id, a suffix.
DELTA_ROWS_PREFIX = "delta-rows-"


def check_protected_share(share: float) -> None:
    """ValueError unless `share` is a protected segment's share of a row cache: at least 0 (a plain LRU cache) and
    below 1 (rows read once need room)."""
    if not 0.0 <= share < 1.0:
        raise ValueError(f"serving.row_cache_protected_share must be at least 0 (a plain LRU cache) and below 1 "
                         f"(rows read once need room), got {share!r}")


class RowCacheTooSmall(ValueError):
    """A request reads more distinct rows of a tiered table than its row cache holds."""


class DeltaRows:
    """The rows deltas changed since a full version, on disk: a sparse RowStore of the table's shape (only the
    pages of rows written take disk) and a flag per row of the table in memory (one byte a row), with
    RowOverlay's `update` / `apply` / `len`. The caller removes the file (`close`)."""

    def __init__(self, path: Path, num_rows: int, embedding_dim: int) -> None:
        self.store = RowStore.sparse(path, num_rows, embedding_dim)
        self.changed = np.zeros(num_rows, dtype=bool)
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def update(self, rows: np.ndarray, values: np.ndarray) -> None:
        rows = np.asarray(rows, np.int64)
        if not len(rows):
            return
        values = np.asarray(values, np.float32)
        self.store.write(rows, values, np.zeros_like(values))
        self.count += int(np.count_nonzero(~self.changed[rows]))
        self.changed[rows] = True

    def apply(self, rows: np.ndarray, values: np.ndarray) -> None:
        """Writes the changed rows among `rows` into `values` (read from the full version's store)."""
        rows = np.asarray(rows, np.int64)
        hit = self.changed[rows] if len(rows) else np.zeros(0, dtype=bool)
        if hit.any():
            values[hit] = self.store.read(rows[hit])[0]

    def close(self) -> None:
        self.store.close()
        self.store.path.unlink(missing_ok=True)


def scratch_for(scratch: Path) -> Path:
    """A new directory for one loaded model's delta rows under `scratch` (named by this process), after removing
    those of processes that are gone (a server killed before it could remove its own)."""
    import psutil

    scratch = Path(scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    for old in scratch.glob(f"{DELTA_ROWS_PREFIX}*"):
        pid = old.name[len(DELTA_ROWS_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{DELTA_ROWS_PREFIX}{os.getpid()}-", dir=scratch))



@dataclass
class ServedTable:
    """One tiered table of a served model: its store, its delta rows, and which row sits in which slot.

    The slot map is a segmented LRU (the module's "Eviction"): `slots` is the probation segment and `protected`
    the protected one, each row -> slot, least recently used first; a row is in one of them or not cached."""

    name: str
    index: int  # the table's index in the model (its `table_<index>` output of the rows endpoint)
    store: RowStore
    cache_rows: int
    load: Any  # the load_slots endpoint of this table, in exports without LOAD_ALL_SLOTS_ENDPOINT; else None
    slots: OrderedDict[int, int] = field(default_factory=OrderedDict)  # probation: row -> slot, least recent first
    protected: OrderedDict[int, int] = field(default_factory=OrderedDict)  # row -> slot, least recent first
    free: list[int] = field(default_factory=list)
    # The rows deltas changed since the full version: in memory, or on disk (DeltaRows).
    delta: RowOverlay | DeltaRows = field(default_factory=RowOverlay)
    rows_loaded: int = 0  # by requests
    rows_hit: int = 0
    rows_preloaded: int = 0  # before the first request (TieredRows.preload)
    protected_share: float = PROTECTED_SHARE  # of cache_rows; 0: a plain LRU cache

    def __post_init__(self) -> None:
        check_protected_share(self.protected_share)
        self.free = list(range(self.cache_rows - 1, -1, -1))  # popped from the end: slot 0 first
        self.protected_rows = int(self.cache_rows * self.protected_share)

    def __contains__(self, row: int) -> bool:
        return row in self.slots or row in self.protected

    def slot_of(self, row: int) -> int | None:
        """The slot of cached `row`, else None."""
        slot = self.protected.get(row)
        return self.slots.get(row) if slot is None else slot

    @property
    def num_cached(self) -> int:
        return len(self.slots) + len(self.protected)

    def values(self, rows: np.ndarray) -> np.ndarray:
        """The rows' values as of the version served: the delta rows where a delta changed them, else the
        store's."""
        values, _ = self.store.read(rows)
        self.delta.apply(rows, values=values)
        return values

    def missing(self, rows: np.ndarray) -> np.ndarray:
        return np.asarray([row for row in rows.tolist() if row not in self], dtype=np.int64)

    def check_fits(self, rows: np.ndarray) -> None:
        if len(rows) > self.cache_rows:
            raise RowCacheTooSmall(
                f"a request reads {len(rows)} distinct rows of tiered table {self.name!r}, more than its row cache "
                f"of {self.cache_rows}; send fewer instances, or serve with a larger serving.row_cache_rows")

    def fill(self, rows: np.ndarray) -> dict[str, np.ndarray] | None:
        """The load of the rows not cached (`slots`, `rows`, `values`, `evicted`: free slots first, then those of
        the least recently used rows the request does not read, probation's before protected ones); None when
        all are cached. The slot map is not changed: the caller (who holds the write lock) writes the load into
        the model's cache, then `commit`s it, so a load that fails leaves the map as the cache is."""
        self.check_fits(rows)
        missing = self.missing(rows)
        if not len(missing):
            return None
        needed = set(rows.tolist())
        free = self.free[max(0, len(self.free) - len(missing)):]
        evicted: list[int] = []
        wanted = len(missing) - len(free)
        for segment in (self.slots, self.protected):
            if len(evicted) == wanted:
                break
            for row in segment:
                if row not in needed:
                    evicted.append(row)
                    if len(evicted) == wanted:
                        break
        slots = np.asarray(free + [self.slot_of(row) for row in evicted], dtype=np.int64)
        order = np.argsort(missing)
        missing, slots = missing[order], slots[order]
        return {"slots": slots, "rows": missing, "values": self.values(missing),
                "evicted": np.asarray(evicted, np.int64), "free_taken": np.asarray(len(free))}

    def commit(self, load: dict[str, np.ndarray] | None, preloaded: bool = False) -> None:
        """Takes a `fill` load, written into the model's cache, into the slot map (its rows on probation's most
        recent end); counted as rows requests loaded, or with `preloaded` as rows loaded before the first
        request."""
        if load is None:
            return
        for row in load["evicted"].tolist():
            if self.slots.pop(row, None) is None:
                del self.protected[row]
        del self.free[len(self.free) - int(load["free_taken"]):]
        self.slots.update(zip(load["rows"].tolist(), load["slots"].tolist(), strict=True))
        if preloaded:
            self.rows_preloaded += len(load["rows"])
        else:
            self.rows_loaded += len(load["rows"])

    def touch(self, rows: np.ndarray, loaded: np.ndarray | None = None) -> None:
        """A request read `rows` (all cached), of which it loaded `loaded`: those stay on probation's most recent
        end; the others, read again, move to the protected segment's most recent end (its least recent row back
        to probation when it is full)."""
        fresh = set() if loaded is None else set(np.asarray(loaded).tolist())
        for row in rows.tolist():
            if row in fresh:
                self.slots.move_to_end(row)
            elif row in self.protected:
                self.protected.move_to_end(row)
            else:
                self.protect(row)

    def protect(self, row: int) -> None:
        """Moves cached `row` from probation to the protected segment's most recent end, demoting the protected
        segment's least recent row to probation's most recent end when it is full."""
        self.protected[row] = self.slots.pop(row)
        if len(self.protected) > self.protected_rows:
            demoted, slot = self.protected.popitem(last=False)
            self.slots[demoted] = slot

    def rank_preloaded(self, rows: np.ndarray) -> None:
        """Orders the preloaded `rows` (cached, the most counted first) by their counts: the first
        `protected_rows` in the protected segment, the rest on probation, each segment's most counted at its
        most recent end."""
        rows = [row for row in rows.tolist() if row in self.slots]
        for row in reversed(rows[:self.protected_rows]):
            self.protected[row] = self.slots.pop(row)
        for row in reversed(rows[self.protected_rows:]):
            self.slots.move_to_end(row)

    def apply_delta(self, rows: np.ndarray, values: np.ndarray) -> dict[str, np.ndarray] | None:
        """A delta's rows of this table: kept as the newest values of those rows; returns the load that writes
        them into the slots of the ones cached (None when none is), for the caller (who holds the write lock)."""
        rows, values = np.asarray(rows, np.int64), np.asarray(values, np.float32)
        self.delta.update(rows, values=values)
        cached = [(row, self.slot_of(row), i) for i, row in enumerate(rows.tolist()) if row in self]
        if not cached:
            return None
        return {"slots": np.asarray([slot for _, slot, _ in cached], np.int64),
                "rows": np.asarray([row for row, _, _ in cached], np.int64),
                "values": values[[i for _, _, i in cached]], "evicted": np.zeros(0, np.int64)}


class TieredRows:
    """The tiered tables of one loaded model (shared by the snapshots a delta makes of it)."""

    def __init__(self, root: Any, directory: Path, tables: Mapping[str, Mapping[str, Any]],
                 scratch: Path | None = None, protected_share: float = PROTECTED_SHARE) -> None:
        """`scratch`: where the delta rows go to disk (a directory of this model's under it, removed when this
        object goes); None keeps them in memory. `protected_share`: each cache's protected segment
        (serving.row_cache_protected_share)."""
        rows_endpoint = getattr(root, TIERED_ROWS_ENDPOINT, None)
        self.rows_endpoint = rows_endpoint.concrete_functions[0] if rows_endpoint is not None else None
        self.load_all = getattr(root, LOAD_ALL_SLOTS_ENDPOINT, None)
        # Called past the signature's binding (0.26 against 0.95 ms a call here, with 3 tables).
        self.load_all_call = direct_call(self.load_all.concrete_functions[0]) if self.load_all is not None else None
        self.tables = [
            ServedTable(name=name, index=int(entry["table"]), store=RowStore.open(Path(directory) / entry["file"],
                                                                                    writable=False),
                        cache_rows=int(entry["cache_rows"]), protected_share=protected_share,
                        load=None if self.load_all is not None
                        else getattr(root, f"{LOAD_SLOTS_ENDPOINT}_{int(entry['table'])}"))
            for name, entry in tables.items()]
        # Per table, the rows to load before the first request (the export's `preload`: the rows training
        # counted most, up to the cache's size); none in exports made before it.
        self.preload_files = {name: Path(directory) / entry["preload"] for name, entry in tables.items()
                              if entry.get("preload")}
        self.preloaded = False
        self.scratch = scratch_for(scratch) if scratch is not None else None
        if self.scratch is not None:
            for table in self.tables:
                table.delta = DeltaRows(self.scratch / f"{table.name}.rows", table.store.num_rows,
                                        table.store.embedding_dim)
            weakref.finalize(self, _remove_delta_rows, [t.delta for t in self.tables], self.scratch)
        self.lock = threading.Lock()  # the slot maps' bookkeeping (touches under the read lock)
        self.one_call_answers = 0  # requests answered by the cached endpoint's one call
        self.loaded_answers = 0  # requests answered by the loaded endpoint, after the cached one (two calls)
        self.load_calls = 0  # graph calls that wrote rows into the caches

    def write(self, loads: Sequence[dict[str, np.ndarray] | None]) -> None:
        """Writes `loads` (per table, in `tables` order: a `fill` or `apply_delta` load, or None) into the
        model's caches: one call for all tables, or one per table in exports before LOAD_ALL_SLOTS_ENDPOINT."""
        if not any(load is not None for load in loads):
            return
        if self.load_all is None:
            for table, load in zip(self.tables, loads, strict=True):
                if load is not None:
                    table.load({"slots": tf.constant(load["slots"], tf.int64),
                                "rows": tf.constant(load["rows"], tf.int64),
                                "values": tf.constant(load["values"], tf.float32),
                                "evicted": tf.constant(load["evicted"], tf.int64)})
                    self.load_calls += 1
            return
        self.load_all_call(self.load_request(loads))
        self.load_calls += 1

    def load_request(self, loads: Sequence[dict[str, np.ndarray] | None]) -> dict[str, tf.Tensor]:
        """`loads` (as `write` takes them) as LOAD_ALL_SLOTS_ENDPOINT's argument; empty for a table with none."""
        request = {}
        for table, load in zip(self.tables, loads, strict=True):
            dim = table.store.embedding_dim
            load = load or {"slots": np.zeros(0, np.int64), "rows": np.zeros(0, np.int64),
                            "values": np.zeros((0, dim), np.float32), "evicted": np.zeros(0, np.int64)}
            request.update({f"slots_{table.index}": tf.constant(load["slots"], tf.int64),
                            f"rows_{table.index}": tf.constant(load["rows"], tf.int64),
                            f"values_{table.index}": tf.constant(load["values"], tf.float32),
                            f"evicted_{table.index}": tf.constant(load["evicted"], tf.int64)})
        return request

    def rows(self, arguments: Sequence[tf.Tensor]) -> list[np.ndarray]:
        """Per table, the distinct row ids a packed batch reads (exports without a cached endpoint)."""
        if self.rows_endpoint is None:
            raise RuntimeError("this model's export has neither a cached endpoint nor the tiered_rows endpoint: "
                               "export it again")
        out = self.rows_endpoint(*arguments)
        return [np.unique(out[f"table_{table.index}"].numpy()) for table in self.tables]

    def run(self, arguments: Sequence[tf.Tensor], reading: Any, writing: Any, call: Any,
            cached_call: Any = None, loaded_call: Any = None) -> Any:
        """`call()` under `reading()` once every row the batch reads is cached, loading under `writing()`.
        `cached_call(*arguments)`: the model's cached endpoint, which answers in the same call when the rows are
        cached (its answer is returned; `one_call_answers` counts them). `loaded_call(load, inputs)`: the model's
        loaded endpoint, which then writes the missing rows and answers from the inputs the cached call
        preprocessed, in one call under `writing()` (no request reads the caches meanwhile, so none of the rows
        can leave before the answer): two graph calls for a request that loads rows, instead of three."""
        if cached_call is not None:
            context: AbstractContextManager[Any] = reading()
            with context:
                out = cached_call(*arguments)
                needed = [np.unique(out[f"table_{table.index}"].numpy()) for table in self.tables]
                if bool(out["cached"]):
                    with self.lock:
                        for table, rows in zip(self.tables, needed, strict=True):
                            table.rows_hit += len(rows)
                            table.touch(rows)
                        self.one_call_answers += 1
                    return out["probability"].numpy()
            if loaded_call is not None:
                inputs = {key[len(MODEL_INPUT_PREFIX):]: value for key, value in out.items()
                          if key.startswith(MODEL_INPUT_PREFIX)}
                with writing(), self.lock:
                    loads = [table.fill(rows) for table, rows in zip(self.tables, needed, strict=True)]
                    probability = loaded_call(self.load_request(loads), inputs).numpy()
                    self.load_calls += 1
                    self.loaded_answers += 1
                    for table, rows, load in zip(self.tables, needed, loads, strict=True):
                        table.commit(load)
                        table.rows_hit += len(rows) - (len(load["rows"]) if load is not None else 0)
                        table.touch(rows, loaded=None if load is None else load["rows"])
                return probability
        else:
            needed = self.rows(arguments)
        loaded: list[list[np.ndarray]] = [[] for _ in self.tables]  # rows this request loaded, per table
        for attempt in range(MAX_LOADS):
            context = reading()
            with context:
                with self.lock:
                    missing = [len(table.missing(rows)) for table, rows in zip(self.tables, needed, strict=True)]
                    for table, rows, count, ours in zip(self.tables, needed, missing, loaded, strict=True):
                        if attempt == 0:  # rows found cached when the request came
                            table.rows_hit += len(rows) - count
                        if not any(missing):
                            table.touch(rows, loaded=np.concatenate(ours) if ours else None)
                if not any(missing):
                    return call()
            with writing(), self.lock:
                loads = [table.fill(rows) for table, rows in zip(self.tables, needed, strict=True)]
                self.write(loads)
                for table, load, ours in zip(self.tables, loads, loaded, strict=True):
                    table.commit(load)
                    if load is not None:
                        ours.append(load["rows"])
        raise RuntimeError(f"the rows of a request were evicted by other requests {MAX_LOADS} times in a row; "
                           "serve with a larger serving.row_cache_rows")

    def preload(self, chunk_rows: int = PRELOAD_CHUNK_ROWS) -> int:
        """Loads each table's preload rows into its cache (once; the model is not serving yet, so no request
        reads the caches meanwhile), `chunk_rows` rows of each table a graph call. Returns the rows loaded."""
        with self.lock:
            if self.preloaded:
                return 0
            self.preloaded = True
            wanted = [np.load(self.preload_files[table.name])[:table.cache_rows].astype(np.int64)
                      if table.name in self.preload_files else np.zeros(0, np.int64) for table in self.tables]
            before = sum(table.rows_preloaded for table in self.tables)
            for start in range(0, max((len(rows) for rows in wanted), default=0), chunk_rows):
                loads = [table.fill(rows[start:start + chunk_rows]) if len(rows[start:start + chunk_rows]) else None
                         for table, rows in zip(self.tables, wanted, strict=True)]
                self.write(loads)
                for table, load in zip(self.tables, loads, strict=True):
                    table.commit(load, preloaded=True)
            for table, rows in zip(self.tables, wanted, strict=True):
                table.rank_preloaded(rows)
            return sum(table.rows_preloaded for table in self.tables) - before

    def apply_delta(self, arrays: Mapping[str, np.ndarray]) -> None:
        """A delta's tiered rows (the caller holds the write lock)."""
        with self.lock:
            self.write([table.apply_delta(arrays[tiered_rows_name(table.name)], arrays[tiered_values_name(table.name)])
                        if tiered_rows_name(table.name) in arrays else None for table in self.tables])

    def counters(self) -> dict[str, dict[str, int]]:
        return {table.name: {"cache_rows": table.cache_rows, "cached": table.num_cached, "rows_hit": table.rows_hit,
                             "rows_loaded": table.rows_loaded, "rows_preloaded": table.rows_preloaded,
                             "delta_rows": len(table.delta), "protected": len(table.protected)}
                for table in self.tables}


def _remove_delta_rows(deltas: list[Any], scratch: Path) -> None:
    for delta in deltas:
        delta.close()
    shutil.rmtree(scratch, ignore_errors=True)
