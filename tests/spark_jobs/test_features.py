from __future__ import annotations

import dataclasses
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from components.block_codec import read_framed_records
from components.config import FeatureConfig, GenerateConfig
from components.feature_spec import load_spec
from components.feature_state import categorical_rows, load_feature_state, transform_dense
from components.layout import Layout
from components.manifest import ManifestError, read_manifest
from components.schema import CATEGORICAL_FEATURES, DENSE_FEATURES, MISSING_ROW, NUM_RESERVED_ROWS, RARE_ROW
from components.synthetic import generate
from spark_jobs.features import build_feature_state, categorical_counts, resolved_min_count, write_feature_state
from spark_jobs.raw import extract_raw, parse_raw
from spark_jobs.samples import make_shard_writer, write_samples, write_splits

CRITEO = load_spec("criteo")

pytestmark = pytest.mark.integration
REPO_ROOT = Path(__file__).resolve().parents[2]


def raw_line(label, dense, categorical) -> str:
    dense_fields = ["" if v is None else str(v) for v in dense] + [""] * (13 - len(dense))
    cat_fields = ["" if v is None else v for v in categorical] + [""] * (26 - len(categorical))
    return "\t".join([str(label), *dense_fields, *cat_fields])


@pytest.fixture(scope="module")
def raw_dir(tmp_path_factory):
    """A handmade minute partition: C1 takes 'aaaa' 4x, 'bbbb' 3x, 'cccc' 1x and one missing value."""
    directory = tmp_path_factory.mktemp("raw") / "raw" / "click_log" / "date=2026-01-01" / "minute=0000"
    directory.mkdir(parents=True)
    c1 = ["aaaa", "aaaa", "bbbb", "aaaa", "bbbb", "cccc", None, "bbbb", "aaaa"]
    i1 = [0, 1, 3, None, -2, 10, 1000000, 7, 2]
    lines = [raw_line(i % 2, [i1[i], 5], [c1[i], "zz"]) for i in range(len(c1))]
    (directory / "part-00000.tsv").write_text("\n".join(lines) + "\n")
    return directory


def test_extract_parses_missing_negative_and_minute(spark, raw_dir):
    frame = parse_raw(extract_raw(spark, [str(raw_dir / "part-00000.tsv")], CRITEO), CRITEO)
    rows = frame.select("label", "I1", "I2", "I3", "C1", "C2", "C3", "minute").collect()
    assert len(rows) == 9
    assert [r["I1"] for r in rows] == [0.0, 1.0, 3.0, None, -2.0, 10.0, 1e6, 7.0, 2.0]
    assert rows[6]["C1"] is None and rows[0]["C3"] is None and rows[0]["I3"] is None
    assert {r["minute"] for r in rows} == {"2026-01-01 00:00"}


def build_state(frame, min_count=2, previous=None, day=20454):
    return build_feature_state(frame, previous, FeatureConfig(min_count=min_count, growth_rows=0), day=day,
                               version="test", evict=True, spec=CRITEO)


def test_counts_skip_missing_values(spark, raw_dir):
    frame = parse_raw(extract_raw(spark, [str(raw_dir / "part-00000.tsv")], CRITEO), CRITEO)
    counts = {(r["feature"], r["value"]): (r["count"], r["last_seen"])
              for r in categorical_counts(frame, 20454, CRITEO).collect()}
    assert counts == {("C1", "aaaa"): (4, 20454), ("C1", "bbbb"): (3, 20454), ("C1", "cccc"): (1, 20454),
                      ("C2", "zz"): (9, 20454)}


def test_counts_by_partition_sum_to_sparks_grouped_counts_with_shared_tables_and_sequences(spark):
    """partition_counts (the minute runs' one-stage count) gives, once a value's per-partition counts are summed,
    what categorical_counts gives: missing and empty values skipped, a sequence's elements pooled with the
    item column that shares its table (advance_feature_state sums a value's rows)."""
    from components.feature_state import COUNTS_SCHEMA
    from spark_jobs.features import counted_columns, partition_counts

    spec = load_spec("events")
    rng = np.random.default_rng(3)
    names = [c for scalar, lists in counted_columns(spec).values() for c in (*scalar, *lists)]
    rows = []
    for _ in range(600):
        row = {name: (None if rng.random() < 0.1 else "" if rng.random() < 0.05 else f"{name}-{rng.integers(40)}")
               for name in names if name != "history"}
        row["history"] = [f"item_id-{v}" for v in rng.integers(60, size=rng.integers(0, 6))] + [""]
        rows.append(row)
    schema = ", ".join(f"{n} string" for n in names if n != "history") + ", history array<string>"
    frame = spark.createDataFrame(rows, schema).repartition(3)

    def summed(table):
        grouped = table.group_by(["feature", "value", "last_seen"]).aggregate([("count", "sum")])
        return {(r["feature"], r["value"]): (r["count_sum"], r["last_seen"]) for r in grouped.to_pylist()}

    by_partition = partition_counts(frame, 20454, spec)
    assert by_partition.schema == COUNTS_SCHEMA
    expected = summed(categorical_counts(frame, 20454, spec).toArrow().cast(COUNTS_SCHEMA))
    assert summed(by_partition) == expected
    assert by_partition.num_rows > len(expected)  # values seen in several partitions come once per partition
    # The item table pools the item column and the sequence's elements, each element under that table (an
    # earlier count put each under the table numbered by its position in the sequence).
    items = Counter(v for r in rows for v in [r["item_id"], *r["history"]] if v)
    assert {v: c for (f, v), (c, _) in expected.items() if f == "item_id"} == items
    assert {f for (f, v) in expected if v.startswith("item_id-")} == {"item_id"}
    assert sum(c for (f, _), (c, _) in expected.items() if f == "C1") == sum(
        r["C1"] not in (None, "") for r in rows)


def test_feature_state_and_samples_agree_with_reference_transforms(spark, raw_dir, tmp_path):
    """Identity parity: the rows Spark writes are the reference mapping of the same raw values."""
    frame = parse_raw(extract_raw(spark, [str(raw_dir / "part-00000.tsv")], CRITEO), CRITEO)
    state = build_state(frame)
    assert state.vocabularies["C1"].values == ("aaaa", "bbbb")
    assert state.vocabularies["C1"].rows == (NUM_RESERVED_ROWS, NUM_RESERVED_ROWS + 1)
    assert state.vocabularies["C2"].values == ("zz",)
    assert state.candidates.to_pylist() == [{"feature": "C1", "value": "cccc", "count": 1, "last_seen": 20454}]

    # The next run folds its counts into this state: "cccc" reaches min_count and gets the next row, the
    # admitted rows stay where they are.
    again = build_state(frame, previous=state, day=20455)
    assert again.vocabularies["C1"].values == ("aaaa", "bbbb", "cccc")
    assert again.vocabularies["C1"].rows == (2, 3, 4) and again.vocabularies["C1"].counts == (8, 6, 2)
    assert again.new_rows["C1"] == (4,) and again.candidates.num_rows == 0
    i1 = np.array([0, 1, 3, -2, 10, 1e6, 7, 2], dtype=float)
    logged = np.sign(i1) * np.log1p(np.abs(i1))
    assert state.dense[0].low == pytest.approx(logged.min())
    assert state.dense[0].high == pytest.approx(logged.max())
    assert state.dense[0].mean == pytest.approx(logged.mean())
    assert state.dense[1].std == 1.0  # I2 is constant: std falls back to 1 rather than dividing by zero

    state_dir = tmp_path / "features"
    write_feature_state(state, state_dir, inputs={}, num_rows=9)
    assert load_feature_state(state_dir) == state

    out = tmp_path / "samples"
    manifest = write_samples(frame, state, out,
                             spec=CRITEO, split="train", block_rows=4, num_shards=2, seed=1,
                             inputs={"interval": "test"})
    assert manifest["row_counts"] == {"rows": 9, "positives": 4}
    read_manifest(out)
    assert sorted(manifest["files"]) == sorted([*(s["file"] for s in manifest["shards"]), "schema.pbtxt"])
    from google.protobuf import text_format
    from tensorflow_metadata.proto.v0 import schema_pb2

    schema = text_format.Parse((out / "schema.pbtxt").read_text(), schema_pb2.Schema())
    features = {f.name: f for f in schema.feature}
    assert sorted(features) == ["categorical", "dense", "label", "num_rows"]
    assert features["categorical"].type == schema_pb2.INT and features["dense"].type == schema_pb2.FLOAT
    # C1 has the largest table: 2 reserved rows + "aaaa" and "bbbb".
    assert (features["categorical"].int_domain.min, features["categorical"].int_domain.max) == (0, 3)

    import tensorflow as tf

    labels, dense, categorical = [], [], []
    for name in sorted(shard["file"] for shard in manifest["shards"]):
        for record in read_framed_records((out / name).read_bytes()):
            features = tf.train.Example.FromString(record).features.feature
            labels.extend(features["label"].float_list.value)
            dense.extend(features["dense"].float_list.value)
            categorical.extend(features["categorical"].int64_list.value)
    categorical = np.array(categorical).reshape(-1, 26)
    dense = np.array(dense, dtype=np.float32).reshape(-1, 26)

    c1 = pa.array(["aaaa", "aaaa", "bbbb", "aaaa", "bbbb", "cccc", None, "bbbb", "aaaa"])
    expected_c1 = categorical_rows(c1, *state.lookup("C1"))
    assert sorted(categorical[:, 0].tolist()) == sorted(expected_c1.tolist())
    assert sorted(expected_c1.tolist()) == sorted([2, 2, 2, 2, 3, 3, 3, RARE_ROW, MISSING_ROW])
    assert set(categorical[:, 2].tolist()) == {MISSING_ROW}
    # The manifest counts the rows that read the rare row: C1's "cccc" (seen once, below min_count).
    assert manifest["rare_rows"]["C1"] == 1 and set(manifest["rare_rows"]) == set(CRITEO.categorical_names)
    assert list(manifest["rare_rows"].values()) == (categorical == RARE_ROW).sum(axis=0).tolist()
    # And the rows that read the missing row: C1's empty field, and every row of C3 (never filled here).
    assert manifest["missing_rows"]["C1"] == 1 and manifest["missing_rows"]["C3"] == 9
    assert list(manifest["missing_rows"].values()) == (categorical == MISSING_ROW).sum(axis=0).tolist()
    raw_dense = np.full((9, 13), np.nan)
    raw_dense[:, 0] = [0, 1, 3, np.nan, -2, 10, 1e6, 7, 2]
    raw_dense[:, 1] = 5
    expected_dense = transform_dense(raw_dense, state)
    order = np.lexsort(dense.T[::-1])
    expected_order = np.lexsort(expected_dense.T[::-1])
    np.testing.assert_allclose(dense[order], expected_dense[expected_order], rtol=1e-6, atol=1e-6)
    assert math.isclose(sum(labels), 4.0)


def test_rewriting_samples_gives_identical_shards(spark, raw_dir, tmp_path):
    frame = parse_raw(extract_raw(spark, [str(raw_dir / "part-00000.tsv")], CRITEO), CRITEO)
    state = build_state(frame)
    first = write_samples(frame, state, tmp_path / "a",
                             spec=CRITEO, split="train", block_rows=4, num_shards=2, seed=1,
                          inputs={})
    first_manifest = (tmp_path / "a" / "manifest.json").read_bytes()
    second = write_samples(frame, state, tmp_path / "a",
                             spec=CRITEO, split="train", block_rows=4, num_shards=2, seed=1,
                           inputs={})
    assert first["files"] == second["files"] and len(first["files"]) == 3  # two shards and the schema
    assert (tmp_path / "a" / "manifest.json").read_bytes() == first_manifest  # byte-identical manifest too
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


@pytest.mark.parametrize(("shuffle", "num_shards"), [(True, 2), (False, 1)])
def test_splits_written_in_one_job_are_the_files_written_one_by_one(spark, raw_dir, tmp_path, shuffle, num_shards):
    """write_splits (a minute's training and held-out rows in one Spark job) gives each split the bytes,
    files and manifest that write_samples gives it alone."""
    frame = parse_raw(extract_raw(spark, [str(raw_dir / "part-00000.tsv")], CRITEO), CRITEO)
    state = build_state(frame)
    splits = {"train": frame.where("label = 0"), "holdout": frame.where("label = 1")}
    options = dict(spec=CRITEO, block_rows=2, num_shards=num_shards, seed=3, inputs={"interval": "t"},
                   shuffle=shuffle)
    together = write_splits({name: (rows, tmp_path / "together" / name) for name, rows in splits.items()},
                            state, **options)
    assert list(together) == ["train", "holdout"]
    assert {n: m["row_counts"] for n, m in together.items()} == {"train": {"rows": 5, "positives": 0},
                                                                 "holdout": {"rows": 4, "positives": 4}}
    for name, rows in splits.items():
        alone = write_samples(rows, state, tmp_path / "alone" / name, split=name, **options)
        assert together[name] == alone
        for file in alone["files"]:
            assert (tmp_path / "together" / name / file).read_bytes() == (tmp_path / "alone" / name / file).read_bytes()
    assert not [p for p in (tmp_path / "together").iterdir() if p.name.startswith(".")]


def test_splits_of_a_persisted_frame_ordered_in_one_task_are_the_files_of_the_exchange(spark, tmp_path):
    """A minute run's rows are persisted; write_splits(in_memory=True) then orders them in one task instead of
    through an exchange: the same rows, in the same order, byte for byte."""
    generate(GenerateConfig(minutes=1, rows_per_minute=3000), Layout(tmp_path / "data"))
    (path,) = (tmp_path / "data" / "raw").rglob("*.tsv")
    frame = parse_raw(extract_raw(spark, [str(path)], CRITEO), CRITEO).persist()
    try:
        state = build_state(frame, min_count=5)
        splits = {"train": frame.where("label = 0"), "holdout": frame.where("label = 1")}
        written = {}
        for in_memory in (False, True):
            written[in_memory] = write_splits(
                {name: (rows, tmp_path / str(in_memory) / name) for name, rows in splits.items()}, state,
                spec=CRITEO, block_rows=64, num_shards=1, seed=3, inputs={}, in_memory=in_memory)
    finally:
        frame.unpersist()
    assert written[True] == written[False]
    assert sum(m["row_counts"]["rows"] for m in written[True].values()) == 3000
    for name, manifest in written[True].items():
        for file in manifest["files"]:
            assert (tmp_path / "True" / name / file).read_bytes() == (tmp_path / "False" / name / file).read_bytes()
    # and the order is not the file's: a shuffle, not a copy
    unshuffled = write_splits({"train": (splits["train"], tmp_path / "plain" / "train")}, state, spec=CRITEO,
                              block_rows=64, num_shards=1, seed=3, inputs={}, shuffle=False)["train"]
    shard = next(f for f in unshuffled["files"] if f.endswith(".tfrecord"))
    assert (tmp_path / "plain" / "train" / shard).read_bytes() != (tmp_path / "True" / "train" / shard).read_bytes()
    # Rows that come shuffled (the events source's minute): kept in their order, both splits in one task.
    frame = parse_raw(extract_raw(spark, [str(path)], CRITEO), CRITEO).persist()
    try:
        kept = write_splits({name: (rows, tmp_path / "kept" / name) for name, rows in
                             {"train": frame.where("label = 0"), "holdout": frame.where("label = 1")}.items()},
                            state, spec=CRITEO, block_rows=64, num_shards=1, seed=3, inputs={}, in_memory=True,
                            shuffle=False)
    finally:
        frame.unpersist()
    assert kept["train"]["files"] == unshuffled["files"]
    assert (tmp_path / "kept" / "train" / shard).read_bytes() == (tmp_path / "plain" / "train" / shard).read_bytes()


def test_a_minutes_hash_split_is_stable_and_holds_out_its_fraction(spark, tmp_path):
    """ClickLogSource.rows(holdout_fraction=...) marks each row held out or not by a hash of its raw fields:
    every row once, the same rows on every read, about the fraction held out."""
    from pyspark.sql import functions as F

    from components.config import load_config
    from components.interval import Interval
    from pipelines.context import RunContext
    from pipelines.sources import HELD_OUT, ClickLogSource, split_rows

    generate(GenerateConfig(minutes=1, rows_per_minute=4000), Layout(tmp_path / "data"))
    config = load_config(overrides={"paths.data_root": str(tmp_path / "data")}, environ={})
    start = datetime.fromisoformat(GenerateConfig().start).replace(tzinfo=UTC)
    ctx = RunContext(config=config, interval=Interval(start, start + timedelta(minutes=1)), pipeline="incremental",
                     run_id="t")
    rows = ClickLogSource().rows(ctx, [start], tmp_path, holdout_fraction=0.2)
    assert rows.columns[-1] == HELD_OUT
    counts = {r[HELD_OUT]: r["count"] for r in rows.groupBy(HELD_OUT).count().collect()}
    assert counts[True] + counts[False] == 4000 and 0.17 < counts[True] / 4000 < 0.23
    key = F.xxhash64(*[F.col(c) for c in rows.columns if c != HELD_OUT])
    held = [sorted(r[0] for r in split.select(key).collect()) for split in split_rows(rows)[::-1]]
    again = ClickLogSource().rows(ctx, [start], tmp_path, holdout_fraction=0.2)
    assert held[0] == sorted(r[0] for r in again.where(F.col(HELD_OUT)).select(key).collect())
    assert len(held[0]) == counts[True] and len(held[1]) == counts[False]
    assert split_rows(rows)[0].columns == ClickLogSource().rows(ctx, [start], tmp_path).columns


def test_rebuilding_a_feature_state_writes_identical_bytes(spark, raw_dir, tmp_path):
    frame = parse_raw(extract_raw(spark, [str(raw_dir / "part-00000.tsv")], CRITEO), CRITEO)
    written = []
    for _ in range(2):  # a re-run of the same interval from the same parent
        write_feature_state(build_state(frame), tmp_path / "state", inputs={"interval": "x"}, num_rows=9)
        written.append({p.name: p.read_bytes() for p in sorted((tmp_path / "state").iterdir())})
    assert written[0] == written[1]
    assert sorted(written[0]) == ["candidates.parquet", "dense.json", "manifest.json", "vocabulary.parquet"]


def test_dense_feature_names_cover_schema():
    assert len(DENSE_FEATURES) == 13 and len(CATEGORICAL_FEATURES) == 26


def test_blocks_are_the_same_bytes_whatever_the_batches(spark, tmp_path, monkeypatch):
    # The writer cuts blocks every block_rows rows from its shard's start, however Spark's batches come.
    import pyspark

    generate(GenerateConfig(minutes=1, rows_per_minute=3000), Layout(tmp_path / "data"))
    paths = sorted(str(p) for p in (tmp_path / "data" / "raw").rglob("*.tsv"))
    frame = parse_raw(extract_raw(spark, paths, CRITEO), CRITEO)
    state = build_state(frame)
    table = frame.toArrow()

    class OnePartition:
        def partitionId(self) -> int:
            return 0

    monkeypatch.setattr(pyspark.TaskContext, "get", staticmethod(OnePartition))
    files = []
    for batch_rows in (1000, 7, 333, 64, 1):
        directory = tmp_path / f"batches-{batch_rows}"
        directory.mkdir()
        writer = make_shard_writer(state, CRITEO, [str(directory)], block_rows=64)
        (summary,) = writer(iter(table.to_batches(max_chunksize=batch_rows)))
        assert summary.to_pylist()[0]["rows"] == 3000 and summary.to_pylist()[0]["blocks"] == math.ceil(3000 / 64)
        files.append((directory / "part-00000.tfrecord").read_bytes())
    assert files[1:] == files[:1] * 4
    blocks = list(read_framed_records(files[0]))
    assert len(blocks) == math.ceil(3000 / 64)


def test_a_writer_killed_half_way_leaves_nothing_a_reader_accepts(spark, tmp_path):
    generate(GenerateConfig(minutes=4, rows_per_minute=2000), Layout(tmp_path / "data"))
    output = tmp_path / "samples" / "train"
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    writer = subprocess.Popen([sys.executable, "-m", "tests.spark_jobs.killed_writer", str(tmp_path / "data"),
                               str(output)], cwd=REPO_ROOT, env=env, start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    partial = []
    while not partial and time.monotonic() < deadline and writer.poll() is None:
        partial = list(output.parent.glob(".train.*.staging/.part-*.tfrecord.tmp"))  # a shard being written
        time.sleep(0.05)
    assert partial, "the writer finished or failed before it could be killed half-way"
    os.killpg(writer.pid, signal.SIGKILL)  # the driver, its JVM and the Python workers
    writer.wait(30)

    assert not output.exists()
    with pytest.raises(ManifestError, match="has no manifest.json"):
        read_manifest(output)
    (staging,) = output.parent.glob(".train.*.staging")
    assert not (staging / "manifest.json").exists()

    # The task's retry writes the whole split and clears the dead attempt's staging directory.
    paths = sorted(str(p) for p in (tmp_path / "data" / "raw").rglob("*.tsv"))
    frame = parse_raw(extract_raw(spark, paths, CRITEO), CRITEO)
    state = build_state(frame)
    manifest = write_samples(frame, state, output,
                             spec=CRITEO, split="train", block_rows=256, num_shards=2, seed=1, inputs={})
    assert read_manifest(output)["row_counts"]["rows"] == manifest["row_counts"]["rows"] == 8000
    assert sorted(p.name for p in output.parent.iterdir()) == ["train"]


def test_row_layout_holds_the_block_layouts_rows_one_example_per_row(spark, raw_dir, tmp_path):
    """features.samples_layout="row": one tf.Example per row, one feature per column (TFX tools' layout), with
    a schema beside it; the trainer reads it into the same batches as the blocks of the same rows."""
    import tensorflow as tf
    from google.protobuf import text_format
    from tensorflow_metadata.proto.v0 import schema_pb2

    from components.block_codec import BLOCK_LAYOUT
    from components.row_codec import ROW_LAYOUT
    from trainer.input import samples_dataset

    frame = parse_raw(extract_raw(spark, [str(raw_dir / "part-00000.tsv")], CRITEO), CRITEO)
    state = build_state(frame)
    blocks = write_samples(frame, state, tmp_path / "blocks",
                             spec=CRITEO, split="train", block_rows=4, num_shards=2, seed=1,
                           inputs={})
    rows = write_samples(frame, state, tmp_path / "rows",
                             spec=CRITEO, split="train", block_rows=4, num_shards=2, seed=1,
                         inputs={}, layout="row")
    assert (blocks["layout"], rows["layout"]) == (BLOCK_LAYOUT, ROW_LAYOUT)
    assert rows["row_counts"] == blocks["row_counts"] == {"rows": 9, "positives": 4}
    assert [s["rows"] for s in rows["shards"]] == [s["rows"] for s in blocks["shards"]]

    records = [record for shard in rows["shards"]
               for record in read_framed_records((tmp_path / "rows" / shard["file"]).read_bytes())]
    assert len(records) == 9  # one Example per row
    example = tf.train.Example.FromString(records[0]).features.feature
    assert sorted(example) == sorted(["label", *DENSE_FEATURES, *CATEGORICAL_FEATURES])

    schema = text_format.Parse((tmp_path / "rows" / "schema.pbtxt").read_text(), schema_pb2.Schema())
    domains = {f.name: (f.int_domain.min, f.int_domain.max) for f in schema.feature if f.type == schema_pb2.INT}
    assert domains["C1"] == (0, 3) and domains["C2"] == (0, 2)  # 2 reserved rows + the admitted values

    def batches(directory, manifest):
        files = [str(directory / s["file"]) for s in manifest["shards"]]
        (features, label), = samples_dataset(files, 16, shuffle=False, seed=0, layout=manifest["layout"])
        return np.concatenate([features["dense"].numpy(), features["categorical"].numpy(),
                               label.numpy()[:, None]], axis=1)

    from_blocks, from_rows = batches(tmp_path / "blocks", blocks), batches(tmp_path / "rows", rows)
    np.testing.assert_allclose(from_rows, from_blocks, rtol=1e-6)  # same shuffle, same rows, same order

    with pytest.raises(ValueError, match="samples_layout='rows'"):
        write_samples(frame, state, tmp_path / "bad",
                             spec=CRITEO, split="train", block_rows=4, num_shards=2, seed=1,
                      inputs={}, layout="rows")
    with pytest.raises(ValueError, match="cannot be read"):
        samples_dataset(["x"], 16, shuffle=False, seed=0, layout="columnar")


def test_min_count_zero_is_chosen_from_the_daily_rows_and_kept_by_the_minute_runs(spark, raw_dir):
    frame = parse_raw(extract_raw(spark, [str(raw_dir / "part-00000.tsv")], CRITEO), CRITEO)
    daily = build_state(frame, min_count=0)
    assert daily.min_count == 2  # 9 rows: the least auto count
    parent = dataclasses.replace(daily, min_count=7)  # as a daily run over 700 K rows would have left it
    minute = build_feature_state(frame, parent, FeatureConfig(min_count=0), day=20454, version="minute",
                                 evict=False, spec=CRITEO)
    assert minute.min_count == 7
    assert resolved_min_count(5, parent, evict=False, num_rows=lambda: 1) == 5  # a configured count wins
    assert resolved_min_count(0, None, evict=True, num_rows=lambda: 450_000) == 4
    with pytest.raises(ValueError, match=r"features.min_count=-1 must be >= 1, or 0 to choose it from the rows"):
        resolved_min_count(-1, None, evict=True, num_rows=lambda: 1)
