import tracemalloc

import numpy as np
import pytest

from trainer import native_tier
from trainer.row_map import INSERT_CHUNK_ROWS, NativeRowMap, RowMap, new_row_map

pytestmark = pytest.mark.unit


def native(expected_rows: int) -> NativeRowMap:
    library = native_tier.library()
    if library is None:
        pytest.skip("trainer/native/hot_tier.c did not build here (no C compiler): stores use the numpy map")
    return NativeRowMap(expected_rows, library)


@pytest.fixture(params=["numpy", "native"])
def map_of(request):
    return RowMap if request.param == "numpy" else native


def test_a_row_map_agrees_with_a_dict_through_updates_removals_and_doublings(map_of):
    rng = np.random.default_rng(0)
    row_map, expected = map_of(0), {}
    for number in range(60):
        rows = np.unique(rng.integers(0, 50_000, 700))
        values = rng.integers(0, 1 << 40, len(rows))
        present = row_map.set(rows, values)
        assert present == sum(int(row) in expected for row in rows)
        expected.update(zip(rows.tolist(), values.tolist(), strict=True))
        if number % 3 == 2:  # a merge of the log takes rows out
            held = np.array(sorted(expected))
            gone = rng.choice(held, len(held) // 4, replace=False)
            row_map.remove(gone)
            for row in gone.tolist():
                del expected[row]
        probe = rng.integers(0, 50_000, 2000)
        np.testing.assert_array_equal(row_map.lookup(probe), [expected.get(int(row), -1) for row in probe])
        assert len(row_map) == len(expected)
    assert len(expected) > 5_000
    rows, values = row_map.items()
    assert dict(zip(rows.tolist(), values.tolist(), strict=True)) == expected


def test_the_native_map_refuses_to_remove_a_row_it_does_not_hold():
    row_map = native(4)
    row_map.set(np.array([3, 9]), np.array([30, 90]))
    with pytest.raises(ValueError, match="1 of the 2 rows to remove were not in the map"):
        row_map.remove(np.array([9, 4]))
    assert len(row_map) == 1 and row_map.lookup(np.array([3, 9])).tolist() == [30, -1]


def test_stores_index_their_log_natively_where_hot_tier_c_builds():
    assert isinstance(new_row_map(0), NativeRowMap if native_tier.library() else RowMap)


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
