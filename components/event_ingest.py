"""`ctr-pipeline ingest --stream impressions|clicks`: a team's own impression and click logs written as the event
streams' raw minute partitions, which the events source joins (spark_jobs/events.py).

Inputs are what `ctr-pipeline ingest` takes (files, folders, globs, s3:// prefixes: components.ingest
expand_inputs), each a Parquet, CSV or TSV file (gzip, zstd or bz2 compressed or not, told by the first bytes),
read whole into memory: ingest a day or an hour at a time. Every file of one call is of one stream:

- impressions: the join's keys (`request_id`, `ts` in epoch milliseconds UTC, `user_id`, `item_id`) and the
  columns the feature spec reads, each of a type its kind is read from (components.events.impression_problems);
  any other column is kept in the raw files, where a later spec may read it;
- clicks: `request_id` and `ts`, the click's time; other columns are dropped.

Ids are read as text (a CSV's `007` stays `007`) and `ts` as an integer; a file that lacks a column the stream
needs, or holds one of a type the spec cannot read, is refused before anything is written, naming the file, the
column and the fix. A row whose key or time is empty is counted, kept with its file and line in a rejects file
(<data root>/ingest/), and not written. The rows are placed by `ts` into raw/<stream>/date=D/minute=HHMM/
part-00000.parquet, sorted by time and request id, each minute from the first to the last one written even when
it holds no row (the join reads a minute without a partition as one still being written), then _SUCCESS. Raw
partitions are immutable: the same rows again leave a minute unchanged, other rows for a complete minute are
refused before anything is written.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyarrow import csv as pa_csv

from components.events import (
    CLICK_SCHEMA,
    CLICKS,
    EVENT_FILE,
    IMPRESSIONS,
    KEY_SCHEMA,
    REQUEST_ID,
    STREAMS,
    TS,
    stream_problems,
    write_event_minute,
)
from components.feature_spec import FeatureSpec
from components.ingest import (
    COMPRESSION_MAGIC,
    PARQUET_MAGIC,
    IngestError,
    IngestReport,
    InputFile,
    Reject,
    expand_inputs,
    s3_client_factory,
    show_columns,
    write_rejects,
)
from components.layout import Layout
from components.synthetic import SUCCESS_MARKER

STREAM_INPUT_FORMATS = ("auto", "csv", "tsv", "parquet")
MINUTE_MS = 60_000


def stream_keys(stream: str) -> pa.Schema:
    """The columns every file of `stream` must have, with the types they are written in."""
    return KEY_SCHEMA if stream == IMPRESSIONS else CLICK_SCHEMA


def ingest_events(spec: FeatureSpec, stream: str, files: Sequence[str | Path], layout: Layout, *,
                  input_format: str = "auto", progress: Callable[[str], None] | None = None,
                  s3_endpoint_url: str = "", s3_client: Any = None) -> IngestReport:
    """Writes `files` as `stream`'s raw minute partitions under `layout` (see the module's doc); returns what it
    did."""
    say = progress or (lambda message: None)
    if stream not in STREAMS:
        raise IngestError(f"--stream {stream!r}: expected one of {', '.join(STREAMS)}")
    if input_format not in STREAM_INPUT_FORMATS:
        raise IngestError(f"--format {input_format!r}: expected one of {', '.join(STREAM_INPUT_FORMATS)}")
    sources = expand_inputs(files, (lambda: s3_client) if s3_client is not None else
                            s3_client_factory(s3_endpoint_url))
    report = IngestReport(spec=spec.name, files=[source.name for source in sources], stream=stream)
    tables: list[pa.Table] = []
    rejects: list[Reject] = []
    schema: pa.Schema | None = None
    for source in sources:
        table, header_lines = read_stream_file(source, input_format, stream)
        table = conform(table, stream, spec, source.name)
        if schema is None:
            schema, first = table.schema, source.name
        elif table.schema != schema:
            try:
                table = table.select(schema.names).cast(schema)
            except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
                raise IngestError(f"{source.name} does not have the columns and types of {first} ({err}); the "
                                  f"files of one {stream} ingest share one schema: ingest them apart") from err
        report.rows_read += table.num_rows
        kept, dropped = _complete_rows(table, stream, source.name, header_lines)
        rejects.extend(dropped)
        tables.append(kept)
        say(f"read {source.name}: {report.rows_read} {stream} so far, {len(rejects)} rejected")
    report.rejected = len(rejects)
    for reject in rejects:
        report.rejects_by_reason[reject.reason] = report.rejects_by_reason.get(reject.reason, 0) + 1
    if rejects:
        report.rejects_file = str(write_rejects(layout, f"{spec.name}-{stream}", sources, rejects))
    rows = pa.concat_tables(tables) if tables else None
    if rows is None or rows.num_rows == 0:
        raise IngestError(f"no {stream} row of {report.files} could be ingested ({report.rejected} rejected; "
                          f"see {report.rejects_file or 'the input'})")
    minutes = by_minute(rows)
    for minute, part in minutes.items():  # refuse before writing anything
        directory = layout.raw_events_minute_dir(stream, minute)
        if (directory / SUCCESS_MARKER).exists():
            existing = directory / EVENT_FILE
            if not existing.exists() or not pq.read_table(existing).equals(part):
                raise IngestError(
                    f"{stream} minute {minute:%Y-%m-%dT%H:%M} already holds other rows ({directory}); raw partitions "
                    "are never rewritten: move it away, or ingest only minutes not written yet")
    for minute, part in minutes.items():
        directory = layout.raw_events_minute_dir(stream, minute)
        unchanged = (directory / SUCCESS_MARKER).exists()
        write_event_minute(part, directory)
        report.minutes_unchanged += unchanged
        report.minutes_written += not unchanged
        report.rows_written += part.num_rows
    report.first_minute = f"{min(minutes):%Y-%m-%dT%H:%M}"
    report.end_minute = f"{max(minutes) + timedelta(minutes=1):%Y-%m-%dT%H:%M}"
    return report


def read_stream_file(source: InputFile, input_format: str, stream: str) -> tuple[pa.Table, int]:
    """One input file as a table, and the lines before its first row (1 for a CSV or TSV header, 0 for Parquet).
    Ids are read as text and `ts` as an integer."""
    with source.open() as handle:
        data = handle.read()
    codec = next((kind for kind, magic in COMPRESSION_MAGIC if data.startswith(magic)), None)
    if codec is not None:
        data = pa.CompressedInputStream(pa.BufferReader(data), "bz2" if codec == "bz2" else codec).read()
    kind = input_format
    if kind == "auto":
        name = source.name.lower().removesuffix(".gz").removesuffix(".gzip").removesuffix(".zst")
        name = name.removesuffix(".zstd").removesuffix(".bz2")
        kind = ("parquet" if data.startswith(PARQUET_MAGIC) else "tsv" if name.endswith(".tsv") or
                b"\t" in data.split(b"\n", 1)[0] else "csv")
    if kind == "parquet":
        try:
            return pq.read_table(pa.BufferReader(data)), 0
        except (pa.ArrowInvalid, OSError) as err:
            raise IngestError(f"{source.name} is not a readable Parquet file: {err}") from err
    keys = stream_keys(stream)
    try:
        table = pa_csv.read_csv(
            io.BytesIO(data), parse_options=pa_csv.ParseOptions(delimiter="\t" if kind == "tsv" else ","),
            convert_options=pa_csv.ConvertOptions(column_types={field.name: field.type for field in keys},
                                                  strings_can_be_null=True))
    except pa.ArrowInvalid as err:
        raise IngestError(f"{source.name} cannot be read as {kind.upper()} with a header line: {err} (ids are read "
                          f"as text and {TS!r} as epoch milliseconds)") from err
    return table, 1


def conform(table: pa.Table, stream: str, spec: FeatureSpec, name: str) -> pa.Table:
    """`table` with the stream's keys in their types (ids of any integer type as text, a timestamp column as epoch
    milliseconds), after checking what the stream and the spec need; clicks keep only their keys."""
    keys = stream_keys(stream)
    missing = [field.name for field in keys if field.name not in table.column_names]
    if missing:
        raise IngestError(f"{name}: the {stream} stream needs columns {missing}, which the file does not have (its "
                          f"columns: {show_columns(table.column_names)}); rename them in the export")
    for field in keys:
        column = table.column(field.name)
        if column.type == field.type:
            continue
        if pa.types.is_timestamp(column.type) and field.name == TS:
            cast = pc.cast(column, pa.timestamp("ms", tz=column.type.tz)).cast(pa.int64())
        elif pa.types.is_integer(column.type) and pa.types.is_string(field.type):
            cast = column.cast(pa.string())
        elif pa.types.is_integer(column.type) and field.type == pa.int64():
            cast = column.cast(pa.int64())
        else:
            raise IngestError(f"{name}: column {field.name!r} is {column.type}, expected {field.type}"
                              + (" (epoch milliseconds, or a timestamp)" if field.name == TS else ""))
        table = table.set_column(table.schema.get_field_index(field.name), field.name, cast)
    if stream == CLICKS:
        table = table.select(keys.names)
    problems = stream_problems(stream, table.schema, spec)
    if problems:
        raise IngestError(f"{name} cannot be ingested as {stream} for feature spec {spec.name!r}: "
                          f"{'; '.join(problems)}. Fix the export, or leave the column out of the spec")
    return table


def _complete_rows(table: pa.Table, stream: str, name: str, header_lines: int) -> tuple[pa.Table, list[Reject]]:
    """The rows with every key, and a Reject for each other row (its file line, the first empty key)."""
    empty = np.zeros(table.num_rows, dtype=bool)
    reasons: list[str | None] = [None] * table.num_rows
    for field in stream_keys(stream):
        nulls = table.column(field.name).is_null().to_numpy(zero_copy_only=False)
        if pa.types.is_string(field.type):
            nulls = nulls | (pc.utf8_length(table.column(field.name)).fill_null(0).to_numpy() == 0)
        for row in np.flatnonzero(nulls & ~empty):
            reasons[row] = f"column {field.name!r} is empty"
        empty |= nulls
    rejects = [Reject(name, int(row) + 1 + header_lines, reasons[row] or "",
                      json.dumps(table.slice(int(row), 1).to_pylist()[0], default=str))
               for row in np.flatnonzero(empty)]
    return table.filter(pa.array(~empty)), rejects


def by_minute(rows: pa.Table) -> dict[datetime, pa.Table]:
    """`rows` by the minute of their `ts`, each sorted by time and request id, every minute from the first to the
    last (an empty table for a minute without a row)."""
    rows = rows.take(pc.sort_indices(rows, [(TS, "ascending"), (REQUEST_ID, "ascending")]))
    minute = rows.column(TS).to_numpy() // MINUTE_MS
    out = {}
    for index in range(int(minute.min()), int(minute.max()) + 1):
        when = datetime.fromtimestamp(index * 60, UTC)
        chosen = np.flatnonzero(minute == index)
        out[when] = rows.slice(int(chosen[0]), len(chosen)) if len(chosen) else rows.schema.empty_table()
    return out
