import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from components.block_codec import frame_records
from components.schema import DENSE_INPUT_DIM, NUM_CATEGORICAL, NUM_DENSE
from tests.trainer.synthetic import Rows, random_rows, write_block_files
from trainer.input import block_dataset, row_dataset
from trainer.row_layout import CRITEO_ROW_COLUMNS, encode_rows, write_row_files

pytestmark = pytest.mark.integration

NUM_ROWS = 2500


@pytest.fixture(scope="module")
def rows() -> Rows:
    rows = random_rows(NUM_ROWS, num_values=30, seed=3)
    rows.categorical[:, 0] = np.arange(NUM_ROWS)  # a row id, to find each row after shuffling
    return rows


@pytest.fixture(scope="module")
def files(rows, tmp_path_factory) -> list[str]:
    # 1250 rows per file in blocks of 1024 + 226: blocks of unequal size, and batches that straddle files.
    return write_block_files(rows, tmp_path_factory.mktemp("blocks"), num_files=2, block_rows=1024)


def read_all(dataset: tf.data.Dataset) -> tuple[list[int], Rows]:
    sizes, labels, dense, categorical = [], [], [], []
    for features, label in dataset:
        sizes.append(int(label.shape[0]))
        labels.append(label.numpy())
        dense.append(features["dense"].numpy())
        categorical.append(features["categorical"].numpy())
    return sizes, Rows(np.concatenate(labels), np.concatenate(dense), np.concatenate(categorical))


def test_unshuffled_reads_every_row_in_file_order(rows, files):
    dataset = block_dataset(files, batch_size=512, shuffle=False, seed=0)
    sizes, read = read_all(dataset)
    assert sizes == [512, 512, 512, 512, 452]
    np.testing.assert_array_equal(read.labels, rows.labels)
    np.testing.assert_array_equal(read.dense, rows.dense)
    np.testing.assert_array_equal(read.categorical, rows.categorical)


def test_element_spec_has_static_widths(files):
    features, label = block_dataset(files, batch_size=8, shuffle=False, seed=0).element_spec
    assert features["dense"] == tf.TensorSpec([None, DENSE_INPUT_DIM], tf.float32)
    assert features["categorical"] == tf.TensorSpec([None, NUM_CATEGORICAL], tf.int64)
    assert label == tf.TensorSpec([None], tf.float32)


def test_shuffled_reads_every_row_exactly_once(rows, files):
    def shuffled() -> tf.data.Dataset:
        return block_dataset(files, batch_size=300, shuffle=True, seed=11, shuffle_buffer_blocks=4)

    sizes, read = read_all(shuffled())
    assert sizes == [300] * 8 + [100]
    order = read.categorical[:, 0]
    assert sorted(order.tolist()) == list(range(NUM_ROWS))
    np.testing.assert_array_equal(read.labels, rows.labels[order])
    np.testing.assert_array_equal(read.dense, rows.dense[order])
    np.testing.assert_array_equal(read.categorical, rows.categorical[order])
    np.testing.assert_array_equal(read_all(shuffled())[1].categorical[:, 0], order)  # same seed, same order


def test_shuffle_moves_whole_blocks_and_reshuffles_every_epoch(rows, tmp_path):
    files = write_block_files(rows, tmp_path, num_files=2, block_rows=125)  # 10 whole blocks per file
    dataset = block_dataset(files, batch_size=250, shuffle=True, seed=5, shuffle_buffer_blocks=8)
    first = read_all(dataset)[1].categorical[:, 0]
    second = read_all(dataset)[1].categorical[:, 0]
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(NUM_ROWS))
    assert not np.array_equal(first, np.arange(NUM_ROWS))
    assert not np.array_equal(first, second)
    # Rows keep their order inside a block: every block of 125 starts at a multiple of 125.
    blocks = first.reshape(-1, 125)
    assert (blocks[:, 0] % 125 == 0).all()
    np.testing.assert_array_equal(blocks - blocks[:, :1], np.tile(np.arange(125), (len(blocks), 1)))


def test_block_with_a_wrong_row_count_fails_loudly(tmp_path):
    example = tf.train.Example(
        features=tf.train.Features(
            feature={
                "num_rows": tf.train.Feature(int64_list=tf.train.Int64List(value=[3])),
                "label": tf.train.Feature(float_list=tf.train.FloatList(value=[0.0, 1.0])),
                "dense": tf.train.Feature(float_list=tf.train.FloatList(value=[0.0] * 2 * DENSE_INPUT_DIM)),
                "categorical": tf.train.Feature(
                    int64_list=tf.train.Int64List(value=[0] * 2 * NUM_CATEGORICAL)
                ),
            }
        )
    )
    path = tmp_path / "bad.tfrecord"
    path.write_bytes(frame_records([example.SerializeToString()]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="block label count differs from num_rows"):
        list(block_dataset([str(path)], batch_size=4, shuffle=False, seed=0))


def test_no_files_is_an_error():
    with pytest.raises(ValueError, match="at least one file"):
        block_dataset([], batch_size=4, shuffle=False, seed=0)


@pytest.mark.parametrize("batch_size", [0, -1, 2.0])
def test_invalid_batch_size(files, batch_size):
    with pytest.raises(ValueError, match=re.escape(f"batch_size={batch_size!r}")):
        block_dataset(files, batch_size=batch_size, shuffle=False, seed=0)


@pytest.mark.parametrize(
    ("layout", "compression"), [("packed", None), ("packed", "GZIP"), ("per_column", None), ("per_column", "GZIP")]
)
def test_row_layouts_read_back_the_rows_block_dataset_reads(rows, files, tmp_path, layout, compression):
    row_files = write_row_files(
        tmp_path, rows.labels, rows.dense, rows.categorical, num_files=2, layout=layout, compression=compression
    )
    assert (Path(row_files[0]).read_bytes()[:2] == b"\x1f\x8b") == (compression == "GZIP")
    dataset = row_dataset(row_files, batch_size=512, shuffle=False, seed=0, layout=layout, compression=compression)
    assert dataset.element_spec == block_dataset(files, batch_size=512, shuffle=False, seed=0).element_spec
    sizes, read = read_all(dataset)
    assert sizes == [512, 512, 512, 512, 452]  # batches straddle files, as block_dataset's do
    np.testing.assert_array_equal(read.labels, rows.labels)
    np.testing.assert_array_equal(read.dense, rows.dense)
    np.testing.assert_array_equal(read.categorical, rows.categorical)


def test_shuffled_row_dataset_reads_every_row_exactly_once(rows, tmp_path):
    row_files = write_row_files(tmp_path, rows.labels, rows.dense, rows.categorical, num_files=2)
    _, read = read_all(row_dataset(row_files, batch_size=300, shuffle=True, seed=3, shuffle_buffer_rows=500))
    order = read.categorical[:, 0]
    assert sorted(order.tolist()) == list(range(NUM_ROWS))
    assert not np.array_equal(order, np.arange(NUM_ROWS))
    np.testing.assert_array_equal(read.dense, rows.dense[order])


def test_per_column_layout_refuses_rows_it_cannot_store(rows):
    dense = rows.dense[:4].copy()
    dense[0, NUM_DENSE] = 0.5
    with pytest.raises(ValueError, match=re.escape("must be 0 or 1, got np.float32(0.5)")):
        encode_rows(rows.labels[:4], dense, rows.categorical[:4], layout="per_column", columns=CRITEO_ROW_COLUMNS)
    dense = rows.dense[:4].copy()
    dense[1, NUM_DENSE + 2], dense[1, 2] = 1.0, 0.25
    with pytest.raises(ValueError, match=re.escape("a missing dense field must hold 0, got np.float32(0.25)")):
        encode_rows(rows.labels[:4], dense, rows.categorical[:4], layout="per_column", columns=CRITEO_ROW_COLUMNS)


def test_row_dataset_rejects_unknown_layouts_and_compressions(files):
    with pytest.raises(ValueError, match=re.escape("unknown row layout 'columns'; expected one of")):
        row_dataset(files, batch_size=4, shuffle=False, seed=0, layout="columns")
    with pytest.raises(ValueError, match=re.escape("unknown compression 'ZLIB'")):
        row_dataset(files, batch_size=4, shuffle=False, seed=0, compression="ZLIB")
    with pytest.raises(ValueError, match="at least one file"):
        row_dataset([], batch_size=4, shuffle=False, seed=0)


def test_per_column_rows_of_a_spec_read_back_as_written(tmp_path):
    """A spec whose first dense feature has no missing flag and whose second has one: the dense input is
    [a, b, b's flag]; b is absent where missing, a always present; categorical columns named after the spec's."""
    from components.feature_spec import spec_from_dict
    from components.row_codec import RowColumns
    from trainer.input import row_dataset

    spec = spec_from_dict({"name": "two", "source": {"format": "csv", "header": True}, "label": {"column": "y"},
                           "features": [{"name": "a", "kind": "dense", "missing_indicator": False},
                                        {"name": "b", "kind": "dense"},
                                        {"names": ["u", "v", "w"], "kind": "categorical"}]})
    columns = RowColumns.of(spec)
    assert (columns.dense, columns.flagged, columns.categorical) == (("a", "b"), (False, True), ("u", "v", "w"))
    rng = np.random.default_rng(5)
    n = 300
    missing = rng.random(n) < 0.3
    dense = np.stack([rng.normal(size=n), np.where(missing, 0.0, rng.normal(size=n)), missing], axis=1)
    categorical = rng.integers(0, 50, (n, 3))
    labels = (rng.random(n) < 0.2).astype(np.float32)
    files = write_row_files(tmp_path, labels, dense, categorical, num_files=2, layout="per_column", columns=columns)
    example = tf.train.Example.FromString(next(iter(tf.data.TFRecordDataset(files[0]))).numpy()).features.feature
    assert sorted(example) == ["a", "b", "label", "u", "v", "w"]
    _, read = read_all(row_dataset(files, batch_size=64, shuffle=False, seed=0, layout="per_column",
                                   columns=columns))
    np.testing.assert_array_equal(read.dense, dense.astype(np.float32))
    np.testing.assert_array_equal(read.categorical, categorical)
    np.testing.assert_array_equal(read.labels, labels)
    with pytest.raises(ValueError, match=re.escape("expected dense and categorical [4, 3] and [4, 3]")):
        encode_rows(labels[:4], dense[:4, :2], categorical[:4], layout="per_column", columns=columns)
    with pytest.raises(ValueError, match="pass columns=RowColumns.of"):
        encode_rows(labels[:4], dense[:4], categorical[:4], layout="per_column")


def test_per_column_rows_carry_a_specs_id_lists_as_the_model_reads_them(tmp_path):
    from components.feature_spec import load_spec
    from components.row_codec import RowColumns
    from trainer.input import row_dataset
    from trainer.model_inputs import model_inputs

    spec = load_spec("taobao")
    columns = RowColumns.of(spec)
    assert columns.lists == (("click_sequence", 20),)
    inputs = model_inputs(spec)
    rng = np.random.default_rng(2)
    n = 100
    dense = np.stack([rng.normal(size=n), np.zeros(n)], axis=1)  # price, its missing flag
    categorical = rng.integers(0, 40, (n, len(columns.categorical)))
    sequence = np.where(np.arange(20) < rng.integers(0, 21, n)[:, None], 1, rng.integers(2, 40, (n, 20)))
    labels = (rng.random(n) < 0.3).astype(np.float32)
    files = write_row_files(tmp_path, labels, dense, categorical, num_files=1, layout="per_column",
                            columns=columns, lists={"click_sequence": sequence})
    (features, label), = row_dataset(files, batch_size=n, shuffle=False, seed=0, layout="per_column",
                                     columns=columns, inputs=inputs)
    assert {k: tuple(v.shape) for k, v in features.items()} == {k: (n, *s[1:]) for k, s in inputs.shapes.items()}
    np.testing.assert_array_equal(features["click_sequence"].numpy(), sequence)
    np.testing.assert_array_equal(features["categorical"].numpy(), categorical)
    np.testing.assert_array_equal(label.numpy(), labels)
    with pytest.raises(ValueError, match=re.escape("expected list features {'click_sequence': (100, 20)}, got {}")):
        encode_rows(labels, dense, categorical, layout="per_column", columns=columns)
    with pytest.raises(ValueError, match="the packed layout has no list features"):
        encode_rows(labels, dense, categorical, lists={"click_sequence": sequence})
