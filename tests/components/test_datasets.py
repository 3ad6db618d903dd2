from __future__ import annotations

import csv
import zipfile
from pathlib import Path

import pytest

from components.datasets import (
    MOVIELENS_COLUMNS,
    OBD_COLUMNS,
    WHEELS,
    DatasetError,
    fetch_dataset,
    fetch_wheel,
    movielens_rows,
    obd_rows,
)
from components.feature_spec import load_spec
from components.ingest import ingest
from components.layout import Layout
from pipelines.cli import main as ctr

pytestmark = pytest.mark.unit

INTER = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n" \
        "7\t3\t4\t881250950\n7\t2\t3\t881250949\n5\t3\t5\t881250949\n"
USER = "user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n" \
       "5\t24\tM\ttechnician\t85711\n7\t53\tF\tother\t94043\n"
ITEM = "item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n" \
       "2\tGoldenEye\t1995\tAction Adventure Thriller\n3\tFour Rooms\t1995\tThriller\n"
OBD_HEADER = ",timestamp,item_id,position,click,propensity_score,user_feature_0,user_feature_1,user_feature_2," \
             "user_feature_3,user-item_affinity_0\n"
ITEM_CONTEXT = ",item_id,item_feature_0,item_feature_1,item_feature_2,item_feature_3\n" \
               "0,0,-0.5,a1,b1,c1\n1,1,0.7,a2,b2,c2\n"


def _fake_wheels(folder: Path) -> Path:
    """Wheels of the pinned names holding tiny copies of the members the readers use (no network)."""
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / WHEELS["movielens"].file_name, "w") as archive:
        for part, text in (("inter", INTER), ("user", USER), ("item", ITEM)):
            archive.writestr(f"recbole/dataset_example/ml-100k/ml-100k.{part}", text)
    with zipfile.ZipFile(folder / WHEELS["obd"].file_name, "w") as archive:
        for policy, rows in (("random", ["0,2019-11-24 00:00:34.762830+00:00,1,3,1,0.0125,u0,u1,u2,u3,0.0\n"]),
                             ("bts", ["0,2019-11-24 00:00:10.5+00:00,0,1,0,0.2,v0,v1,v2,v3,0.0\n",
                                      "1,2019-11-24 00:01:00+00:00,9,2,0,0.2,w0,w1,w2,w3,0.0\n"])):
            archive.writestr(f"obp/dataset/obd/{policy}/all/all.csv", OBD_HEADER + "".join(rows))
            archive.writestr(f"obp/dataset/obd/{policy}/all/item_context.csv", ITEM_CONTEXT)
    return folder


def test_movielens_rows_join_attributes_label_liked_and_sort_by_time(tmp_path):
    wheel = _fake_wheels(tmp_path) / WHEELS["movielens"].file_name
    assert movielens_rows(wheel) == [
        # time, then user, then item; liked = rating >= 4; genres "|"-joined; the title left out
        ["1", "881250949", "5", "3", "24", "M", "technician", "85711", "1995", "Thriller"],
        ["0", "881250949", "7", "2", "53", "F", "other", "94043", "1995", "Action|Adventure|Thriller"],
        ["1", "881250950", "7", "3", "53", "F", "other", "94043", "1995", "Thriller"],
    ]


def test_obd_rows_join_item_context_in_whole_seconds(tmp_path):
    wheel = _fake_wheels(tmp_path) / WHEELS["obd"].file_name
    assert obd_rows(wheel, "random", "all") == [
        ["1", "1574553634", "1", "3", "u0", "u1", "u2", "u3", "0.7", "a2", "b2", "c2"]]
    both = obd_rows(wheel, "both", "all")
    # 00:00:10.5 -> 1574553610; an item the context lacks gets empty features
    assert [row[:4] for row in both] == [["0", "1574553610", "0", "1"], ["1", "1574553634", "1", "3"],
                                         ["0", "1574553660", "9", "2"]]
    assert both[2][8:] == ["", "", "", ""]
    with pytest.raises(DatasetError, match="OBD policy 'greedy' is not one of"):
        obd_rows(wheel, "greedy")


def test_fetch_wheel_uses_the_cache_and_names_a_member_it_lacks(tmp_path):
    cache = _fake_wheels(tmp_path / "cache")
    assert fetch_wheel(WHEELS["obd"], cache) == cache / "obp-0.4.1-py3-none-any.whl"
    with zipfile.ZipFile(cache / WHEELS["movielens"].file_name, "w") as archive:
        archive.writestr("recbole/__init__.py", "")
    with pytest.raises(DatasetError, match="has no member 'recbole/dataset_example/ml-100k/ml-100k.inter'"):
        movielens_rows(cache / WHEELS["movielens"].file_name)


def test_cli_fetch_writes_the_csv_the_preset_ingests_and_prints_the_next_command(tmp_path, capsys):
    cache = _fake_wheels(tmp_path / "cache")
    out = tmp_path / "data"
    assert ctr(["datasets", "fetch", "movielens", "--out", str(out), "--cache", str(cache),
                "--set", f"paths.data_root={tmp_path / 'var'}"]) == 0
    printed = capsys.readouterr().out
    expected = f"ctr-pipeline ingest --spec movielens --set paths.data_root={tmp_path / 'var'} {out / 'movielens.csv'}"
    assert f"next: {expected}\n" in printed
    with open(out / "movielens.csv", newline="") as handle:
        rows = list(csv.reader(handle))
    assert tuple(rows[0]) == MOVIELENS_COLUMNS and len(rows) == 4
    report = ingest(load_spec("movielens"), [out / "movielens.csv"], Layout(tmp_path / "var"))
    assert (report.rows_written, report.rejected, report.first_minute, report.end_minute) == \
        (3, 0, "1997-12-04T15:55", "1997-12-04T15:56")

    assert ctr(["datasets", "fetch", "obd", "--out", str(out), "--cache", str(cache)]) == 0
    with open(out / "obd-both-all.csv", newline="") as handle:
        assert tuple(next(csv.reader(handle))) == OBD_COLUMNS
    report = ingest(load_spec("obd"), [out / "obd-both-all.csv"], Layout(tmp_path / "obd"))
    assert (report.rows_written, report.rejected) == (3, 0)


def test_an_unreachable_index_is_an_error_that_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr("components.datasets.pip_command", lambda: ["false"])
    with pytest.raises(DatasetError, match=r"could not download recbole==1.2.1 from the package index \(exit 1"):
        fetch_wheel(WHEELS["movielens"], tmp_path)


@pytest.fixture(scope="module")
def real_wheels(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("wheels")
    try:
        for wheel in WHEELS.values():
            fetch_wheel(wheel, cache, timeout_s=120)
    except DatasetError as err:
        pytest.skip(f"the real datasets are fetched from the package index, which cannot be reached here: {err}")
    return cache


def test_real_movielens_and_obd_as_the_presets_read_them(real_wheels, tmp_path):
    movielens = fetch_dataset("movielens", tmp_path, cache_dir=real_wheels)
    assert (movielens.rows, movielens.positives) == (100_000, 55_375)
    assert (movielens.first_timestamp, movielens.last_timestamp) == (874724710, 893286638)
    with open(movielens.path, newline="") as handle:
        rows = list(csv.reader(handle))[1:]
    assert len({row[2] for row in rows}) == 943 and len({row[3] for row in rows}) == 1682
    assert [int(row[1]) for row in rows] == sorted(int(row[1]) for row in rows)
    first = tmp_path / "first.csv"
    first.write_text("".join(open(movielens.path).readlines()[:2001]))
    report = ingest(load_spec("movielens"), [first], Layout(tmp_path / "var"))
    assert (report.rows_written, report.rejected) == (2000, 0)

    obd = fetch_dataset("obd", tmp_path, cache_dir=real_wheels)
    assert (obd.rows, obd.positives) == (20_000, 80)  # random 38 + bts 42 clicks
    report = ingest(load_spec("obd"), [obd.path], Layout(tmp_path / "obd"))
    assert (report.rows_written, report.rejected) == (20_000, 0)
