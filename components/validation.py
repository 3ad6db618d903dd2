"""Validation of raw minute partitions with great-expectations, and quarantine of the ones that fail.

Suites are code, one function per dataset (`raw_click_log_suite` here, the event streams' in
components.event_validation); a `PartitionedDataset` says where a dataset's minute partitions live, how a
partition is read for its suite, and where a failed one goes. Each minute partition gets its own verdict, so
one bad minute is quarantined without touching the rest; partitions are validated many to a suite run where the
suite allows it (validate_interval), and a failing batch is split until each failing partition is validated
alone. A quarantined partition is moved, never deleted: the raw files and a report naming the failed
expectations sit under <data_root>/quarantine/.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import re
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd

from components.errors import DataValidationError
from components.feature_spec import (
    CategoricalFeature,
    DenseFeature,
    FeatureSpec,
    TimestampFeature,
)
from components.layout import Layout
from components.manifest import file_sha256, write_json_atomic

log = logging.getLogger(__name__)

SUITE_NAME = "raw_click_log"
SUITE_VERSION = "3"
NUM_FIELDS_COLUMN = "_num_fields"
# 1 for a line ending in a newline, 0 for a last line cut short (a writer died mid-line; it can keep all 40
# fields and still have lost characters of the last one).
LINE_TERMINATED_COLUMN = "_line_terminated"
VALIDATED_MARKER = "_VALIDATED.json"
MAX_UNEXPECTED_SHOWN = 5
# Results of the last partitions validated on arrival (validate_arrived) that passed, kept in this process for
# the Data Docs page of the run that uses them.
ARRIVED_RESULTS_KEPT = 8


class SpecColumnsError(DataValidationError):
    """The feature spec reads columns that no partition of an interval holds: the spec's error, not the
    partitions' (validate_interval raises it before validating or moving anything)."""


class PartitionReadError(ValueError):
    """A partition cannot be read into the frame its suite checks (not the file format, wrong schema)."""

    def __init__(self, check: str, detail: str) -> None:
        super().__init__(detail)
        self.check, self.detail = check, detail


@dataclass(frozen=True)
class SliceResult:
    minute: datetime
    path: str
    success: bool
    num_rows: int
    failures: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> str:
        parts = [f"{f['expectation']}({f.get('column') or 'table'}): {f['detail']}" for f in self.failures]
        return f"{self.minute:%Y-%m-%d %H:%M} {self.path}: " + "; ".join(parts)


@dataclass(frozen=True)
class PartitionedDataset:
    """A raw dataset in minute partitions, as validation sees it."""

    name: str  # the suite's name, and the report's
    suite_version: str  # bump when the suite changes: partitions validated before are validated again
    suite: Callable[[], Any]  # () -> gx.ExpectationSuite
    read: Callable[[Path, datetime], pd.DataFrame]  # (data file, minute) -> the frame the suite checks
    minute_dir: Callable[[Layout, datetime], Path]
    file_name: str  # the partition's data file
    quarantine_dir: Callable[[Layout, datetime], Path]
    # What one partition is called in messages, and what to do when none passed.
    noun: str = "raw slice"
    hint: str = "run `ctr generate` or check the ingest"
    # Many partitions read at once: (their frames one after another in one frame or None, and per partition
    # its rows there as (start, stop) or its PartitionReadError). None: `read` each (read_each).
    read_batch: Callable[[list[tuple[Path, datetime]]], BatchRead] | None = None
    # The columns the feature spec reads that a partition must hold by name, the spec's name, and how to read
    # the names a partition holds (its header or footer; None for a layout whose columns are by position, or a
    # file that cannot be read). With them, validate_interval refuses a spec that reads a column no partition
    # of the interval holds before it validates anything (check_spec_columns).
    spec_columns: tuple[str, ...] = ()
    spec_name: str = ""
    column_names: Callable[[Path], list[str] | None] | None = None


BatchRead = tuple[pd.DataFrame | None, list[tuple[int, int] | PartitionReadError]]


def read_each(read: Callable[[Path, datetime], pd.DataFrame], items: list[tuple[Path, datetime]]) -> BatchRead:
    """A batch read done one partition at a time with `read`."""
    frames, spans, offset = [], [], 0
    for path, minute in items:
        try:
            frame = read(path, minute)
        except PartitionReadError as err:
            spans.append(err)
            continue
        frames.append(frame)
        spans.append((offset, offset + len(frame)))
        offset += len(frame)
    return (pd.concat(frames, ignore_index=True) if frames else None), spans


def read_raw_slice(path: str | Path, minute: datetime | None = None, *,
                   spec: FeatureSpec | None = None) -> pd.DataFrame:
    """Reads one raw partition of the spec's layout (the criteo preset when none is given) as strings: the
    columns the spec reads (empty field -> None), the number of fields on each line and whether the line
    ended in a newline. A header that lacks a column the spec reads is a PartitionReadError."""
    spec = spec or _criteo()
    if spec.source.format == "parquet":
        return _read_parquet_slice(Path(path), spec)
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    columns = list(spec.source.columns)
    if spec.source.header:
        if not lines:
            raise PartitionReadError("header", f"{path} is empty: expected a header line naming the columns")
        header = next(csv.reader([lines.pop(0)], delimiter=spec.source.field_delimiter))
        if columns and header != columns:
            raise PartitionReadError("header", f"header {header} differs from source.columns {columns}")
        missing = [c for c in spec.input_columns if c not in header]
        if missing:
            raise PartitionReadError("header", f"the header lacks columns {missing} that spec {spec.name!r} reads "
                                               f"(header: {header})")
        columns = header
    wanted = list(spec.input_columns)
    if not lines:
        return pd.DataFrame({**{c: pd.Series([], dtype=object) for c in wanted},
                             NUM_FIELDS_COLUMN: pd.Series([], dtype="int64"),
                             LINE_TERMINATED_COLUMN: pd.Series([], dtype="int64")})
    series = pd.Series(lines, dtype=object)
    delimiter = spec.source.field_delimiter
    if delimiter == "," and any('"' in line for line in lines):  # quoted fields: the csv module splits them
        rows = list(csv.reader(lines, delimiter=","))
        num_fields = pd.Series([len(r) for r in rows], dtype="int64")
        split = pd.DataFrame([r[:len(columns)] for r in rows], dtype=object)
    else:
        num_fields = series.str.count(re.escape(delimiter)) + 1
        split = series.str.split(delimiter, expand=True, n=len(columns), regex=False)
    split = split.reindex(columns=range(len(columns)))
    frame = split.iloc[:, :len(columns)]
    frame.columns = columns
    frame = frame[wanted].replace({"": None})
    frame[NUM_FIELDS_COLUMN] = num_fields.astype("int64").to_numpy()
    terminated = pd.Series(1, index=series.index, dtype="int64")
    if not text.endswith("\n"):
        terminated.iloc[-1] = 0
    frame[LINE_TERMINATED_COLUMN] = terminated.to_numpy()
    return frame


def _read_parquet_slice(path: Path, spec: FeatureSpec) -> pd.DataFrame:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise PartitionReadError("parquet", f"{path} is not a readable Parquet file: {err}") from err
    missing = [c for c in spec.input_columns if c not in table.column_names]
    if missing:
        raise PartitionReadError("schema", f"{path} lacks columns {missing} that spec {spec.name!r} reads")
    frame = pd.DataFrame(index=range(table.num_rows))
    for name in spec.input_columns:
        column = table.column(name)
        if pa.types.is_list(column.type):
            frame[name] = pa.compute.list_value_length(column).cast(pa.string()).to_pandas()
        else:
            frame[name] = column.cast(pa.string()).to_pandas()
    frame[NUM_FIELDS_COLUMN] = len(table.column_names)
    frame[LINE_TERMINATED_COLUMN] = 1
    return frame


def read_raw_slice_arrow(path: str | Path, minute: datetime | None = None, *,
                         spec: FeatureSpec | None = None) -> pd.DataFrame:
    """read_raw_slice with the raw columns as Arrow-backed strings (missing: <NA>), what validation reads: the
    suite's checks run on them in 5.3-6.3 s instead of 7.6-8.2 s for a 60 K-row slice, here."""
    spec = spec or _criteo()
    fast = read_delimited_arrow(Path(path), spec) if spec.source.format != "parquet" else None
    if fast is not None:
        return fast
    frame = read_raw_slice(path, minute, spec=spec)
    for name in spec.input_columns:
        frame[name] = frame[name].astype("string[pyarrow]")
    return frame


def read_delimited_arrow(path: Path, spec: FeatureSpec) -> pd.DataFrame | None:
    """read_raw_slice_arrow of a well-formed delimited file, split by Arrow's CSV reader (a 60 K-row slice:
    about a tenth of the time of splitting its lines in pandas); None when the file needs the line-by-line
    reader to say exactly what is wrong or to read it as read_raw_slice does: a line with another number of
    fields, bytes that are not UTF-8, carriage returns, quotes in a comma-separated file, a header."""
    import io

    import numpy as np
    import pyarrow as pa
    from pyarrow import csv as pa_csv

    columns, delimiter = list(spec.source.columns), spec.source.field_delimiter
    if spec.source.header or not columns or len(delimiter.encode()) != 1:
        return None
    data = path.read_bytes()
    if not data or b"\r" in data or (delimiter == "," and b'"' in data):
        return None
    buffer = np.frombuffer(data, np.uint8)
    terminated = data.endswith(b"\n")
    ends = np.flatnonzero(buffer == 10)
    if not terminated:
        ends = np.append(ends, len(buffer))
    fields = np.diff(np.searchsorted(np.flatnonzero(buffer == ord(delimiter)), ends), prepend=0) + 1
    if not (fields == len(columns)).all():
        return None
    wanted = list(spec.input_columns)
    try:
        table = pa_csv.read_csv(
            io.BytesIO(data), read_options=pa_csv.ReadOptions(column_names=columns, use_threads=False),
            parse_options=pa_csv.ParseOptions(delimiter=delimiter, quote_char=False, double_quote=False,
                                              escape_char=False, newlines_in_values=False,
                                              ignore_empty_lines=False),
            convert_options=pa_csv.ConvertOptions(column_types={c: pa.string() for c in columns},
                                                  include_columns=wanted, strings_can_be_null=True,
                                                  null_values=[""]))
    except pa.ArrowInvalid:  # not UTF-8: the line reader replaces the bytes, and the suite flags them
        return None
    if table.num_rows != len(ends):
        return None
    frame = table.to_pandas(types_mapper={pa.string(): pd.StringDtype("pyarrow")}.get)
    frame[NUM_FIELDS_COLUMN] = fields.astype("int64")
    line_terminated = np.ones(len(ends), np.int64)
    line_terminated[-1] = int(terminated)
    frame[LINE_TERMINATED_COLUMN] = line_terminated
    return frame


def read_raw_slices_arrow(paths: list[Path], spec: FeatureSpec) -> BatchRead:
    """read_raw_slice_arrow of many partitions at once: their frames one after another in one frame, and per
    path its rows there ((start, stop)) or why it cannot be read. Well-formed delimited files (UTF-8, every
    line with every field, no carriage return, no quote in a comma-separated file, the same header) are split
    by one Arrow CSV read of their lines joined: a minute of a few rows costs microseconds that way, about 10 ms
    read alone. Every other file is read alone by read_raw_slice_arrow, which says exactly what is wrong."""
    import io

    import numpy as np
    import pyarrow as pa
    from pyarrow import csv as pa_csv

    delimiter = spec.source.field_delimiter
    if spec.source.format == "parquet" or len(delimiter.encode()) != 1 or \
            getattr(spec.source, "encoding", "utf-8").lower().replace("-", "") != "utf8":
        return read_each(lambda path, minute: read_raw_slice_arrow(path, spec=spec), [(p, None) for p in paths])
    columns, header_line = list(spec.source.columns), None
    joined: dict[int, tuple[bytes, bool]] = {}  # index -> (lines, whether the file's last line was terminated)
    alone: list[int] = []
    for index, path in enumerate(paths):
        data = Path(path).read_bytes()
        if spec.source.header:
            cut = data.find(b"\n")
            head, data = (data[:cut], data[cut + 1:]) if cut >= 0 else (data, b"")
            if header_line is None and data:
                header = _header_columns(head, spec)
                if header is not None:
                    header_line, columns = head, header
            if head != header_line:
                alone.append(index)
                continue
        if not data or b"\r" in data or (delimiter == "," and b'"' in data) or not _is_utf8(data):
            alone.append(index)
            continue
        terminated = data.endswith(b"\n")
        joined[index] = (data if terminated else data + b"\n", terminated)
    frame = None
    while joined and columns:
        members = list(joined)
        buffer = np.frombuffer(b"".join(joined[i][0] for i in members), np.uint8)
        ends = np.flatnonzero(buffer == 10)
        fields = np.diff(np.searchsorted(np.flatnonzero(buffer == ord(delimiter)), ends), prepend=0) + 1
        lines = np.array([joined[i][0].count(b"\n") for i in members])
        owner = np.repeat(np.arange(len(members)), lines)
        bad = np.unique(owner[fields != len(columns)])
        if len(bad):  # lines with another number of fields: those files go alone, the rest are joined again
            for position in bad:
                alone.append(members[position])
                del joined[members[position]]
            continue
        try:
            table = pa_csv.read_csv(
                io.BytesIO(buffer.tobytes()),
                read_options=pa_csv.ReadOptions(column_names=columns, use_threads=False),
                parse_options=pa_csv.ParseOptions(delimiter=delimiter, quote_char=False, double_quote=False,
                                                  escape_char=False, newlines_in_values=False,
                                                  ignore_empty_lines=False),
                convert_options=pa_csv.ConvertOptions(column_types={c: pa.string() for c in columns},
                                                      include_columns=list(spec.input_columns),
                                                      strings_can_be_null=True, null_values=[""]))
        except pa.ArrowInvalid:
            table = None
        if table is None or table.num_rows != len(ends):
            alone.extend(members)
            joined.clear()
            break
        frame = table.to_pandas(types_mapper={pa.string(): pd.StringDtype("pyarrow")}.get)
        frame[NUM_FIELDS_COLUMN] = fields.astype("int64")
        line_terminated = np.ones(len(ends), np.int64)
        stops = np.cumsum(lines)
        line_terminated[[stops[k] - 1 for k, i in enumerate(members) if not joined[i][1]]] = 0
        frame[LINE_TERMINATED_COLUMN] = line_terminated
        break
    if frame is None:
        alone.extend(joined)
        joined.clear()
    spans: list[tuple[int, int] | PartitionReadError | None] = [None] * len(paths)
    offset = 0
    for index in joined:
        rows = joined[index][0].count(b"\n")
        spans[index] = (offset, offset + rows)
        offset += rows
    frames = [frame] if frame is not None else []
    for index in sorted(alone):
        try:
            single = read_raw_slice_arrow(paths[index], spec=spec)
        except PartitionReadError as err:
            spans[index] = err
            continue
        frames.append(single)
        spans[index] = (offset, offset + len(single))
        offset += len(single)
    combined = pd.concat(frames, ignore_index=True) if len(frames) > 1 else (frames[0] if frames else None)
    return combined, spans  # type: ignore[return-value]


def parquet_columns(path: Path) -> list[str] | None:
    """The column names of a Parquet file's schema (its footer alone is read); None for a file that is not
    Parquet (its validation says why)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return list(pq.read_schema(path).names)
    except (OSError, pa.ArrowInvalid):
        return None


def raw_partition_columns(path: Path, spec: FeatureSpec) -> list[str] | None:
    """The column names a raw partition holds: its Parquet schema's, or its header line's. None for text without
    a header (its columns are the spec's, by position) and for a file that cannot be read that way (its
    validation says why)."""
    if spec.source.format == "parquet":
        return parquet_columns(path)
    if not spec.source.header:
        return None
    try:
        with open(path, "rb") as file:
            line = file.readline().rstrip(b"\r\n")
        if not line:  # an empty file has no header to read
            return None
        return next(csv.reader([line.decode("utf-8")], delimiter=spec.source.field_delimiter))
    except (OSError, UnicodeDecodeError, StopIteration, csv.Error):
        return None


def check_spec_columns(dataset: PartitionedDataset, paths: list[Path], interval: str) -> None:
    """Raises SpecColumnsError, with the columns the partitions do hold and the closest names, when a column
    `dataset.spec_columns` names is in no readable partition of `paths` and at least two partitions were read
    (one partition alone cannot tell a spec's misspelt name from a file that lost a column: it is validated,
    and quarantined, as before). Stops reading at the first partitions that hold them all, so a spec that is
    right costs a header or a footer."""
    import difflib

    if not dataset.spec_columns or dataset.column_names is None:
        return
    missing = dict.fromkeys(dataset.spec_columns)
    held: dict[str, None] = {}
    read = 0
    for path in paths:
        names = dataset.column_names(path)
        if names is None:
            continue
        read += 1
        held.update(dict.fromkeys(names))
        for name in names:
            missing.pop(name, None)
        if not missing:
            return
    if read < 2:
        return
    hints = []
    for name in missing:
        close = difflib.get_close_matches(name, list(held), n=1)
        if close:
            hints.append(f"{name!r}: did you mean {close[0]!r}?")
    spec = f"feature spec {dataset.spec_name!r}" if dataset.spec_name else "the feature spec"
    raise SpecColumnsError(
        f"{spec} reads column(s) {list(missing)} that none of the {read} {dataset.noun}s of {interval} holds "
        f"({' '.join(hints) + ' ' if hints else ''}their columns: {', '.join(held)}). Nothing was validated or "
        f"moved to quarantine: this is the spec's error, not the partitions'. Fix the column names the spec "
        f"reads, or ingest files that hold these columns, and run again.")


def _header_columns(line: bytes, spec: FeatureSpec) -> list[str] | None:
    """The columns a header line names, when the spec can read files with it (else None: read_raw_slice says
    why)."""
    try:
        header = next(csv.reader([line.decode("utf-8")], delimiter=spec.source.field_delimiter))
    except (UnicodeDecodeError, StopIteration, csv.Error):
        return None
    if (spec.source.columns and header != list(spec.source.columns)) or \
            any(c not in header for c in spec.input_columns):
        return None
    return header


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _criteo() -> FeatureSpec:
    from components.feature_spec import load_spec

    return load_spec("criteo")


# Values a raw field may hold, by what the spec says it is. Strings: no control characters (binary garbage)
# and no U+FFFD (bytes that are not UTF-8, replaced when read).
NUMBER_REGEX = r"^-?[0-9]{1,18}(?:\.[0-9]*)?(?:[eE][-+]?[0-9]{1,3})?$"
INTEGER_REGEX = r"^-?[0-9]{1,19}$"
# (U+FFFD itself, not its escape, which RE2 does not read: components.gx_expectations.)
STRING_REGEX = "^[^\\x00-\\x1f\\x7f\ufffd]{1,256}$"
LIST_REGEX = "^[^\\x00-\\x1f\\x7f\ufffd]{1,8192}$"


def timestamp_regex(feature: TimestampFeature) -> str:
    """A regex a raw timestamp of the feature's format matches (what the suite checks before parsing)."""
    if feature.format.startswith("unix_"):
        return r"^[0-9]{1,16}(?:\.[0-9]*)?$"
    widths = {"%Y": r"[0-9]{4}", "%y": r"[0-9]{2}", "%m": r"[0-9]{2}", "%d": r"[0-9]{2}", "%H": r"[0-9]{2}",
              "%M": r"[0-9]{2}", "%S": r"[0-9]{2}", "%f": r"[0-9]{1,6}"}
    pattern = re.escape(feature.format)
    for directive, regex in widths.items():
        pattern = pattern.replace(re.escape(directive), regex)
    return f"^{pattern}$"


def raw_click_log_checks(spec: FeatureSpec) -> list[tuple[str, dict[str, Any]]]:
    """What the click log's suite checks, as data: (expectation class, its arguments), one per rule: field
    count, label set, and per column its kind's pattern (numbers, integer or string ids, lists, timestamps).
    Settings no check reads (min_count, table sizes, embedding sizes) are not here."""
    checks: list[tuple[str, dict[str, Any]]] = [("ExpectTableRowCountToBeBetween", {"min_value": 1})]
    if spec.source.format != "parquet":
        num_fields = len(spec.source.columns) if spec.source.columns else None
        if num_fields:
            checks.append(("ExpectColumnValuesToBeBetween",
                           {"column": NUM_FIELDS_COLUMN, "min_value": num_fields, "max_value": num_fields}))
        checks.append(("ExpectColumnValuesToBeBetween",
                       {"column": LINE_TERMINATED_COLUMN, "min_value": 1, "max_value": 1}))
    label = spec.label.column
    checks.append(("ExpectColumnValuesToNotBeNull", {"column": label}))
    checks.append(("ExpectColumnValuesToBeInSet", {"column": label, "value_set": ["0", "1"]}))
    checked = {label}
    for feature in spec.features:
        if feature.column in checked or getattr(feature, "derived_from", "") or getattr(feature, "history", None):
            continue  # derived and history features have no raw column
        checked.add(feature.column)
        if isinstance(feature, DenseFeature):
            regex = NUMBER_REGEX
        elif isinstance(feature, TimestampFeature):
            checks.append(("ExpectColumnValuesToNotBeNull", {"column": feature.column}))
            regex = timestamp_regex(feature)
        elif isinstance(feature, CategoricalFeature):
            regex = INTEGER_REGEX if feature.dtype == "int" else STRING_REGEX
        elif spec.source.format == "parquet":  # a list column, read as its length
            regex = r"^[0-9]{1,6}$"
        else:
            regex = LIST_REGEX
        checks.append(("ExpectColumnValuesToMatchPattern", {"column": feature.column, "regex": regex}))
    return checks


def raw_click_log_checks_version(spec: FeatureSpec) -> str:
    """SUITE_VERSION and a hash of what a slice's verdict depends on: the suite's checks and how a partition is
    read for them (the source layout, the columns read). A slice marked validated under this version stays
    validated while its bytes are unchanged, whatever else of the spec changes (min_count, tables, models)."""
    source = spec.source
    description = {"checks": raw_click_log_checks(spec), "format": source.format, "header": source.header,
                   "columns": list(source.columns), "delimiter": source.field_delimiter,
                   "encoding": getattr(source, "encoding", "utf-8"), "file_name": source.file_name,
                   "read": list(spec.input_columns)}
    digest = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]
    return f"{SUITE_VERSION}-{digest}"


def raw_click_log_suite(spec: FeatureSpec | None = None):
    """The expectation suite for one raw minute slice, generated from the feature spec (raw_click_log_checks)."""
    import great_expectations as gx

    from components.gx_expectations import ExpectColumnValuesToMatchPattern

    spec = spec or _criteo()
    suite = gx.ExpectationSuite(name=SUITE_NAME, meta={"version": SUITE_VERSION, "feature_spec": spec.name,
                                                       "feature_spec_hash": spec.hash()})
    for name, kwargs in raw_click_log_checks(spec):
        expectation = (ExpectColumnValuesToMatchPattern if name == "ExpectColumnValuesToMatchPattern"
                       else getattr(gx.expectations, name))
        suite.add_expectation(expectation(**kwargs))
    return suite


class SliceValidator:
    """Holds one ephemeral great-expectations context and validates partitions against a dataset's suite."""

    def __init__(self, dataset: PartitionedDataset) -> None:
        import great_expectations as gx

        logging.getLogger("great_expectations").setLevel(logging.WARNING)
        from great_expectations.data_context.types.base import ProgressBarsConfig

        self._context = gx.get_context(mode="ephemeral")
        self._context.variables.progress_bars = ProgressBarsConfig(globally=False)
        self._dataset = dataset
        source = self._context.data_sources.add_pandas("raw")
        asset = source.add_dataframe_asset(name=dataset.name)
        self._batch_definition = asset.add_batch_definition_whole_dataframe("slice")
        self._suite = self._context.suites.add(dataset.suite())
        self._batch_suite, self.row_bounds = self._batch_part(dataset)

    def _batch_part(self, dataset: PartitionedDataset) -> tuple[Any, tuple[float | None, float | None] | None]:
        """The suite to run over many partitions' rows at once, and the row-count bounds each partition is held
        to apart; (None, None) when the suite cannot be run that way. A batch may stand for its partitions when
        the batch passing means each partition passes: every check is a per-row one (a column map expectation
        that every row must meet, `mostly` 1), and the row count (a partition's, not the batch's) is checked
        per partition. Anything else (a share of rows, a mean) is checked one partition at a time."""
        from great_expectations.expectations import ExpectTableRowCountToBeBetween
        from great_expectations.expectations.expectation import (
            ColumnMapExpectation,
            ColumnPairMapExpectation,
            MulticolumnMapExpectation,
        )

        suite = dataset.suite()
        row_wise, bounds = [], (None, None)
        for expectation in suite.expectations:
            kwargs = dict(expectation.configuration.kwargs)
            if isinstance(expectation, ExpectTableRowCountToBeBetween) and not kwargs.get("strict_min") \
                    and not kwargs.get("strict_max") and bounds == (None, None):
                bounds = (kwargs.get("min_value"), kwargs.get("max_value"))
            elif isinstance(expectation, (ColumnMapExpectation, ColumnPairMapExpectation, MulticolumnMapExpectation)) \
                    and kwargs.get("mostly", 1) == 1:
                row_wise.append(type(expectation)(**{k: v for k, v in kwargs.items() if k != "batch_id"}))
            else:
                return None, None
        import great_expectations as gx

        batch_suite = gx.ExpectationSuite(name=f"{suite.name}_batch", expectations=row_wise)
        return self._context.suites.add(batch_suite), bounds

    @property
    def validates_batches(self) -> bool:
        return self._batch_suite is not None

    def rows_allowed(self, num_rows: int) -> bool:
        """Whether a partition of `num_rows` rows meets the suite's row-count check."""
        low, high = self.row_bounds or (None, None)
        return (low is None or num_rows >= low) and (high is None or num_rows <= high)

    def batch_passes(self, frame: pd.DataFrame) -> bool:
        """Whether every row of `frame` (many partitions' rows) meets every per-row check (see _batch_part)."""
        from great_expectations.validator.v1_validator import Validator

        return bool(Validator(batch_definition=self._batch_definition, batch_parameters={"dataframe": frame},
                              result_format={"result_format": "BOOLEAN_ONLY"})
                    .validate_expectation_suite(self._batch_suite).success)

    def validate(self, minute: datetime, path: Path) -> tuple[SliceResult, dict[str, Any]]:
        try:
            frame = self._dataset.read(path, minute)
        except PartitionReadError as err:
            failure = {"expectation": err.check, "column": None, "kwargs": {}, "detail": err.detail}
            return SliceResult(minute, str(path), False, 0, [failure]), {"success": False, "read_error": err.detail}
        self.last_result = None
        # What Batch.validate runs, without getting the batch first: each get_batch hashes the whole frame (0.2 s
        # of a 60 K-row slice).
        from great_expectations.validator.v1_validator import Validator

        def validate(result_format: dict[str, Any]):
            return Validator(batch_definition=self._batch_definition, batch_parameters={"dataframe": frame},
                             result_format=result_format).validate_expectation_suite(self._suite)

        # A pass/fail verdict first: a third of the time of the summary, whose unexpected counts and examples
        # are computed only for a slice that failed (measured on a 60 K-row slice: 3.8 s against 11.6 s).
        result = validate({"result_format": "BOOLEAN_ONLY"})
        if not result.success:
            result = validate({"result_format": "SUMMARY", "partial_unexpected_count": MAX_UNEXPECTED_SHOWN})
        self.last_result = result
        failures = []
        for item in result.results:
            if item.success:
                continue
            config = item.expectation_config
            detail = item.result or {}
            if item.exception_info and item.exception_info.get("raised_exception"):
                text = item.exception_info.get("exception_message")
            elif "unexpected_count" in detail:
                text = (f"{detail['unexpected_count']} of {detail.get('element_count')} rows unexpected, "
                        f"e.g. {detail.get('partial_unexpected_list', [])[:MAX_UNEXPECTED_SHOWN]}")
            else:
                text = f"observed {detail.get('observed_value')!r}"
            failures.append({"expectation": config.type, "column": config.kwargs.get("column"),
                             "kwargs": {k: v for k, v in config.kwargs.items() if k != "batch_id"}, "detail": text})
        return (
            SliceResult(minute, str(path), bool(result.success), len(frame), failures),
            result.to_json_dict(),
        )


def data_docs_html(result) -> str:
    """great-expectations' Data Docs page of one validation result (its own renderer and page view): the suite,
    each expectation with its status and, for a failed slice, what was observed."""
    from great_expectations.render.renderer import ValidationResultsPageRenderer
    from great_expectations.render.view import DefaultJinjaPageView

    return DefaultJinjaPageView().render(ValidationResultsPageRenderer().render(_renderable(result)))


def _renderable(result):
    """A copy of `result` whose unexpected values are ones the page renderer can show: great-expectations'
    renderer fails on pandas' NA (the unexpected value of a null check) and leaves the table out."""
    import copy

    import pandas as pd

    def shown(value):
        return "null" if value is None or (pd.api.types.is_scalar(value) and pd.isna(value)) else value

    result = copy.deepcopy(result)
    for item in result.results:
        detail = item.result or {}
        if "partial_unexpected_list" in detail:
            detail["partial_unexpected_list"] = [shown(v) for v in detail["partial_unexpected_list"]]
        for count in detail.get("partial_unexpected_counts") or []:
            count["value"] = shown(count["value"])
    return result


def _write_data_docs(docs_dir: Path, dataset: str, minute: datetime, result) -> str:
    name = f"{dataset}-{minute:%Y%m%dT%H%M}.html"
    docs_dir.mkdir(parents=True, exist_ok=True)
    tmp = docs_dir / f".{name}.tmp"
    tmp.write_text(data_docs_html(result))
    os.replace(tmp, docs_dir / name)
    return name


QUARANTINE_REPORT = "report.json"
DATA_DOCS = "data_docs"  # the folder of Data Docs pages beside an interval's validation report


def quarantine(source: Path, target: Path, result: SliceResult, full_report: dict[str, Any]) -> Path:
    """The one quarantine, for raw partitions and written outputs alike: moves every file of `source` into
    `target` with the validation report beside them (report.json), and removes `source`, so nothing reads
    them as data and a re-run goes on without them. Bytes are moved, never changed or dropped: when `target`
    is taken (the same partition failed before), the new one goes to `target`.2, .3, ... Returns where it went.
    """
    final, attempt = target, 1
    while final.exists():
        attempt += 1
        final = target.with_name(f"{target.name}.{attempt}")
    staging = final.with_name(f".{final.name}.moving")
    staging.mkdir(parents=True, exist_ok=True)
    write_json_atomic(staging / QUARANTINE_REPORT, {
        "summary": result.summary(), "failures": result.failures, "num_rows": result.num_rows,
        "source": str(source), "great_expectations": full_report})
    for item in sorted(source.iterdir()):
        os.replace(item, staging / item.name)
    source.rmdir()
    os.replace(staging, final)
    return final


def quarantined(layout: Layout, dataset: PartitionedDataset, minute: datetime) -> Path | None:
    """Where `dataset`'s partition of `minute` is in quarantine, or None when it is not there."""
    target = dataset.quarantine_dir(layout, minute)
    return target if target.exists() else None


SLICE_LOCKS: dict[str, threading.Lock] = {}
_SLICE_LOCKS_GUARD = threading.Lock()
_ARRIVED_RESULTS: OrderedDict[tuple[str, str], Any] = OrderedDict()


SLICE_LOCKS_KEPT = 4096


def slice_lock(path: Path) -> threading.Lock:
    """The lock of one partition's validation in this process (validate_interval and validate_arrived). The
    worker validates a partition a minute for as long as it runs, so locks no one holds are dropped once there
    are SLICE_LOCKS_KEPT of them (one dropped between its lookup and its use costs, at worst, one validation
    done twice)."""
    with _SLICE_LOCKS_GUARD:
        if len(SLICE_LOCKS) >= SLICE_LOCKS_KEPT:
            for key in [key for key, lock in SLICE_LOCKS.items() if not lock.locked()]:
                del SLICE_LOCKS[key]
        return SLICE_LOCKS.setdefault(str(path), threading.Lock())


def _validated_rows(directory: Path, checksum: str, dataset: PartitionedDataset) -> int | None:
    """The row count of a partition that passed `dataset`'s suite with these bytes (its _VALIDATED marker), or
    None. A marker that cannot be read (cut short by a crash) counts as none: the partition is validated again."""
    try:
        previous = json.loads((directory / VALIDATED_MARKER).read_text())
    except (OSError, ValueError):
        return None
    if isinstance(previous, dict) and previous.get("sha256") == checksum \
            and previous.get("suite_version") == dataset.suite_version and isinstance(previous.get("num_rows"), int):
        return previous["num_rows"]
    return None


def _mark_validated(directory: Path, checksum: str, dataset: PartitionedDataset, num_rows: int) -> None:
    """Writes the partition's _VALIDATED marker, renamed into place but not synced to disk: a marker lost in a
    crash costs one validation again, never a wrong verdict, and a backfill writes thousands of them."""
    tmp = directory / f".{VALIDATED_MARKER}.{uuid.uuid4().hex}.tmp"
    tmp.write_text(json.dumps({"sha256": checksum, "suite_version": dataset.suite_version, "num_rows": num_rows},
                              indent=2, sort_keys=True))
    os.replace(tmp, directory / VALIDATED_MARKER)


def validate_arrived(layout: Layout, minute: datetime, dataset: PartitionedDataset,
                     validator: SliceValidator | None = None) -> SliceResult | None:
    """Validates one partition once it is complete, before any run asks (pipelines/arrivals.py calls it when
    its completion marker lands), so the run's validate step finds it validated. One that passes gets its
    _VALIDATED marker, and its result is kept in this process for the run's Data Docs page. One that fails is
    left where it is, unmarked: the run's validate step validates it again, quarantines it and reports, as
    for any slice. Returns the result, or None where there was nothing to do (no data file; validated
    already)."""
    directory = dataset.minute_dir(layout, minute)
    path = directory / dataset.file_name
    with slice_lock(path):
        if not path.exists():
            return None
        checksum = file_sha256(path)
        if _validated_rows(directory, checksum, dataset) is not None:
            return None
        validator = validator or SliceValidator(dataset)
        result, _ = validator.validate(minute, path)
        if result.success:
            _mark_validated(directory, checksum, dataset, result.num_rows)
            _ARRIVED_RESULTS[(str(path), checksum)] = validator.last_result
            while len(_ARRIVED_RESULTS) > ARRIVED_RESULTS_KEPT:
                _ARRIVED_RESULTS.popitem(last=False)
        return result


# Partitions validated together in one suite run: at most this many, holding at most this many bytes (a
# generated 60 K-row Criteo minute, about 11 MB, is a batch of its own; a MovieLens minute of a few rows
# shares one with a thousand others).
BATCH_PARTITIONS = 1024
BATCH_BYTES = 16 << 20
# A batch that fails is split in halves until a part holds at most this many partitions, which are then
# validated one by one, each with its own report.
ONE_BY_ONE_AT = 4


@dataclass
class _Pending:
    """A partition no marker vouches for."""

    minute: datetime
    path: Path
    checksum: str
    num_rows: int = 0


class _IntervalValidation:
    """One validate_interval call's verdicts so far, and its validator (built on first need)."""

    def __init__(self, layout: Layout, dataset: PartitionedDataset, docs_dir: Path | None) -> None:
        self.layout, self.dataset, self.docs_dir = layout, dataset, docs_dir
        self._built: SliceValidator | None = None
        self.passed: list[dict[str, Any]] = []
        self.failed: list[dict[str, Any]] = []
        self.docs: list[str] = []
        self.last_passed: tuple[datetime, Path, Any] | None = None  # (minute, path, its result when known)
        self.validated_before = 0

    @property
    def validator(self) -> SliceValidator:
        if self._built is None:
            self._built = SliceValidator(self.dataset)
        return self._built

    def settle(self, chunk: list[tuple[datetime, Path]]) -> None:
        """Gives each partition of `chunk` its verdict. Each one's lock is held from its marker check to its
        verdict: a partition being validated on arrival is waited for, not validated twice (validate_arrived
        holds one lock at a time, so taking several in turn here cannot deadlock with it)."""
        locks = []
        try:
            pending = []
            for minute, path in chunk:
                lock = slice_lock(path)
                lock.acquire()
                locks.append(lock)
                if not path.exists():  # moved away meanwhile (quarantined by a run beside this one)
                    moved = self.dataset.quarantine_dir(self.layout, minute)
                    self.failed.append({"minute": minute.isoformat(), "quarantined": str(moved)})
                    continue
                checksum = file_sha256(path)
                rows = _validated_rows(path.parent, checksum, self.dataset)
                if rows is None:
                    pending.append(_Pending(minute, path, checksum))
                    continue
                self.passed.append({"minute": minute.isoformat(), "rows": rows})
                self.validated_before += 1
                arrived = _ARRIVED_RESULTS.get((str(path), checksum))
                if arrived is not None:
                    self.last_passed = (minute, path, arrived)
            if pending:
                self._validate(pending)
        finally:
            for lock in locks:
                lock.release()

    def _validate(self, pending: list[_Pending]) -> None:
        """Validates partitions together when the suite allows it (SliceValidator.validates_batches), else one
        by one."""
        validator = self.validator
        if not validator.validates_batches or len(pending) == 1:
            for slice_ in pending:
                self._alone(slice_)
            return
        read_batch = self.dataset.read_batch or (lambda items: read_each(self.dataset.read, items))
        frame, spans = read_batch([(s.path, s.minute) for s in pending])
        together: list[tuple[int, _Pending]] = []
        for slice_, span in zip(pending, spans, strict=True):
            if isinstance(span, tuple) and validator.rows_allowed(span[1] - span[0]):
                slice_.num_rows = span[1] - span[0]
                together.append((span[0], slice_))
            else:  # unreadable, or a row count the suite refuses: validated alone, its report says which
                self._alone(slice_)
        together.sort(key=lambda item: item[0])
        self._bisect(frame, [slice_ for _, slice_ in together], [start for start, _ in together])

    def _bisect(self, frame: pd.DataFrame | None, group: list[_Pending], starts: list[int]) -> None:
        """One suite run over the rows of `group`; when it fails, each half again, down to ONE_BY_ONE_AT
        partitions validated alone: k bad partitions of n cost about k log2(n) runs, not n."""
        if not group:
            return
        import numpy as np

        rows = np.concatenate([np.arange(start, start + s.num_rows) for start, s in zip(starts, group, strict=True)])
        if frame is not None and self.validator.batch_passes(frame.take(rows).reset_index(drop=True)):
            for slice_ in group:
                self._pass(slice_, slice_.num_rows)
        elif len(group) <= ONE_BY_ONE_AT:
            for slice_ in group:
                self._alone(slice_)
        else:
            half = len(group) // 2
            self._bisect(frame, group[:half], starts[:half])
            self._bisect(frame, group[half:], starts[half:])

    def _pass(self, slice_: _Pending, num_rows: int, result: Any = None) -> None:
        _mark_validated(slice_.path.parent, slice_.checksum, self.dataset, num_rows)
        self.passed.append({"minute": slice_.minute.isoformat(), "rows": num_rows})
        self.last_passed = (slice_.minute, slice_.path, result)

    def _alone(self, slice_: _Pending) -> None:
        """Validates one partition alone: a pass is marked; a failure gets its report and goes to quarantine."""
        validator = self.validator
        result, full_report = validator.validate(slice_.minute, slice_.path)
        if result.success:
            self._pass(slice_, result.num_rows, validator.last_result)
            return
        minute = slice_.minute
        if self.docs_dir is not None and validator.last_result is not None:
            self.docs.append(_write_data_docs(self.docs_dir, self.dataset.name, minute, validator.last_result))
        target = quarantine(slice_.path.parent, self.dataset.quarantine_dir(self.layout, minute), result,
                            full_report)
        log.error("quarantined %s: %s", minute.isoformat(), result.summary())
        self.failed.append({"minute": minute.isoformat(), "quarantined": str(target), "summary": result.summary(),
                            "failures": result.failures, "newly_quarantined": True})

    def last_page(self) -> str | None:
        """The Data Docs page of the last partition that passed here or on arrival, when there is one."""
        if self.docs_dir is None or self.last_passed is None:
            return None
        minute, path, result = self.last_passed
        if result is None:  # passed in a batch: its own page comes from validating it alone once
            if not path.exists():
                return None
            self.validator.validate(minute, path)
            result = self.validator.last_result
        return _write_data_docs(self.docs_dir, self.dataset.name, minute, result)


def _listed(layout: Layout, minute_dir: Callable[[Layout, datetime], Path],
            minutes: list[datetime]) -> set[datetime] | None:
    """Which of `minutes` (sorted) have a partition folder, from a listing of the dataset's date=/minute=
    folders (components.layout.list_minute_partitions); None for a dataset laid out otherwise."""
    from datetime import timedelta

    from components.layout import list_minute_partitions

    first = minutes[0]
    directory = minute_dir(layout, first)
    base = directory.parent.parent
    if directory != base / f"date={first:%Y-%m-%d}" / f"minute={first:%H%M}":
        return None
    return set(list_minute_partitions(base, first, minutes[-1] + timedelta(minutes=1))) & set(minutes)


def validate_interval(layout: Layout, minutes: list[datetime], report_path: Path,
                      progress: Callable[[int, int, int], None] | None = None,
                      dataset: PartitionedDataset | None = None, docs_dir: Path | None = None) -> dict[str, Any]:
    """Validates every minute partition of `dataset` (the click log by default) in an interval; quarantines
    the ones that fail. With `docs_dir`, great-expectations' Data Docs pages go there: one per slice that failed
    and one for the last slice validated here or on arrival in this process (rendering every slice of a day
    would cost minutes); their names are the report's `data_docs`.

    What it costs follows the partitions there, not the minutes: the dataset's folders are listed (a day at a
    time), and partitions no marker vouches for are validated in batches (BATCH_PARTITIONS, BATCH_BYTES), one
    suite run over their rows together. A batch that fails is split until each failing partition is validated
    alone, so each failure is reported for its own minute and only that minute is quarantined. `progress`, when
    given, is called after each batch with (partitions done, partitions there, rows passed so far).

    Returns the interval's report (also written to `report_path`). Raises DataValidationError, after
    quarantining, when any slice failed. A slice already validated with the same bytes and suite version
    (by an earlier run, or on arrival: validate_arrived) is not validated again, so a re-run is cheap.
    """
    dataset = dataset or click_log_dataset(_criteo())
    minutes = sorted(set(minutes))
    state = _IntervalValidation(layout, dataset, docs_dir)
    listed = _listed(layout, dataset.minute_dir, minutes) if minutes else set()
    in_quarantine = _listed(layout, dataset.quarantine_dir, minutes) if minutes else set()
    present: list[tuple[datetime, Path, int]] = []
    missing: list[str] = []
    for minute in minutes:
        if listed is None or minute in listed:
            path = dataset.minute_dir(layout, minute) / dataset.file_name
            try:
                present.append((minute, path, path.stat().st_size))
                continue
            except (FileNotFoundError, NotADirectoryError):
                pass
        moved = quarantined(layout, dataset, minute) if in_quarantine is None or minute in in_quarantine else None
        if moved is not None:
            state.failed.append({"minute": minute.isoformat(), "quarantined": str(moved)})
        else:
            missing.append(minute.isoformat())
    if len(present) > 1:
        interval = f"{present[0][0]:%Y-%m-%d %H:%M}..{present[-1][0]:%Y-%m-%d %H:%M}"
        try:
            check_spec_columns(dataset, [path for _, path, _ in present], interval)
        except SpecColumnsError as err:
            write_json_atomic(report_path, {
                "suite": dataset.name, "suite_version": dataset.suite_version, "num_slices": len(minutes),
                "num_passed": 0, "num_validated_before": 0, "num_rows": 0, "passed": [], "failed": state.failed,
                "missing": missing, "data_docs": [], "spec_error": str(err)})
            raise
    done = 0
    while done < len(present):
        chunk, num_bytes = [], 0
        for minute, path, size in present[done:done + BATCH_PARTITIONS]:
            if chunk and num_bytes + size > BATCH_BYTES:
                break
            chunk.append((minute, path))
            num_bytes += size
        state.settle(chunk)
        done += len(chunk)
        if progress:
            progress(done, len(present), sum(p["rows"] for p in state.passed))
    page = state.last_page()
    if page is not None:
        state.docs.append(page)
    passed = sorted(state.passed, key=lambda p: p["minute"])
    failed = sorted(state.failed, key=lambda f: f["minute"])
    report = {
        "suite": dataset.name,
        "suite_version": dataset.suite_version,
        "num_slices": len(minutes),
        "num_passed": len(passed),
        "num_validated_before": state.validated_before,  # passed with their bytes and suite validated already
        "num_rows": sum(p["rows"] for p in passed),
        "passed": passed,
        "failed": failed,
        "missing": missing,
        "data_docs": state.docs,
    }
    write_json_atomic(report_path, report)
    newly = [f for f in failed if f.get("newly_quarantined")]
    if newly:
        lines = "\n".join(f"  - {f['summary']}" for f in newly)
        raise DataValidationError(
            f"{len(newly)} {dataset.noun}(s) failed validation and were moved to quarantine (raw data kept, "
            f"nothing will train on them):\n{lines}\nFull report: {report_path}. Fix or drop the data and re-run "
            f"the task: the remaining slices are used and the quarantined ones are listed in the run's report."
        )
    if not passed:
        raise DataValidationError(
            f"no valid {dataset.noun}s in the interval ({len(missing)} missing, {len(failed)} "
            f"quarantined): expected minute partitions under {layout.root / 'raw'}; {dataset.hint}"
        )
    return report


def click_log_dataset(spec: FeatureSpec) -> PartitionedDataset:
    """The raw click log of a feature spec's layout, with its generated suite. A partition validated under
    other checks (raw_click_log_checks_version: the suite's checks and how the partition is read) is validated
    again; one validated under another spec with the same checks (another min_count, say) is not."""
    return PartitionedDataset(
        name=SUITE_NAME, suite_version=raw_click_log_checks_version(spec), suite=lambda: raw_click_log_suite(spec),
        read=lambda path, minute: read_raw_slice_arrow(path, minute, spec=spec), minute_dir=Layout.raw_minute_dir,
        file_name=spec.source.file_name, quarantine_dir=Layout.quarantine_minute_dir,
        hint="run `ctr generate` (criteo) or `ctr ingest --spec NAME FILE...`",
        read_batch=lambda items: read_raw_slices_arrow([path for path, _ in items], spec),
        spec_columns=tuple(spec.input_columns), spec_name=spec.name,
        column_names=lambda path: raw_partition_columns(path, spec),
    )
