import queue
import re
import threading

import numpy as np
import pytest

from trainer.hot_tier import ArraySlots, HotTier, HotTierPlanner
from trainer.row_store import RowStore

pytestmark = pytest.mark.unit

DIM = 2


def make_store(path, num_rows: int) -> RowStore:
    values = np.repeat(np.arange(num_rows, dtype=np.float32)[:, None] * 10, DIM, axis=1)
    return RowStore.from_arrays(path, values, np.ones_like(values))


def step(tier_plan, slots: ArraySlots, batch: np.ndarray, number: int) -> None:
    """A stand-in for a training step: each distinct row of the batch moves by an amount that depends on the
    row and the step, and its accumulator grows, in whichever slot it sits."""
    rows, first = np.unique(batch, return_index=True)
    used = tier_plan.slot_ids.reshape(-1)[first]
    slots.values[used] += (number + 1 + rows * 0.25)[:, None].astype(np.float32)
    slots.accumulators[used] += 1.0


def reference_step(values: np.ndarray, accumulators: np.ndarray, batch: np.ndarray, number: int) -> None:
    rows = np.unique(batch)
    values[rows] += (number + 1 + rows * 0.25)[:, None].astype(np.float32)
    accumulators[rows] += 1.0


def test_the_least_recently_used_slot_the_batch_does_not_read_is_evicted():
    planner = HotTierPlanner(3)
    first = planner.plan(np.array([12, 10, 11]))
    assert first.slot_ids.tolist() == [2, 0, 1]  # free slots lowest first, rows in id order
    assert (first.load_rows.tolist(), first.load_slots.tolist()) == ([10, 11, 12], [0, 1, 2])
    assert first.write_back_rows.size == 0
    hit = planner.plan(np.array([[10], [10]]))
    assert hit.slot_ids.tolist() == [[0], [0]] and hit.load_rows.size == 0
    # 10 was used last batch; 11 and 12 before it, 11 first (lower ids count as used earlier within a batch).
    third = planner.plan(np.array([13]))
    assert (third.write_back_slots.tolist(), third.write_back_rows.tolist()) == ([1], [11])
    assert (third.load_rows.tolist(), third.load_slots.tolist()) == ([13], [1])
    # 12 and 10 are read by this batch, so 13 is the only victim although it is the most recent.
    fourth = planner.plan(np.array([12, 14, 10]))
    assert fourth.slot_ids.tolist() == [2, 1, 0]
    assert (fourth.write_back_rows.tolist(), fourth.load_rows.tolist()) == ([13], [14])
    assert [first.sequence, hit.sequence, third.sequence, fourth.sequence] == [0, 1, 2, 3]


def test_only_dirty_slots_are_written_back():
    planner = HotTierPlanner(2)
    planner.plan(np.array([1, 2]), training=False)
    clean = planner.plan(np.array([3, 4]), training=False)  # evicts 1 and 2, never trained: nothing to write
    assert clean.write_back_rows.size == 0 and clean.load_rows.tolist() == [3, 4]
    planner.plan(np.array([3]), training=True)  # the step updates row 3's slot
    evicting = planner.plan(np.array([5, 6]), training=False)
    assert evicting.write_back_rows.tolist() == [3]
    assert evicting.write_back_slots.tolist() == [0]
    again = planner.plan(np.array([3, 4]), training=False)  # 5 and 6 were only read
    assert again.write_back_rows.size == 0


def test_a_batch_with_more_distinct_rows_than_slots_is_refused_and_changes_nothing():
    planner = HotTierPlanner(2)
    with pytest.raises(ValueError, match=re.escape("A batch reads 3 distinct rows of this table, more than its hot "
                                                   "tier's hot_rows=2 slots. Set hot_rows to at least 3")):
        planner.plan(np.array([1, 2, 3, 3]))
    plan = planner.plan(np.array([3, 3]))
    assert plan.sequence == 0 and plan.load_slots.tolist() == [0]
    with pytest.raises(ValueError, match=re.escape("Row ids must be >= 0. Received: [-4]")):
        planner.plan(np.array([1, -4]))
    with pytest.raises(ValueError, match=re.escape("hot_rows=0")):
        HotTierPlanner(0)


def test_a_load_whose_write_back_is_pending_is_read_after_it_not_before(tmp_path):
    """The stale-read race: batch 2 reloads rows 0 and 1, which batch 1 evicts. Batch 2 is planned (and its rows
    prefetched) before batch 1's plan is applied, when the store still holds the rows' values from before the
    first step. A prefetch that read them then would train batch 2 on those stale values."""
    store = make_store(tmp_path / "t.rows", 10)
    tier, slots = HotTier(store, hot_rows=2), ArraySlots(2, DIM)
    batches = [np.array([0, 1]), np.array([2, 3]), np.array([0, 1])]
    plan0 = tier.prepare(batches[0])
    tier.apply(plan0, slots)
    step(plan0.plan, slots, batches[0], 0)
    trained = slots.read(plan0.plan.slot_ids)  # rows 0 and 1 after step 0

    plan1 = tier.prepare(batches[1])  # evicts 0 and 1: their write-back waits for plan 1's apply
    plan2 = tier.prepare(batches[2])  # planned ahead, before plan 1 is applied
    assert plan1.plan.write_back_rows.tolist() == [0, 1]
    assert plan2.deferred.tolist() == [True, True]
    naive = store.read(plan2.plan.load_rows)  # what a prefetch reading now would load
    np.testing.assert_array_equal(naive[0], [[0, 0], [10, 10]])
    assert not np.array_equal(naive[0], trained[0])

    tier.apply(plan1, slots)
    step(plan1.plan, slots, batches[1], 1)
    tier.apply(plan2, slots)
    loaded = slots.read(plan2.plan.slot_ids)
    np.testing.assert_array_equal(loaded[0], trained[0])
    np.testing.assert_array_equal(loaded[1], trained[1])
    np.testing.assert_array_equal(loaded[0], [[1, 1], [11.25, 11.25]])

    # Once the write-back's plan is applied, a later load of its rows is read ahead, from the store.
    plan3 = tier.prepare(np.array([2, 7]))
    assert plan3.deferred.tolist() == [False, False]
    np.testing.assert_array_equal(plan3.load_values[0], [20 + 2 + 0.5] * DIM)
    assert tier.counters.rows_deferred == 2 and tier.counters.rows_prefetched == 6


def test_plans_are_applied_once_each_in_order(tmp_path):
    tier, slots = HotTier(make_store(tmp_path / "t.rows", 10), hot_rows=4), ArraySlots(4, DIM)
    first, second = tier.prepare(np.array([1])), tier.prepare(np.array([2]))
    with pytest.raises(ValueError, match=re.escape("the next is plan 0. Received: plan 1")):
        tier.apply(second, slots)
    tier.apply(first, slots)
    with pytest.raises(ValueError, match=re.escape("the next is plan 1. Received: plan 0")):
        tier.apply(first, slots)


def test_flush_writes_the_slots_as_applied_not_as_planned_ahead(tmp_path):
    store = make_store(tmp_path / "t.rows", 10)
    tier, slots = HotTier(store, hot_rows=2), ArraySlots(2, DIM)
    plan0 = tier.prepare(np.array([0, 1]))
    tier.apply(plan0, slots)
    step(plan0.plan, slots, np.array([0, 1]), 0)
    plan1 = tier.prepare(np.array([2, 3]))  # the planner now has 2 and 3 in the slots that hold 0 and 1
    assert tier.flush(slots) == 2
    values, accumulators = store.read(np.arange(4))
    np.testing.assert_array_equal(values[:, 0], [1, 11.25, 20, 30])
    np.testing.assert_array_equal(accumulators[:, 0], [2, 2, 1, 1])
    assert tier.flush(slots) == 0  # nothing changed since
    tier.apply(plan1, slots)  # the plan prepared before the flush is still valid
    np.testing.assert_array_equal(slots.values[:, 0], [20, 30])
    assert tier.resident_rows() == {2: 0, 3: 1}


def test_reset_after_a_stream_stopped_early_leaves_the_whole_table_in_the_store(tmp_path):
    store = make_store(tmp_path / "t.rows", 10)
    tier, slots = HotTier(store, hot_rows=2), ArraySlots(2, DIM)
    plan0 = tier.prepare(np.array([4, 5]))
    tier.apply(plan0, slots)
    step(plan0.plan, slots, np.array([4, 5]), 0)
    tier.prepare(np.array([6, 7]))  # made for a batch that never trains
    assert tier.num_pending == 1
    tier.reset(slots)
    assert tier.num_pending == 0 and tier.resident_rows() == {}
    np.testing.assert_array_equal(store.read(np.array([4, 5, 6]))[0][:, 0], [42, 52.25, 60])
    again = tier.prepare(np.array([4]))
    assert again.plan.sequence == 1 and again.plan.load_rows.tolist() == [4]
    tier.apply(again, slots)


def random_batches(num_batches: int, num_rows: int, batch_size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    popular = rng.permutation(num_rows)
    return [popular[np.minimum(rng.zipf(1.3, batch_size) - 1, num_rows - 1)] for _ in range(num_batches)]


@pytest.mark.parametrize("ahead", [0, 1, 4])
def test_training_through_the_tier_with_plans_made_ahead_equals_training_the_whole_table(tmp_path, ahead):
    num_rows, hot_rows = 300, 24
    batches = random_batches(120, num_rows, 16, seed=ahead)
    store = make_store(tmp_path / "t.rows", num_rows)
    values, accumulators = store.read(np.arange(num_rows))
    tier, slots = HotTier(store, hot_rows), ArraySlots(hot_rows, DIM)
    prepared = [tier.prepare(batch) for batch in batches[:ahead]]
    for number, batch in enumerate(batches):
        if number + ahead < len(batches):
            prepared.append(tier.prepare(batches[number + ahead]))
        plan = prepared.pop(0)
        tier.apply(plan, slots)
        step(plan.plan, slots, batch, number)
        reference_step(values, accumulators, batch, number)
    tier.flush(slots)
    got_values, got_accumulators = store.read(np.arange(num_rows))
    np.testing.assert_array_equal(got_values, values)
    np.testing.assert_array_equal(got_accumulators, accumulators)
    counters = tier.counters
    assert counters.rows_written_back > 200 and counters.rows_loaded > 300  # rows went out and came back
    assert (counters.rows_deferred > 0) == (ahead > 0)


def test_a_producer_thread_planning_ahead_gives_the_same_table(tmp_path):
    num_rows, hot_rows = 300, 24
    batches = random_batches(150, num_rows, 16, seed=9)
    store = make_store(tmp_path / "t.rows", num_rows)
    values, accumulators = store.read(np.arange(num_rows))
    tier, slots = HotTier(store, hot_rows), ArraySlots(hot_rows, DIM)
    plans: queue.Queue = queue.Queue(maxsize=3)
    producer = threading.Thread(target=lambda: [plans.put(tier.prepare(batch)) for batch in batches])
    producer.start()
    for number, batch in enumerate(batches):
        plan = plans.get(timeout=30)
        tier.apply(plan, slots)
        step(plan.plan, slots, batch, number)
        reference_step(values, accumulators, batch, number)
    producer.join()
    tier.flush(slots)
    np.testing.assert_array_equal(store.read(np.arange(num_rows))[0], values)
    np.testing.assert_array_equal(store.read(np.arange(num_rows))[1], accumulators)
