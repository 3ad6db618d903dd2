import tracemalloc

import numpy as np
import pytest

from trainer.row_map import INSERT_CHUNK_ROWS, RowMap

pytestmark = pytest.mark.unit


def test_a_row_map_agrees_with_a_dict_through_updates_and_doublings():
    rng = np.random.default_rng(0)
    row_map, expected = RowMap(0), {}
    for _ in range(60):
        rows = np.unique(rng.integers(0, 50_000, 700))
        values = rng.integers(0, 1 << 40, len(rows))
        present = row_map.set(rows, values)
        assert present == sum(int(row) in expected for row in rows)
        expected.update(zip(rows.tolist(), values.tolist(), strict=True))
        probe = rng.integers(0, 50_000, 2000)
        np.testing.assert_array_equal(row_map.lookup(probe), [expected.get(int(row), -1) for row in probe])
    assert len(row_map) == len(expected) and row_map.num_buckets > 2
    rows, values = row_map.items()
    assert dict(zip(rows.tolist(), values.tolist(), strict=True)) == expected


def test_putting_many_rows_back_holds_a_chunk_of_scratch_at_a_time():
    # 400,000 rows set at once: the table doubles 15 times from 2 buckets, each time putting every row back. A
    # placement takes scratch of about BUCKET_WIDTH * 17 bytes a row placed; placed a chunk at a time, the peak
    # is the doubled table and its predecessor (about 40 MB here), not 100+ MB of scratch for the rows at once.
    rows = np.random.default_rng(1).choice(10**9, 400_000, replace=False)
    row_map = RowMap(0)
    tracemalloc.start()
    try:
        row_map.set(rows, np.arange(len(rows)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    table_bytes = row_map.rows.nbytes + row_map.values.nbytes
    assert peak < 1.5 * table_bytes + 64 * INSERT_CHUNK_ROWS * 17
    np.testing.assert_array_equal(row_map.lookup(rows[::997]), np.arange(len(rows))[::997])
