"""`ctr ingest`: a team's own files written as raw minute partitions of the feature spec's layout.

Rows are placed by the spec's timestamp column when it has one (a timestamp coarser than a minute, such as
Avazu's YYMMDDHH hours, spreads its rows evenly over its 60 minutes in file order), else by row order at
`rows_per_minute` from `start`. Each minute becomes raw/click_log/date=D/minute=HHMM/part-00000.<format> in
the spec's source layout (columns in the spec's order; a header line when the layout has one), then an empty
_SUCCESS marker. The input files are only read. A malformed line (wrong field count, a label outside 0/1, a
number that does not parse, a timestamp that does not parse) is counted, kept with its file and line number
in a rejects file, and reported; it is not written. Raw partitions are immutable: writing a minute again
with the same bytes is a no-op, with other bytes an error that names the minute.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from components.feature_spec import DenseFeature, FeatureSpec, TimestampFeature
from components.interval import Interval
from components.layout import Layout
from components.synthetic import SUCCESS_MARKER

INPUT_FORMATS = ("auto", "tsv", "csv", "parquet")
LABEL_VALUES = {"0", "1"}  # what validation accepts


class IngestError(ValueError):
    """The input cannot be ingested as a whole (a file is missing, lacks a column, or would change a minute)."""


@dataclass(frozen=True)
class Reject:
    file: str
    line: int  # 1-based line number in the file (row number + 1 for Parquet)
    reason: str
    text: str


@dataclass
class IngestReport:
    spec: str
    files: list[str]
    rows_read: int = 0
    rows_written: int = 0
    rejected: int = 0
    rejects_by_reason: dict[str, int] = field(default_factory=dict)
    minutes_written: int = 0
    minutes_unchanged: int = 0
    first_minute: str = ""
    end_minute: str = ""  # exclusive
    rejects_file: str = ""

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def parse_timestamp(value: str, feature: TimestampFeature) -> datetime:
    """A raw timestamp as a UTC datetime. Raises ValueError naming the format when it does not parse."""
    return feature.parse(value)


def coarser_than_a_minute(feature: TimestampFeature) -> bool:
    """True for a strptime format without minutes (e.g. %y%m%d%H): its rows are spread over the hour."""
    return not feature.format.startswith("unix_") and "%M" not in feature.format


def ingest(spec: FeatureSpec, files: Sequence[str | Path], layout: Layout, *, start: str | None = None,
           rows_per_minute: int | None = None, input_format: str = "auto",
           progress: Callable[[str], None] | None = None) -> IngestReport:
    """Writes `files` as raw minute partitions under `layout` (see the module's doc). Returns what it did."""
    say = progress or (lambda message: None)
    if input_format not in INPUT_FORMATS:
        raise IngestError(f"--format {input_format!r}: expected one of {', '.join(INPUT_FORMATS)}")
    timestamp = spec.timestamp
    if timestamp is not None and start is not None:
        raise IngestError(f"--start applies to specs without a timestamp column; spec {spec.name!r} places rows by "
                          f"its timestamp {timestamp.column!r}: drop --start")
    if timestamp is None and start is None:
        raise IngestError(f"spec {spec.name!r} has no timestamp column, so rows are placed by their order: give "
                          "--start (the first minute, e.g. 2026-01-01T00:00) and --rows-per-minute")
    first_minute = None
    if start is not None:
        try:
            first_minute = Interval.minute(start).start
        except ValueError as err:
            raise IngestError(f"--start {start!r}: {err} (an ISO time on a whole minute, e.g. 2026-01-01T00:00)") \
                from err
    if rows_per_minute is not None and rows_per_minute < 1:
        raise IngestError(f"--rows-per-minute must be at least 1, got {rows_per_minute}")
    paths = [Path(f) for f in files]
    for path in paths:
        if not path.is_file():
            raise IngestError(f"input file {str(path)!r} does not exist")
    report = IngestReport(spec=spec.name, files=[str(p) for p in paths])
    output_columns = list(spec.source.columns)
    rows: list[tuple[datetime | None, list[str]]] = []  # (timestamp or None, fields in output order)
    rejects: list[Reject] = []
    for path in paths:
        records, columns = _read(path, spec, input_format)
        if not output_columns:
            output_columns = list(columns)
        missing = [c for c in spec.input_columns if c not in columns]
        if missing:
            raise IngestError(f"{path}: columns {missing} that spec {spec.name!r} reads are not in the file (its "
                              f"columns: {list(columns)}); check the file's header or the spec's source.columns")
        positions = [columns.index(c) if c in columns else None for c in output_columns]
        checks = _row_checks(spec, columns)
        for line, fields, text in records:
            report.rows_read += 1
            if len(fields) != len(columns):
                rejects.append(Reject(str(path), line, f"expected {len(columns)} fields, got {len(fields)}", text))
                continue
            reason = next((r for r in (check(fields) for check in checks) if r), None)
            if reason:
                rejects.append(Reject(str(path), line, reason, text))
                continue
            when = parse_timestamp(fields[columns.index(timestamp.column)], timestamp) if timestamp else None
            rows.append((when, [fields[p] if p is not None else "" for p in positions]))
        say(f"read {path}: {report.rows_read} rows so far, {len(rejects)} rejected")
    report.rejected = len(rejects)
    for reject in rejects:
        key = reject.reason.split(":")[0]
        report.rejects_by_reason[key] = report.rejects_by_reason.get(key, 0) + 1
    if rejects:
        report.rejects_file = str(_write_rejects(layout, spec, paths, rejects))
    minutes = _place(rows, timestamp, first_minute, rows_per_minute or 1000)
    if not minutes:
        raise IngestError(f"no row of {[str(p) for p in paths]} could be ingested ({report.rejected} rejected; "
                          f"see {report.rejects_file or 'the input'})")
    encoded = {minute: _encode(spec, output_columns, part) for minute, part in sorted(minutes.items())}
    for minute, data in encoded.items():  # refuse before writing anything
        existing = layout.raw_minute_dir(minute) / spec.source.file_name
        if existing.exists() and existing.read_bytes() != data:
            raise IngestError(f"minute {minute:%Y-%m-%dT%H:%M} already holds other data ({existing}); raw partitions "
                              "are never rewritten: move it away or ingest into other minutes")
    for minute, data in encoded.items():
        if _write_partition(layout.raw_minute_dir(minute), spec.source.file_name, data):
            report.minutes_written += 1
        else:
            report.minutes_unchanged += 1
        report.rows_written += len(minutes[minute])
    report.first_minute = f"{min(encoded):%Y-%m-%dT%H:%M}"
    report.end_minute = f"{max(encoded) + timedelta(minutes=1):%Y-%m-%dT%H:%M}"
    return report


def _read(path: Path, spec: FeatureSpec, input_format: str) -> tuple[Iterator[tuple[int, list[str], str]],
                                                                        list[str]]:
    """(records as (line number, fields, original text), the file's columns)."""
    fmt = input_format
    if fmt == "auto":
        fmt = "parquet" if path.suffix == ".parquet" else _sniff(path)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        columns = table.column_names
        values = [[None if v is None else str(v) for v in table.column(c).to_pylist()] for c in columns]

        def parquet_rows() -> Iterator[tuple[int, list[str], str]]:
            for i in range(table.num_rows):
                fields = ["" if col[i] is None else col[i] for col in values]
                yield i + 2, fields, json.dumps(dict(zip(columns, fields, strict=True)))

        return parquet_rows(), columns
    delimiter = "\t" if fmt == "tsv" else ","
    handle = open(path, newline="", encoding="utf-8", errors="replace")
    first = handle.readline()
    header = next(csv.reader([first], delimiter=delimiter)) if first else []
    has_header = spec.label.column in header
    if has_header:
        columns = header
    elif spec.source.columns:
        columns = list(spec.source.columns)
        handle.seek(0)
    else:
        handle.close()
        raise IngestError(f"{path}: no header line naming the label column {spec.label.column!r}, and spec "
                          f"{spec.name!r} lists no source.columns to read it by position")

    def text_rows() -> Iterator[tuple[int, list[str], str]]:
        with handle:
            first_line = 2 if has_header else 1
            for number, text in enumerate(handle, start=first_line):
                stripped = text.rstrip("\r\n")
                if not stripped:
                    continue
                fields = next(csv.reader([stripped], delimiter=delimiter)) if delimiter == "," \
                    else stripped.split(delimiter)
                yield number, fields, stripped

    return text_rows(), columns


def _sniff(path: Path) -> str:
    with open(path, encoding="utf-8", errors="replace") as handle:
        first = handle.readline()
    return "tsv" if "\t" in first else "csv"


def _row_checks(spec: FeatureSpec, columns: list[str]) -> list[Callable[[list[str]], str | None]]:
    label_at = columns.index(spec.label.column)
    checks: list[Callable[[list[str]], str | None]] = [
        lambda f: None if f[label_at].strip() in LABEL_VALUES else f"label: {spec.label.column}={f[label_at]!r} is "
                                                                     "not 0 or 1"]
    for feature in spec.features:
        if isinstance(feature, DenseFeature):
            checks.append(_number_check(feature.column, columns.index(feature.column)))
    if spec.timestamp is not None:
        timestamp = spec.timestamp
        at = columns.index(timestamp.column)

        def timestamp_check(fields: list[str]) -> str | None:
            try:
                parse_timestamp(fields[at], timestamp)
            except (ValueError, OverflowError, OSError):
                return f"timestamp: {timestamp.column}={fields[at]!r} does not match format {timestamp.format!r}"
            return None

        checks.append(timestamp_check)
    return checks


def _number_check(column: str, at: int) -> Callable[[list[str]], str | None]:
    def check(fields: list[str]) -> str | None:
        value = fields[at].strip()
        if value:
            try:
                float(value)
            except ValueError:
                return f"number: {column}={fields[at]!r} is not a number"
        return None

    return check


def _place(rows: list[tuple[datetime | None, list[str]]], timestamp: TimestampFeature | None,
           first: datetime | None, rows_per_minute: int) -> dict[datetime, list[list[str]]]:
    out: dict[datetime, list[list[str]]] = {}
    if timestamp is None:
        assert first is not None
        for index, (_, fields) in enumerate(rows):
            out.setdefault(first + timedelta(minutes=index // rows_per_minute), []).append(fields)
        return out
    if coarser_than_a_minute(timestamp):
        by_hour: dict[datetime, list[list[str]]] = {}
        for when, fields in rows:
            assert when is not None
            by_hour.setdefault(when.replace(minute=0, second=0, microsecond=0), []).append(fields)
        for hour, members in by_hour.items():
            for k, fields in enumerate(members):
                out.setdefault(hour + timedelta(minutes=k * 60 // len(members)), []).append(fields)
        return out
    for when, fields in rows:
        assert when is not None
        out.setdefault(when.replace(second=0, microsecond=0), []).append(fields)
    return out


def _encode(spec: FeatureSpec, columns: list[str], rows: list[list[str]]) -> bytes:
    if spec.source.format == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({c: [r[i] or None for r in rows] for i, c in enumerate(columns)})
        sink = io.BytesIO()
        pq.write_table(table, sink)
        return sink.getvalue()
    delimiter = spec.source.field_delimiter
    text = io.StringIO()
    if delimiter == ",":
        writer = csv.writer(text, delimiter=",", lineterminator="\n")
        if spec.source.header:
            writer.writerow(columns)
        writer.writerows(rows)
    else:
        if spec.source.header:
            text.write(delimiter.join(columns) + "\n")
        for row in rows:
            text.write(delimiter.join(row) + "\n")
    return text.getvalue().encode()


def _write_partition(directory: Path, file_name: str, data: bytes) -> bool:
    """Writes one minute (data file, then _SUCCESS) atomically. False when it was already there, unchanged."""
    final = directory / file_name
    if final.exists() and (directory / SUCCESS_MARKER).exists():
        return False
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{file_name}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, final)
    (directory / SUCCESS_MARKER).touch()
    return True


def _write_rejects(layout: Layout, spec: FeatureSpec, paths: list[Path], rejects: list[Reject]) -> Path:
    key = hashlib.sha256("\0".join(str(p.absolute()) for p in paths).encode()).hexdigest()[:8]
    target = layout.root / "ingest" / f"{spec.name}-{key}.rejects.tsv"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "w", newline="") as handle:
        writer = csv.writer(handle, delimiter="\t", lineterminator="\n")
        writer.writerow(["file", "line", "reason", "text"])
        for reject in rejects:
            writer.writerow([reject.file, reject.line, reject.reason, reject.text])
    return target
