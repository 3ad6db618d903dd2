"""A tiered table as of a minute checkpoint: its daily store and the minutes' overlays after it, read in memory
or, for a chain longer than the bound, through a store written out beside the caller's."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from components.manifest import write_manifest
from trainer.optimizers import INITIAL_ACCUMULATOR_VALUE
from trainer.row_store import RowStore, uniform_initializer
from trainer.tiered_tables import (
    LIVE_STATE,
    ChainRows,
    checkpoint_identity,
    checkpoint_tables,
    live_directory,
    materialize,
    warm_store,
    write_overlay,
)

pytestmark = pytest.mark.unit

NUM_ROWS, DIM = 5_000, 4


def day_and_minutes(root: Path, minutes: int, rows_per_minute: int, num_rows: int = NUM_ROWS
                    ) -> tuple[Path, np.ndarray, np.ndarray]:
    """A daily checkpoint holding table C1's store and `minutes` minute checkpoints after it, each an overlay of
    random rows; returns the last checkpoint and the table (values, accumulators) it stands for."""
    rng = np.random.default_rng(3)
    values = rng.normal(size=(num_rows, DIM)).astype(np.float32)
    accumulators = rng.uniform(size=(num_rows, DIM)).astype(np.float32)
    day = root / "day"
    (day / "tables").mkdir(parents=True)
    RowStore.write_new(day / "tables" / "C1.rows", num_rows, DIM, iter([(values.copy(), accumulators.copy())])
                       ).close()
    write_manifest(day, kind="checkpoint", version="day", files=["tables/C1.rows"])
    parent = day
    for minute in range(minutes):
        rows = np.sort(rng.choice(num_rows, rows_per_minute, replace=False))
        values[rows] = rng.normal(size=(len(rows), DIM)).astype(np.float32)
        accumulators[rows] = rng.uniform(size=(len(rows), DIM)).astype(np.float32)
        directory = root / f"minute-{minute}"
        (directory / "tables").mkdir(parents=True)
        write_overlay(directory / "tables" / "C1.overlay.npz", rows, values[rows], accumulators[rows])
        write_manifest(directory, kind="checkpoint", version=f"m{minute}", files=["tables/C1.overlay.npz"],
                       inputs={"parent_checkpoint": str(parent)})
        parent = directory
    return parent, values, accumulators


def read_all(chain: ChainRows) -> tuple[np.ndarray, np.ndarray]:
    return chain.read(np.arange(chain.num_rows))


def test_a_chain_reads_as_the_table_in_memory_and_through_a_written_out_store(tmp_path):
    last, values, accumulators = day_and_minutes(tmp_path, minutes=12, rows_per_minute=700)
    with ChainRows(last, "C1") as chain:
        assert chain.scratch_store is None and len(chain.overlay) > 0
        got = read_all(chain)
    np.testing.assert_array_equal(got[0], values)
    np.testing.assert_array_equal(got[1], accumulators)

    scratch = tmp_path / "live"
    with ChainRows(last, "C1", scratch=scratch, max_overlay_bytes=1) as chain:
        assert chain.scratch_store is not None and chain.scratch_store.parent == scratch
        assert len(chain.overlay) == 0  # nothing of the overlays held
        got = read_all(chain)
    np.testing.assert_array_equal(got[0], values)
    np.testing.assert_array_equal(got[1], accumulators)
    assert list(scratch.iterdir()) == []  # the written-out store is gone with the reader

    # Under the bound a scratch directory is not used.
    with ChainRows(last, "C1", scratch=scratch) as chain:
        assert chain.scratch_store is None


def test_a_long_chain_written_out_holds_one_overlay_at_a_time(tmp_path):
    last, values, _ = day_and_minutes(tmp_path, minutes=30, rows_per_minute=2_000, num_rows=200_000)
    tracemalloc.start()
    try:
        with ChainRows(last, "C1", scratch=tmp_path / "live", max_overlay_bytes=1) as chain:
            held, peak = tracemalloc.get_traced_memory()
            first = chain.read(np.arange(10))[0]
    finally:
        tracemalloc.stop()
    # 30 overlays of 2,000 rows (of 200,000) merge into about 1.9 MB of rows, values and accumulators, which the
    # reader would hold; written out, it holds none of them, and writing held one overlay (96 KB) at a time
    # besides the copy's buffer (8 MiB where the filesystem copies through one).
    assert held < 256 * 1024
    assert peak < 8 * 2**20 + 1024 * 1024
    np.testing.assert_array_equal(first, values[:10])
    destination = tmp_path / "materialized.rows"
    materialize(last, "C1", destination)
    with RowStore.open(destination, writable=False) as store:
        np.testing.assert_array_equal(store.read(np.arange(len(values)))[0], values)


def test_a_minutes_report_reads_the_live_stores_when_they_hold_its_tables(tmp_path):
    last, values, accumulators = day_and_minutes(tmp_path, minutes=3, rows_per_minute=500)
    live = live_directory(last, "C1")
    assert live == tmp_path / ".day.tables-live"
    live.mkdir()
    # Live stores that differ from the chain, to tell which one the report read.
    RowStore.write_new(live / "C1.rows", NUM_ROWS, DIM, iter([(values + 1, accumulators)])).close()
    rows = np.arange(0, NUM_ROWS, 7)

    def reported() -> np.ndarray:
        with checkpoint_tables(last, {"C1": 64}) as tables:
            assert tables["C1"]["bytes"] == NUM_ROWS * DIM * 4
            return tables["C1"]["rows"](rows)

    np.testing.assert_array_equal(reported(), values[rows])  # no state file: the chain
    (live / LIVE_STATE).write_text(json.dumps(checkpoint_identity(last.parent / "minute-1")))
    np.testing.assert_array_equal(reported(), values[rows])  # they hold another checkpoint's tables
    (live / LIVE_STATE).write_text(json.dumps(checkpoint_identity(last)))
    np.testing.assert_array_equal(reported(), values[rows] + 1)  # they hold this one's: read there


def test_a_warm_start_from_a_parent_that_draws_its_rows_writes_only_the_rows_it_trained(tmp_path):
    fresh = uniform_initializer(DIM, seed=11)
    day = tmp_path / "day"
    (day / "tables").mkdir(parents=True)
    trained = np.array([3, 4, 100, 4_000])  # the rows the day wrote; every other row is drawn
    day_values = np.full((len(trained), DIM), 2.0, np.float32)
    RowStore.create_fresh(day / "tables" / "C1.rows", NUM_ROWS, fresh, INITIAL_ACCUMULATOR_VALUE,
                          written=[(trained, day_values, np.full_like(day_values, 0.7))]).close()
    write_manifest(day, kind="checkpoint", version="day", files=["tables/C1.rows"])
    minute = tmp_path / "minute"
    (minute / "tables").mkdir(parents=True)
    write_overlay(minute / "tables" / "C1.overlay.npz", np.array([4, 7]), np.full((2, DIM), 5.0, np.float32),
                  np.full((2, DIM), 0.9, np.float32))
    write_manifest(minute, kind="checkpoint", version="m0", files=["tables/C1.overlay.npz"],
                   inputs={"parent_checkpoint": str(day)})
    reset, num_rows = np.array([100]), NUM_ROWS + 500  # row 100 re-admitted; 500 rows admitted past the parent
    with ChainRows(minute, "C1") as parent:
        expected, _ = parent.read(np.arange(NUM_ROWS))
        store = warm_store(tmp_path / "next.rows", parent, num_rows, fresh, reset)
    # Written: the rows the parent trained (3, 4 and 4,000 in the day, 4 and 7 in the minute), not the reset one.
    assert store.fresh == fresh and store.counters.rows_written == 4
    values, accumulators, written = store.read_marked(np.arange(num_rows))
    assert np.flatnonzero(written).tolist() == [3, 4, 7, 4_000]
    expected[reset] = fresh.rows(reset)
    np.testing.assert_array_equal(values[:NUM_ROWS], expected)
    np.testing.assert_array_equal(values[NUM_ROWS:], fresh.rows(np.arange(NUM_ROWS, num_rows)))
    np.testing.assert_array_equal(values[[3, 4, 7]], [[2.0] * DIM, [5.0] * DIM, [5.0] * DIM])
    assert (accumulators == np.float32(INITIAL_ACCUMULATOR_VALUE)).all()  # a warm start starts a new optimizer
    assert os.stat(tmp_path / "next.rows").st_blocks * 512 <= 64 << 10
    store.close()
    # A parent drawn with another seed: every row written, its drawn rows as it drew them.
    with ChainRows(minute, "C1") as parent:
        other = warm_store(tmp_path / "other.rows", parent, num_rows, uniform_initializer(DIM, seed=12), reset)
    assert other.fresh is None and other.counters.rows_written == num_rows
    np.testing.assert_array_equal(other.read(np.arange(NUM_ROWS))[0][[0, 3, 7]], expected[[0, 3, 7]])
    other.close()
