"""great-expectations suites for the impression and click streams and for joined samples.

Each stream's minute partitions are validated like the click log's (components.validation), the impressions'
expectations on the join's keys and on the columns the feature spec reads, by kind: a failing
partition is moved to quarantine/<stream>/ with its report, the run fails with the reasons, and a re-run goes
on without it (the join treats a quarantined minute as empty and says so). A partition whose Parquet schema
is wrong fails without reaching the suite, with the schema problem as its reason.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from components.events import (
    CLICKS,
    EVENT_FILE,
    IMPRESSIONS,
    KEY_SCHEMA,
    LABEL,
    REQUEST_ID,
    SLOT,
    TS,
    impression_payload,
    impression_readers,
    stream_problems,
)
from components.feature_spec import CategoricalFeature, DenseFeature, FeatureSpec
from components.validation import PartitionedDataset, PartitionReadError, parquet_columns

SUITE_VERSION = "2"
OFFSET_COLUMN = "_offset_ms"  # ts - the partition's minute start: a record belongs to its own minute
HISTORY_LENGTH_COLUMN = "_history_length"
MAX_SLOT = 100
# Bounds on the share of impressions that get a click, per joined span: outside them the click stream is
# broken (lost, duplicated wholesale, or joined to the wrong impressions), not the audience.
MIN_LABEL_RATE, MAX_LABEL_RATE = 0.001, 0.6


def read_event_partition(stream: str, path: Path, minute: datetime, spec: FeatureSpec) -> pd.DataFrame:
    """A stream partition as the suite checks it, after its schema: raises PartitionReadError on a file that
    is not Parquet, or lacks or mistypes a column the join or `spec` reads (components.events.stream_problems)."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as err:
        raise PartitionReadError("parquet", f"{path} is not a readable Parquet file: {err}") from err
    problems = stream_problems(stream, table.schema, spec)
    if problems:
        raise PartitionReadError("schema", "; ".join(problems))
    frame = table.to_pandas()
    frame[OFFSET_COLUMN] = frame[TS] - int(minute.timestamp() * 1000)
    return frame


def impressions_suite(spec: FeatureSpec) -> Any:
    """The keys never null, each record in its own minute; of the columns `spec` reads, a dense one present in
    at least 10 % of the rows (one almost always missing was dropped upstream), a categorical one of text ids
    holding ids (letters, digits, _ and -, at most 64), and the ad slot, when read, a position from 1 up."""
    import great_expectations as gx

    from components.gx_expectations import ExpectColumnValuesToMatchPattern

    e = gx.expectations
    suite = gx.ExpectationSuite(name=IMPRESSIONS, meta={"version": SUITE_VERSION})
    # Traffic never stops for a whole minute: an empty partition is a broken writer.
    suite.add_expectation(e.ExpectTableRowCountToBeBetween(min_value=1))
    for name in KEY_SCHEMA.names:
        suite.add_expectation(e.ExpectColumnValuesToNotBeNull(column=name))
    suite.add_expectation(e.ExpectColumnValuesToBeBetween(column=OFFSET_COLUMN, min_value=0, max_value=59_999))
    for name, feature in impression_readers(spec).items():
        if name == SLOT:
            suite.add_expectation(e.ExpectColumnValuesToBeBetween(column=SLOT, min_value=1, max_value=MAX_SLOT))
        elif isinstance(feature, DenseFeature):
            suite.add_expectation(e.ExpectColumnValuesToNotBeNull(column=name, mostly=0.1))
        elif isinstance(feature, CategoricalFeature) and feature.dtype == "string":
            suite.add_expectation(ExpectColumnValuesToMatchPattern(column=name, regex=r"^[0-9a-zA-Z_\-]{1,64}$"))
    return suite


def clicks_suite() -> Any:
    import great_expectations as gx

    e = gx.expectations
    suite = gx.ExpectationSuite(name=CLICKS, meta={"version": SUITE_VERSION})
    for name in (REQUEST_ID, TS):
        suite.add_expectation(e.ExpectColumnValuesToNotBeNull(column=name))
    suite.add_expectation(e.ExpectColumnValuesToBeBetween(column=OFFSET_COLUMN, min_value=0, max_value=59_999))
    return suite


def joined_samples_suite(sequence_length: int) -> Any:
    """For the join's output: labels, ids, label-rate bounds and history lengths."""
    import great_expectations as gx

    e = gx.expectations
    suite = gx.ExpectationSuite(name="joined_samples", meta={"version": SUITE_VERSION})
    suite.add_expectation(e.ExpectTableRowCountToBeBetween(min_value=1))
    suite.add_expectation(e.ExpectColumnValuesToBeInSet(column=LABEL, value_set=[0, 1]))
    suite.add_expectation(e.ExpectColumnMeanToBeBetween(column=LABEL, min_value=MIN_LABEL_RATE,
                                                        max_value=MAX_LABEL_RATE))
    suite.add_expectation(e.ExpectColumnValuesToBeUnique(column=REQUEST_ID))
    suite.add_expectation(e.ExpectColumnValuesToBeBetween(column=HISTORY_LENGTH_COLUMN, min_value=0,
                                                          max_value=sequence_length))
    return suite


def _stream_checks_version(stream: str, spec: FeatureSpec) -> str:
    """SUITE_VERSION, and for impressions a hash of the columns the spec reads with their kinds: a partition
    validated for one spec is validated again for a spec that reads other columns."""
    if stream != IMPRESSIONS:
        return SUITE_VERSION
    read = [[name, feature.kind, getattr(feature, "dtype", "")] for name, feature in impression_readers(spec).items()]
    return f"{SUITE_VERSION}-{hashlib.sha256(json.dumps(read).encode()).hexdigest()[:16]}"


def stream_dataset(stream: str, spec: FeatureSpec) -> PartitionedDataset:
    """The impressions or clicks stream as validate_interval checks it, for the columns `spec` reads."""
    suite = (lambda: impressions_suite(spec)) if stream == IMPRESSIONS else clicks_suite
    return PartitionedDataset(
        name=stream, suite_version=_stream_checks_version(stream, spec), suite=suite,
        read=lambda path, minute: read_event_partition(stream, path, minute, spec),
        minute_dir=lambda layout, minute: layout.raw_events_minute_dir(stream, minute),
        file_name=EVENT_FILE,
        quarantine_dir=lambda layout, minute: layout.quarantine_events_minute_dir(stream, minute),
        noun=f"{stream} partition", hint="run `ctr-pipeline generate --events` or check the ingest",
        spec_columns=impression_payload(spec) if stream == IMPRESSIONS else (), spec_name=spec.name,
        column_names=parquet_columns,
    )

