"""Models with a linear part (DeepFM, Wide & Deep) over a tiered table: the store's record holds the row's values
and its linear weight (trainer/tiered_tables.py, docs/tiers.md "A linear part over a tiered table")."""

import numpy as np
import pytest

from trainer.optimizers import INITIAL_ACCUMULATOR_VALUE
from trainer.row_store import RowStore, uniform_initializer

DIM = 8


@pytest.mark.unit
def test_a_store_of_records_with_a_linear_weight_draws_its_values_as_the_table_alone_and_zeros_after(tmp_path):
    rows = np.array([0, 5, 399, 12345])
    plain, with_linear = uniform_initializer(DIM, 7), uniform_initializer(DIM + 1, 7, zero_columns=1)
    drawn = with_linear.rows(rows)
    np.testing.assert_array_equal(drawn[:, :DIM], plain.rows(rows))  # the values as a table of DIM columns
    np.testing.assert_array_equal(drawn[:, DIM], 0.0)
    with RowStore.create(tmp_path / "t.rows", 20_000, DIM + 1, with_linear,
                         initial_accumulator=INITIAL_ACCUMULATOR_VALUE):
        pass
    with RowStore.open(tmp_path / "t.rows", writable=False) as store:  # the header keeps the zero columns
        assert store.fresh == with_linear
        values, accumulators = store.read(rows)
    np.testing.assert_array_equal(values, drawn)
    np.testing.assert_array_equal(accumulators, np.float32(INITIAL_ACCUMULATOR_VALUE))
    with pytest.raises(ValueError, match=r"`zero_columns` must be in \[0, embedding_dim=8\)"):
        uniform_initializer(DIM, 7, zero_columns=DIM)
