"""Sample generation: parsed rows + feature state -> TFRecords, committed atomically with a manifest.

Rows are mapped to embedding rows and transformed inside `mapInArrow` on whole Arrow batches (no per-row
Python) and encoded with tfx-bsl's Arrow -> tf.Example encoder, in one of two layouts:
- "block" (default): one tf.Example per `block_rows` rows (components.block_codec);
- "row": one tf.Example per row, one feature per column (components.row_codec, PER_COLUMN), for TFX tools.
Each Spark task frames its records as TFRecords into its own shard under a staging directory. The driver then
writes the TensorFlow Metadata schema and the manifest and renames the directory into place, so readers never
see a partial dataset.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType

from components.block_codec import (
    BLOCK_CATEGORICAL_KEY,
    BLOCK_DENSE_KEY,
    BLOCK_LABEL_KEY,
    BLOCK_LAYOUT,
    BLOCK_NUM_ROWS_KEY,
    encode_blocks,
    frame_records,
)
from components.feature_spec import BUCKET_DERIVATION, FeatureSpec
from components.feature_state import (
    FeatureState,
    bucket_values,
    categorical_rows,
    check_state_matches,
    list_rows,
    transform_dense,
)
from components.manifest import commit_dir, staging_dir, write_manifest
from components.row_codec import PER_COLUMN, ROW_LAYOUT, encode_rows
from components.schema import CATEGORICAL_FEATURES, DENSE_FEATURES
from spark_jobs.raw import LABEL

SAMPLES_KIND = "samples"
# features.samples_layout -> the layout name the manifest records.
LAYOUTS = {"block": BLOCK_LAYOUT, "row": ROW_LAYOUT}
SHARD_SCHEMA = StructType([
    StructField("file", StringType()), StructField("rows", LongType()),
    StructField("positives", LongType()), StructField("blocks", LongType()),
])


def shuffle_deterministically(frame: DataFrame, num_shards: int, seed: int) -> DataFrame:
    """Spreads rows over shards and orders them pseudo-randomly, identically on every run."""
    key = F.xxhash64(F.lit(seed), *[F.col(c) for c in frame.columns])
    return frame.withColumn("_key", key).repartition(num_shards, "_key").sortWithinPartitions("_key").drop("_key")


def check_samples_layout(layout: str) -> str:
    """features.samples_layout -> the manifest's layout name, or a clear error."""
    if layout not in LAYOUTS:
        raise ValueError(f"features.samples_layout={layout!r} is not a sample layout; expected one of "
                         f"{sorted(LAYOUTS)} (block: one tf.Example per block of rows; row: one per row, for TFX)")
    return LAYOUTS[layout]


def check_row_layout_spec(spec: FeatureSpec) -> None:
    """The row layout (one column per feature, for TFX tools) is written for the criteo columns only."""
    if spec.lists or spec.dense_names != DENSE_FEATURES or spec.categorical_names != CATEGORICAL_FEATURES \
            or not all(f.missing_indicator and f.transform == "log_standardize" for f in spec.dense):
        raise ValueError(f"features.samples_layout=row is written for the criteo columns only; feature spec "
                         f"{spec.name!r} needs features.samples_layout=block")


def make_shard_writer(state: FeatureState, spec: FeatureSpec, output_dir: str, block_rows: int,
                      layout: str = "block"):
    """The mapInArrow function: Arrow batches of parsed rows (spark_jobs.raw.parse_raw) -> one shard file per
    Spark partition, in `layout` ("block", or "row": one per-column tf.Example per row; rows are still encoded
    `block_rows` at a time)."""
    check_samples_layout(layout)
    if layout == "row":
        check_row_layout_spec(spec)
    check_state_matches(list(state.vocabularies), state.dense_names, spec, f"feature state {state.version}")
    # Per categorical column: its name, the dense feature whose bucket it is (or None) and its table's lookup.
    categorical = [(f.name, f.derived_from if f.derivation == BUCKET_DERIVATION else None,
                    state.lookup(spec.table_of(f.name))) for f in spec.categorical]
    boundaries = {source: state.boundaries(source) for _, source, _ in categorical if source}
    lists = [(f.name, f.max_length, state.lookup(spec.table_of(f.name))) for f in spec.lists]
    dense_names = spec.dense_names
    # The function is pickled into every task: it carries the vocabularies but not the candidates (values
    # below min_count; hundreds of thousands after a few days), which writing samples never reads.
    state = dataclasses.replace(state, candidates=state.candidates.schema.empty_table())

    def write_partition(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        partition = TaskContext.get().partitionId()
        name = f"part-{partition:05d}.tfrecord"
        tmp = os.path.join(output_dir, f".{name}.tmp")
        rows = positives = blocks = 0
        pending: list[pa.RecordBatch] = []
        pending_rows = 0
        with open(tmp, "wb") as handle:
            def flush(table: pa.Table) -> None:
                nonlocal rows, positives, blocks
                labels = table.column(LABEL).to_numpy(zero_copy_only=False).astype(np.float32)
                num = len(labels)
                dense_raw = np.stack([table.column(n).to_numpy(zero_copy_only=False).astype(np.float64)
                                      for n in dense_names], axis=1) if dense_names else np.zeros((num, 0))
                dense = transform_dense(dense_raw, state)
                ids = np.stack([
                    categorical_rows(bucket_values(dense_raw[:, dense_names.index(source)], boundaries[source])
                                     if source else table.column(n).combine_chunks(), *lookup)
                    for n, source, lookup in categorical
                ], axis=1) if categorical else np.zeros((num, 0), np.int64)
                id_lists = {n: list_rows(table.column(n), *lookup, length) for n, length, lookup in lists}
                if layout == "block":
                    records = encode_blocks(labels, dense, ids, block_rows, id_lists)
                else:
                    records = encode_rows(labels, dense, ids, PER_COLUMN)
                handle.write(frame_records(records))
                rows += len(labels)
                positives += int(labels.sum())
                blocks += len(records)

            for batch in batches:
                pending.append(batch)
                pending_rows += batch.num_rows
                if pending_rows >= block_rows:
                    table = pa.Table.from_batches(pending)
                    full = (pending_rows // block_rows) * block_rows
                    flush(table.slice(0, full))
                    rest = table.slice(full)
                    pending, pending_rows = rest.to_batches(), rest.num_rows
            if pending_rows:
                flush(pa.Table.from_batches(pending))
        if rows == 0:
            os.remove(tmp)
            return
        os.replace(tmp, os.path.join(output_dir, name))
        yield pa.RecordBatch.from_pylist(
            [{"file": name, "rows": rows, "positives": positives, "blocks": blocks}],
            schema=pa.schema([("file", pa.string()), ("rows", pa.int64()), ("positives", pa.int64()),
                              ("blocks", pa.int64())]),
        )

    return write_partition


SCHEMA_FILE = "schema.pbtxt"


def block_schema(state: FeatureState, spec: FeatureSpec) -> str:
    """A TensorFlow Metadata schema (text format) of the block Examples, for TFX tools (TFDV, Transform) and
    for readers: the keys, their types and the row-id domain of the embedding tables, from the feature spec."""
    from google.protobuf import text_format
    from tensorflow_metadata.proto.v0 import schema_pb2

    schema = schema_pb2.Schema()
    sizes = state.table_sizes()
    largest_table = max(sizes.values(), default=1)
    flagged = [f.name for f in spec.scaled_dense if f.missing_indicator]
    scaled = ", ".join(f.name for f in spec.scaled_dense) or "(none)"
    keys = [
        (BLOCK_NUM_ROWS_KEY, schema_pb2.INT, "rows in this block: n"),
        (BLOCK_LABEL_KEY, schema_pb2.FLOAT, f"n labels (0 or 1), from column {spec.label.column!r}"),
        (BLOCK_DENSE_KEY, schema_pb2.FLOAT,
         f"n x {spec.dense_input_dim}, row-major: standardized {scaled}, then "
         f"the missing flags of {', '.join(flagged) or '(none)'}"),
        (BLOCK_CATEGORICAL_KEY, schema_pb2.INT,
         f"n x {len(spec.categorical)}, row-major: embedding rows of {', '.join(spec.categorical_names)} "
         f"(0 rare or unseen, 1 missing)"),
        *[(f.name, schema_pb2.INT, f"n x {f.max_length}, row-major: {f.kind} {f.name!r}, rows of table "
           f"{spec.table_of(f.name)!r} ({sizes[spec.table_of(f.name)]} rows), newest last, front-padded with 1")
          for f in spec.lists],
    ]
    for name, kind, description in keys:
        feature = schema.feature.add(name=name, type=kind)
        feature.presence.min_fraction = 1.0
        feature.annotation.tag.append(BLOCK_LAYOUT)
        feature.annotation.comment.append(description)
        if name == BLOCK_NUM_ROWS_KEY:
            feature.shape.dim.add(size=1)
        else:
            feature.value_count.min = 1
        if kind == schema_pb2.INT and name != BLOCK_NUM_ROWS_KEY:
            feature.int_domain.min, feature.int_domain.max = 0, largest_table - 1
        if name == BLOCK_LABEL_KEY:
            feature.float_domain.min, feature.float_domain.max = 0.0, 1.0
    return text_format.MessageToString(schema)


def row_schema(state: FeatureState) -> str:
    """The TensorFlow Metadata schema of the row layout: label, I1..I13 (standardized; absent when the field
    was missing) and C1..C26 (embedding row ids within each feature's table), one value each."""
    from google.protobuf import text_format
    from tensorflow_metadata.proto.v0 import schema_pb2

    schema = schema_pb2.Schema()
    sizes = state.table_sizes()
    label = schema.feature.add(name=LABEL, type=schema_pb2.FLOAT)
    label.presence.min_fraction = 1.0
    label.shape.dim.add(size=1)
    label.float_domain.min, label.float_domain.max = 0.0, 1.0
    for name in DENSE_FEATURES:
        feature = schema.feature.add(name=name, type=schema_pb2.FLOAT)
        feature.value_count.min, feature.value_count.max = 0, 1
        feature.annotation.comment.append("standardized value; no value when the raw field was missing")
    for name in CATEGORICAL_FEATURES:
        feature = schema.feature.add(name=name, type=schema_pb2.INT)
        feature.presence.min_fraction = 1.0
        feature.shape.dim.add(size=1)
        feature.int_domain.min, feature.int_domain.max = 0, sizes[name] - 1
        feature.annotation.comment.append("embedding row id (0 rare or unseen, 1 missing)")
    for feature in schema.feature:
        feature.annotation.tag.append(ROW_LAYOUT)
    return text_format.MessageToString(schema)


def write_samples(frame: DataFrame, state: FeatureState, directory: Path, *, spec: FeatureSpec, split: str,
                  block_rows: int, num_shards: int, seed: int, inputs: dict, layout: str = "block",
                  shuffle: bool = True) -> dict:
    """Writes the split's TFRecords in `layout` ("block" or "row") to `directory` (replacing an older copy),
    with their TensorFlow Metadata schema (schema.pbtxt), and returns the manifest.

    `shuffle`: spread and order the rows pseudo-randomly (shuffle_deterministically). False for rows that
    come already shuffled in an order every read repeats (the join's samples, spark_jobs.events.joined_rows):
    their partitions are kept, merged down to `num_shards`, which saves a shuffle of the wide rows."""
    layout_name = check_samples_layout(layout)
    staging = staging_dir(directory)
    shuffled = shuffle_deterministically(frame, num_shards, seed) if shuffle else frame.coalesce(num_shards)
    writer = make_shard_writer(state, spec, str(staging), block_rows, layout)
    shards = sorted((r.asDict() for r in shuffled.mapInArrow(writer, SHARD_SCHEMA).collect()),
                    key=lambda r: r["file"])
    num_rows = sum(s["rows"] for s in shards)
    (staging / SCHEMA_FILE).write_text(block_schema(state, spec) if layout == "block" else row_schema(state))
    manifest = write_manifest(
        staging, kind=SAMPLES_KIND, version=f"{inputs.get('interval', '')}/{split}",
        files=[*(s["file"] for s in shards), SCHEMA_FILE], spec_hash=spec.hash(), inputs=inputs,
        row_counts={"rows": num_rows, "positives": sum(s["positives"] for s in shards)},
        extra={"split": split, "layout": layout_name, "block_rows": block_rows if layout == "block" else 1,
               "shards": shards, "compression": "none", "feature_state_version": state.version,
               "feature_spec": {"name": spec.name, "hash": spec.hash()}},
    )
    commit_dir(staging, directory)
    return manifest


def state_fingerprint(state: FeatureState) -> str:
    digest = hashlib.sha256(state.version.encode())
    for vocabulary in state.vocabularies.values():
        digest.update("\x1f".join(vocabulary.values).encode())
        digest.update(np.asarray(vocabulary.rows, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]
