import logging
import queue
import re
import threading
from collections import OrderedDict

import numpy as np
import pytest

from trainer import native_tier
from trainer.hot_tier import ArraySlots, HotTier, HotTierPlanner, NativePlanner, RowSlotMap, make_planner
from trainer.row_map import RowMap, new_row_map
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


def native(hot_rows: int, first_sequence: int = 0) -> NativePlanner:
    library = native_tier.library()
    if library is None:
        pytest.skip("trainer/native/hot_tier.c did not build here (no C compiler): the numpy planner plans alone")
    return NativePlanner(hot_rows, library, first_sequence)


@pytest.fixture(params=["numpy", "native"])
def planner_of(request):
    """Each planner, built by the test with its hot_rows: the numpy one and hot_tier.c's."""
    return HotTierPlanner if request.param == "numpy" else native


def test_the_least_recently_used_slot_the_batch_does_not_read_is_evicted(planner_of):
    planner = planner_of(3)
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


def test_within_a_batch_lower_row_ids_count_as_used_earlier_whether_resident_or_loaded(planner_of):
    planner = planner_of(3)
    planner.plan(np.array([5, 7]))  # 5 -> slot 0, 7 -> slot 1
    second = planner.plan(np.array([7, 6]))  # 7 resident, 6 loaded into slot 2; in this batch 6 counts as first
    assert (second.load_rows.tolist(), second.load_slots.tolist()) == ([6], [2])
    # Least recent first: 5 (batch 1), then 6 and 7 (batch 2, 6 < 7).
    assert planner.plan(np.array([8])).write_back_rows.tolist() == [5]
    fourth = planner.plan(np.array([9]))
    assert (fourth.write_back_rows.tolist(), fourth.write_back_slots.tolist()) == ([6], [2])
    assert planner.plan(np.array([10])).write_back_rows.tolist() == [7]


class ReferencePlanner:
    """The planner's rule written plainly: an OrderedDict in recency order, a batch's rows moved to its end in
    ascending id order, loads taking free slots lowest first, then the front's rows (which the batch does not
    read)."""

    def __init__(self, hot_rows: int) -> None:
        self.slot_of_row: OrderedDict[int, int] = OrderedDict()
        self.free = list(range(hot_rows))
        self.dirty = np.zeros(hot_rows, dtype=bool)

    def plan(self, ids: np.ndarray, training: bool) -> tuple[list, list, list, list, list]:
        rows = np.unique(ids).tolist()
        slots = {row: self.slot_of_row.pop(row) for row in rows if row in self.slot_of_row}
        write_back_slots, write_back_rows, loads = [], [], []
        for row in rows:
            if row in slots:
                continue
            if self.free:
                slot = self.free.pop(0)
            else:
                victim, slot = self.slot_of_row.popitem(last=False)
                if self.dirty[slot]:
                    write_back_slots.append(slot)
                    write_back_rows.append(victim)
                    self.dirty[slot] = False
            slots[row] = slot
            loads.append(row)
        for row in rows:
            self.slot_of_row[row] = slots[row]
        if training:
            self.dirty[[slots[row] for row in rows]] = True
        slot_ids = [slots[row] for row in np.asarray(ids).reshape(-1).tolist()]
        return slot_ids, write_back_slots, write_back_rows, loads, [slots[row] for row in loads]


def test_the_planner_makes_the_plans_of_a_plain_least_recently_used_map(planner_of):
    rng = np.random.default_rng(4)
    for hot_rows, num_rows in ((1, 5), (7, 40), (50, 400), (200, 5000)):
        reference, planner = ReferencePlanner(hot_rows), planner_of(hot_rows)
        num_planned = 0
        for _ in range(150):
            size = int(rng.integers(1, min(hot_rows, 40) + 1))
            ids = (np.minimum(rng.zipf(1.3, size), num_rows) * 7919) % num_rows
            if len(np.unique(ids)) > hot_rows:
                continue
            training = bool(rng.random() < 0.8)
            plan = planner.plan(ids, training)
            num_planned += 1
            expected = reference.plan(ids, training)
            got = (plan.slot_ids.tolist(), plan.write_back_slots.tolist(), plan.write_back_rows.tolist(),
                   plan.load_rows.tolist(), plan.load_slots.tolist())
            assert got == expected
        assert num_planned > 100


def test_the_row_slot_map_agrees_with_a_dict_through_removals_and_growth():
    rows_map = RowSlotMap(300)
    assert rows_map.lookup(np.array([4, 1 << 40])).tolist() == [-1, -1]
    rows_map.insert(np.array([4, 1 << 40, 9]), np.array([2, 0, 299]))
    assert rows_map.lookup(np.array([9, 5, 4, 1 << 40])).tolist() == [299, -1, 2, 0]
    rows_map.remove_slots(np.array([2]))
    assert rows_map.lookup(np.array([4, 9])).tolist() == [-1, 299] and len(rows_map) == 2
    with pytest.raises(ValueError, match=re.escape("Slots [2] hold no row of the map")):
        rows_map.remove_slots(np.array([2]))

    rng = np.random.default_rng(0)
    rows_map, expected = RowSlotMap(300), {}
    rows_map.allocate(2)  # 32 entries to start with: the map has to double several times
    free_slots, most = list(range(300)), 0
    for _ in range(300):
        if expected and rng.random() < 0.5:
            removed = rng.choice(list(expected), int(rng.integers(1, min(len(expected), 12) + 1)), replace=False)
            slots = np.array([expected.pop(int(row)) for row in removed])
            rows_map.remove_slots(slots)
            free_slots += slots.tolist()
        added = np.unique(rng.integers(0, 1 << 40, int(rng.integers(0, 30))))
        added = added[~np.isin(added, list(expected))][:300 - len(expected)]
        rng.shuffle(free_slots)
        slots, free_slots = np.array(free_slots[:len(added)], dtype=np.int64), free_slots[len(added):]
        rows_map.insert(added, slots)
        expected.update(zip(added.tolist(), slots.tolist(), strict=True))
        asked = np.concatenate([added, rng.integers(0, 1 << 40, 20), np.array(list(expected), dtype=np.int64)])
        assert rows_map.lookup(asked).tolist() == [expected.get(int(row), -1) for row in asked]
        assert len(rows_map) == len(expected)
        most = max(most, len(expected))
    assert most == 300 and rows_map.num_buckets >= 32  # 300 rows need 19 buckets of 16 at least


def test_only_dirty_slots_are_written_back(planner_of):
    planner = planner_of(2)
    planner.plan(np.array([1, 2]), training=False)
    clean = planner.plan(np.array([3, 4]), training=False)  # evicts 1 and 2, never trained: nothing to write
    assert clean.write_back_rows.size == 0 and clean.load_rows.tolist() == [3, 4]
    planner.plan(np.array([3]), training=True)  # the step updates row 3's slot
    evicting = planner.plan(np.array([5, 6]), training=False)
    assert evicting.write_back_rows.tolist() == [3]
    assert evicting.write_back_slots.tolist() == [0]
    again = planner.plan(np.array([3, 4]), training=False)  # 5 and 6 were only read
    assert again.write_back_rows.size == 0


def test_a_batch_with_more_distinct_rows_than_slots_is_refused_and_changes_nothing(planner_of):
    planner = planner_of(2)
    with pytest.raises(ValueError, match=re.escape("A batch reads 3 distinct rows of this table, more than its hot "
                                                   "tier's hot_rows=2 slots. Set hot_rows to at least 3")):
        planner.plan(np.array([1, 2, 3, 3]))
    plan = planner.plan(np.array([3, 3]))
    assert plan.sequence == 0 and plan.load_slots.tolist() == [0]
    with pytest.raises(ValueError, match=re.escape("Row ids must be >= 0. Received: [-4]")):
        planner.plan(np.array([1, -4]))
    with pytest.raises(ValueError, match=re.escape("hot_rows=0")):
        planner_of(0)
    with pytest.raises(ValueError, match=re.escape("Row ids must be integers. Received: dtype float64")):
        planner.plan(np.array([1.0]))


def test_the_native_planner_makes_the_numpy_planners_plans_through_many_evictions():
    """Bench-tiers' access pattern (Zipf 1.05 ids hashed over the table), batches of 1,024 ids and a hot tier of a
    few batches' rows: every slot is evicted and reused many times, so the C table's removals (entries shifted
    back into the hole) and the recency list are exercised far past the small cases above."""
    rng = np.random.default_rng(11)
    hot_rows, num_rows = 3000, 200_000
    numpy_planner, native_one = HotTierPlanner(hot_rows, first_sequence=5), native(hot_rows, first_sequence=5)
    loads = write_backs = 0
    for number in range(400):
        ids = (np.minimum(rng.zipf(1.05, (1024, 1)), num_rows) * 7919) % num_rows
        training = number % 7 != 3
        expected, got = numpy_planner.plan(ids, training), native_one.plan(ids, training)
        assert got.sequence == expected.sequence == number + 5 and got.num_rows == expected.num_rows
        assert got.slot_ids.shape == ids.shape
        for name in ("slot_ids", "write_back_slots", "write_back_rows", "load_rows", "load_slots"):
            assert getattr(got, name).tolist() == getattr(expected, name).tolist(), (number, name)
        loads += len(got.load_rows)
        write_backs += len(got.write_back_rows)
    assert loads > 20 * hot_rows and write_backs > 10 * hot_rows
    # The open-addressing table holds exactly the resident rows, each at its slot, as the numpy planner's map.
    resident = native_one.resident()
    assert len(resident) == hot_rows
    assert resident == dict(zip(*(part.tolist() for part in numpy_planner.slot_map.items()), strict=True))


def test_a_hot_tier_plans_natively_where_hot_tier_c_builds():
    assert isinstance(make_planner(4), NativePlanner if native_tier.library() else HotTierPlanner)


def test_without_a_compiler_the_tier_plans_in_numpy_and_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CTR_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    native_tier.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="trainer.native_tier"):
            assert isinstance(make_planner(4), HotTierPlanner)
            assert isinstance(new_row_map(0), RowMap)
        assert "native hot tier unavailable, plans and row maps are made in numpy" in caplog.text
        assert "no-such-compiler" in caplog.text and "did not run" in caplog.text
        assert list(tmp_path.iterdir()) == []
    finally:
        native_tier.library.cache_clear()  # the next caller builds or finds the real library again


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


def test_write_backs_reach_the_store_at_the_next_prepare_or_flush_and_loads_see_them_before(tmp_path):
    """Applying a plan reads its write-backs from the slots; the store gets them from the next prepare (the
    producer thread, beside the steps) or a flush. A load applied in between takes them from memory."""
    store = make_store(tmp_path / "t.rows", 10)
    tier, slots = HotTier(store, hot_rows=2), ArraySlots(2, DIM)
    plan0 = tier.prepare(np.array([0, 1]))
    tier.apply(plan0, slots)
    step(plan0.plan, slots, np.array([0, 1]), 0)  # rows 0 and 1: 1 and 11.25
    plan1, plan2 = tier.prepare(np.array([2, 3])), tier.prepare(np.array([0, 5]))
    tier.apply(plan1, slots)  # writes back 0 and 1: in memory, not in the store yet
    np.testing.assert_array_equal(store.read(np.array([0, 1]))[0][:, 0], [0, 10])
    step(plan1.plan, slots, np.array([2, 3]), 1)
    tier.apply(plan2, slots)  # loads 0 (deferred: its write-back was not applied when plan 2 was made)
    assert plan2.deferred.tolist() == [True, False]
    np.testing.assert_array_equal(slots.read(plan2.plan.slot_ids)[0][:, 0], [1, 50])
    tier.prepare(np.array([6]))  # writes behind: plan 1's write-backs (rows 0, 1) and plan 2's (rows 2, 3)
    np.testing.assert_array_equal(store.read(np.arange(4))[0][:, 0], [1, 11.25, 22.5, 32.75])
    assert tier.counters.rows_written_back == 4


class HeldWrites(RowStore):
    """A store whose writes wait for `release` once `hold` is set, and which records the reads made meanwhile."""

    hold = False

    def write(self, rows, values, accumulators, **options):
        if self.hold:
            self.log.append(("write", np.asarray(rows).tolist()))
            self.in_flight.set()
            assert self.release.wait(30)
        super().write(rows, values, accumulators, **options)

    def read(self, rows):
        # While held, a write-behind started (its write waits for `release`) cannot have finished.
        if self.hold:
            self.log.append(("read", np.asarray(rows).tolist()))
        if self.hold and not self.release.is_set():
            self.read_during_write.append(np.asarray(rows).tolist())
            self.read_seen.set()
        return super().read(rows)


def test_the_next_loads_are_read_while_the_write_behind_is_in_flight_and_see_its_rows(tmp_path):
    values = np.repeat(np.arange(10, dtype=np.float32)[:, None] * 10, DIM, axis=1)
    store = HeldWrites.from_arrays(tmp_path / "t.rows", values, np.ones_like(values))
    store.in_flight, store.release, store.read_during_write = threading.Event(), threading.Event(), []
    store.read_seen, store.log = threading.Event(), []
    tier, slots = HotTier(store, hot_rows=2), ArraySlots(2, DIM)
    plan0 = tier.prepare(np.array([0, 1]))
    tier.apply(plan0, slots)
    step(plan0.plan, slots, np.array([0, 1]), 0)  # rows 0 and 1: 1 and 11.25
    plan1 = tier.prepare(np.array([2, 3]))
    tier.apply(plan1, slots)  # writes back 0 and 1: in memory until the next prepare writes them
    step(plan1.plan, slots, np.array([2, 3]), 1)
    store.hold = True
    prepared = []
    producer = threading.Thread(target=lambda: prepared.append(tier.prepare(np.array([0, 4]))))
    producer.start()
    assert store.in_flight.wait(30)  # the write-behind of rows 0 and 1 has started, and waits
    assert store.read_seen.wait(30)  # the next loads are read meanwhile
    producer.join(0.5)
    assert producer.is_alive()  # prepare returns only once its write-behind is done
    store.release.set()
    producer.join(30)
    (plan2,) = prepared
    assert plan2.deferred.tolist() == [False, False]  # plan 1, which wrote row 0 back, was applied
    # Row 0 came from the write-back in memory, row 4 from the store, read while the write was in flight.
    np.testing.assert_array_equal(plan2.load_values[:, 0], [1, 40])
    assert store.read_during_write == [[4]]
    np.testing.assert_array_equal(store.read(np.array([0, 1]))[0][:, 0], [1, 11.25])


def test_with_one_io_thread_the_write_behind_is_done_before_the_loads_are_read(tmp_path):
    values = np.repeat(np.arange(10, dtype=np.float32)[:, None] * 10, DIM, axis=1)
    store = HeldWrites.from_arrays(tmp_path / "t.rows", values, np.ones_like(values))
    store.in_flight, store.release, store.read_during_write = threading.Event(), threading.Event(), []
    store.read_seen, store.log = threading.Event(), []
    store.io_threads = 1
    tier, slots = HotTier(store, hot_rows=2), ArraySlots(2, DIM)
    plan0 = tier.prepare(np.array([0, 1]))
    tier.apply(plan0, slots)
    tier.apply(tier.prepare(np.array([2, 3])), slots)
    store.hold = True
    store.release.set()
    tier.prepare(np.array([0, 4]))
    assert store.log == [("write", [0, 1]), ("read", [0, 4])]  # the write-behind first, then both loads from it


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


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
@pytest.mark.parametrize("ahead", [0, 1, 4])
def test_training_through_the_tier_with_plans_made_ahead_equals_training_the_whole_table(tmp_path, ahead, native):
    """With hot_tier.c's planner and log index, and with numpy's (as on a host without a compiler)."""
    num_rows, hot_rows = 300, 24
    batches = random_batches(120, num_rows, 16, seed=ahead)
    store = make_store(tmp_path / "t.rows", num_rows)
    assert store.log_writes
    if not native:
        store.use_numpy_index()
    values, accumulators = store.read(np.arange(num_rows))
    tier, slots = HotTier(store, hot_rows, native=native), ArraySlots(hot_rows, DIM)
    assert isinstance(tier.planner, HotTierPlanner) != (native and native_tier.library() is not None)
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
    assert store.counters.log_appends > 50 and store.native_index == native
    assert isinstance(store.log_index, RowMap) != (native and native_tier.library() is not None)


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


def test_every_plan_made_before_the_first_is_applied_gives_the_same_table(tmp_path):
    """Nothing is written behind until the end: a row evicted, reloaded and evicted again has several write-backs
    in memory, and a load must take the latest."""
    num_rows, hot_rows = 60, 12
    batches = random_batches(80, num_rows, 8, seed=3)
    store = make_store(tmp_path / "t.rows", num_rows)
    values, accumulators = store.read(np.arange(num_rows))
    tier, slots = HotTier(store, hot_rows), ArraySlots(hot_rows, DIM)
    prepared = [tier.prepare(batch) for batch in batches]
    for number, (plan, batch) in enumerate(zip(prepared, batches, strict=True)):
        tier.apply(plan, slots)
        step(plan.plan, slots, batch, number)
        reference_step(values, accumulators, batch, number)
    assert len(tier.unwritten) > 20  # write-backs of as many plans wait in memory
    tier.flush(slots)
    np.testing.assert_array_equal(store.read(np.arange(num_rows))[0], values)
    np.testing.assert_array_equal(store.read(np.arange(num_rows))[1], accumulators)
