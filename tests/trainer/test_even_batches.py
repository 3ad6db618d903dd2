"""Minute runs cut their rows into even batches: a last batch of a few rows is their last update."""

from __future__ import annotations

import math

import pytest

from trainer.arguments import auto_batch_size, even_batch_size, resolve_batch_size


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


@pytest.mark.parametrize(("num_rows", "expected"), [
    (1, 64), (9_000, 64), (19_199, 64), (19_200, 64), (38_400, 128), (90_000, 256), (614_399, 1024),
    (614_400, 2048), (2_700_000, 2048), (10**9, 2048)])
def test_auto_batch_size_gives_an_epoch_at_least_300_steps_within_64_and_2048(num_rows, expected):
    size = auto_batch_size(num_rows)
    assert size == expected
    assert size & (size - 1) == 0  # a power of two
    if 64 < size < 2048:
        assert num_rows // size >= 300 and num_rows // (2 * size) < 300  # the largest that keeps 300 steps


def test_resolve_batch_size_keeps_a_configured_size_and_refuses_a_negative_one():
    assert resolve_batch_size(512, 90_000) == 512
    assert resolve_batch_size(0, 90_000) == 256
    assert resolve_batch_size(0, None) == 2048  # a minute run's rows are not counted ahead
    with pytest.raises(ValueError, match=r"train.batch_size=-1 must be a positive number of rows, or 0"):
        resolve_batch_size(-1, 100)
