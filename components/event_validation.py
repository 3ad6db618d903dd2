"""great-expectations suites for the impression and click streams and for joined samples.

Each stream's minute partitions are validated like the click log's (components.validation): a failing
partition is moved to quarantine/<stream>/ with its report, the run fails with the reasons, and a re-run goes
on without it (the join treats a quarantined minute as empty and says so). A partition whose Parquet schema
is wrong fails without reaching the suite, with the schema problem as its reason.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from components.events import (
    CLICKS,
    DEVICE,
    DEVICES,
    EVENT_FILE,
    IMPRESSIONS,
    ITEM_ID,
    REQUEST_ID,
    SLOT,
    STREAM_SCHEMAS,
    TS,
    USER_ID,
)
from components.schema import CATEGORICAL_FEATURES, DENSE_FEATURES, LABEL
from components.validation import PartitionedDataset, PartitionReadError

SUITE_VERSION = "1"
OFFSET_COLUMN = "_offset_ms"  # ts - the partition's minute start: a record belongs to its own minute
HISTORY_LENGTH_COLUMN = "_history_length"
MAX_SLOT = 100
# Bounds on the share of impressions that get a click, per joined span: outside them the click stream is
# broken (lost, duplicated wholesale, or joined to the wrong impressions), not the audience.
MIN_LABEL_RATE, MAX_LABEL_RATE = 0.001, 0.6


def read_event_partition(stream: str, path: Path, minute: datetime) -> pd.DataFrame:
    """A stream partition as the suite checks it, after its schema: raises PartitionReadError on a file that
    is not Parquet or lacks or mistypes a column."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as err:
        raise PartitionReadError("parquet", f"{path} is not a readable Parquet file: {err}") from err
    problems = []
    for field in STREAM_SCHEMAS[stream]:
        index = table.schema.get_field_index(field.name)
        if index < 0:
            problems.append(f"column {field.name!r} is missing")
        elif table.schema.field(index).type != field.type:
            problems.append(f"column {field.name!r} is {table.schema.field(index).type}, expected {field.type}")
    if problems:
        raise PartitionReadError("schema", "; ".join(problems))
    frame = table.to_pandas()
    frame[OFFSET_COLUMN] = frame[TS] - int(minute.timestamp() * 1000)
    return frame


def impressions_suite() -> Any:
    import great_expectations as gx

    from components.gx_expectations import ExpectColumnValuesToMatchPattern

    e = gx.expectations
    suite = gx.ExpectationSuite(name=IMPRESSIONS, meta={"version": SUITE_VERSION})
    # Traffic never stops for a whole minute: an empty partition is a broken writer.
    suite.add_expectation(e.ExpectTableRowCountToBeBetween(min_value=1))
    for name in (REQUEST_ID, TS, USER_ID, ITEM_ID):
        suite.add_expectation(e.ExpectColumnValuesToNotBeNull(column=name))
    suite.add_expectation(e.ExpectColumnValuesToBeBetween(column=OFFSET_COLUMN, min_value=0, max_value=59_999))
    suite.add_expectation(e.ExpectColumnValuesToBeBetween(column=SLOT, min_value=1, max_value=MAX_SLOT))
    suite.add_expectation(e.ExpectColumnValuesToBeInSet(column=DEVICE, value_set=list(DEVICES)))
    for name in DENSE_FEATURES:  # null rate: a field that is almost always missing was dropped upstream
        suite.add_expectation(e.ExpectColumnValuesToNotBeNull(column=name, mostly=0.1))
    for name in CATEGORICAL_FEATURES:
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


def _stream_dataset(stream: str, suite) -> PartitionedDataset:
    return PartitionedDataset(
        name=stream, suite_version=SUITE_VERSION, suite=suite,
        read=lambda path, minute: read_event_partition(stream, path, minute),
        minute_dir=lambda layout, minute: layout.raw_events_minute_dir(stream, minute),
        file_name=EVENT_FILE,
        quarantine_dir=lambda layout, minute: layout.quarantine_events_minute_dir(stream, minute),
        noun=f"{stream} partition", hint="run `ctr-pipeline generate --events` or check the ingest",
    )


IMPRESSIONS_DATASET = _stream_dataset(IMPRESSIONS, impressions_suite)
CLICKS_DATASET = _stream_dataset(CLICKS, clicks_suite)
