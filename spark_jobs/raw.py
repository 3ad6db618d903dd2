"""The source: raw minute partitions in a feature spec's layout -> typed rows for the feature and sample jobs.

`extract_raw` reads the spec's layout (TSV or CSV, with or without a header, or Parquet) and adds each row's
minute ('YYYY-MM-DD HH:MM', from the partition path); `parse_raw` turns the spec's raw columns into typed
columns named after the features:

- `label`: int 0/1 (from the spec's label column);
- a dense feature: double, null when missing;
- a categorical feature: string, null when missing; those derived from the timestamp (hour of day, day of
  week) as their number, e.g. "13"; a dense feature's quantile bucket (`<name>_bucket`) is not a column here:
  its boundaries are the feature state's, so the sample writer computes it from the dense column;
- a multi-valued or sequence feature: array<string> without empty elements, the newest `max_length` kept
  (values are newest last);
- `minute`.

The join's samples (the events source, spark_jobs.events.joined_rows) go through the same `parse_raw`, so no
step after this one knows which source its rows came from.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StringType, StructField, StructType

from components.feature_spec import (
    BUCKET_DERIVATION,
    CategoricalFeature,
    FeatureSpec,
    FeatureSpecError,
    MultiCategoricalFeature,
    SequenceFeature,
    TimestampFeature,
)

LABEL = "label"
MINUTE_COLUMN = "minute"
# strptime directives and the Spark datetime patterns that read the same text.
_SPARK_PATTERN = {"%Y": "yyyy", "%y": "yy", "%m": "MM", "%d": "dd", "%H": "HH", "%M": "mm", "%S": "ss"}


def _minute_of_path() -> Column:
    path = F.col("_metadata.file_path")
    return F.concat(
        F.regexp_extract(path, r"date=(\d{4}-\d{2}-\d{2})", 1), F.lit(" "),
        F.regexp_extract(path, r"minute=(\d{2})(\d{2})", 1), F.lit(":"),
        F.regexp_extract(path, r"minute=(\d{2})(\d{2})", 2),
    )


def raw_columns(spec: FeatureSpec) -> list[str]:
    """The columns of extract_raw's frame, in order."""
    return [*spec.input_columns, MINUTE_COLUMN]


def extract_raw(spark: SparkSession, paths: list[str], spec: FeatureSpec) -> DataFrame:
    """The spec's raw columns of the partition files `paths` (text formats: strings, an empty field null;
    Parquet: as stored) plus the partition's minute (raw_columns). Many small text files are read by the
    driver (small_files_table), others by Spark."""
    source = spec.source
    if source.format != "parquet":
        table = small_files_table(paths, spec)
        if table is not None:
            return spark.createDataFrame(table)
    if source.format == "parquet":
        frame = spark.read.parquet(*paths)
    elif source.header:
        frame = spark.read.csv(paths, sep=source.field_delimiter, header=True, inferSchema=False,
                               mode="PERMISSIVE", emptyValue=None)
    else:
        schema = StructType([StructField(name, StringType(), True) for name in source.columns])
        frame = spark.read.csv(paths, sep=source.field_delimiter, schema=schema, header=False, mode="PERMISSIVE",
                               emptyValue=None)
        # The spec's own columns (checked against the spec when it was read): no need to ask Spark, which over
        # Spark Connect is a round trip that lists the files.
        return frame.select(*spec.input_columns, _minute_of_path().alias(MINUTE_COLUMN))
    missing = [c for c in spec.input_columns if c not in frame.columns]
    if missing:
        raise FeatureSpecError(f"feature spec {spec.name!r} reads columns {missing} that the files do not have; "
                               f"they have {frame.columns} (first file {paths[0] if paths else '-'})")
    return frame.select(*spec.input_columns, _minute_of_path().alias(MINUTE_COLUMN))


# Many small text partitions (months of sparse minutes) are read by the driver into one Arrow table that Spark
# takes as it is: Spark opens each file with a reader of its own, 1-3 ms a file here (23 K minutes of a few
# MovieLens rows: 25-75 s a scan, in every step that reads them; the same rows in 1,440 minutes cost a tenth).
DRIVER_READ_MIN_FILES = 64
DRIVER_READ_MAX_MEAN_BYTES = 64 << 10
DRIVER_READ_MAX_BYTES = 256 << 20


def small_files_table(paths: Sequence[str], spec: FeatureSpec):  # -> pyarrow.Table | None
    """extract_raw's frame of `paths` as an Arrow table (the spec's raw columns as strings, an empty field null,
    then the minute), read by the driver, when they are many small text files that Spark and Arrow split alike:
    UTF-8, one header line the same in all (header layouts), no quote, carriage return or empty line, every line
    with every field. None otherwise (Spark reads them)."""
    import csv
    import io
    import os
    import re

    import numpy as np
    import pyarrow as pa
    from pyarrow import csv as pa_csv

    source = spec.source
    delimiter = source.field_delimiter
    if len(paths) < DRIVER_READ_MIN_FILES or len(delimiter.encode()) != 1 or \
            getattr(source, "encoding", "utf-8").lower().replace("-", "") != "utf8":
        return None
    total = sum(os.stat(path).st_size for path in paths)
    if total > DRIVER_READ_MAX_BYTES or total > DRIVER_READ_MAX_MEAN_BYTES * len(paths):
        return None
    columns, header = list(source.columns), None
    bodies, minutes = [], []
    for path in paths:
        data = open(path, "rb").read()
        if source.header:
            cut = data.find(b"\n")
            if cut < 0 or (header is not None and data[:cut] != header):
                return None
            header, data = data[:cut], data[cut + 1:]
        match = re.search(r"date=(\d{4}-\d{2}-\d{2})/minute=(\d{2})(\d{2})", str(path))
        if match is None or not data or b'"' in data or b"\r" in data or b"\n\n" in data or data.startswith(b"\n"):
            return None
        bodies.append(data if data.endswith(b"\n") else data + b"\n")
        minutes.append(f"{match.group(1)} {match.group(2)}:{match.group(3)}")
    if header is not None:
        try:
            columns = next(csv.reader([header.decode("utf-8")], delimiter=delimiter))
        except (UnicodeDecodeError, csv.Error):
            return None
    if len(columns) < 2 or len(set(columns)) != len(columns) or any(c not in columns for c in spec.input_columns):
        return None
    buffer = b"".join(bodies)
    values = np.frombuffer(buffer, np.uint8)
    ends = np.flatnonzero(values == 10)
    fields = np.diff(np.searchsorted(np.flatnonzero(values == ord(delimiter)), ends), prepend=0) + 1
    if not (fields == len(columns)).all():
        return None
    try:
        table = pa_csv.read_csv(
            io.BytesIO(buffer), read_options=pa_csv.ReadOptions(column_names=columns),
            parse_options=pa_csv.ParseOptions(delimiter=delimiter, quote_char=False, double_quote=False,
                                              escape_char=False, newlines_in_values=False, ignore_empty_lines=False),
            convert_options=pa_csv.ConvertOptions(column_types={c: pa.string() for c in columns},
                                                  include_columns=list(spec.input_columns), strings_can_be_null=True,
                                                  null_values=[""]))
    except pa.ArrowInvalid:  # not UTF-8
        return None
    lines = [body.count(b"\n") for body in bodies]
    if table.num_rows != sum(lines):
        return None
    return table.append_column(MINUTE_COLUMN, pa.array(np.repeat(np.array(minutes, dtype=object), lines), pa.string()))


def epoch_seconds(column: Column, feature: TimestampFeature) -> Column:
    """Whole UTC seconds of a raw timestamp column, in the feature's format (bigint)."""
    if feature.format == "unix_seconds":
        return F.floor(column.cast("double")).cast("long")
    if feature.format == "unix_millis":
        return F.floor(column.cast("double") / 1000).cast("long")
    return F.unix_timestamp(column.cast("string"), spark_pattern(feature.format))


def spark_pattern(strptime_format: str) -> str:
    """A strptime format as a Spark datetime pattern; the directives in _SPARK_PATTERN only."""
    out, index = [], 0
    while index < len(strptime_format):
        char = strptime_format[index]
        if char == "%":
            directive = strptime_format[index:index + 2]
            if directive not in _SPARK_PATTERN:
                raise FeatureSpecError(f"timestamp format {strptime_format!r}: {directive!r} is not supported; "
                                       f"use {', '.join(_SPARK_PATTERN)}, unix_seconds or unix_millis")
            out.append(_SPARK_PATTERN[directive])
            index += 2
        else:
            out.append(f"'{char}'" if char.isalpha() else char)
            index += 1
    return "".join(out)


def derived_value(seconds: Column, derivation: str) -> Column:
    """components.feature_spec.derive_time in Spark: the same integer arithmetic, as a string."""
    if derivation == "hour_of_day":
        value = F.pmod(F.floor(seconds / 3600), F.lit(24))
    else:
        value = F.pmod(F.floor(seconds / 86400) + 3, F.lit(7))
    return value.cast("long").cast("string")


def id_list(column: Column, feature: MultiCategoricalFeature | SequenceFeature, dtype: str) -> Column:
    """The feature's values as array<string> without empty elements, the newest `max_length` kept."""
    if feature.separator:
        values = F.split(F.coalesce(column.cast("string"), F.lit("")), _regex_literal(feature.separator))
    else:
        values = F.coalesce(column.cast("array<string>"), F.array().cast("array<string>"))
    values = F.filter(values, lambda v: v.isNotNull() & (F.trim(v) != ""))
    if dtype == "int":
        values = F.transform(values, _canonical_int)
    length = F.size(values)
    limit = feature.max_length
    return F.when(length > limit, F.slice(values, length - limit + 1, F.lit(limit))).otherwise(values)


def _regex_literal(separator: str) -> str:
    return "".join("\\" + c if not c.isalnum() else c for c in separator)


def _canonical_int(value: Column) -> Column:
    """An integer id written as "7", "7.0" or " 7" -> "7", as serving writes a JSON number; other text kept."""
    as_number = value.try_cast("double")
    return F.when(as_number.isNotNull() & (as_number == F.floor(as_number)),
                  as_number.cast("long").cast("string")).otherwise(value)


def parse_raw(frame: DataFrame, spec: FeatureSpec, keep: Sequence[str] = ()) -> DataFrame:
    """Typed columns named after the spec's features (see the module docstring), then the columns of `frame`
    named in `keep`, as they are."""
    timestamp = spec.timestamp
    seconds = epoch_seconds(F.col(timestamp.column), timestamp) if timestamp is not None else None
    columns = [F.col(spec.label.column).cast("double").cast("int").alias(LABEL)]
    for feature in spec.dense:
        columns.append(F.col(feature.column).cast("double").alias(feature.name))
    for feature in spec.categorical:
        if feature.derivation != BUCKET_DERIVATION:
            columns.append(_categorical(feature, seconds).alias(feature.name))
    for feature in spec.lists:
        if getattr(feature, "history", None) is not None:  # no raw column: spark_jobs.history adds it
            continue
        dtype = spec.feature(spec.table_of(feature.name)).dtype  # type: ignore[union-attr]
        columns.append(id_list(F.col(feature.column), feature, dtype).alias(feature.name))
    columns.append(F.col(MINUTE_COLUMN))
    return frame.select(*columns, *keep)


def _categorical(feature: CategoricalFeature, seconds: Column | None) -> Column:
    if feature.derived_from:
        assert seconds is not None
        return derived_value(seconds, feature.derivation)
    value = F.col(feature.column).cast("string")
    if feature.dtype == "int":
        value = _canonical_int(value)
    return F.when(F.trim(value) == "", None).otherwise(value)
