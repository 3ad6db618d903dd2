"""The hot tier: `hot_rows` slots in memory holding the rows a batch trains on, in front of a RowStore on disk.

The model trains on a table of `hot_rows` slots (a variable), not on the table itself. Before each batch the
planner maps the batch's row ids to slots, evicting the least recently used slots the batch does not read;
the batch's columns are rewritten from row ids to slot ids, and the plan says which evicted slots to write back
to which rows (only dirty ones: slots a training step may have changed) and which rows to load into which
slots. Each row carries its Adagrad accumulator row with it, so a row trains exactly as it would in a table of
all rows.

The order, for batch i (plans are made and applied in batch order, one sequence per tier):

1. Plan (producer thread, ahead of training): `prepare` plans batch i against the planner's state, which
   already includes the plans made for batches < i, applied or not.
2. Prefetch (producer thread): `prepare` reads from the store the rows plan i loads, except a row whose latest
   write-back belongs to a plan not yet applied. That write-back reads the slot only when its plan is applied,
   after the step before it, so the store holds the row's old value until then: reading it now is the
   stale-read race of FBGEMM's cache (prefetch of batch i + 1 cached rows before batch i's backward wrote
   them; fixed there by making prefetch wait for the pending writes). Such loads are deferred: read at apply
   time, after the write-back that precedes them.
3. Apply (training thread, after step i - 1 completed, before step i; `apply`): write-backs first (they read
   the slots' values after step i - 1's update, one gather per variable), then the deferred loads take their
   rows as last written back, then every load writes its row and accumulator into its slot (one scatter per
   variable). The write-backs' values are kept in memory, in plan order, until written to the store.
4. Step i (Keras): reads and updates only slots of batch i.
5. Write-behind (the next `prepare`, on one of the store's I/O threads while the producer plans and reads the
   next loads; or `flush`): the applied plans' write-backs are written to the store, oldest first, and only
   then dropped from memory. The store writes thus run beside the steps instead of between them, and beside
   the next reads instead of before them.

Why this is free of the race: a row is loaded by plan i either at prepare time, when every plan that wrote it
back was applied, from its latest write-back (`read_latest`: in memory while the write-behind has not written
it, else from the store, which then holds it; the rows read from the store are rows no write in flight names),
or at apply time of plan i, after every plan < i was applied, the same way. No other write of the row can be
pending, since a row is written back only by a plan that evicts it, and it is not resident between that plan
and plan i. A write-back and a load in
the same plan never name the same row (victims are rows the batch does not read), and when they share a slot
the write-back reads it first. Write-backs reach the store one writer at a time, in plan order, so a row
written back twice ends with its later value.

`flush` writes the pending write-backs, then every slot that is dirty as of the last applied plan back to its
row (the applied state, not the planner's, which may be ahead with plans of batches not yet trained), then
fsyncs: the store then holds the whole table as of the last step. A checkpoint is flush + RowStore.snapshot.

A prepared plan belongs to the tier that made it; one producer thread prepares, one training thread applies.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from trainer import native_tier
from trainer.arguments import require_integer
from trainer.row_map import RowMap
from trainer.row_store import IO_POOL, RowStore


@dataclass(frozen=True)
class Plan:
    """What to do before a batch: its ids as slot ids, the write-backs and the loads, in that order."""

    sequence: int  # 0, 1, ... in the order plans are made and must be applied
    slot_ids: np.ndarray  # the batch's row ids mapped to slots, same shape
    write_back_slots: np.ndarray  # int64: these slots' values go to...
    write_back_rows: np.ndarray  # ...these rows of the store
    load_rows: np.ndarray  # int64, ascending: these rows of the store go to...
    load_slots: np.ndarray  # ...these slots
    training: bool  # a training step updates the batch's slots: they become dirty
    num_rows: int = 0  # distinct rows the batch reads (resident ones and loads)


class RowSlotMap(RowMap):
    """Row id -> slot, for up to `capacity` rows and slots in [0, capacity): a RowMap (trainer/row_map.py) that
    also knows each slot's entry, so a slot's row is removed without looking the row up. Its memory is 40 to 72
    bytes per slot and does not grow with the table on disk."""

    def __init__(self, capacity: int) -> None:
        require_integer("capacity", capacity)
        self.capacity = int(capacity)
        super().__init__(self.capacity)

    def allocate(self, num_buckets: int) -> None:
        super().allocate(num_buckets)
        self.entry_of_slot = np.full(self.capacity, -1, dtype=np.int64)  # flat position of each slot's row

    def insert(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """Adds distinct `rows`, none of them present, with their distinct `slots`, none of them in use."""
        if len(self) + len(rows) > self.capacity:
            raise ValueError(f"A RowSlotMap of capacity {self.capacity} holds {len(self)} rows; adding "
                             f"{len(rows)} would exceed it. Remove rows first")
        super().insert(rows, slots)

    def placed(self, values: np.ndarray, entries: np.ndarray) -> None:
        self.entry_of_slot[values] = entries

    def remove_slots(self, slots: np.ndarray) -> None:
        """Removes the rows of distinct `slots`, all in use."""
        entries = self.entry_of_slot[slots]
        if (entries < 0).any():
            raise ValueError(f"Slots {np.asarray(slots)[entries < 0][:10].tolist()} hold no row of the map; remove "
                             "only slots in use")
        self.remove_entries(entries)
        self.entry_of_slot[slots] = -1


class HotTierPlanner:
    """Maps each batch's row ids to `hot_rows` slots, least recently used slot evicted first.

    Sequential and pure (no I/O): the plan for a batch depends on the plans made before it. Recency is by
    batch; within a batch, lower row ids count as used earlier (whether resident or loaded). Free slots are
    taken lowest first, then the least recently used slots the batch does not read, the loads in ascending
    row order taking them in that order.

    Vectorised: row -> slot is a RowSlotMap; each slot carries the number of its last use (uses are numbered
    in batch order, then row order); and a queue of (slot, use) in use order gives the victims: the queue's
    front entries whose use is still their slot's last, the others being stale (the slot was used again
    since). Each entry is appended once and passed over once, so a batch costs O(its distinct rows), whatever
    `hot_rows`.
    """

    def __init__(self, hot_rows: int, first_sequence: int = 0) -> None:
        require_integer("hot_rows", hot_rows)
        self.hot_rows = int(hot_rows)
        self.slot_map = RowSlotMap(self.hot_rows)
        self.row_of_slot = np.full(self.hot_rows, -1, dtype=np.int64)
        self.last_use = np.full(self.hot_rows, -1, dtype=np.int64)
        self.num_used_slots = 0  # slots [0, num_used_slots) hold rows; an evicted slot goes to the next row
        self.dirty = np.zeros(self.hot_rows, dtype=bool)
        self.num_planned = first_sequence
        self.num_uses = 0
        # The recency queue: entries [queue_head, queue_tail), in use order. At most one entry per slot is live,
        # so compacting leaves at most hot_rows, and a batch adds at most hot_rows.
        self.queue_slots = np.empty(2 * self.hot_rows, dtype=np.int64)
        self.queue_uses = np.empty(2 * self.hot_rows, dtype=np.int64)
        self.queue_head = self.queue_tail = 0

    def plan(self, row_ids: np.ndarray, training: bool = True) -> Plan:
        ids = integer_ids(row_ids)
        if ids.size and ids.min() < 0:
            raise negative_ids(ids)
        unique, inverse = np.unique(ids, return_inverse=True)
        if len(unique) > self.hot_rows:
            raise too_many_rows(len(unique), self.hot_rows)
        slots = self.slot_map.lookup(unique)
        uses = self.num_uses + np.arange(len(unique), dtype=np.int64)
        resident = slots >= 0
        self.last_use[slots[resident]] = uses[resident]  # before choosing victims: the batch's rows stay
        missing = np.flatnonzero(~resident)
        num_free = min(len(missing), self.hot_rows - self.num_used_slots)
        free = np.arange(self.num_used_slots, self.num_used_slots + num_free, dtype=np.int64)
        self.num_used_slots += num_free
        victims = self.least_recently_used(len(missing) - num_free)
        victim_rows = self.row_of_slot[victims]
        written = self.dirty[victims]
        if len(victims):
            self.dirty[victims] = False
            self.slot_map.remove_slots(victims)
        new_slots = np.concatenate([free, victims])
        load_rows = unique[missing]
        self.slot_map.insert(load_rows, new_slots)
        self.row_of_slot[new_slots] = load_rows
        self.last_use[new_slots] = uses[missing]
        slots[missing] = new_slots
        self.enqueue(slots, uses)
        self.num_uses += len(unique)
        if training:
            self.dirty[slots] = True
        plan = Plan(
            sequence=self.num_planned,
            slot_ids=slots[inverse].reshape(ids.shape),
            write_back_slots=victims[written],
            write_back_rows=victim_rows[written],
            load_rows=load_rows,
            load_slots=new_slots,
            training=bool(training),
            num_rows=len(unique),
        )
        self.num_planned += 1
        return plan

    def least_recently_used(self, count: int) -> np.ndarray:
        """Takes the `count` least recently used slots off the queue's front, least recent first."""
        taken: list[np.ndarray] = []
        while count > 0:
            if self.queue_head == self.queue_tail:
                raise RuntimeError(f"The recency queue ran out with {count} victims still to find; the planner's "
                                   "state is inconsistent (a bug: report it with the batches that led here)")
            stop = min(self.queue_tail, self.queue_head + max(2 * count, 64))
            window = self.queue_slots[self.queue_head:stop]
            live = np.flatnonzero(self.last_use[window] == self.queue_uses[self.queue_head:stop])
            if len(live) >= count:
                taken.append(window[live[:count]])
                self.queue_head += int(live[count - 1]) + 1
                count = 0
            else:
                taken.append(window[live])
                self.queue_head = stop
                count -= len(live)
        return np.concatenate(taken) if taken else np.empty(0, dtype=np.int64)

    def enqueue(self, slots: np.ndarray, uses: np.ndarray) -> None:
        """Appends (slot, use) entries, `uses` ascending and above every use queued so far."""
        if self.queue_tail + len(slots) > len(self.queue_slots):  # compact: keep the live entries, in order
            window = slice(self.queue_head, self.queue_tail)
            live = self.last_use[self.queue_slots[window]] == self.queue_uses[window]
            kept_slots, kept_uses = self.queue_slots[window][live], self.queue_uses[window][live]
            self.queue_head, self.queue_tail = 0, len(kept_slots)
            self.queue_slots[:self.queue_tail], self.queue_uses[:self.queue_tail] = kept_slots, kept_uses
        self.queue_slots[self.queue_tail:self.queue_tail + len(slots)] = slots
        self.queue_uses[self.queue_tail:self.queue_tail + len(slots)] = uses
        self.queue_tail += len(slots)


class NativePlanner:
    """HotTierPlanner's plans, made by trainer/native/hot_tier.c in one call a batch. The same state, held in
    numpy arrays the C code updates: row -> slot in an open-addressing table of at least twice `hot_rows`
    entries (16 bytes each), and per slot its row, whether it is dirty and its place in a list of the slots in
    use from least to most recently used (32 bytes). `library` is trainer.native_tier.library()'s."""

    def __init__(self, hot_rows: int, library: Any, first_sequence: int = 0) -> None:
        require_integer("hot_rows", hot_rows)
        self.hot_rows = int(hot_rows)
        self.library = library
        self.num_planned = first_sequence
        self.capacity = 1 << max(1, (2 * self.hot_rows - 1).bit_length())
        self.table = np.full((self.capacity, 2), -1, dtype=np.int64)  # (row, slot) entries, row -1 where free
        self.slots = np.full((self.hot_rows, 4), -1, dtype=np.int64)  # row, older and newer slot, dirty
        self.slots[:, 3] = 0
        self.scalars = np.array([-1, -1, 0], dtype=np.int64)  # least and most recent slot, slots in use
        self.counts = np.zeros(3, dtype=np.int64)
        self.state = (self.table.ctypes.data, self.slots.ctypes.data, self.scalars.ctypes.data)

    def resident(self) -> dict[int, int]:
        """Row -> slot of every row held."""
        held = self.table[:, 0] >= 0
        return dict(zip(self.table[held, 0].tolist(), self.table[held, 1].tolist(), strict=True))

    def plan(self, row_ids: np.ndarray, training: bool = True) -> Plan:
        ids = integer_ids(row_ids)
        flat = np.ascontiguousarray(ids.reshape(-1))
        count = len(flat)
        scratch = np.empty(4 * count, dtype=np.int64)
        out = np.empty((7, count), dtype=np.int64)
        status = self.library.ctr_plan(self.hot_rows, self.capacity, *self.state, flat.ctypes.data, count,
                                       int(bool(training)), scratch.ctypes.data, out.ctypes.data,
                                       self.counts.ctypes.data)
        if status == native_tier.NEGATIVE_ID:
            raise negative_ids(ids)
        if status == native_tier.TOO_MANY_ROWS:
            raise too_many_rows(int(self.counts[0]), self.hot_rows)
        if status != 0:
            raise RuntimeError(f"hot_tier.c returned {status} (a bug: report it with the batch that led here)")
        num_rows, num_loads, num_write_backs = self.counts.tolist()
        plan = Plan(
            sequence=self.num_planned,
            slot_ids=out[0].reshape(ids.shape),
            write_back_slots=out[5, :num_write_backs],
            write_back_rows=out[6, :num_write_backs],
            load_rows=out[3, :num_loads],
            load_slots=out[4, :num_loads],
            training=bool(training),
            num_rows=num_rows,
        )
        self.num_planned += 1
        return plan


def make_planner(hot_rows: int, first_sequence: int = 0, native: bool = True) -> HotTierPlanner | NativePlanner:
    """The native planner where hot_tier.c builds here (and `native`), else the numpy one: the same plans either
    way."""
    library = native_tier.library() if native else None
    if library is None:
        return HotTierPlanner(hot_rows, first_sequence)
    return NativePlanner(hot_rows, library, first_sequence)


def integer_ids(row_ids: np.ndarray) -> np.ndarray:
    ids = np.asarray(row_ids)
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"Row ids must be integers. Received: dtype {ids.dtype}")
    return ids.astype(np.int64, copy=False)


def negative_ids(ids: np.ndarray) -> ValueError:
    return ValueError(f"Row ids must be >= 0. Received: {np.unique(ids[ids < 0])[:10].tolist()}")


def too_many_rows(num_rows: int, hot_rows: int) -> ValueError:
    return ValueError(
        f"A batch reads {num_rows} distinct rows of this table, more than its hot tier's hot_rows={hot_rows} "
        f"slots. Set hot_rows to at least {num_rows} (a few times the distinct rows of a batch, so that rows stay "
        "resident between batches) or use smaller batches")


@dataclass(frozen=True)
class PreparedPlan:
    """A plan with its loads read ahead where that is safe. Row k of `load_values` / `load_accumulators` is
    the value of `plan.load_rows[k]`, read by `prepare` unless `deferred[k]` (then read by `apply`)."""

    plan: Plan
    load_values: np.ndarray
    load_accumulators: np.ndarray
    deferred: np.ndarray  # bool, one per load


class SlotAccess(Protocol):
    """Reads and writes slots of the hot table and of its accumulator (a Keras variable pair, or arrays)."""

    def read(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    def write(self, slots: np.ndarray, values: np.ndarray, accumulators: np.ndarray) -> None: ...


class ArraySlots:
    """Slots held in two numpy arrays [hot_rows, embedding_dim]: for tests, and for code that steps without
    Keras."""

    def __init__(self, hot_rows: int, embedding_dim: int) -> None:
        self.values = np.zeros((hot_rows, embedding_dim), dtype=np.float32)
        self.accumulators = np.zeros((hot_rows, embedding_dim), dtype=np.float32)

    def read(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.values[slots].copy(), self.accumulators[slots].copy()

    def write(self, slots: np.ndarray, values: np.ndarray, accumulators: np.ndarray) -> None:
        self.values[slots] = values
        self.accumulators[slots] = accumulators


@dataclass(frozen=True)
class TierCounters:
    """What a hot tier has done: plans, rows found resident, rows loaded (read ahead or at apply time), rows
    written back on eviction and by flushes."""

    plans_made: int = 0
    plans_applied: int = 0
    rows_hit: int = 0
    rows_loaded: int = 0
    rows_prefetched: int = 0
    rows_deferred: int = 0
    rows_written_back: int = 0
    rows_flushed: int = 0
    flushes: int = 0


class HotTier:
    """A planner, its store, and the state of the slots as of the last applied plan (see the module's order)."""

    def __init__(self, store: RowStore, hot_rows: int, native: bool = True) -> None:
        self.store = store
        self.native = native  # False: plans in numpy, as where hot_tier.c does not build (for comparisons)
        self.planner = make_planner(hot_rows, native=native)
        self.hot_rows = self.planner.hot_rows
        # The slots as the last applied plan left them: what flush writes back.
        self.applied_row_of_slot = np.full(self.hot_rows, -1, dtype=np.int64)
        self.applied_dirty = np.zeros(self.hot_rows, dtype=bool)
        self.num_applied = 0
        # The write-backs of plans that may not be applied yet, by plan: (sequence, rows), oldest first.
        self.write_backs_by_plan: deque[tuple[int, np.ndarray]] = deque()
        # Write-backs of applied plans whose rows are not in the store yet, oldest first: (rows ascending,
        # values, accumulators). Appended by `apply`, removed by `write_behind` once written.
        self.unwritten: deque[tuple[np.ndarray, np.ndarray, np.ndarray]] = deque()
        self.writing = threading.Lock()  # one writer at a time, so write-backs of a row land in plan order
        self.condition = threading.Condition()
        self.counters = TierCounters()

    @property
    def num_pending(self) -> int:
        """Plans made and not applied yet."""
        return self.planner.num_planned - self.num_applied

    def prepare(self, row_ids: np.ndarray, training: bool = True) -> PreparedPlan:
        """Writes the write-backs of the plans applied so far to the store while it plans the next batch and reads
        its loads that are safe to read now (producer thread); returns once both are done. With the store's
        `io_threads` at 1, the write-backs are written first, on this thread."""
        with self.condition:
            applied = self.num_applied
        if self.store.io_threads > 1:
            writing = IO_POOL.submit(self.write_behind)
        else:
            writing = None
            self.write_behind()
        try:
            return self.plan_and_read(row_ids, training, applied)
        finally:
            if writing is not None:
                writing.result()  # waits; a failed write fails the plan: its rows would be lost otherwise

    def plan_and_read(self, row_ids: np.ndarray, training: bool, applied: int) -> PreparedPlan:
        """`prepare` after its write-behind started: every write-back of plans < `applied` is in the store or
        in `unwritten`, from where `read_latest` takes it."""
        while self.write_backs_by_plan and self.write_backs_by_plan[0][0] < applied:
            self.write_backs_by_plan.popleft()
        try:
            plan = self.planner.plan(row_ids, training)
        except ValueError as error:  # name the table: a model may have several
            raise ValueError(f"Tiered table {self.store.path.stem!r} (store {self.store.path}): {error}. In a feature "
                             "spec, hot_rows is set on the categorical feature that owns the table") from error
        # A row written back by a plan not applied yet is read when this plan is applied.
        if self.write_backs_by_plan and len(plan.load_rows):
            pending = np.concatenate([rows for _, rows in self.write_backs_by_plan])
            deferred = np.isin(plan.load_rows, pending)
        else:
            deferred = np.zeros(len(plan.load_rows), dtype=bool)
        ready = ~deferred
        num_deferred = int(deferred.sum())
        if num_deferred:
            load_values = np.empty((len(plan.load_rows), self.store.embedding_dim), dtype=np.float32)
            load_accumulators = np.empty_like(load_values)
            if num_deferred < len(ready):
                load_values[ready], load_accumulators[ready] = self.read_latest(plan.load_rows[ready])
        else:
            load_values, load_accumulators = self.read_latest(plan.load_rows)
        if len(plan.write_back_rows):
            self.write_backs_by_plan.append((plan.sequence, plan.write_back_rows))
        self.count(plans_made=1, rows_hit=plan.num_rows - len(plan.load_rows),
                   rows_prefetched=len(ready) - num_deferred, rows_deferred=num_deferred)
        return PreparedPlan(plan, load_values, load_accumulators, deferred)

    def apply(self, prepared: PreparedPlan, slots: SlotAccess) -> None:
        """Applies the next plan (training thread, between steps): write-backs read from the slots, then loads
        written to them. The write-backs reach the store later, written by the next `prepare` (the producer
        thread) or by `flush`; until then a load of their rows takes them from memory."""
        plan = prepared.plan
        if plan.sequence != self.num_applied:
            raise ValueError(
                f"Plans must be applied once each, in the order they were made: the next is plan "
                f"{self.num_applied}. Received: plan {plan.sequence}. Apply each batch's plan just before its step")
        written_back = None
        if len(plan.write_back_slots):
            values, accumulators = slots.read(plan.write_back_slots)
            order = np.argsort(plan.write_back_rows)
            written_back = (plan.write_back_rows[order], values[order], accumulators[order])
        load_values, load_accumulators = prepared.load_values, prepared.load_accumulators
        if prepared.deferred.any():
            load_values, load_accumulators = load_values.copy(), load_accumulators.copy()
            load_values[prepared.deferred], load_accumulators[prepared.deferred] = self.read_latest(
                plan.load_rows[prepared.deferred])
        if len(plan.load_slots):
            slots.write(plan.load_slots, load_values, load_accumulators)
        self.applied_dirty[plan.write_back_slots] = False
        self.applied_row_of_slot[plan.load_slots] = plan.load_rows
        self.applied_dirty[plan.load_slots] = False
        if plan.training:
            self.applied_dirty[plan.slot_ids.reshape(-1)] = True
        with self.condition:
            if written_back is not None:
                self.unwritten.append(written_back)
            self.num_applied += 1
            self.condition.notify_all()
        self.count(plans_applied=1, rows_loaded=len(plan.load_rows), rows_written_back=len(plan.write_back_rows))

    def read_latest(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values, accumulators) of `rows` as last written back: from a write-back not in the store yet (the
        latest holding the row), else from the store (every write-back of it is there)."""
        with self.condition:
            unwritten = list(self.unwritten)
        values = np.empty((len(rows), self.store.embedding_dim), dtype=np.float32)
        accumulators = np.empty_like(values)
        found = np.zeros(len(rows), dtype=bool)
        for written_rows, written_values, written_accumulators in reversed(unwritten):
            positions = np.minimum(np.searchsorted(written_rows, rows), len(written_rows) - 1)
            here = ~found & (written_rows[positions] == rows)
            values[here], accumulators[here] = written_values[positions[here]], written_accumulators[positions[here]]
            found |= here
        if not found.all():
            values[~found], accumulators[~found] = self.store.read(rows[~found])
        return values, accumulators

    def write_behind(self) -> None:
        """Writes the applied plans' write-backs that are not in the store yet, oldest first."""
        with self.writing:
            while True:
                with self.condition:
                    if not self.unwritten:
                        return
                    rows, values, accumulators = self.unwritten[0]
                self.store.write(rows, values, accumulators)
                with self.condition:  # only now: until written, `read_latest` takes the rows from here
                    self.unwritten.popleft()

    def flush(self, slots: SlotAccess) -> int:
        """Writes the pending write-backs, then every slot dirty as of the last applied plan back to its row, and
        fsyncs the store; returns the dirty rows written. Call it between steps; plans prepared ahead stay
        valid."""
        self.write_behind()
        dirty = np.flatnonzero(self.applied_dirty)
        if len(dirty):
            values, accumulators = slots.read(dirty)
            self.store.write(self.applied_row_of_slot[dirty], values, accumulators)
        self.store.flush()
        self.applied_dirty[:] = False
        self.count(rows_flushed=len(dirty), flushes=1)
        return len(dirty)

    def reset(self, slots: SlotAccess) -> None:
        """Flushes, then empties the tier: every slot free, plans prepared and not applied dropped. For a new
        stream of batches after one that stopped early (its producer must have stopped)."""
        self.flush(slots)
        self.planner = make_planner(self.hot_rows, first_sequence=self.num_applied, native=self.native)
        self.applied_row_of_slot[:] = -1
        self.write_backs_by_plan.clear()

    def resident_rows(self) -> dict[int, int]:
        """Row -> slot as of the last applied plan."""
        slots = np.flatnonzero(self.applied_row_of_slot >= 0)
        return dict(zip(self.applied_row_of_slot[slots].tolist(), slots.tolist(), strict=True))

    def count(self, **increments: int) -> None:
        with self.condition:
            self.counters = replace(self.counters, **{name: getattr(self.counters, name) + value
                                                      for name, value in increments.items()})
