"""`ingest` reads the files teams actually have: compressed (gzip, zstd, bz2, by suffix and by first bytes, read as
streams), Parquet of any codec, several files, folders, globs and s3:// prefixes in one call; text with a
byte-order mark, CRLF line ends or another encoding; and it refuses what it cannot read with an error that says
what it found. Every input is generated here, in the Avazu layout (never a sample copied into the project)."""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import lzma
import random
import shlex
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from components.feature_spec import load_spec, spec_from_dict
from components.ingest import IngestError, ingest, visible
from components.layout import Layout
from pipelines.cli import build_parser, main

pytestmark = pytest.mark.unit

SPEC = load_spec("avazu")
ROWS = 100


def _table(label_first: bool = False) -> tuple[list[str], list[list[str]]]:
    """The Avazu layout's header and ROWS rows over two hours, some fields holding commas and quotes."""
    names = ["id", *SPEC.input_columns]  # id, click, hour, C1, ...
    if not label_first:
        assert names[1] == "click"
    else:
        names = ["click", "id", *SPEC.input_columns[1:]]
    draw = random.Random(50)
    rows = []
    for i in range(ROWS):
        row = {name: f"{name.lower()}_{draw.randrange(5)}" for name in names}
        row.update(id=str(10_000 + i), click=str(draw.randrange(2)), hour=f"1410210{i * 2 // ROWS}",
                   site_domain=f"shop, {draw.randrange(3)}", app_id=f'say "{i % 4}"')
        rows.append([row[name] for name in names])
    return names, rows


def _csv_text(label_first: bool = False, line_end: str = "\n") -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator=line_end)
    names, rows = _table(label_first)
    writer.writerow(names)
    writer.writerows(rows)
    return out.getvalue()


def _excel_csv(label_first: bool = False) -> bytes:
    """Excel's "CSV UTF-8": a byte-order mark and CRLF line ends."""
    return b"\xef\xbb\xbf" + _csv_text(label_first, "\r\n").encode()


def _partitions(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes()
            for p in sorted((root / "raw" / "click_log").glob("date=*/minute=*/part-00000.*"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, bytes]:
    """The partitions the plain CSV gives: every other shape of the same rows must give these bytes."""
    directory = tmp_path_factory.mktemp("plain")
    source = directory / "avazu.csv"
    source.write_text(_csv_text())
    report = ingest(SPEC, [source], Layout(directory / "var"))
    assert (report.rows_read, report.rows_written, report.rejected) == (ROWS, ROWS, 0)
    parts = _partitions(directory / "var")
    assert len(parts) == 100  # two hours of 50 rows, each spread over 50 of its 60 minutes
    return parts


def _ingest(tmp_path: Path, *files, spec=SPEC, **kwargs) -> dict[str, bytes]:
    report = ingest(spec, list(files), Layout(tmp_path / "var"), **kwargs)
    assert (report.rows_read, report.rows_written, report.rejected) == (ROWS, ROWS, 0)
    return _partitions(tmp_path / "var")


# ------------------------------------------------------------------ the rows of issue 50's table

def test_plain_csv_with_quoted_commas_keeps_every_field(reference):
    written = [row for data in reference.values() for row in list(csv.reader(io.StringIO(data.decode())))[1:]]
    names, rows = _table()
    assert written == rows
    assert all(next(csv.reader(io.StringIO(data.decode()))) == names for data in reference.values())
    assert any(row[names.index("site_domain")].startswith("shop, ") for row in written)


@pytest.mark.parametrize("codec", ["none", "snappy", "gzip", "zstd", "brotli", "lz4"])
def test_parquet_of_any_codec(tmp_path, reference, codec):
    names, rows = _table()
    path = tmp_path / "avazu.parquet"
    pq.write_table(pa.table({n: [r[i] for r in rows] for i, n in enumerate(names)}), path, compression=codec)
    assert _ingest(tmp_path, path) == reference


def test_excel_csv_with_a_byte_order_mark_and_crlf_writes_no_mark(tmp_path, reference):
    path = tmp_path / "avazu.csv"
    path.write_bytes(_excel_csv())
    parts = _ingest(tmp_path, path)
    assert parts == reference
    assert not any(b"\xef\xbb\xbf" in data or b"\r" in data for data in parts.values())


def test_excel_csv_with_the_label_column_first(tmp_path):
    path = tmp_path / "avazu.csv"
    path.write_bytes(_excel_csv(label_first=True))
    parts = _ingest(tmp_path, path)
    header = next(csv.reader(io.StringIO(next(iter(parts.values())).decode())))
    assert header[:2] == ["click", "id"]


@pytest.mark.parametrize("suffix, compress", [
    (".csv.gz", gzip.compress),
    (".csv.zst", lambda data: zstandard.ZstdCompressor().compress(data)),
    (".csv.bz2", bz2.compress),
    (".csv", gzip.compress),   # told by its first bytes alone
    ("", bz2.compress),
    (".csv.zstd", lambda data: zstandard.ZstdCompressor().compress(data)),
])
def test_compressed_csv_by_suffix_or_first_bytes(tmp_path, reference, suffix, compress):
    path = tmp_path / f"avazu{suffix}"
    path.write_bytes(compress(_excel_csv()))
    assert _ingest(tmp_path, path) == reference


def test_compressed_files_are_read_as_streams(tmp_path, reference, monkeypatch):
    """Several zstd frames and gzip members, as a streaming writer leaves them; nothing unpacked to disk."""
    data = _csv_text().encode()
    half = data.index(b"\n", len(data) // 2) + 1
    frames = tmp_path / "avazu.csv.zst"
    frames.write_bytes(zstandard.ZstdCompressor().compress(data[:half]) + zstandard.ZstdCompressor().compress(
        data[half:]))
    members = tmp_path / "avazu.csv.gz"
    members.write_bytes(gzip.compress(data[:half]) + gzip.compress(data[half:]))
    before = sorted(tmp_path.iterdir())
    assert _ingest(tmp_path / "a", frames) == reference
    assert _ingest(tmp_path / "b", members) == reference
    assert sorted(p for p in tmp_path.iterdir() if p.name not in ("a", "b")) == before


def test_several_files_a_folder_and_a_glob_in_one_call(tmp_path, reference):
    text = _csv_text()
    header, *lines = text.splitlines(keepends=True)
    exports = tmp_path / "exports"
    exports.mkdir()
    (exports / "part-0.csv.gz").write_bytes(gzip.compress((header + "".join(lines[:30])).encode()))
    (exports / "part-1.csv.zst").write_bytes(zstandard.ZstdCompressor().compress(
        (header + "".join(lines[30:70])).encode()))
    (exports / "part-2.csv").write_text(header + "".join(lines[70:]))
    (exports / "_SUCCESS").write_bytes(b"")
    (exports / ".part-2.csv.crc").write_bytes(b"\x00\x01")
    assert _ingest(tmp_path / "folder", exports) == reference
    assert _ingest(tmp_path / "glob", str(exports / "part-*")) == reference
    files = [exports / "part-0.csv.gz", exports / "part-1.csv.zst", exports / "part-2.csv"]
    assert _ingest(tmp_path / "files", *files) == reference
    report = ingest(SPEC, [str(exports / "*.csv.gz"), exports / "part-1.csv.zst", exports / "part-2.csv"],
                    Layout(tmp_path / "mixed"))
    assert report.files == [str(f) for f in files] and report.rows_written == ROWS
    with pytest.raises(IngestError, match=r"input '.*/nothing-\*\.csv' is a glob that matches no file"):
        ingest(SPEC, [str(exports / "nothing-*.csv")], Layout(tmp_path / "none"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(IngestError, match=r"input folder '.*empty' holds no file to ingest"):
        ingest(SPEC, [tmp_path / "empty"], Layout(tmp_path / "none"))


# ------------------------------------------------------------------ text as it comes, and what is not text

def test_the_encoding_is_the_specs(tmp_path):
    spec_yaml = {"name": "team", "source": {"format": "csv", "header": True}, "label": "clicked",
                 "features": [{"name": "when", "kind": "timestamp", "format": "unix_seconds"},
                              {"name": "city", "kind": "categorical"}]}
    path = tmp_path / "log.csv"
    path.write_bytes("clicked,when,city\r\n1,1767225600,Zürich\r\n0,1767225601,Liège\r\n".encode("cp1252"))
    with pytest.raises(IngestError, match=r"log.csv: line 2 is not utf-8 text \(invalid (start|continuation) "
                                          r"byte: b'\\xfc'\); set the feature spec's source.encoding"):
        ingest(spec_from_dict(spec_yaml), [path], Layout(tmp_path / "a"))
    spec = spec_from_dict({**spec_yaml, "source": {"format": "csv", "header": True, "encoding": "cp1252"}})
    report = ingest(spec, [path], Layout(tmp_path / "b"))
    assert report.rows_written == 2
    (part,) = _partitions(tmp_path / "b").values()
    assert part.decode("utf-8") == "clicked,when,city\n1,1767225600,Zürich\n0,1767225601,Liège\n"
    wide = tmp_path / "wide.csv"
    wide.write_bytes("clicked,when,city\n1,1767225600,Zürich\n".encode("utf-16"))
    with pytest.raises(IngestError, match=r"wide.csv: the file starts with a UTF-16 byte-order mark \(b'\\xff\\xfe'\) "
                                          r"but the spec reads utf-8; set source.encoding: utf-16"):
        ingest(spec_from_dict(spec_yaml), [wide], Layout(tmp_path / "c"))
    utf16 = spec_from_dict({**spec_yaml, "source": {"format": "csv", "header": True, "encoding": "utf-16"}})
    assert ingest(utf16, [wide], Layout(tmp_path / "d")).rows_written == 1


@pytest.mark.parametrize("name, data, message", [
    ("avazu.csv", bytes(range(256)) * 4, r"avazu.csv: the file holds binary data, not text \(its first bytes: "
                                         r"b'\\x00\\x01\\x02.*'\); give a CSV, TSV or Parquet file"),
    ("avazu.csv.gz", gzip.compress(bytes(range(256))), r"the gzip-compressed file holds binary data"),
    ("avazu.csv.xz", lzma.compress(b"click\n1\n"), r"avazu.csv.xz: the file is xz-compressed data \(its first bytes: "
                                                   r"b'\\xfd7zXZ.*'\), not a CSV or TSV log; decompress it"),
    ("avazu.xlsx", b"PK\x03\x04" + bytes(60), r"the file is a ZIP archive \(an .xlsx workbook is one\).*save a "
                                              r"workbook as CSV"),
    ("avazu.csv.gz", b"click,hour\n1,14102203\n", r"avazu.csv.gz: the name says gzip \(.gz\), but the file holds "
                                                  r"data that is not gzip-compressed \(its first bytes: b'click,hour"),
    ("avazu.csv.bz2", gzip.compress(b"click\n"), r"the name says bz2 \(.bz2\), but the file holds gzip-compressed "
                                                 r"data"),
    ("avazu.csv.gz", gzip.compress(_csv_text().encode())[:2000], r"avazu.csv.gz: gzip-compressed data ends early or "
                                                                 r"is damaged after line \d+: .*; the file may be cut "
                                                                 r"short"),
    ("avazu.csv.zst", zstandard.ZstdCompressor().compress(_csv_text().encode())[:2000],
     r"avazu.csv.zst: zstd-compressed data ends early or is damaged"),
])
def test_what_is_not_a_log_is_refused_saying_what_it_is(tmp_path, name, data, message):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(IngestError, match=message):
        ingest(SPEC, [path], Layout(tmp_path / "var"))
    assert not (tmp_path / "var" / "raw").exists()


def test_the_format_asked_must_be_the_files(tmp_path):
    names, rows = _table()
    table = tmp_path / "avazu.parquet"
    pq.write_table(pa.table({n: [r[i] for r in rows] for i, n in enumerate(names)}), table)
    with pytest.raises(IngestError, match=r"--format csv asks for text, but the file is Parquet; give --format "
                                          r"parquet \(or auto\)"):
        ingest(SPEC, [table], Layout(tmp_path / "var"), input_format="csv")
    text = tmp_path / "avazu.csv.gz"
    text.write_bytes(gzip.compress(_csv_text().encode()))
    with pytest.raises(IngestError, match=r"expected a Parquet file, but the gzip-compressed file starts with "
                                          r"b'id,click,hour,C1'"):
        ingest(SPEC, [text], Layout(tmp_path / "var"), input_format="parquet")
    misnamed = tmp_path / "export.parquet"
    misnamed.write_text(_csv_text())
    with pytest.raises(IngestError, match=r"export.parquet: expected a Parquet file"):
        ingest(SPEC, [misnamed], Layout(tmp_path / "var"))
    table.rename(tmp_path / "export.bin")  # Parquet by its first bytes, whatever its name
    assert ingest(SPEC, [tmp_path / "export.bin"], Layout(tmp_path / "var")).rows_written == ROWS


# ------------------------------------------------------------------ errors that name the cause

def test_a_missing_label_column_lists_the_header_read_with_invisible_characters_escaped(tmp_path):
    path = tmp_path / "avazu.csv"
    path.write_text(_csv_text(label_first=True).replace("click", "\u200bclick", 1))
    with pytest.raises(IngestError) as raised:
        ingest(SPEC, [path], Layout(tmp_path / "var"))
    message = str(raised.value)
    assert message.startswith(f"{path}: no header line naming the label column 'click': the first line read as "
                              "['\\u200bclick', 'id', 'hour', ")
    assert "(24 columns); column 1 is 'click' with invisible characters ('\\u200bclick'): remove them" in message
    assert "spec 'avazu' lists no source.columns to read it by position" in message
    semicolons = tmp_path / "semicolons.csv"
    semicolons.write_text("click;id;hour\r\n1;2;14102203\r\n")
    with pytest.raises(IngestError, match=r"the first line read as \['click;id;hour'\] \(1 columns\); the line "
                                          r"holds ';', not ',': .* set the spec's source.delimiter"):
        ingest(SPEC, [semicolons], Layout(tmp_path / "var"))
    spaced = tmp_path / "spaced.csv"
    spaced.write_text(_csv_text().replace("click", "click\u00a0", 1))
    with pytest.raises(IngestError, match=r"column 2 is 'click' with invisible characters \('click\\xa0'\)"):
        ingest(SPEC, [spaced], Layout(tmp_path / "var"))


def test_visible_escapes_what_a_terminal_does_not_show():
    assert visible("\ufeffclick") == "\\ufeffclick"
    assert visible("click\r") == "click\\r"
    assert visible("a b\u00a0c\u200d") == "a b\\xa0c\\u200d"
    assert visible("Zürich 東京") == "Zürich 東京"


# ------------------------------------------------------------------ s3://bucket/prefix

@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint, monkeypatch):
    """A bucket of a team's exports; boto3's usual credential variables set as an operator sets them."""
    import boto3

    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket="exports")
    header, *lines = _excel_csv().decode("utf-8-sig").splitlines(keepends=True)
    bom = "\ufeff"
    client.put_object(Bucket="exports", Key="avazu/day=1/part-0.csv.gz",
                      Body=gzip.compress((bom + header + "".join(lines[:60])).encode()))
    client.put_object(Bucket="exports", Key="avazu/day=1/part-1.csv.gz",
                      Body=gzip.compress((bom + header + "".join(lines[60:])).encode()))
    client.put_object(Bucket="exports", Key="avazu/day=1/_SUCCESS", Body=b"")
    client.put_object(Bucket="exports", Key="avazu/day=10/part-0.csv.gz", Body=b"not this day")
    yield client
    for page in client.get_paginator("list_objects_v2").paginate(Bucket="exports"):
        for item in page.get("Contents", []):
            client.delete_object(Bucket="exports", Key=item["Key"])
    client.delete_bucket(Bucket="exports")


@pytest.mark.integration
def test_an_s3_prefix_is_listed_and_streamed_with_the_model_stores_settings(tmp_path, s3, s3_endpoint, reference,
                                                                          monkeypatch, capsys):
    report = ingest(SPEC, ["s3://exports/avazu/day=1"], Layout(tmp_path / "a"), s3_endpoint_url=s3_endpoint)
    assert report.files == ["s3://exports/avazu/day=1/part-0.csv.gz", "s3://exports/avazu/day=1/part-1.csv.gz"]
    assert _partitions(tmp_path / "a") == reference
    assert _ingest(tmp_path / "b", "s3://exports/avazu/day=1/part-*.csv.gz", s3_endpoint_url=s3_endpoint) == reference
    # The command line, with the endpoint from the same setting the model store reads.
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CTR_HOME", raising=False)
    monkeypatch.setenv("CTR_S3_ENDPOINT_URL", s3_endpoint)
    assert main(["ingest", "--spec", "avazu", "--set", "paths.data_root=cli", "s3://exports/avazu/day=1/"]) == 0
    assert _partitions(tmp_path / "cli") == reference
    assert "100 rows in 100 minutes" in capsys.readouterr().out
    assert main(["ingest", "--spec", "avazu", "s3://exports/avazu/day=2/"]) == 2
    assert "input 's3://exports/avazu/day=2/' names no object (0 object(s) under s3://exports/avazu/day=2/); " \
           "check the prefix" in capsys.readouterr().err
    assert main(["ingest", "--spec", "avazu", "s3://no-such-bucket/x"]) == 2
    assert "cannot list 's3://no-such-bucket/x': " in capsys.readouterr().err


# ------------------------------------------------------------------ the command line

def test_the_next_command_keeps_every_setting_it_was_given(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CTR_HOME", raising=False)
    path = tmp_path / "my data" / "avazu.csv.gz"
    path.parent.mkdir()
    path.write_bytes(gzip.compress(_excel_csv()))
    root = tmp_path / "team root"
    given = ["ingest", "--spec", "avazu", "--set", f"paths.data_root={root}", "--set", "features.min_count=2",
             str(path)]
    assert main(given) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("next: ")]
    assert line == ("next: ctr-pipeline run daily --spec avazu --set 'paths.data_root=" + str(root) + "' --set "
                    "features.min_count=2 --start 2014-10-21T00:00 --end 2014-10-21T01:59")
    # Run as printed, it reads the partitions just written.
    words = shlex.split(line.removeprefix("next: "))
    assert words[0] == "ctr-pipeline"
    from pipelines.cli import config_from_args

    args = build_parser().parse_args(words[1:])
    config = config_from_args(args)
    assert config.paths.root == root and config.features.min_count == 2
    assert len(list((config.paths.root / "raw" / "click_log").glob("date=*/minute=*/part-00000.csv"))) == 100


def test_ctr_is_an_alias_that_says_the_new_name(capsys):
    from pipelines.cli import deprecated_main

    with pytest.raises(SystemExit) as raised:
        deprecated_main(["--help"])
    assert raised.value.code == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("ctr: this command is now called ctr-pipeline (ctr-pipeline --help); 'ctr' stays "
                                   "as an alias for this release only")
    assert captured.out.startswith("usage: ctr-pipeline ")
