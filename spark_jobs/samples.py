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
import functools
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, IntegerType, LongType, StringType, StructField, StructType

from components.block_codec import (
    BLOCK_CATEGORICAL_KEY,
    BLOCK_DENSE_KEY,
    BLOCK_LABEL_KEY,
    BLOCK_LAYOUT,
    BLOCK_NUM_ROWS_KEY,
    encode_blocks,
    frame_records,
)
from components.feature_spec import BUCKET_DERIVATION, MISSING_ROW, RARE_ROW, FeatureSpec
from components.feature_state import (
    FeatureState,
    bucket_values,
    categorical_rows,
    check_state_matches,
    list_rows,
    transform_dense,
)
from components.manifest import commit_dir, staging_dir, write_manifest
from components.row_codec import LABEL_KEY, PER_COLUMN, ROW_LAYOUT, RowColumns, encode_rows
from spark_jobs.raw import LABEL

SAMPLES_KIND = "samples"
# features.samples_layout -> the layout name the manifest records.
LAYOUTS = {"block": BLOCK_LAYOUT, "row": ROW_LAYOUT}
SHARD_SCHEMA = StructType([
    StructField("split", IntegerType()), StructField("file", StringType()), StructField("rows", LongType()),
    StructField("positives", LongType()), StructField("blocks", LongType()),
    # Per categorical column (spec order): rows whose value reads the shared rare row (rare or unseen).
    StructField("rare", ArrayType(LongType())),
    # The same for the missing row (an empty field).
    StructField("missing", ArrayType(LongType())),
])
# When one job writes several splits (write_splits), each row's split: its index into the output directories.
SPLIT_COLUMN = "_split"


def shuffle_deterministically(frame: DataFrame, num_shards: int, seed: int,
                              key_columns: list[str] | None = None, *, in_memory: bool = False) -> DataFrame:
    """Spreads rows over shards and orders them pseudo-randomly, identically on every run (the key: a hash of
    `key_columns`, by default all of them).

    `in_memory`: the rows come from a persisted frame. For one shard they are then gathered into one task and
    sorted there, without an exchange: the same rows in the same order, minus a stage that writes and reads
    every row again. (Gathering rows read from files into one task would read them on one core instead.)"""
    key = F.xxhash64(F.lit(seed), *[F.col(c) for c in (key_columns or frame.columns)])
    keyed = frame.withColumn("_key", key)
    spread = keyed.coalesce(1) if in_memory and num_shards == 1 else keyed.repartition(num_shards, "_key")
    return spread.sortWithinPartitions("_key").drop("_key")


def check_samples_layout(layout: str) -> str:
    """features.samples_layout -> the manifest's layout name, or a clear error."""
    if layout not in LAYOUTS:
        raise ValueError(f"features.samples_layout={layout!r} is not a sample layout; expected one of "
                         f"{sorted(LAYOUTS)} (block: one tf.Example per block of rows; row: one per row, for TFX)")
    return LAYOUTS[layout]


def writer_columns(spec: FeatureSpec) -> list[str]:
    """The columns make_shard_writer's function reads (besides SPLIT_COLUMN): the label, the dense values, the
    categorical values that are not buckets of a dense one, and the lists."""
    return [LABEL, *spec.dense_names,
            *(f.name for f in spec.categorical if f.derivation != BUCKET_DERIVATION), *(f.name for f in spec.lists)]


def make_shard_writer(state: FeatureState, spec: FeatureSpec, output_dirs: list[str], block_rows: int,
                      layout: str = "block"):
    """The mapInArrow function: Arrow batches of parsed rows (spark_jobs.raw.parse_raw) -> one shard file per
    Spark partition and output directory, in `layout` ("block", or "row": one per-column tf.Example per row;
    rows are still encoded `block_rows` at a time). With several directories, each row's SPLIT_COLUMN says
    which it goes to."""
    check_samples_layout(layout)
    row_columns = RowColumns.of(spec) if layout == "row" else None
    check_state_matches(list(state.vocabularies), state.dense_names, spec, f"feature state {state.version}")
    # Per categorical column: its name, the dense feature whose bucket it is (or None) and its table's lookup.
    categorical = [(f.name, f.derived_from if f.derivation == BUCKET_DERIVATION else None,
                    state.lookup(spec.table_of(f.name))) for f in spec.categorical]
    boundaries = {source: state.boundaries(source) for _, source, _ in categorical if source}
    lists = [(f.name, f.max_length, state.lookup(spec.table_of(f.name))) for f in spec.lists]
    dense_names = spec.dense_names
    # The function is pickled into every task: it carries the lookups above (Arrow arrays and numpy rows, which
    # pickle as buffers) and, of the state, only the dense transforms. The vocabularies' tuples (a Python object
    # per value, row, count and day) and the candidates (values below min_count; hundreds of thousands after a
    # few days) are never read here: with them the function of a state from 2 M rows pickled to 7.2 MB.
    state = dataclasses.replace(state, vocabularies={}, candidates=state.candidates.schema.empty_table())

    def encode(table: pa.Table) -> tuple[list[bytes], np.ndarray, np.ndarray, np.ndarray]:
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
        rare, missing = (ids == RARE_ROW).sum(axis=0), (ids == MISSING_ROW).sum(axis=0)
        if layout == "block":
            return encode_blocks(labels, dense, ids, block_rows, id_lists), labels, rare, missing
        return encode_rows(labels, dense, ids, PER_COLUMN, row_columns, id_lists), labels, rare, missing

    class ShardFile:
        """One output's shard of this partition: rows gathered into whole blocks, framed and written."""

        def __init__(self, path: str):
            self.path, self.tmp = path, os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
            self.handle = open(self.tmp, "wb")  # noqa: SIM115 (closed in finish)
            self.pending: list[pa.RecordBatch] = []
            self.pending_rows = self.rows = self.positives = self.blocks = 0
            self.rare = np.zeros(len(categorical), dtype=np.int64)
            self.missing = np.zeros(len(categorical), dtype=np.int64)

        def flush(self, table: pa.Table) -> None:
            records, labels, rare, missing = encode(table)
            self.rare += rare
            self.missing += missing
            self.handle.write(frame_records(records))
            self.rows += len(labels)
            self.positives += int(labels.sum())
            self.blocks += len(records)

        def add(self, batch: pa.RecordBatch) -> None:
            self.pending.append(batch)
            self.pending_rows += batch.num_rows
            if self.pending_rows >= block_rows:
                table = pa.Table.from_batches(self.pending)
                full = (self.pending_rows // block_rows) * block_rows
                self.flush(table.slice(0, full))
                rest = table.slice(full)
                self.pending, self.pending_rows = rest.to_batches(), rest.num_rows

        def finish(self) -> bool:
            """Writes the rest and puts the shard in place; False (and no file) when it got no rows."""
            if self.pending_rows:
                self.flush(pa.Table.from_batches(self.pending))
            self.handle.close()
            if self.rows == 0:
                os.remove(self.tmp)
                return False
            os.replace(self.tmp, self.path)
            return True

    def write_partition(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        name = f"part-{TaskContext.get().partitionId():05d}.tfrecord"
        shards = [ShardFile(os.path.join(directory, name)) for directory in output_dirs]
        for batch in batches:
            if len(shards) == 1:
                shards[0].add(batch)
                continue
            split = batch.column(SPLIT_COLUMN).to_numpy(zero_copy_only=False)
            for index, shard in enumerate(shards):
                mask = split == index
                if mask.any():
                    shard.add(batch.filter(pa.array(mask)))
        done = [(index, shard) for index, shard in enumerate(shards) if shard.finish()]
        if done:
            yield pa.RecordBatch.from_pylist(
                [{"split": index, "file": name, "rows": shard.rows, "positives": shard.positives,
                  "blocks": shard.blocks, "rare": shard.rare.tolist(), "missing": shard.missing.tolist()}
                 for index, shard in done],
                schema=pa.schema([("split", pa.int32()), ("file", pa.string()), ("rows", pa.int64()),
                                  ("positives", pa.int64()), ("blocks", pa.int64()),
                                  ("rare", pa.list_(pa.int64())), ("missing", pa.list_(pa.int64()))]),
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


def row_schema(state: FeatureState, spec: FeatureSpec) -> str:
    """The TensorFlow Metadata schema of the row layout: the label, the spec's scaled dense features
    (standardized; absent when the field was missing and the feature has a missing flag) and its categorical
    features (embedding row ids within each feature's table), one value each, then its list features
    (max_length row ids each)."""
    from google.protobuf import text_format
    from tensorflow_metadata.proto.v0 import schema_pb2

    columns = RowColumns.of(spec)
    schema = schema_pb2.Schema()
    sizes = state.table_sizes()
    label = schema.feature.add(name=LABEL_KEY, type=schema_pb2.FLOAT)
    label.presence.min_fraction = 1.0
    label.shape.dim.add(size=1)
    label.float_domain.min, label.float_domain.max = 0.0, 1.0
    for name, flagged in zip(columns.dense, columns.flagged, strict=True):
        feature = schema.feature.add(name=name, type=schema_pb2.FLOAT)
        if flagged:
            feature.value_count.min, feature.value_count.max = 0, 1
            feature.annotation.comment.append("standardized value; no value when the raw field was missing")
        else:
            feature.presence.min_fraction = 1.0
            feature.shape.dim.add(size=1)
            feature.annotation.comment.append("standardized value; 0 when the raw field was missing")
    for name in columns.categorical:
        feature = schema.feature.add(name=name, type=schema_pb2.INT)
        feature.presence.min_fraction = 1.0
        feature.shape.dim.add(size=1)
        feature.int_domain.min, feature.int_domain.max = 0, sizes[spec.table_of(name)] - 1
        feature.annotation.comment.append("embedding row id (0 rare or unseen, 1 missing)")
    for name, width in columns.lists:
        feature = schema.feature.add(name=name, type=schema_pb2.INT)
        feature.presence.min_fraction = 1.0
        feature.shape.dim.add(size=width)
        feature.int_domain.min, feature.int_domain.max = 0, sizes[spec.table_of(name)] - 1
        feature.annotation.comment.append("embedding row ids, newest last, the front padded with 1 (missing)")
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
    return write_splits({split: (frame, directory)}, state, spec=spec, block_rows=block_rows,
                        num_shards=num_shards, seed=seed, inputs=inputs, layout=layout, shuffle=shuffle)[split]


def write_splits(splits: dict[str, tuple[DataFrame, Path]], state: FeatureState, *, spec: FeatureSpec,
                 block_rows: int, num_shards: int, seed: int, inputs: dict, layout: str = "block",
                 shuffle: bool = True, in_memory: bool = False) -> dict[str, dict]:
    """write_samples for several splits (split -> (its rows, its directory)) in one Spark job: a minute's
    training and held-out rows pay Spark's per-job stages once. Each split gets the files, order and manifest
    that write_samples would give it alone (with shuffle=False, when num_shards is 1); returns split ->
    manifest. `in_memory`: the frames are read from a persisted frame (shuffle_deterministically)."""
    layout_name = check_samples_layout(layout)
    names = list(splits)
    frames = [frame for frame, _ in splits.values()]
    combined = frames[0] if len(frames) == 1 else functools.reduce(
        lambda left, right: left.unionByName(right),
        [frame.withColumn(SPLIT_COLUMN, F.lit(i)) for i, frame in enumerate(frames)])
    shuffled = (shuffle_deterministically(combined, num_shards, seed, key_columns=frames[0].columns,
                                          in_memory=in_memory) if shuffle else combined.coalesce(num_shards))
    staging = {name: staging_dir(directory) for name, (_, directory) in splits.items()}
    writer = make_shard_writer(state, spec, [str(staging[name]) for name in names], block_rows, layout)
    # Only what the writer reads goes to its Python worker: Spark then neither computes nor sends the rest (the
    # parsed rows' minute, a formatted string a row, and the columns a caller kept, such as the held-out flag).
    read = shuffled.select(*writer_columns(spec), *([SPLIT_COLUMN] if len(frames) > 1 else []))
    shards = sorted((r.asDict() for r in read.mapInArrow(writer, SHARD_SCHEMA).collect()),
                    key=lambda r: (r["split"], r["file"]))
    manifests = {}
    for index, name in enumerate(names):
        own = [{k: v for k, v in s.items() if k not in ("split", "rare", "missing")} for s in shards
               if s["split"] == index]
        rare_counts, missing_counts = (
            np.sum([s[key] for s in shards if s["split"] == index], axis=0, dtype=np.int64) if own
            else np.zeros(len(spec.categorical), np.int64) for key in ("rare", "missing"))
        num_rows = sum(s["rows"] for s in own)
        (staging[name] / SCHEMA_FILE).write_text(block_schema(state, spec) if layout == "block"
                                                 else row_schema(state, spec))
        manifests[name] = write_manifest(
            staging[name], kind=SAMPLES_KIND, version=f"{inputs.get('interval', '')}/{name}",
            files=[*(s["file"] for s in own), SCHEMA_FILE], spec_hash=spec.hash(), inputs=inputs,
            row_counts={"rows": num_rows, "positives": sum(s["positives"] for s in own)},
            extra={"split": name, "layout": layout_name, "block_rows": block_rows if layout == "block" else 1,
                   "shards": own, "compression": "none", "feature_state_version": state.version,
                   # Rows whose value reads the shared rare row, per categorical column: the training rows' share
                   # against the held-out rows' says how often serving will meet values training never saw.
                   "rare_rows": dict(zip(spec.categorical_names, rare_counts.tolist(), strict=True)),
                   "missing_rows": dict(zip(spec.categorical_names, missing_counts.tolist(), strict=True)),
                   "feature_spec": {"name": spec.name, "hash": spec.hash()}},
        )
    for name, (_, directory) in splits.items():
        commit_dir(staging[name], directory)
    return manifests


def state_fingerprint(state: FeatureState) -> str:
    digest = hashlib.sha256(state.version.encode())
    for vocabulary in state.vocabularies.values():
        digest.update("\x1f".join(vocabulary.values).encode())
        digest.update(np.asarray(vocabulary.rows, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]
