"""Validation of raw click-log slices with great-expectations, and quarantine of the slices that fail.

The suite is code (`raw_click_log_suite`). Each minute partition is validated on its own so one bad minute
is quarantined without touching the rest. A quarantined slice is moved, never deleted: the raw file and a
report naming the failed expectations sit under <data_root>/quarantine/.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd

from components.layout import Layout
from components.manifest import file_sha256, write_json_atomic
from components.schema import CATEGORICAL_FEATURES, DENSE_FEATURES, LABEL, NUM_RAW_FIELDS, RAW_COLUMNS

log = logging.getLogger(__name__)

SUITE_NAME = "raw_click_log"
SUITE_VERSION = "2"
NUM_FIELDS_COLUMN = "_num_fields"
# 1 for a line ending in a newline, 0 for a last line cut short (a writer died mid-line; it can keep all 40
# fields and still have lost characters of the last one).
LINE_TERMINATED_COLUMN = "_line_terminated"
RAW_FILE = "part-00000.tsv"
VALIDATED_MARKER = "_VALIDATED.json"
MAX_UNEXPECTED_SHOWN = 5


class DataValidationError(RuntimeError):
    """A raw slice failed validation. The message names the failed expectations and the report's path."""


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


def read_raw_slice(path: str | Path) -> pd.DataFrame:
    """Reads a Criteo-layout TSV as strings (empty field -> None) plus the number of fields on each line."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        return pd.DataFrame({**{c: pd.Series([], dtype=object) for c in RAW_COLUMNS},
                             NUM_FIELDS_COLUMN: pd.Series([], dtype="int64"),
                             LINE_TERMINATED_COLUMN: pd.Series([], dtype="int64")})
    series = pd.Series(lines, dtype=object)
    num_fields = series.str.count("\t") + 1
    split = series.str.split("\t", expand=True, n=NUM_RAW_FIELDS)
    split = split.reindex(columns=range(NUM_RAW_FIELDS))
    frame = split.iloc[:, :NUM_RAW_FIELDS]
    frame.columns = list(RAW_COLUMNS)
    frame = frame.replace({"": None})
    frame[NUM_FIELDS_COLUMN] = num_fields.astype("int64")
    terminated = pd.Series(1, index=series.index, dtype="int64")
    if not text.endswith("\n"):
        terminated.iloc[-1] = 0
    frame[LINE_TERMINATED_COLUMN] = terminated
    return frame


def raw_click_log_suite():
    """The expectation suite for one raw minute slice."""
    import great_expectations as gx

    e = gx.expectations
    suite = gx.ExpectationSuite(name=SUITE_NAME, meta={"version": SUITE_VERSION})
    suite.add_expectation(e.ExpectTableRowCountToBeBetween(min_value=1))
    suite.add_expectation(
        e.ExpectColumnValuesToBeBetween(column=NUM_FIELDS_COLUMN, min_value=NUM_RAW_FIELDS, max_value=NUM_RAW_FIELDS)
    )
    suite.add_expectation(e.ExpectColumnValuesToBeBetween(column=LINE_TERMINATED_COLUMN, min_value=1, max_value=1))
    suite.add_expectation(e.ExpectColumnValuesToNotBeNull(column=LABEL))
    suite.add_expectation(e.ExpectColumnValuesToBeInSet(column=LABEL, value_set=["0", "1"]))
    for name in DENSE_FEATURES:
        suite.add_expectation(e.ExpectColumnValuesToMatchRegex(column=name, regex=r"^-?[0-9]{1,18}$"))
    for name in CATEGORICAL_FEATURES:
        suite.add_expectation(e.ExpectColumnValuesToMatchRegex(column=name, regex=r"^[0-9a-zA-Z_\-]{1,64}$"))
    return suite


class RawSliceValidator:
    """Holds one ephemeral great-expectations context and validates slices against the suite."""

    def __init__(self) -> None:
        import great_expectations as gx

        logging.getLogger("great_expectations").setLevel(logging.WARNING)
        from great_expectations.data_context.types.base import ProgressBarsConfig

        self._context = gx.get_context(mode="ephemeral")
        self._context.variables.progress_bars = ProgressBarsConfig(globally=False)
        source = self._context.data_sources.add_pandas("raw")
        asset = source.add_dataframe_asset(name=SUITE_NAME)
        self._batch_definition = asset.add_batch_definition_whole_dataframe("slice")
        self._suite = self._context.suites.add(raw_click_log_suite())

    def validate(self, minute: datetime, path: Path) -> tuple[SliceResult, dict[str, Any]]:
        frame = read_raw_slice(path)
        batch = self._batch_definition.get_batch(batch_parameters={"dataframe": frame})
        result = batch.validate(self._suite, result_format={"result_format": "SUMMARY",
                                                            "partial_unexpected_count": MAX_UNEXPECTED_SHOWN})
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


def quarantine(layout: Layout, result: SliceResult, full_report: dict[str, Any]) -> Path:
    """Moves a failed slice out of the raw log, with its report. The raw bytes are kept untouched."""
    target = layout.quarantine_minute_dir(result.minute)
    target.mkdir(parents=True, exist_ok=True)
    source_dir = layout.raw_minute_dir(result.minute)
    write_json_atomic(target / "report.json", {"summary": result.summary(), "failures": result.failures,
                                              "num_rows": result.num_rows, "source": str(source_dir),
                                              "great_expectations": full_report})
    for item in sorted(source_dir.iterdir()):
        os.replace(item, target / item.name)
    source_dir.rmdir()
    return target


def validate_interval(layout: Layout, minutes: list[datetime], report_path: Path,
                      progress=None) -> dict[str, Any]:
    """Validates every raw minute partition of an interval; quarantines the ones that fail.

    Returns the interval's report (also written to `report_path`). Raises DataValidationError, after
    quarantining, when any slice failed. A slice already validated with the same bytes and suite version
    is not validated again, so a re-run is cheap.
    """
    validator: RawSliceValidator | None = None
    passed, failed, missing = [], [], []
    for index, minute in enumerate(minutes):
        directory = layout.raw_minute_dir(minute)
        path = directory / RAW_FILE
        if not path.exists():
            quarantined = layout.quarantine_minute_dir(minute)
            (failed if quarantined.exists() else missing).append(
                {"minute": minute.isoformat(), "quarantined": str(quarantined)} if quarantined.exists()
                else minute.isoformat()
            )
            continue
        marker = directory / VALIDATED_MARKER
        checksum = file_sha256(path)
        if marker.exists():
            previous = json.loads(marker.read_text())
            if previous.get("sha256") == checksum and previous.get("suite_version") == SUITE_VERSION:
                passed.append({"minute": minute.isoformat(), "rows": previous["num_rows"]})
                continue
        validator = validator or RawSliceValidator()
        result, full_report = validator.validate(minute, path)
        if result.success:
            write_json_atomic(marker, {"sha256": checksum, "suite_version": SUITE_VERSION, "num_rows": result.num_rows})
            passed.append({"minute": minute.isoformat(), "rows": result.num_rows})
        else:
            target = quarantine(layout, result, full_report)
            log.error("quarantined %s: %s", minute.isoformat(), result.summary())
            failed.append({"minute": minute.isoformat(), "quarantined": str(target), "summary": result.summary(),
                           "failures": result.failures, "newly_quarantined": True})
        if progress:
            progress(index + 1, len(minutes))
    report = {
        "suite": SUITE_NAME,
        "suite_version": SUITE_VERSION,
        "num_slices": len(minutes),
        "num_passed": len(passed),
        "num_rows": sum(p["rows"] for p in passed),
        "passed": passed,
        "failed": failed,
        "missing": missing,
    }
    write_json_atomic(report_path, report)
    newly = [f for f in failed if f.get("newly_quarantined")]
    if newly:
        lines = "\n".join(f"  - {f['summary']}" for f in newly)
        raise DataValidationError(
            f"{len(newly)} raw slice(s) failed validation and were moved to quarantine (raw data kept, "
            f"nothing will train on them):\n{lines}\nFull report: {report_path}. Fix or drop the data and re-run "
            f"the task: the remaining slices are used and the quarantined ones are listed in the run's report."
        )
    if not passed:
        raise DataValidationError(
            f"no valid raw slices in the interval ({len(missing)} missing, {len(failed)} quarantined): "
            f"expected minute partitions under {layout.root / 'raw'}; run `ctr generate` or check the ingest"
        )
    return report
