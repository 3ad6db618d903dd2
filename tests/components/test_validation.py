from __future__ import annotations

import json
import re
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from components.config import GenerateConfig
from components.feature_spec import load_spec
from components.interval import Interval
from components.layout import Layout
from components.manifest import file_sha256
from components.schema import NUM_RAW_FIELDS, RAW_COLUMNS
from components.synthetic import RAW_FILE, SUCCESS_MARKER, generate
from components.validation import (
    DATA_DOCS,
    LINE_TERMINATED_COLUMN,
    NUM_FIELDS_COLUMN,
    ONE_BY_ONE_AT,
    SUITE_VERSION,
    VALIDATED_MARKER,
    DataValidationError,
    raw_click_log_checks_version,
    raw_click_log_suite,
    read_delimited_arrow,
    read_raw_slice,
    read_raw_slice_arrow,
    validate_interval,
)

pytestmark = pytest.mark.unit

START = datetime(2026, 1, 1, tzinfo=UTC)
ROWS = 200


def minute(index: int) -> datetime:
    return START + timedelta(minutes=index)


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    """One generated dataset for the module. Minutes 0-1: clean; 2-7: the quarantine run (2-6 damaged there);
    8: missing; 9: changed after it passed."""
    layout = Layout(tmp_path_factory.mktemp("validation"))
    generate(GenerateConfig(start="2026-01-01T00:00", minutes=10, rows_per_minute=ROWS, seed=3), layout)
    shutil.rmtree(layout.raw_minute_dir(minute(8)))
    return layout


def _raw(layout: Layout, index: int):
    return layout.raw_minute_dir(minute(index)) / RAW_FILE


def _replace_field(layout: Layout, index: int, line: int, field: int, value: str) -> None:
    path = _raw(layout, index)
    lines = path.read_text().split("\n")
    fields = lines[line].split("\t")
    fields[field] = value
    lines[line] = "\t".join(fields)
    path.write_text("\n".join(lines))


@pytest.fixture(scope="module")
def quarantine_run(layout):
    """Damages minutes 2-6, validates minutes 2-8 once, and keeps what the first run left behind."""
    truncated = _raw(layout, 2)
    truncated.write_bytes(truncated.read_bytes()[:-25])  # a writer died mid-line, fields lost
    cut_in_last_field = _raw(layout, 6)
    data = cut_in_last_field.read_bytes()
    assert re.search(rb"\t[0-9a-f]{8}\n$", data)  # the last field is not missing, so it can be cut short
    cut_in_last_field.write_bytes(data[:-4])
    _replace_field(layout, 3, line=7, field=0, value="2")  # label 2
    _replace_field(layout, 4, line=11, field=3, value="12x")  # I3 not a number
    _raw(layout, 5).write_bytes(b"")  # an empty file
    damaged = {i: _raw(layout, i).read_bytes() for i in (2, 3, 4, 5, 6)}
    minutes = [minute(i) for i in range(2, 9)]
    interval = Interval(minute(2), minute(9))
    report_path = layout.validation_report(interval)
    with pytest.raises(DataValidationError) as raised:
        validate_interval(layout, minutes, report_path, docs_dir=report_path.parent / DATA_DOCS)
    first_report = json.loads(report_path.read_text())
    return {
        "error": str(raised.value),
        "damaged": damaged,
        "minutes": minutes,
        "report_path": report_path,
        "first_report": first_report,
    }


def test_read_raw_slice_counts_fields_and_maps_empty_to_none(tmp_path):
    path = tmp_path / RAW_FILE
    full = ["1", "5", "", *["0"] * 11, "abcd1234", "", *["ffff0000"] * 24]
    assert len(full) == NUM_RAW_FIELDS
    path.write_text("\t".join(full) + "\n" + "0\t3\n" + "\t".join(full + ["extra"]) + "\n")
    frame = read_raw_slice(path)
    assert list(frame.columns) == [*RAW_COLUMNS, NUM_FIELDS_COLUMN, LINE_TERMINATED_COLUMN]
    assert frame[NUM_FIELDS_COLUMN].tolist() == [40, 2, 41]
    assert frame[LINE_TERMINATED_COLUMN].tolist() == [1, 1, 1]
    assert frame["label"].tolist() == ["1", "0", "1"]
    assert frame["I1"].tolist() == ["5", "3", "5"]
    assert frame["I2"].tolist() == [None, None, None]
    assert frame["C1"].tolist() == ["abcd1234", None, "abcd1234"]
    assert frame["C2"].tolist() == [None, None, None]
    assert frame["C26"].tolist()[0] == "ffff0000"


def test_read_raw_slice_of_an_empty_file(tmp_path):
    path = tmp_path / RAW_FILE
    path.write_bytes(b"")
    frame = read_raw_slice(path)
    assert len(frame) == 0
    assert list(frame.columns) == [*RAW_COLUMNS, NUM_FIELDS_COLUMN, LINE_TERMINATED_COLUMN]


def test_read_raw_slice_marks_an_unterminated_last_line(tmp_path):
    path = tmp_path / RAW_FILE
    line = "\t".join(["0", *["1"] * 13, *["abcdef01"] * 26])
    path.write_text(line + "\n" + line[:-3])  # cut inside the last field: all 40 fields are still there
    frame = read_raw_slice(path)
    assert frame[NUM_FIELDS_COLUMN].tolist() == [40, 40]
    assert frame[LINE_TERMINATED_COLUMN].tolist() == [1, 0]
    assert frame["C26"].tolist() == ["abcdef01", "abcde"]


def _line_reader_as_arrow(path):
    frame = read_raw_slice(path)
    for name in RAW_COLUMNS:
        frame[name] = frame[name].astype("string[pyarrow]")
    return frame


@pytest.mark.parametrize("damage", ["none", "unterminated", "short line", "extra field", "not utf-8",
                                    "carriage return", "empty line"])
def test_validation_reads_what_the_line_reader_reads(tmp_path, damage):
    """read_raw_slice_arrow (Arrow's CSV reader for well-formed files, the line reader otherwise) gives the
    same frame as the line reader, on a generated slice as it is and damaged."""
    import pandas as pd

    layout = Layout(tmp_path)
    generate(GenerateConfig(start="2026-01-01T00:00", minutes=1, rows_per_minute=500), layout)
    path = next(tmp_path.rglob(RAW_FILE))
    data = path.read_bytes()
    lines = data.split(b"\n")
    damaged = {
        "none": data,
        "unterminated": data[:-1],
        "short line": b"\n".join([*lines[:3], b"0\t3", *lines[4:]]),
        "extra field": b"\n".join([*lines[:3], lines[3] + b"\textra", *lines[4:]]),
        "not utf-8": b"\n".join([*lines[:3], lines[3].replace(b"\t", b"\t\xff\xfe", 1), *lines[4:]]),
        "carriage return": data.replace(b"\n", b"\r\n", 2),
        "empty line": b"\n".join([*lines[:3], b"", *lines[3:]]),
    }[damage]
    path.write_bytes(damaged)
    frame = read_raw_slice_arrow(path)
    pd.testing.assert_frame_equal(frame, _line_reader_as_arrow(path))
    assert len(frame) == 500 + (damage == "empty line")
    assert frame["I1"].isna().sum() > 0  # empty fields read as missing
    # Arrow splits the well-formed files; the damaged ones go to the line reader, which says what is wrong.
    assert (read_delimited_arrow(path, load_spec("criteo")) is not None) == (damage in ("none", "unterminated"))


def test_suite_has_one_expectation_per_column_rule():
    import great_expectations as gx

    gx.get_context(mode="ephemeral")  # GX builds suites only with an active context, as SliceValidator has
    suite = raw_click_log_suite()
    types = [e.expectation_type for e in suite.expectations]
    assert len(types) == 5 + 13 + 26
    assert types.count("expect_column_values_to_match_pattern") == 39
    assert suite.meta["version"] == SUITE_VERSION


def test_clean_slices_pass_and_are_not_validated_twice(layout, tmp_path, monkeypatch):
    report_path = tmp_path / "report.json"
    report = validate_interval(layout, [minute(0), minute(1)], report_path)
    assert report["num_slices"] == 2
    assert report["num_passed"] == 2
    assert report["num_rows"] == 2 * ROWS
    assert report["failed"] == [] and report["missing"] == []
    assert json.loads(report_path.read_text()) == report
    marker = json.loads((layout.raw_minute_dir(minute(0)) / VALIDATED_MARKER).read_text())
    assert marker == {
        "sha256": file_sha256(_raw(layout, 0)),
        "suite_version": raw_click_log_checks_version(load_spec("criteo")),
        "num_rows": ROWS,
    }

    # A re-run trusts the markers: the validator is never built.
    import components.validation as validation

    def fail():
        raise AssertionError("validated again")

    monkeypatch.setattr(validation, "SliceValidator", fail)
    again = validate_interval(layout, [minute(0), minute(1)], tmp_path / "again.json")
    assert again["num_passed"] == 2 and again["num_rows"] == 2 * ROWS


def test_damaged_slices_are_quarantined_with_their_raw_bytes(layout, quarantine_run):
    for index, damaged in quarantine_run["damaged"].items():
        target = layout.quarantine_minute_dir(minute(index))
        assert sorted(p.name for p in target.iterdir()) == sorted([RAW_FILE, SUCCESS_MARKER, "report.json"])
        assert (target / RAW_FILE).read_bytes() == damaged
        assert not layout.raw_minute_dir(minute(index)).exists()
    # The clean minute of the same interval stays in the raw log.
    assert _raw(layout, 7).exists()


BETWEEN = "expect_column_values_to_be_between"
ONE_ROW = r"1 of 200 rows unexpected, e\.g\. "


@pytest.mark.parametrize(
    ("index", "failures"),
    [
        (
            2,
            [
                (BETWEEN, "_num_fields", ONE_ROW + r"\[\d+\]"),
                (BETWEEN, "_line_terminated", ONE_ROW + r"\[0\]"),
            ],
        ),
        (3, [("expect_column_values_to_be_in_set", "label", ONE_ROW + r"\['2'\]")]),
        (4, [("expect_column_values_to_match_pattern", "I3", ONE_ROW + r"\['12x'\]")]),
        (5, [("expect_table_row_count_to_be_between", None, r"observed 0")]),
        (6, [(BETWEEN, "_line_terminated", ONE_ROW + r"\[0\]")]),
    ],
)
def test_quarantine_report_names_the_failed_expectations(layout, quarantine_run, index, failures):
    report = json.loads((layout.quarantine_minute_dir(minute(index)) / "report.json").read_text())
    assert [(f["expectation"], f["column"]) for f in report["failures"]] == [(e, c) for e, c, _ in failures]
    for failure, (expectation, _, detail) in zip(report["failures"], failures, strict=True):
        assert re.fullmatch(detail, failure["detail"]), failure["detail"]
        assert expectation in report["summary"]
    assert report["source"] == str(layout.raw_minute_dir(minute(index)))
    assert report["num_rows"] == (0 if index == 5 else ROWS)
    assert report["great_expectations"]["success"] is False


def test_truncated_line_is_reported_with_its_field_count(layout, quarantine_run):
    report = json.loads((layout.quarantine_minute_dir(minute(2)) / "report.json").read_text())
    failure = report["failures"][0]
    assert failure["kwargs"] == {"column": "_num_fields", "min_value": 40.0, "max_value": 40.0}
    damaged = quarantine_run["damaged"][2].decode()
    last_line_fields = damaged.split("\n")[-1].count("\t") + 1
    assert last_line_fields < 40
    assert failure["detail"] == f"1 of 200 rows unexpected, e.g. [{last_line_fields}]"


def test_data_docs_pages_for_each_failed_slice_and_the_last_good_one(layout, quarantine_run):
    docs = quarantine_run["report_path"].parent / DATA_DOCS
    expected = [f"raw_click_log-{minute(i):%Y%m%dT%H%M}.html" for i in (2, 3, 4, 5, 6, 7)]
    assert sorted(quarantine_run["first_report"]["data_docs"]) == sorted(expected)
    assert sorted(p.name for p in docs.iterdir()) == sorted(expected)
    failed = (docs / expected[1]).read_text()  # minute 3: a label of 2
    assert "Expectation Validation Result" in failed and "fa-times text-danger" in failed
    assert ">2<" in failed or "&#39;2&#39;" in failed or "'2'" in failed  # the unexpected value is shown
    passed = (docs / expected[-1]).read_text()
    assert "fa-times text-danger" not in passed and "fa-check-circle text-success" in passed


def test_validate_interval_raises_naming_each_bad_slice(layout, quarantine_run):
    error = quarantine_run["error"]
    assert error.startswith("5 raw slice(s) failed validation and were moved to quarantine")
    assert "2026-01-01 00:02" in error and "expect_column_values_to_be_between(_num_fields)" in error
    assert "2026-01-01 00:03" in error and "expect_column_values_to_be_in_set(label)" in error
    assert "2026-01-01 00:04" in error and "expect_column_values_to_match_pattern(I3)" in error
    assert "2026-01-01 00:05" in error and "expect_table_row_count_to_be_between(table): observed 0" in error
    assert "2026-01-01 00:06" in error and "expect_column_values_to_be_between(_line_terminated)" in error
    assert f"Full report: {quarantine_run['report_path']}" in error
    first = quarantine_run["first_report"]
    assert first["num_passed"] == 1
    assert first["num_rows"] == ROWS
    assert [f["minute"] for f in first["failed"]] == [minute(i).isoformat() for i in (2, 3, 4, 5, 6)]
    assert first["missing"] == [minute(8).isoformat()]


def test_second_run_succeeds_without_the_quarantined_slices(layout, quarantine_run):
    report = validate_interval(layout, quarantine_run["minutes"], quarantine_run["report_path"])
    assert report["num_slices"] == 7
    assert report["passed"] == [{"minute": minute(7).isoformat(), "rows": ROWS}]
    assert report["num_rows"] == ROWS
    assert report["failed"] == [
        {"minute": minute(i).isoformat(), "quarantined": str(layout.quarantine_minute_dir(minute(i)))}
        for i in (2, 3, 4, 5, 6)
    ]
    assert report["missing"] == [minute(8).isoformat()]
    assert json.loads(quarantine_run["report_path"].read_text()) == report


def test_a_slice_changed_after_it_passed_is_validated_again(layout, tmp_path):
    assert validate_interval(layout, [minute(9)], tmp_path / "first.json")["num_passed"] == 1
    assert (layout.raw_minute_dir(minute(9)) / VALIDATED_MARKER).exists()
    _replace_field(layout, 9, line=0, field=0, value="2")  # the marker's checksum no longer matches
    with pytest.raises(
        DataValidationError, match=r"(?s)1 raw slice\(s\) failed.*2026-01-01 00:09.*be_in_set\(label\)"
    ):
        validate_interval(layout, [minute(9)], tmp_path / "second.json")
    assert (layout.quarantine_minute_dir(minute(9)) / RAW_FILE).exists()


def test_an_interval_without_slices_says_to_generate(tmp_path):
    layout = Layout(tmp_path)
    report_path = tmp_path / "report.json"
    with pytest.raises(
        DataValidationError,
        match=r"no valid raw slices in the interval \(3 missing, 0 quarantined\): "
        r"expected minute partitions under "
        + re.escape(str(tmp_path / "raw"))
        + r"; run `ctr generate` \(criteo\) or `ctr ingest --spec NAME FILE\.\.\.`",
    ):
        validate_interval(layout, [minute(i) for i in range(3)], report_path)
    assert json.loads(report_path.read_text())["missing"] == [minute(i).isoformat() for i in range(3)]


SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
REAL_SAMPLES = {"criteo": "criteo_sample_deepctr.txt", "avazu": "avazu_sample_deepctr.txt",
                "taobao": "taobao_ad_tiny_fuxictr_train.csv"}


def _ingested(tmp_path, preset: str):
    from components.feature_spec import load_spec
    from components.ingest import ingest

    source = SHARED_DATA / REAL_SAMPLES[preset]
    if not source.is_file():
        pytest.skip(f"the real {preset} sample is read from {source}, which is absent (../shared is not beside the "
                    "checkout)")
    spec = load_spec(preset)
    layout = Layout(tmp_path)
    report = ingest(spec, [source], layout, **({} if spec.timestamp else {"start": "2026-01-01T00:00",
                                                                            "rows_per_minute": 50}))
    minutes = list(Interval.parse(report.first_minute, report.end_minute).minutes())
    return spec, layout, minutes


@pytest.mark.parametrize("preset", sorted(REAL_SAMPLES))
def test_each_presets_real_sample_passes_the_suite_generated_from_its_spec(tmp_path, preset):
    from components.validation import click_log_dataset

    spec, layout, minutes = _ingested(tmp_path, preset)
    dataset = click_log_dataset(spec)
    report = validate_interval(layout, minutes, tmp_path / "report.json", dataset=dataset)
    expected_rows = {"criteo": 200, "avazu": 100, "taobao": 100}[preset]
    assert (report["num_rows"], report["failed"]) == (expected_rows, [])
    assert report["suite_version"] == dataset.suite_version == raw_click_log_checks_version(spec)


def test_a_taobao_slice_with_a_bad_time_stamp_and_garbage_ids_is_quarantined_naming_both(tmp_path):
    from components.validation import click_log_dataset

    spec, layout, minutes = _ingested(tmp_path, "taobao")
    path = layout.raw_minute_dir(minutes[0]) / spec.source.file_name
    lines = path.read_bytes().split(b"\n")
    fields = lines[1].split(b",")
    fields[1] = b"06/05/2017"  # time_stamp in another format
    lines[1] = b",".join(fields)
    fields = lines[2].split(b",")
    fields[4] = b"\x00\xff\xfe"  # pid: binary garbage, not UTF-8
    lines[2] = b",".join(fields)
    damaged = b"\n".join(lines)
    path.write_bytes(damaged)
    with pytest.raises(DataValidationError, match=r"(?s)match_pattern\(time_stamp\).*\['06/05/2017'\]"
                                                  r".*match_pattern\(pid\)"):
        validate_interval(layout, minutes, tmp_path / "report.json", dataset=click_log_dataset(spec))
    quarantined = layout.quarantine_minute_dir(minutes[0]) / spec.source.file_name
    assert quarantined.read_bytes() == damaged


def test_a_partition_quarantined_twice_keeps_both_deliveries_bytes(tmp_path):
    """The same minute delivered twice, bad both times: the second quarantine goes beside the first (.2),
    neither's bytes are changed or dropped, and each has its own report."""
    layout = Layout(tmp_path)
    generate(GenerateConfig(start="2026-01-01T00:00", minutes=1, rows_per_minute=20, seed=5), layout)
    raw = layout.raw_minute_dir(START) / RAW_FILE
    deliveries = []
    for label in ("7", "9"):
        lines = raw.read_text().splitlines(keepends=True)
        lines[0] = label + lines[0][lines[0].index("\t"):]
        raw.write_text("".join(lines))
        deliveries.append(raw.read_bytes())
        with pytest.raises(DataValidationError, match=r"1 raw slice\(s\) failed"):
            validate_interval(layout, [START], tmp_path / f"report-{label}.json")
        if label == "7":  # delivered again: the same partition, fresh bytes
            layout.raw_minute_dir(START).mkdir(parents=True)
            raw.write_bytes(deliveries[0])
            (layout.raw_minute_dir(START) / SUCCESS_MARKER).touch()
    first = layout.quarantine_minute_dir(START)
    second = first.with_name(first.name + ".2")
    assert (first / RAW_FILE).read_bytes() == deliveries[0]
    assert (second / RAW_FILE).read_bytes() == deliveries[1]
    for directory in (first, second):
        report = json.loads((directory / "report.json").read_text())
        assert report["source"] == str(layout.raw_minute_dir(START))
        assert any(f["column"] == "label" for f in report["failures"]), report["failures"]
    assert not layout.raw_minute_dir(START).exists()
    assert not list(first.parent.glob(".*moving"))


def test_the_data_docs_page_of_a_missing_label_shows_it_as_null(tmp_path, caplog):
    import logging

    from components.validation import SliceValidator, click_log_dataset, data_docs_html

    generate(GenerateConfig(start=minute(0).isoformat(), minutes=1, rows_per_minute=50), Layout(tmp_path))
    path = Layout(tmp_path).raw_minute_dir(minute(0)) / RAW_FILE
    lines = path.read_text().splitlines()
    lines[3] = "\t".join([""] + lines[3].split("\t")[1:])  # the label left empty
    path.write_text("\n".join(lines) + "\n")
    validator = SliceValidator(click_log_dataset(load_spec("criteo")))
    result, _ = validator.validate(minute(0), path)
    assert not result.success
    with caplog.at_level(logging.ERROR):
        page = data_docs_html(validator.last_result)
    assert "boolean value of NA" not in caplog.text  # the renderer used to fail on pandas' NA and drop the table
    assert "expect_column_values_to_not_be_null" in page or "values must never be null" in page
    assert ">null<" in page


# Batches: months of minutes, few of them with rows, validated many partitions to a suite run.
SPARSE_MINUTES = 300
SPARSE_ROWS = 2
BAD = (17, 241)


@pytest.fixture(scope="module")
def sparse_run(tmp_path_factory):
    """300 two-row minutes, a third of them deleted (empty minutes), minutes 17 and 241 damaged, validated once
    over 330 minutes, with the suite runs counted."""
    import components.validation as validation

    layout = Layout(tmp_path_factory.mktemp("sparse"))
    generate(GenerateConfig(start=START.isoformat(), minutes=SPARSE_MINUTES, rows_per_minute=SPARSE_ROWS, seed=11),
             layout)
    for index in range(0, SPARSE_MINUTES, 3):
        shutil.rmtree(layout.raw_minute_dir(minute(index)))
    _replace_field(layout, 17, line=1, field=0, value="2")  # a label of 2
    truncated = _raw(layout, 241)
    truncated.write_bytes(truncated.read_bytes()[:-30])  # the writer died mid-line
    damaged = {i: _raw(layout, i).read_bytes() for i in BAD}
    runs = {"batch": 0, "alone": []}
    batch_passes, validate = validation.SliceValidator.batch_passes, validation.SliceValidator.validate

    def counted_batch(self, frame):
        runs["batch"] += 1
        return batch_passes(self, frame)

    def counted_alone(self, at, path):
        runs["alone"].append(at)
        return validate(self, at, path)

    progress = []
    patch = pytest.MonkeyPatch()
    patch.setattr(validation.SliceValidator, "batch_passes", counted_batch)
    patch.setattr(validation.SliceValidator, "validate", counted_alone)
    report_path = layout.validation_report(Interval(START, minute(330)))
    try:
        with pytest.raises(DataValidationError) as raised:
            validate_interval(layout, [minute(i) for i in range(330)], report_path,
                              progress=lambda *args: progress.append(args), docs_dir=report_path.parent / DATA_DOCS)
    finally:
        patch.undo()
    return {"layout": layout, "error": str(raised.value), "report": json.loads(report_path.read_text()),
            "runs": runs, "progress": progress, "damaged": damaged}


def test_sparse_minutes_only_the_bad_ones_are_quarantined_and_each_is_reported_for_its_minute(sparse_run):
    layout, report = sparse_run["layout"], sparse_run["report"]
    present = [i for i in range(SPARSE_MINUTES) if i % 3]
    good = [i for i in present if i not in BAD]
    assert [f["minute"] for f in report["failed"]] == [minute(i).isoformat() for i in BAD]
    assert report["passed"] == [{"minute": minute(i).isoformat(), "rows": SPARSE_ROWS} for i in good]
    assert report["missing"] == [minute(i).isoformat() for i in range(330) if i not in present]
    assert (report["num_slices"], report["num_rows"]) == (330, SPARSE_ROWS * len(good))
    for index, data in sparse_run["damaged"].items():
        assert (layout.quarantine_minute_dir(minute(index)) / RAW_FILE).read_bytes() == data
        assert not layout.raw_minute_dir(minute(index)).exists()
    assert sorted(p.parent.name for p in (layout.root / "quarantine").rglob(RAW_FILE)) == ["minute=0017",
                                                                                          "minute=0401"]
    for index in good:
        assert (layout.raw_minute_dir(minute(index)) / VALIDATED_MARKER).exists()
    label = json.loads((layout.quarantine_minute_dir(minute(17)) / "report.json").read_text())
    assert [(f["expectation"], f["column"]) for f in label["failures"]] == [("expect_column_values_to_be_in_set",
                                                                              "label")]
    assert label["failures"][0]["detail"] == "1 of 2 rows unexpected, e.g. ['2']"
    cut = json.loads((layout.quarantine_minute_dir(minute(241)) / "report.json").read_text())
    assert ("expect_column_values_to_be_between", "_line_terminated") in [(f["expectation"], f["column"])
                                                                          for f in cut["failures"]]
    error = sparse_run["error"]
    assert error.startswith("2 raw slice(s) failed validation") and "00:17" in error and "04:01" in error


def test_sparse_minutes_cost_a_few_suite_runs_not_one_a_minute(sparse_run):
    runs, present = sparse_run["runs"], [i for i in range(SPARSE_MINUTES) if i % 3]
    # One run over the 200 partitions fails; each failing part is split in halves (two runs) until parts of at
    # most ONE_BY_ONE_AT partitions, whose partitions are validated alone: about 2 log2(n) runs a bad minute.
    assert runs["batch"] <= 1 + 2 * len(BAD) * 6
    assert all(minute(i) in runs["alone"] for i in BAD)
    # Alone: the partitions of the failing parts, and the last one passed once more for its Data Docs page.
    assert len(runs["alone"]) <= len(BAD) * ONE_BY_ONE_AT + 1
    assert runs["batch"] + len(runs["alone"]) < len(present) / 5


def test_sparse_minutes_progress_counts_partitions_not_minutes(sparse_run):
    progress = sparse_run["progress"]
    assert progress[-1] == (200, 200, SPARSE_ROWS * 198)
    assert [done for done, _, _ in progress] == sorted(done for done, _, _ in progress)


def test_a_change_no_check_reads_keeps_slices_validated(layout, tmp_path, monkeypatch):
    """min_count is in the spec's hash, not in what validation checks: a run with another min_count trusts the
    markers; a spec that checks a column otherwise validates again."""
    import dataclasses

    import yaml

    import components.validation as validation
    from components.feature_spec import FeatureDefaults, spec_from_dict
    from components.validation import click_log_dataset

    criteo = load_spec("criteo")
    rare_values_kept = criteo.with_defaults(dataclasses.replace(FeatureDefaults.of(), min_count=2))
    assert rare_values_kept.hash() != criteo.hash()
    assert click_log_dataset(rare_values_kept).suite_version == click_log_dataset(criteo).suite_version
    validate_interval(layout, [minute(0), minute(1)], tmp_path / "first.json", dataset=click_log_dataset(criteo))

    def fail(*args, **kwargs):
        raise AssertionError("validated again")

    with monkeypatch.context() as patch:
        patch.setattr(validation, "SliceValidator", fail)
        again = validate_interval(layout, [minute(0), minute(1)], tmp_path / "again.json",
                                  dataset=click_log_dataset(rare_values_kept))
    assert (again["num_passed"], again["num_validated_before"]) == (2, 2)

    data = yaml.safe_load((Path(validation.__file__).parent / "feature_specs" / "criteo.yaml").read_text())
    data["features"][1] = {"names": data["features"][1]["names"], "kind": "categorical", "dtype": "int"}
    ids_as_integers = spec_from_dict(data)
    assert click_log_dataset(ids_as_integers).suite_version != click_log_dataset(criteo).suite_version
    # C1..C26 are hex strings: as integer ids they fail, so the slices are validated again and quarantined.
    with pytest.raises(DataValidationError, match=r"(?s)2 raw slice\(s\).*match_pattern\(C1\)"):
        validate_interval(layout, [minute(0), minute(1)], tmp_path / "third.json",
                          dataset=click_log_dataset(ids_as_integers))


HEADER_SPEC = """\
name: ratings
source: {format: csv, header: true}
label: {column: liked}
features:
  - {name: ts, kind: timestamp, format: unix_seconds}
  - {names: [user, item], kind: categorical, dtype: int}
  - {name: age, kind: dense}
  - {name: genres, kind: multi_categorical, separator: "|", max_length: 4}
"""
HEADER = b"user,item,liked,ts,age,genres\n"
GOOD = b"1,10,1,1767225600,31,Drama|Crime\n2,11,0,1767225601,,Comedy\n"


@pytest.mark.parametrize("spec_name", ["criteo", "ratings"])
def test_partitions_read_together_read_as_each_alone(tmp_path, spec_name):
    """read_raw_slices_arrow gives, for each partition, the rows read_raw_slice_arrow gives it alone (and the same
    read error), well-formed and damaged partitions mixed."""
    import pandas as pd

    from components.feature_spec import spec_from_dict
    from components.validation import PartitionReadError, read_raw_slices_arrow

    if spec_name == "criteo":
        spec = load_spec("criteo")
        generate(GenerateConfig(start="2026-01-01T00:00", minutes=1, rows_per_minute=6, seed=2), Layout(tmp_path))
        data = next(tmp_path.rglob(RAW_FILE)).read_bytes()
        lines = data.split(b"\n")
        files = {"good": data, "good again": b"\n".join(lines[3:]), "unterminated": data[:-1],
                 "cut short": data[:-20], "short line": b"\n".join([lines[0], b"0\t3", *lines[1:]]),
                 "empty": b"", "empty line": b"\n" + data, "not utf-8": data.replace(b"\t", b"\t\xff", 1),
                 "carriage return": data.replace(b"\n", b"\r\n", 1), "last good": b"\n".join(lines[:2]) + b"\n"}
    else:
        import yaml

        spec = spec_from_dict(yaml.safe_load(HEADER_SPEC))
        files = {"good": HEADER + GOOD, "unterminated": HEADER + GOOD[:-1], "header only": HEADER, "empty": b"",
                 "other header": b"user,item,liked,ts,genres,age\n" + GOOD,
                 "missing column": b"user,item,liked,ts\n1,2,1,3\n", "extra field": HEADER + b"1,2,1,3,4,5,6\n",
                 "quoted": HEADER + b'1,10,1,1767225600,31,"Drama"\n',
                 "not utf-8": HEADER + GOOD.replace(b"D", b"\xff"),
                 "last good": HEADER + GOOD + GOOD}
    paths = []
    for index, (name, content) in enumerate(files.items()):
        path = tmp_path / f"{index:02d}-{name.replace(' ', '_')}"
        path.write_bytes(content)
        paths.append(path)
    frame, spans = read_raw_slices_arrow(paths, spec)
    for path, span in zip(paths, spans, strict=True):
        try:
            alone = read_raw_slice_arrow(path, spec=spec)
        except PartitionReadError as err:
            assert isinstance(span, PartitionReadError) and (span.check, span.detail) == (err.check, err.detail)
            continue
        assert isinstance(span, tuple), path.name
        pd.testing.assert_frame_equal(frame.iloc[span[0]:span[1]].reset_index(drop=True), alone, obj=path.name)
    assert sorted(s for s in spans if isinstance(s, tuple)) == sorted(  # every row belongs to one partition
        {s for s in spans if isinstance(s, tuple)})
    assert sum(s[1] - s[0] for s in spans if isinstance(s, tuple)) == len(frame)
    # The well-formed ones were read together, ahead of those read alone: the last file's rows are not last.
    assert spans[-1][0] < max(s[0] for s in spans if isinstance(s, tuple))


def test_event_streams_a_bad_click_minute_is_found_in_its_batch_and_impressions_go_one_by_one(tmp_path):
    """The clicks' suite (per-row checks) runs over many minutes at once; the impressions' (a share of rows
    may be null) cannot, and is run a minute at a time. Either way only the bad minute is quarantined."""
    import pyarrow.parquet as pq

    from components.config import EventsConfig
    from components.event_validation import stream_dataset
    from components.events import CLICKS, EVENT_FILE, IMPRESSIONS, TS, generate_events
    from components.validation import SliceValidator

    spec = load_spec("events")
    clicks_dataset, impressions_dataset = stream_dataset(CLICKS, spec), stream_dataset(IMPRESSIONS, spec)

    layout = Layout(tmp_path)
    generate_events(GenerateConfig(start=START.isoformat(), minutes=12, rows_per_minute=40, seed=5), EventsConfig(),
                    layout)
    assert SliceValidator(clicks_dataset).validates_batches
    assert not SliceValidator(impressions_dataset).validates_batches
    minutes = [minute(i) for i in range(12)]
    clicked = [i for i in range(12) if pq.read_table(layout.raw_events_minute_dir(CLICKS, minute(i)) / EVENT_FILE)
               .num_rows]
    bad = clicked[len(clicked) // 2]
    path = layout.raw_events_minute_dir(CLICKS, minute(bad)) / EVENT_FILE
    table = pq.read_table(path)
    late = table.column(TS).to_numpy().copy()
    late[0] += 120_000  # a click filed two minutes before its time
    pq.write_table(table.set_column(table.schema.get_field_index(TS), TS, [late]), path)
    with pytest.raises(DataValidationError, match=rf"(?s)1 clicks partition\(s\) failed.*{minute(bad):%H:%M}"):
        validate_interval(layout, minutes, tmp_path / "clicks.json", dataset=clicks_dataset)
    report = json.loads((tmp_path / "clicks.json").read_text())
    assert [f["minute"] for f in report["failed"]] == [minute(bad).isoformat()]
    assert report["num_passed"] == 11 and report["missing"] == []
    assert sorted(p.parent.name for p in (tmp_path / "quarantine").rglob(EVENT_FILE)) == [f"minute={minute(bad):%H%M}"]
    impressions = validate_interval(layout, minutes, tmp_path / "impressions.json", dataset=impressions_dataset)
    assert (impressions["num_passed"], impressions["failed"]) == (12, [])


def test_a_marker_cut_short_by_a_crash_means_validate_again(tmp_path):
    layout = Layout(tmp_path)
    generate(GenerateConfig(start=START.isoformat(), minutes=2, rows_per_minute=20, seed=8), layout)
    first = validate_interval(layout, [minute(0), minute(1)], tmp_path / "first.json")
    assert first["num_validated_before"] == 0
    (layout.raw_minute_dir(minute(0)) / VALIDATED_MARKER).write_text("")  # renamed in, its bytes never synced
    (layout.raw_minute_dir(minute(1)) / VALIDATED_MARKER).write_text('{"sha256": "x"')
    again = validate_interval(layout, [minute(0), minute(1)], tmp_path / "again.json")
    assert (again["num_passed"], again["num_validated_before"], again["num_rows"]) == (2, 0, 40)
    marker = json.loads((layout.raw_minute_dir(minute(0)) / VALIDATED_MARKER).read_text())
    assert (marker["sha256"], marker["num_rows"]) == (file_sha256(_raw(layout, 0)), 20)
    assert not list(layout.raw_minute_dir(minute(0)).glob(".*.tmp"))


def _header_partitions(layout: Layout, spec, contents: list[bytes]) -> list[datetime]:
    minutes = []
    for index, content in enumerate(contents):
        directory = layout.raw_minute_dir(minute(index))
        directory.mkdir(parents=True)
        (directory / spec.source.file_name).write_bytes(content)
        minutes.append(minute(index))
    return minutes


def _ratings_spec(reads: str = "age"):
    import yaml

    from components.feature_spec import spec_from_dict

    return spec_from_dict(yaml.safe_load(HEADER_SPEC.replace("{name: age,", f"{{name: {reads},")))


def _partition_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("part-*"))


def test_a_spec_reading_a_column_no_partition_holds_is_refused_with_nothing_moved(tmp_path):
    """A misspelt column in the spec: every partition would fail its header check and go to quarantine; the
    interval's check names the spec's column, the closest one the partitions hold, and moves nothing."""
    from components.validation import SpecColumnsError, click_log_dataset

    spec = _ratings_spec("agee")
    layout = Layout(tmp_path / "data")
    minutes = _header_partitions(layout, spec, [HEADER + GOOD] * 3 + [b""])  # an empty file has no names
    before = _partition_files(layout.root)
    report_path = tmp_path / "report.json"
    with pytest.raises(SpecColumnsError) as raised:
        validate_interval(layout, minutes, report_path, dataset=click_log_dataset(spec))
    message = str(raised.value)
    assert "feature spec 'ratings' reads column(s) ['agee']" in message
    assert "none of the 3 raw slices of 2026-01-01 00:00..2026-01-01 00:03" in message
    assert "did you mean 'age'?" in message and "user, item, liked, ts, age, genres" in message
    assert isinstance(raised.value, DataValidationError)  # the DAG's validate step fails the same way
    assert _partition_files(layout.root) == before and not (layout.root / "quarantine").exists()
    assert not list(layout.root.rglob(VALIDATED_MARKER))
    report = json.loads(report_path.read_text())
    assert (report["num_passed"], report["failed"], report["spec_error"]) == (0, [], message)
    # The spec fixed, the same partitions pass where they are.
    with pytest.raises(DataValidationError, match=r"(?s)1 raw slice\(s\) failed.*is empty"):
        validate_interval(layout, minutes, tmp_path / "fixed.json", dataset=click_log_dataset(_ratings_spec()))
    fixed = json.loads((tmp_path / "fixed.json").read_text())
    assert (fixed["num_passed"], fixed["num_rows"], len(fixed["failed"])) == (3, 6, 1)


def test_a_column_some_partitions_hold_quarantines_only_the_others(tmp_path):
    """A column that one partition of three holds is the spec's to read: the two without it are the data's
    error and go to quarantine, as does a single partition without it (one alone cannot tell the two apart)."""
    from components.validation import click_log_dataset

    spec = _ratings_spec()
    layout = Layout(tmp_path / "data")
    lost = b"user,item,liked,ts,genres\n1,10,1,1767225600,Drama\n"
    minutes = _header_partitions(layout, spec, [lost, HEADER + GOOD, lost])
    with pytest.raises(DataValidationError, match=r"(?s)2 raw slice\(s\) failed.*lacks columns \['age'\]"):
        validate_interval(layout, minutes, tmp_path / "report.json", dataset=click_log_dataset(spec))
    assert [p.split("/")[1:3] for p in _partition_files(layout.root / "quarantine")] == [
        ["date=2026-01-01", "minute=0000"], ["date=2026-01-01", "minute=0002"]]

    alone = Layout(tmp_path / "alone")
    _header_partitions(alone, _ratings_spec("agee"), [HEADER + GOOD])
    with pytest.raises(DataValidationError, match=r"1 raw slice\(s\) failed") as raised:
        validate_interval(alone, [minute(0)], tmp_path / "alone.json", dataset=click_log_dataset(_ratings_spec("agee")))
    assert "spec_error" not in json.loads((tmp_path / "alone.json").read_text())
    assert len(_partition_files(alone.root / "quarantine")) == 1, raised.value


def test_a_headerless_layout_has_no_names_to_check_and_reads_one_header_when_the_spec_is_right(tmp_path,
                                                                                                  monkeypatch):
    from components import validation
    from components.validation import check_spec_columns, click_log_dataset, raw_partition_columns

    criteo = load_spec("criteo")
    generate(GenerateConfig(start="2026-01-01T00:00", minutes=2, rows_per_minute=5, seed=4), Layout(tmp_path))
    assert raw_partition_columns(next(tmp_path.rglob(RAW_FILE)), criteo) is None  # columns by position
    spec = _ratings_spec()
    layout = Layout(tmp_path / "data")
    minutes = _header_partitions(layout, spec, [HEADER + GOOD] * 4)
    dataset = click_log_dataset(spec)
    reads = []
    monkeypatch.setattr(validation, "raw_partition_columns", lambda path, s: reads.append(path) or HEADER_NAMES)
    paths = [layout.raw_minute_dir(m) / spec.source.file_name for m in minutes]
    assert check_spec_columns(dataset, paths, "the day") is None and len(reads) == 1


HEADER_NAMES = HEADER.decode().strip().split(",")


def test_impressions_without_a_column_the_spec_reads_are_refused_before_their_suite(tmp_path):
    """The impressions' footers are read: a spec column none of them holds is the spec's error, with the
    stream's columns listed; the clicks are not checked against the spec (it reads none of theirs)."""
    import dataclasses

    from components.config import EventsConfig
    from components.event_validation import stream_dataset
    from components.events import CLICKS, IMPRESSIONS, KEY_SCHEMA, generate_events
    from components.feature_spec import CategoricalFeature
    from components.validation import SpecColumnsError

    spec = load_spec("events")
    categorical = next(f for f in spec.features if isinstance(f, CategoricalFeature) and not f.derived_from
                       and f.column not in KEY_SCHEMA.names)  # a column of the spec's, not one of the join's keys
    misspelt = dataclasses.replace(spec, features=tuple(
        dataclasses.replace(f, column=f.column + "_id") if f is categorical else f for f in spec.features))
    layout = Layout(tmp_path)
    generate_events(GenerateConfig(start=START.isoformat(), minutes=3, rows_per_minute=20, seed=5), EventsConfig(),
                    layout)
    minutes = [minute(i) for i in range(3)]
    with pytest.raises(SpecColumnsError, match=rf"reads column\(s\) \['{categorical.column}_id'\] that none of the "
                                               r"3 impressions partitions"):
        validate_interval(layout, minutes, tmp_path / "impressions.json",
                          dataset=stream_dataset(IMPRESSIONS, misspelt))
    assert not (tmp_path / "quarantine").exists()
    clicks = validate_interval(layout, minutes, tmp_path / "clicks.json", dataset=stream_dataset(CLICKS, misspelt))
    assert clicks["num_passed"] == 3


def test_the_cli_says_the_specs_error_without_a_traceback(tmp_path, capsys):
    """`ctr-pipeline run daily` with a misspelt column: exit status 1, one line naming the column, nothing moved."""
    from pipelines.cli import main as ctr

    spec_path = tmp_path / "ratings.yaml"
    spec_path.write_text(HEADER_SPEC.replace("{name: age,", "{name: agee,"))
    layout = Layout(tmp_path / "data")
    _header_partitions(layout, _ratings_spec(), [HEADER + GOOD] * 2)
    code = ctr(["run", "daily", "--spec", str(spec_path), "--set", f"paths.data_root={layout.root}",
                "--start", "2026-01-01T00:00", "--end", "2026-01-01T00:02"])
    error = capsys.readouterr().err
    assert code == 1
    assert error.strip().splitlines()[-1].startswith(
        "ctr-pipeline: validation: feature spec 'ratings' reads column(s) ['agee'] that none of the 2 raw slices")
    assert "Traceback" not in error and not (layout.root / "quarantine").exists()
