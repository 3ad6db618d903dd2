from __future__ import annotations

import csv
import hashlib
from datetime import UTC, datetime
from pathlib import Path

import pytest

from components.feature_spec import load_spec, spec_from_dict
from components.ingest import IngestError, coarser_than_a_minute, ingest, parse_timestamp
from components.layout import Layout
from pipelines.cli import main as ctr
from tests.real_samples import SAMPLES, SHARED_DATA

pytestmark = pytest.mark.unit



def _sample(name: str) -> Path:
    path = SHARED_DATA / SAMPLES[name]
    if not path.is_file():
        pytest.skip(f"the real {name} sample is read from {path}, which is absent (../shared is not beside the "
                    "checkout); it is never copied into the project")
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _partitions(root: Path) -> dict[str, Path]:
    return {f"{p.parent.parent.name[5:]}T{p.parent.name[7:9]}:{p.parent.name[9:]}": p
            for p in sorted((root / "raw" / "click_log").glob("date=*/minute=*/part-00000.*"))}


def _rows(path: Path, delimiter: str, header: bool) -> list[list[str]]:
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle, delimiter=delimiter))
    return rows[1:] if header else rows


def test_avazu_hours_are_spread_evenly_over_their_minutes(tmp_path):
    source = _sample("avazu")
    before = _sha(source)
    report = ingest(load_spec("avazu"), [source], Layout(tmp_path))
    assert _sha(source) == before  # input files are only read
    assert (report.rows_read, report.rows_written, report.rejected) == (100, 100, 0)
    # All 100 rows are in the first hour of 2014-10-21: 100 rows over 60 minutes, in file order.
    parts = _partitions(tmp_path)
    assert len(parts) == 60 and (report.first_minute, report.end_minute) == ("2014-10-21T00:00", "2014-10-21T01:00")
    sizes = [len(_rows(p, ",", True)) for p in parts.values()]
    assert sorted(set(sizes)) == [1, 2] and sum(sizes) == 100
    first = _rows(parts["2014-10-21T00:00"], ",", True)
    original = _rows(source, ",", True)
    assert first == original[:len(first)]
    header = next(csv.reader(open(parts["2014-10-21T00:00"])))
    assert header[:3] == ["id", "click", "hour"]
    assert all((p.parent / "_SUCCESS").is_file() for p in parts.values())


def test_taobao_rows_go_to_the_minute_of_their_time_stamp_with_their_click_sequence(tmp_path):
    source = _sample("taobao")
    report = ingest(load_spec("taobao"), [source], Layout(tmp_path))
    assert report.rows_written == 100 and report.rejected == 0
    parts = _partitions(tmp_path)
    assert list(parts) == ["2017-05-06T00:00"]
    rows = _rows(parts["2017-05-06T00:00"], ",", True)
    sequences = [r[-1] for r in rows]
    # The first row's click sequence, two ad groups joined by '^', as the source file has it (read from there, so
    # that no value of the sample is written into the repository).
    assert sequences[0] == _rows(source, ",", True)[0][-1] and sequences[0].count("^") == 1
    assert sum("^" in s for s in sequences) == 10  # ten rows of the sample have two or more clicked ad groups
    assert rows == _rows(source, ",", True)


def test_criteo_csv_with_a_header_becomes_headerless_tsv_placed_by_row_order(tmp_path):
    source = _sample("criteo")
    report = ingest(load_spec("criteo"), [source], Layout(tmp_path), start="2026-01-01T00:00", rows_per_minute=50)
    parts = _partitions(tmp_path)
    assert list(parts) == ["2026-01-01T00:00", "2026-01-01T00:01", "2026-01-01T00:02", "2026-01-01T00:03"]
    assert report.end_minute == "2026-01-01T00:04"
    written = [row for p in parts.values() for row in _rows(p, "\t", False)]
    assert written == _rows(source, ",", True)
    assert all(len(row) == 40 for row in written)


def test_malformed_lines_are_kept_with_their_file_and_line_number_and_the_rest_is_written(tmp_path):
    spec = spec_from_dict({
        "name": "team", "source": {"format": "csv", "header": True}, "label": "clicked",
        "features": [{"name": "when", "kind": "timestamp", "format": "unix_seconds"},
                     {"name": "item", "kind": "categorical"}, {"name": "price", "kind": "dense"}],
    })
    log = tmp_path / "log.csv"
    log.write_text("clicked,when,item,price\n"
                   "1,1767225600,a,3.5\n"        # 2026-01-01T00:00
                   "0,1767225661,b\n"            # too few fields
                   "2,1767225662,c,1\n"          # label outside 0/1
                   "0,1767225663,d,cheap\n"      # not a number
                   "0,yesterday,e,1\n"           # timestamp does not parse
                   "0,1767225690,f,\n")          # 00:01; an empty price is a missing value
    report = ingest(spec, [log], Layout(tmp_path / "var"))
    assert (report.rows_read, report.rows_written, report.rejected) == (6, 2, 4)
    assert report.rejects_by_reason == {"expected 4 fields, got 3": 1, "label": 1, "number": 1, "timestamp": 1}
    rejects = _rows(Path(report.rejects_file), "\t", True)
    assert [(Path(r[0]).name, r[1]) for r in rejects] == [("log.csv", "3"), ("log.csv", "4"), ("log.csv", "5"),
                                                          ("log.csv", "6")]
    assert rejects[2][2] == "number: price='cheap' is not a number" and rejects[2][3] == "0,1767225663,d,cheap"
    parts = _partitions(tmp_path / "var")
    assert list(parts) == ["2026-01-01T00:00", "2026-01-01T00:01"]
    assert _rows(parts["2026-01-01T00:01"], ",", True) == [["0", "1767225690", "f", ""]]


def test_ingesting_again_is_a_no_op_and_other_data_for_a_written_minute_is_refused(tmp_path):
    spec = spec_from_dict({"name": "team", "source": {"format": "tsv", "columns": ["y", "x"]}, "label": "y",
                           "features": [{"name": "x", "kind": "categorical"}]})
    log = tmp_path / "log.tsv"
    log.write_text("1\ta\n0\tb\n0\tc\n")
    layout = Layout(tmp_path / "var")
    first = ingest(spec, [log], layout, start="2026-01-01T00:00", rows_per_minute=2)
    assert (first.minutes_written, first.minutes_unchanged) == (2, 0)
    partition = next(iter(_partitions(layout.root).values()))
    before = partition.stat().st_mtime_ns
    again = ingest(spec, [log], layout, start="2026-01-01T00:00", rows_per_minute=2)
    assert (again.minutes_written, again.minutes_unchanged) == (0, 2)
    assert partition.stat().st_mtime_ns == before
    other = tmp_path / "other.tsv"
    other.write_text("0\tz\n")
    with pytest.raises(IngestError, match=r"minute 2026-01-01T00:00 already holds other data"):
        ingest(spec, [other], layout, start="2026-01-01T00:00", rows_per_minute=2)
    assert partition.read_text() == "1\ta\n0\tb\n"


def test_input_that_cannot_be_placed_is_a_clear_error(tmp_path):
    log = tmp_path / "log.csv"
    log.write_text("click,hour,C1\n1,14102203,a\n")
    with pytest.raises(IngestError, match=r"columns \['banner_pos', .*\] that spec 'avazu' reads are not in the file"):
        ingest(load_spec("avazu"), [log], Layout(tmp_path))
    with pytest.raises(IngestError, match=r"spec 'criteo' has no timestamp column, so rows are placed by their "
                                          r"order: give --start"):
        ingest(load_spec("criteo"), [log], Layout(tmp_path))
    with pytest.raises(IngestError, match=r"--start applies to specs without a timestamp column"):
        ingest(load_spec("avazu"), [log], Layout(tmp_path), start="2026-01-01T00:00")
    with pytest.raises(IngestError, match=r"--start '2026-01-01T00:00:30': minute .* must start on a whole minute"):
        ingest(load_spec("criteo"), [log], Layout(tmp_path), start="2026-01-01T00:00:30")
    with pytest.raises(IngestError, match=r"input file '.*missing.csv' does not exist"):
        ingest(load_spec("avazu"), [tmp_path / "missing.csv"], Layout(tmp_path))


def test_timestamps_in_each_format():
    spec = load_spec("avazu")
    assert parse_timestamp("14102113", spec.timestamp) == datetime(2014, 10, 21, 13, tzinfo=UTC)
    assert coarser_than_a_minute(spec.timestamp)
    taobao = load_spec("taobao").timestamp
    assert parse_timestamp("2017-05-06 08:09:10", taobao) == datetime(2017, 5, 6, 8, 9, 10, tzinfo=UTC)
    assert not coarser_than_a_minute(taobao)
    events = load_spec("events").timestamp
    assert parse_timestamp("1767225661500", events) == datetime(2026, 1, 1, 0, 1, 1, 500000, tzinfo=UTC)


def test_the_cli_ingests_and_says_what_to_run_next(tmp_path, capsys, monkeypatch):
    source = _sample("avazu")
    monkeypatch.setenv("CTR_HOME", str(tmp_path))
    assert ctr(["ingest", "--spec", "avazu", str(source)]) == 0
    out = capsys.readouterr().out
    assert "100 rows in 60 minutes [2014-10-21T00:00, 2014-10-21T01:00)" in out
    assert "next: ctr-pipeline run daily --spec avazu --start 2014-10-21T00:00 --end 2014-10-21T01:00" in out
    assert ctr(["ingest", "--spec", "criteo", str(source)]) == 2
    assert "give --start" in capsys.readouterr().err
