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
   the slots' values after step i - 1's update and write them to the store), then the deferred loads read the
   store, then every load writes its row and accumulator into its slot.
4. Step i (Keras): reads and updates only slots of batch i.

Why this is free of the race: a row is loaded by plan i either from a store that already holds its last
write-back (the write-back's plan was applied before the prefetch read), or at apply time of plan i, after the
write-backs of every plan < i were applied. No other write of the row can be pending, since a row is written
back only by a plan that evicts it, and it is not resident between that plan and plan i. A write-back and a
load in the same plan never name the same row (victims are rows the batch does not read), and when they
share a slot the write-back reads it first.

`flush` writes every slot that is dirty as of the last applied plan back to its row (the applied state, not
the planner's, which may be ahead with plans of batches not yet trained), then fsyncs: the store then holds
the whole table as of the last step. A checkpoint is flush + RowStore.snapshot.

A prepared plan belongs to the tier that made it; one producer thread prepares, one training thread applies.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from trainer.arguments import require_integer
from trainer.row_store import RowStore


@dataclass(frozen=True)
class Plan:
    """What to do before a batch: its ids as slot ids, the write-backs and the loads, in that order."""

    sequence: int  # 0, 1, ... in the order plans are made and must be applied
    slot_ids: np.ndarray  # the batch's row ids mapped to slots, same shape
    write_back_slots: np.ndarray  # int64: these slots' values go to...
    write_back_rows: np.ndarray  # ...these rows of the store
    load_rows: np.ndarray  # int64: these rows of the store go to...
    load_slots: np.ndarray  # ...these slots
    training: bool  # a training step updates the batch's slots: they become dirty


class HotTierPlanner:
    """Maps each batch's row ids to `hot_rows` slots, least recently used slot evicted first.

    Sequential and pure (no I/O): the plan for a batch depends on the plans made before it. Recency is by
    batch; within a batch, lower row ids count as used earlier. Free slots are taken lowest first.
    """

    def __init__(self, hot_rows: int, first_sequence: int = 0) -> None:
        require_integer("hot_rows", hot_rows)
        self.hot_rows = int(hot_rows)
        self.slot_of_row: OrderedDict[int, int] = OrderedDict()  # least recently used first
        self.free_slots: deque[int] = deque(range(self.hot_rows))
        self.dirty = np.zeros(self.hot_rows, dtype=bool)
        self.num_planned = first_sequence

    def plan(self, row_ids: np.ndarray, training: bool = True) -> Plan:
        ids = np.asarray(row_ids)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"Row ids must be integers. Received: dtype {ids.dtype}")
        if ids.size and ids.min() < 0:
            raise ValueError(f"Row ids must be >= 0. Received: {np.unique(ids[ids < 0])[:10].tolist()}")
        unique, inverse = np.unique(ids.astype(np.int64, copy=False), return_inverse=True)
        if len(unique) > self.hot_rows:
            raise ValueError(
                f"A batch reads {len(unique)} distinct rows of this table, more than its hot tier's hot_rows="
                f"{self.hot_rows} slots. Set hot_rows to at least {len(unique)} (a few times the distinct rows of a "
                "batch, so that rows stay resident between batches) or use smaller batches")
        slots = np.empty(len(unique), dtype=np.int64)
        missing = []
        for position, row in enumerate(unique.tolist()):
            slot = self.slot_of_row.get(row)
            if slot is None:
                missing.append(position)
            else:
                self.slot_of_row.move_to_end(row)
                slots[position] = slot
        write_back_slots, write_back_rows = [], []
        for position in missing:
            if self.free_slots:
                slot = self.free_slots.popleft()
            else:  # the front holds rows this batch does not read: its own rows were moved or added to the end
                victim, slot = self.slot_of_row.popitem(last=False)
                if self.dirty[slot]:
                    write_back_slots.append(slot)
                    write_back_rows.append(victim)
                    self.dirty[slot] = False
            row = int(unique[position])
            self.slot_of_row[row] = slot
            slots[position] = slot
        if training:
            self.dirty[slots] = True
        plan = Plan(
            sequence=self.num_planned,
            slot_ids=slots[inverse].reshape(ids.shape),
            write_back_slots=np.asarray(write_back_slots, dtype=np.int64),
            write_back_rows=np.asarray(write_back_rows, dtype=np.int64),
            load_rows=unique[missing],
            load_slots=slots[missing],
            training=bool(training),
        )
        self.num_planned += 1
        return plan


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

    def __init__(self, store: RowStore, hot_rows: int) -> None:
        self.store = store
        self.planner = HotTierPlanner(hot_rows)
        self.hot_rows = self.planner.hot_rows
        # The slots as the last applied plan left them: what flush writes back.
        self.applied_row_of_slot = np.full(self.hot_rows, -1, dtype=np.int64)
        self.applied_dirty = np.zeros(self.hot_rows, dtype=bool)
        self.num_applied = 0
        # Rows whose latest write-back is in a plan that may not be applied yet: row -> that plan's sequence;
        # and the write-backs by plan, to forget them once applied.
        self.last_write_back: dict[int, int] = {}
        self.write_backs_by_plan: deque[tuple[int, np.ndarray]] = deque()
        self.condition = threading.Condition()
        self.counters = TierCounters()

    @property
    def num_pending(self) -> int:
        """Plans made and not applied yet."""
        return self.planner.num_planned - self.num_applied

    def prepare(self, row_ids: np.ndarray, training: bool = True) -> PreparedPlan:
        """Plans the next batch and reads its loads that are safe to read now (producer thread)."""
        with self.condition:
            applied = self.num_applied
        while self.write_backs_by_plan and self.write_backs_by_plan[0][0] < applied:
            sequence, rows = self.write_backs_by_plan.popleft()
            for row in rows.tolist():
                if self.last_write_back.get(row) == sequence:
                    del self.last_write_back[row]
        plan = self.planner.plan(row_ids, training)
        # A write-back of plan s is in the store once s < applied (plans are applied in sequence order).
        deferred = np.asarray([self.last_write_back.get(row, -1) >= applied for row in plan.load_rows.tolist()],
                              dtype=bool)
        load_values = np.empty((len(plan.load_rows), self.store.embedding_dim), dtype=np.float32)
        load_accumulators = np.empty_like(load_values)
        ready = ~deferred
        if ready.any():
            load_values[ready], load_accumulators[ready] = self.store.read(plan.load_rows[ready])
        if len(plan.write_back_rows):
            self.write_backs_by_plan.append((plan.sequence, plan.write_back_rows))
            self.last_write_back.update(dict.fromkeys(plan.write_back_rows.tolist(), plan.sequence))
        self.count(plans_made=1, rows_hit=int(np.unique(plan.slot_ids).size) - len(plan.load_rows),
                   rows_prefetched=int(ready.sum()), rows_deferred=int(deferred.sum()))
        return PreparedPlan(plan, load_values, load_accumulators, deferred)

    def apply(self, prepared: PreparedPlan, slots: SlotAccess) -> None:
        """Applies the next plan (training thread, between steps): write-backs, then loads."""
        plan = prepared.plan
        if plan.sequence != self.num_applied:
            raise ValueError(
                f"Plans must be applied once each, in the order they were made: the next is plan "
                f"{self.num_applied}. Received: plan {plan.sequence}. Apply each batch's plan just before its step")
        if len(plan.write_back_slots):
            values, accumulators = slots.read(plan.write_back_slots)
            self.store.write(plan.write_back_rows, values, accumulators)
        load_values, load_accumulators = prepared.load_values, prepared.load_accumulators
        if prepared.deferred.any():
            load_values, load_accumulators = load_values.copy(), load_accumulators.copy()
            load_values[prepared.deferred], load_accumulators[prepared.deferred] = self.store.read(
                plan.load_rows[prepared.deferred])
        if len(plan.load_slots):
            slots.write(plan.load_slots, load_values, load_accumulators)
        self.applied_dirty[plan.write_back_slots] = False
        self.applied_row_of_slot[plan.load_slots] = plan.load_rows
        self.applied_dirty[plan.load_slots] = False
        if plan.training:
            self.applied_dirty[plan.slot_ids.reshape(-1)] = True
        with self.condition:
            self.num_applied += 1
            self.condition.notify_all()
        self.count(plans_applied=1, rows_loaded=len(plan.load_rows), rows_written_back=len(plan.write_back_rows))

    def flush(self, slots: SlotAccess) -> int:
        """Writes every slot dirty as of the last applied plan back to its row and fsyncs the store; returns the
        rows written. Call it between steps; plans prepared ahead stay valid."""
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
        self.planner = HotTierPlanner(self.hot_rows, first_sequence=self.num_applied)
        self.applied_row_of_slot[:] = -1
        self.last_write_back.clear()
        self.write_backs_by_plan.clear()

    def resident_rows(self) -> dict[int, int]:
        """Row -> slot as of the last applied plan."""
        slots = np.flatnonzero(self.applied_row_of_slot >= 0)
        return dict(zip(self.applied_row_of_slot[slots].tolist(), slots.tolist(), strict=True))

    def count(self, **increments: int) -> None:
        with self.condition:
            self.counters = replace(self.counters, **{name: getattr(self.counters, name) + value
                                                      for name, value in increments.items()})
