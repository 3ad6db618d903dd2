import numpy as np
import pytest

from components.quantiles import merged_quantiles, summarize

pytestmark = pytest.mark.unit

LEVELS = [0.0, 0.001, 0.01, 0.25, 0.5, 0.9, 0.999, 1.0]


def rank_error(data: np.ndarray, value: float, level: float) -> float:
    """How far `level` lies outside the ranks (as fractions) that `value` holds in `data`."""
    low = np.searchsorted(data, value, "left") / len(data)
    high = np.searchsorted(data, value, "right") / len(data)
    return max(0.0, low - level, level - high)


def test_small_parts_are_kept_whole_and_answer_exactly():
    values, weights = summarize(np.array([3.0, np.nan, 1.0, 2.0]), 1e-4)
    assert values.tolist() == [1.0, 2.0, 3.0] and weights.tolist() == [1, 1, 1]
    assert merged_quantiles([(values, weights)], [0.0, 0.001, 0.5, 0.999, 1.0]) == [1.0, 1.0, 2.0, 3.0, 3.0]


def test_merged_parts_are_within_the_relative_error_in_rank():
    rng = np.random.default_rng(3)
    parts = [rng.lognormal(0, 2, size=n) for n in (200_000, 50_000, 123_457, 7)]
    parts[1][::10] = np.nan  # missing values are left out
    parts[2] = np.round(parts[2])  # many ties
    data = np.sort(np.concatenate([p[~np.isnan(p)] for p in parts]))
    for error in (1e-3, 1e-4):
        summaries = [summarize(p, error) for p in parts]
        assert sum(int(w.sum()) for _, w in summaries) == len(data)  # every value stands in a weight
        assert sum(len(v) for v, _ in summaries) <= len(parts) * (1 / error + 1)  # and each stays small
        got = merged_quantiles(summaries, LEVELS)
        assert got[0] == data[0] and got[-1] == data[-1]
        assert max(rank_error(data, v, q) for v, q in zip(got, LEVELS, strict=True)) <= error


def test_no_values_answer_empty_and_bad_arguments_are_named():
    assert merged_quantiles([summarize(np.array([np.nan]), 1e-3)], [0.5]) == []
    with pytest.raises(ValueError, match="relative_error"):
        summarize(np.ones(3), 0)
    with pytest.raises(ValueError, match="quantile level 1.5"):
        merged_quantiles([summarize(np.ones(3), 0.1)], [1.5])
