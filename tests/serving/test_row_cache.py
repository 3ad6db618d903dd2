"""The rows deltas change of a served tiered table, kept on disk (serving.row_cache DeltaRows)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from serving.row_cache import DELTA_ROWS_PREFIX, DeltaRows, scratch_for
from trainer.row_store import RowOverlay

pytestmark = pytest.mark.unit


def test_delta_rows_on_disk_read_as_the_overlay_in_memory_and_take_only_their_pages(tmp_path):
    num_rows, dim = 1_000_000, 16
    rng = np.random.default_rng(1)
    on_disk, in_memory = DeltaRows(tmp_path / "C1.rows", num_rows, dim), RowOverlay()
    for _ in range(5):  # five deltas, rows overlapping between them
        rows = np.sort(rng.choice(2_000, 300, replace=False)) * 400
        values = rng.normal(size=(len(rows), dim)).astype(np.float32)
        on_disk.update(rows, values=values)
        in_memory.update(rows, values=values)
    assert len(on_disk) == len(in_memory)
    asked = np.concatenate([in_memory.rows[::3], np.arange(5) * 400 + 1])  # changed rows and unchanged ones
    base = rng.normal(size=(len(asked), dim)).astype(np.float32)
    expected, got = base.copy(), base.copy()
    in_memory.apply(asked, values=expected)
    on_disk.apply(asked, values=got)
    np.testing.assert_array_equal(got, expected)
    assert not np.array_equal(got, base)
    # The file is the table's size (128 MB) but holds only the pages of the rows written (at most 1,500 here).
    stat = os.stat(tmp_path / "C1.rows")
    assert stat.st_size > 128_000_000 and stat.st_blocks * 512 < 1_600 * 4096 + 65_536
    on_disk.close()
    assert not (tmp_path / "C1.rows").exists()


def test_a_scratch_directory_is_per_model_and_those_of_gone_processes_are_removed(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    stale = tmp_path / f"{DELTA_ROWS_PREFIX}{gone}-abc"
    mine = tmp_path / f"{DELTA_ROWS_PREFIX}{os.getpid()}-def"
    stale.mkdir()
    mine.mkdir()
    first, second = scratch_for(tmp_path), scratch_for(tmp_path)
    assert first != second and first.parent == tmp_path and first.name.startswith(f"{DELTA_ROWS_PREFIX}{os.getpid()}-")
    assert not stale.exists() and mine.exists()


def test_the_rows_preloaded_are_those_the_table_s_vocabularies_counted_most():
    from components.feature_state import Vocabulary
    from trainer.tiered_tables import preload_rows

    # Two features reading one table: a row's count is the sum over both.
    first = Vocabulary(values=("a", "b", "c", "d"), rows=(2, 3, 4, 5), counts=(5, 40, 7, 7), last_seen=(0,) * 4)
    second = Vocabulary(values=("x", "y"), rows=(4, 6), counts=(30, 5), last_seen=(0, 0))
    # The reserved rows first (the shared rare row 0 and the missing row 1); then row 3: 40, row 4: 7 + 30,
    # row 5: 7; rows 2 and 6 have 5 each, and the lower goes first.
    assert preload_rows([first, second], 10).tolist() == [0, 1, 3, 4, 5, 2, 6]
    assert preload_rows([first, second], 4).tolist() == [0, 1, 3, 4]
    assert preload_rows([first], 0).tolist() == []
    assert preload_rows([], 5).tolist() == [0, 1] and preload_rows([], 5).dtype == np.int64
    assert preload_rows([first, second], 3, reserved=0).tolist() == [3, 4, 5]


def served_table(tmp_path, cache_rows: int, protected_share: float = 0.8):
    from serving.row_cache import ServedTable
    from trainer.row_store import RowStore, uniform_initializer

    store = RowStore.create(tmp_path / "C1.rows", 1_000, 4, uniform_initializer(4, 3), initial_accumulator=0.1)
    return ServedTable(name="C1", index=0, store=store, cache_rows=cache_rows, load=None,
                       protected_share=protected_share)


def read(table, rows) -> int:
    """One request reading `rows` as TieredRows.run's two-call path does: load what is missing, then touch;
    returns the rows it loaded."""
    rows = np.unique(np.asarray(rows, np.int64))
    load = table.fill(rows)
    table.commit(load)
    table.touch(rows, loaded=None if load is None else load["rows"])
    return 0 if load is None else len(load["rows"])


def test_rows_read_by_one_request_only_pass_through_probation_without_evicting_rows_read_again(tmp_path):
    table = served_table(tmp_path, cache_rows=10)  # 8 protected slots, probation the rest
    assert table.protected_rows == 8
    assert read(table, [1, 2, 3, 4]) == 4 and list(table.slots) == [1, 2, 3, 4] and not table.protected
    assert read(table, [1, 2, 3, 4]) == 0  # read again: protected
    assert list(table.protected) == [1, 2, 3, 4] and not table.slots
    # A scan of 30 rows read once, three a request: they take the free slots, then evict each other, never the
    # rows read twice.
    loaded = sum(read(table, [100 + 3 * i, 101 + 3 * i, 102 + 3 * i]) for i in range(10))
    assert loaded == 30
    assert all(row in table for row in (1, 2, 3, 4)) and read(table, [1, 2, 3, 4]) == 0
    assert list(table.slots) == list(range(124, 130))  # the last two requests' rows
    assert table.num_cached == 10 and not table.free
    # Slots stay distinct, and every cached row keeps the slot it was loaded into.
    slots = [table.slot_of(row) for row in [*table.slots, *table.protected]]
    assert sorted(slots) == list(range(10))


def test_the_protected_segment_is_bounded_and_its_least_recent_row_goes_back_to_probation(tmp_path):
    table = served_table(tmp_path, cache_rows=10)
    for rows in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        read(table, rows)
    read(table, [1, 2, 3, 4, 5, 6, 7, 8, 9])  # all read again: 9 rows for 8 protected slots
    assert len(table.protected) == 8 and list(table.protected) == [2, 3, 4, 5, 6, 7, 8, 9]
    assert list(table.slots) == [1]  # demoted to probation's most recent end, still cached
    # A request of rows not cached evicts probation first, then the least recently used protected rows, and
    # never a row it reads itself.
    assert read(table, [20, 21, 22, 2]) == 3  # one free slot, then row 1 (probation), then protected 3
    assert 1 not in table and 3 not in table and 2 in table
    assert table.num_cached == 10


def test_a_plain_lru_cache_would_lose_the_rows_read_again_where_the_segmented_one_keeps_them(tmp_path):
    """The same requests against the cache with every row on probation (serving.row_cache_protected_share 0: plain
    LRU)."""
    rng = np.random.default_rng(5)
    hot = np.arange(10)
    requests = [np.concatenate([rng.choice(hot, 3, replace=False), 100 + rng.choice(900, 5, replace=False)])
                for _ in range(300)]
    loads = {}
    for name in ("lru", "segmented"):
        (tmp_path / name).mkdir()
        table = served_table(tmp_path / name, 20, protected_share=0.0 if name == "lru" else 0.8)
        assert table.protected_rows == (0 if name == "lru" else 16)
        loads[name] = sum(read(table, rows) for rows in requests)
    # The 10 rows every request reads from stay cached in the segmented cache (loaded once each, then only the
    # 5 rows of 900 a request reads once); in plain LRU those push them out, and they are loaded again and again
    # (1,906 rows loaded against 1,496 with this seed).
    assert loads["segmented"] <= 10 + 5 * 300
    assert loads["lru"] > loads["segmented"] + 300


def test_a_protected_share_that_leaves_no_room_for_rows_read_once_is_refused(tmp_path):
    for share in (1.0, 1.5, -0.2):
        with pytest.raises(ValueError, match="must be at least 0 .* and below 1"):
            served_table(tmp_path, 10, protected_share=share)


def test_preloaded_rows_are_ranked_by_count_the_most_counted_protected(tmp_path):
    table = served_table(tmp_path, cache_rows=10)
    preload = np.asarray([0, 1, 50, 40, 30, 20, 10, 60, 70, 80], np.int64)  # most counted first
    table.commit(table.fill(preload), preloaded=True)
    table.rank_preloaded(preload)
    # The 8 most counted protected, least counted at the least recent end; the other 2 on probation.
    assert list(table.protected) == [60, 10, 20, 30, 40, 50, 1, 0]
    assert list(table.slots) == [80, 70]
    assert table.rows_preloaded == 10 and table.rows_loaded == 0
    # A request of new rows evicts the least counted preloaded rows first.
    assert read(table, [500, 501, 502]) == 3
    assert 80 not in table and 70 not in table and 60 not in table and 10 in table
