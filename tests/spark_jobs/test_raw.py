"""extract_raw of many small partitions: read by the driver into one Arrow table, the same rows Spark reads."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import yaml

from components.config import GenerateConfig
from components.feature_spec import load_spec, spec_from_dict
from components.layout import Layout
from components.synthetic import RAW_FILE, generate
from spark_jobs import raw
from spark_jobs.raw import extract_raw, parse_raw, small_files_table

pytestmark = pytest.mark.integration

START = datetime(2026, 1, 1, tzinfo=UTC)
RATINGS = spec_from_dict(yaml.safe_load("""\
name: ratings
source: {format: csv, header: true}
label: {column: liked}
features:
  - {name: ts, kind: timestamp, format: unix_seconds, derive: [hour_of_day]}
  - {names: [user, item], kind: categorical, dtype: int}
  - {name: occupation, kind: categorical}
  - {name: age, kind: dense}
  - {name: genres, kind: multi_categorical, separator: "|", max_length: 4}
"""))
HEADER = "user,item,liked,ts,age,occupation,genres\n"


def _criteo_paths(tmp_path) -> list[str]:
    layout = Layout(tmp_path)
    generate(GenerateConfig(start=START.isoformat(), minutes=140, rows_per_minute=3, seed=4), layout)
    return sorted(str(p) for p in (tmp_path / "raw").rglob(RAW_FILE))[::2]  # every other minute: gaps


def _ratings_paths(tmp_path, count: int = 70) -> list[str]:
    layout = Layout(tmp_path)
    paths = []
    for index in range(count):
        minute = START + timedelta(days=index // 20, minutes=37 * index)
        directory = layout.raw_minute_dir(minute)
        directory.mkdir(parents=True)
        seconds = int(minute.timestamp())
        rows = [f"{index % 9},{100 + index},{index % 2},{seconds + 5},{20 + index % 40},doctor,Drama|Crime",
                f"{index % 7},{200 + index},0,{seconds + 30},,, Comedy||War "]  # empty fields, spaces kept
        (directory / RATINGS.source.file_name).write_text(HEADER + "\n".join(rows[: 1 + index % 2]) + "\n")
        paths.append(str(directory / RATINGS.source.file_name))
    return paths


@pytest.mark.parametrize("spec", [load_spec("criteo"), RATINGS], ids=["criteo", "ratings"])
def test_small_partitions_read_by_the_driver_are_the_rows_spark_reads(spark, tmp_path, monkeypatch, spec):
    from pyspark.testing import assertDataFrameEqual

    paths = _criteo_paths(tmp_path) if spec.name == "criteo" else _ratings_paths(tmp_path)
    assert small_files_table(paths, spec) is not None
    by_driver = extract_raw(spark, paths, spec)
    monkeypatch.setattr(raw, "DRIVER_READ_MIN_FILES", len(paths) + 1)  # Spark reads the files itself
    by_spark = extract_raw(spark, paths, spec)
    assert by_driver.columns == by_spark.columns == [*spec.input_columns, "minute"]
    assert by_driver.count() == (210 if spec.name == "criteo" else 105)
    assertDataFrameEqual(by_driver, by_spark)
    assertDataFrameEqual(parse_raw(by_driver, spec), parse_raw(by_spark, spec))


def test_partitions_spark_and_arrow_could_split_otherwise_are_left_to_spark(tmp_path):
    paths = _ratings_paths(tmp_path)
    assert small_files_table(paths, RATINGS).num_rows == 105
    assert small_files_table(paths[:63], RATINGS) is None  # a few files: Spark reads them well
    cases = {
        "a quote": HEADER + '1,2,1,1767225600,30,"doctor",Drama\n',
        "a missing field": HEADER + "1,2,1,1767225600,30,Drama\n",
        "another header": "item,user,liked,ts,age,occupation,genres\n1,2,1,1767225600,30,doctor,Drama\n",
        "an empty line": HEADER + "\n1,2,1,1767225600,30,doctor,Drama\n",
        "a carriage return": HEADER + "1,2,1,1767225600,30,doctor,Drama\r\n",
    }
    last = paths[-1]
    for case, text in cases.items():
        with open(last, "w") as out:
            out.write(text)
        assert small_files_table(paths, RATINGS) is None, case
