import re

import numpy as np
import pytest

from tests.trainer.synthetic import random_rows, write_block_files
from trainer.block_reader import block_batches
from trainer.parallel_reader import parallel_block_batches

pytestmark = pytest.mark.integration

NUM_ROWS = 3000


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[str]:
    rows = random_rows(NUM_ROWS, num_values=30, seed=5)
    rows.categorical[:, 0] = np.arange(NUM_ROWS)  # a row id, to find each row after shuffling
    return write_block_files(rows, tmp_path_factory.mktemp("blocks"), num_files=4, block_rows=200)


def test_one_worker_unshuffled_gives_the_batches_of_block_batches(files):
    expected = list(block_batches(files, 256, drop_remainder=True))
    actual = list(parallel_block_batches(files, 256, num_workers=1, shuffle=False))
    assert len(actual) == len(expected) == NUM_ROWS // 256
    for (features, labels), (expected_features, expected_labels) in zip(actual, expected, strict=True):
        np.testing.assert_array_equal(features["dense"], expected_features["dense"])
        assert features["categorical"].dtype == np.int32
        np.testing.assert_array_equal(features["categorical"], expected_features["categorical"])
        np.testing.assert_array_equal(labels, expected_labels)


def test_workers_read_every_full_batch_row_once_and_shuffle(files):
    batches = list(parallel_block_batches(files, 100, num_workers=3, shuffle=True, seed=4))
    # 750 rows per file; workers hold 2, 1 and 1 files: 15 + 7 + 7 full batches of 100.
    assert len(batches) == 29
    ids = np.concatenate([features["categorical"][:, 0] for features, _ in batches])
    assert len(np.unique(ids)) == len(ids) == 2900
    assert not np.array_equal(ids, np.sort(ids))


def test_to_device_sees_each_batch_before_its_slot_is_reused(files):
    sums = []
    batches = parallel_block_batches(files, 500, num_workers=2, to_device=lambda b: float(b[0]["dense"].sum()),
                                     shuffle=False, slots_per_worker=1)
    sums = sorted(batches)
    expected = sorted(float(f["dense"].sum()) for share in (files[0::2], files[1::2])
                      for f, _ in block_batches(share, 500, drop_remainder=True))
    np.testing.assert_allclose(sums, expected, rtol=1e-6)


def test_a_corrupt_file_fails_with_the_workers_message(files, tmp_path):
    broken = tmp_path / "broken.tfrecord"
    broken.write_bytes(open(files[0], "rb").read()[:-10])
    with pytest.raises(RuntimeError, match=r"worker failed: BlockFormatError: .*broken\.tfrecord"):
        list(parallel_block_batches([files[1], str(broken)], 100, num_workers=2, shuffle=False))


def test_invalid_arguments():
    with pytest.raises(ValueError, match="at least one file"):
        next(parallel_block_batches([], 10, num_workers=2))
    with pytest.raises(ValueError, match=re.escape("num_workers")):
        next(parallel_block_batches(["x"], 10, num_workers=0.5))
