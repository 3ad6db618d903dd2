"""Minute runs cut their rows into even batches: a last batch of a few rows is their last update."""

from __future__ import annotations

import math

import pytest

from trainer.arguments import even_batch_size


@pytest.mark.parametrize("rows, batch", [(161_861, 2048), (54_000, 2048), (4096, 2048), (100, 2048), (2049, 2048),
                                         (1, 1), (999_983, 4096)])
def test_batches_are_even_and_cover_every_row(rows, batch):
    size = even_batch_size(rows, batch)
    num_batches = math.ceil(rows / size)
    last = rows - (num_batches - 1) * size
    assert size <= batch
    assert num_batches == math.ceil(rows / batch)  # as many steps as before
    assert size - num_batches < last <= size  # the last batch is at most one row per batch shorter


def test_the_measured_case_and_bad_input():
    assert even_batch_size(161_861, 2048) == 2024  # 79 x 2024 + 1965, instead of 79 x 2048 + 69
    assert even_batch_size(2049, 2048) == 1025
    with pytest.raises(ValueError, match="positive rows"):
        even_batch_size(0, 2048)
