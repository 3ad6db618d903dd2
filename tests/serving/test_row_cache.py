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
