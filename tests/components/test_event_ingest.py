"""`ctr-pipeline ingest --stream`: a team's impression and click logs written as the event streams' raw minutes."""

from __future__ import annotations

import csv
import gzip
import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from components.config import EventsConfig, GenerateConfig
from components.event_ingest import ingest_events
from components.events import CLICKS, EVENT_FILE, IMPRESSIONS, generate_events
from components.feature_spec import load_spec, spec_from_dict
from components.ingest import IngestError
from components.layout import Layout
from components.synthetic import SUCCESS_MARKER

pytestmark = pytest.mark.unit

START = datetime(2026, 1, 1, tzinfo=UTC)
MINUTES = 6
EVENTS = load_spec("events")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """Six generated minutes of both streams, and each stream as one table of every delivery."""
    layout = Layout(tmp_path_factory.mktemp("generated"))
    generate_events(GenerateConfig(start=START.isoformat(), minutes=MINUTES, rows_per_minute=200, seed=11),
                    EventsConfig(attribution_window_s=60), layout)
    streams = {stream: pa.concat_tables(pq.read_table(layout.raw_events_minute_dir(stream, START + timedelta(
        minutes=i)) / EVENT_FILE) for i in range(MINUTES)) for stream in (IMPRESSIONS, CLICKS)}
    return layout, streams


def _sorted(table: pa.Table) -> list[dict]:
    return table.take(pc.sort_indices(table, [("ts", "ascending"), ("request_id", "ascending")])).to_pylist()


def test_a_log_exported_as_one_file_each_comes_back_as_the_same_minutes(generated, tmp_path):
    """The impressions as one Parquet file in another order, the clicks as a gzipped CSV (ids as text, times as
    integers): every minute holds the rows the generator wrote there, and a second ingest changes nothing."""
    source, streams = generated
    impressions = tmp_path / "impressions.parquet"
    shuffled = streams[IMPRESSIONS].take(pa.array(list(range(streams[IMPRESSIONS].num_rows))[::-1]))
    pq.write_table(shuffled, impressions)
    clicks = tmp_path / "clicks.csv.gz"
    with gzip.open(clicks, "wt", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["request_id", "ts", "page"])  # a column the clicks stream does not keep
        writer.writerows([row["request_id"], row["ts"], "home"] for row in streams[CLICKS].to_pylist())
    layout = Layout(tmp_path / "data")
    said: list[str] = []
    first = ingest_events(EVENTS, IMPRESSIONS, [impressions], layout, progress=said.append)
    assert (first.rows_read, first.rows_written, first.rejected) == (shuffled.num_rows,) * 2 + (0,)
    assert (first.minutes_written, first.first_minute, first.end_minute) == (MINUTES, "2026-01-01T00:00",
                                                                             "2026-01-01T00:06")
    assert said and str(impressions) in said[0]
    done = ingest_events(EVENTS, CLICKS, [clicks], layout)
    assert done.rows_written == streams[CLICKS].num_rows and done.minutes_written == MINUTES
    for i in range(MINUTES):
        minute = START + timedelta(minutes=i)
        for stream in (IMPRESSIONS, CLICKS):
            written = pq.read_table(layout.raw_events_minute_dir(stream, minute) / EVENT_FILE)
            expected = pq.read_table(source.raw_events_minute_dir(stream, minute) / EVENT_FILE)
            assert written.schema == expected.schema
            assert written.to_pylist() == _sorted(expected)
            assert (layout.raw_events_minute_dir(stream, minute) / SUCCESS_MARKER).exists()
    again = ingest_events(EVENTS, IMPRESSIONS, [impressions], layout)
    assert (again.minutes_written, again.minutes_unchanged) == (0, MINUTES)


def test_minutes_without_a_row_are_written_empty_and_rows_without_a_key_are_kept_aside(tmp_path):
    """The join reads every minute of its span: a quiet minute between two busy ones is written, empty. A row
    without its request id or time is not written; the rejects file says which line and why. Numeric ids are
    read as text, keeping their leading zeros."""
    path = tmp_path / "impressions.csv"
    base = int(START.timestamp() * 1000)
    path.write_text("request_id,ts,user_id,item_id,campaign,I2\n"
                    f"r1,{base + 5},007,i1,c1,3\n"
                    f",{base + 7},u2,i2,c1,\n"
                    f"r3,,u3,i3,c2,4\n"
                    f"r4,{base + 2 * 60_000 + 1},u4,i4,c2,5\n")
    spec = spec_from_dict({
        "name": "campaigns", "source": {"format": "parquet"}, "label": {"column": "label"},
        "features": [{"name": "ts", "kind": "timestamp", "format": "unix_millis"},
                     {"names": ["user_id", "item_id", "campaign"], "kind": "categorical"},
                     {"name": "I2", "kind": "dense"}]})
    layout = Layout(tmp_path / "data")
    report = ingest_events(spec, IMPRESSIONS, [path], layout)
    assert (report.rows_read, report.rows_written, report.rejected) == (4, 2, 2)
    assert report.rejects_by_reason == {"column 'request_id' is empty": 1, "column 'ts' is empty": 1}
    lines = Path(report.rejects_file).read_text().splitlines()
    assert [line.split("\t")[:3] for line in lines[1:]] == [[str(path), "3", "column 'request_id' is empty"],
                                                            [str(path), "4", "column 'ts' is empty"]]
    minutes = [pq.read_table(layout.raw_events_minute_dir(IMPRESSIONS, START + timedelta(minutes=i)) / EVENT_FILE)
               for i in range(3)]
    assert [m.num_rows for m in minutes] == [1, 0, 1]
    assert minutes[0].to_pylist() == [{"request_id": "r1", "ts": base + 5, "user_id": "007", "item_id": "i1",
                                       "campaign": "c1", "I2": 3}]
    assert minutes[1].schema == minutes[0].schema


def test_a_file_the_stream_or_the_spec_cannot_read_is_refused_before_anything_is_written(generated, tmp_path):
    _, streams = generated
    layout = Layout(tmp_path / "data")
    no_item = tmp_path / "no_item.parquet"
    pq.write_table(streams[IMPRESSIONS].drop(["item_id"]), no_item)
    with pytest.raises(IngestError, match=r"no_item.parquet: the impressions stream needs columns \['item_id'\], "
                                          r"which the file does not have \(its columns: "
                                          r"\['request_id', 'ts', 'user_id'"):
        ingest_events(EVENTS, IMPRESSIONS, [no_item], layout)
    text_dense = tmp_path / "text_dense.parquet"
    table = streams[IMPRESSIONS]
    as_text = table.column("I5").cast(pa.string())
    pq.write_table(table.set_column(table.schema.get_field_index("I5"), "I5", as_text), text_dense)
    with pytest.raises(IngestError, match=r"cannot be ingested as impressions for feature spec 'events': column 'I5' "
                                          r"is string, which a dense feature does not read"):
        ingest_events(EVENTS, IMPRESSIONS, [text_dense], layout)
    assert not (layout.root / "raw").exists()
    # A complete minute holding other rows is refused before any minute is written.
    good = tmp_path / "good.parquet"
    pq.write_table(table, good)
    ingest_events(EVENTS, IMPRESSIONS, [good], layout)
    later = layout.raw_events_minute_dir(IMPRESSIONS, START + timedelta(minutes=MINUTES - 1)) / EVENT_FILE
    before = later.read_bytes()
    pq.write_table(table.slice(1), good)
    with pytest.raises(IngestError, match=r"impressions minute 2026-01-01T00:00 already holds other rows"):
        ingest_events(EVENTS, IMPRESSIONS, [good], layout)
    assert later.read_bytes() == before


def test_the_cli_ingests_a_stream_and_says_what_to_run_next(generated, tmp_path):
    """After the impressions it asks for the clicks; after the clicks, the daily run over the impression minutes
    whose labels are final (the attribution window after each), or that none is yet."""
    _, streams = generated
    paths = {stream: tmp_path / f"{stream}.parquet" for stream in streams}
    for stream, path in paths.items():
        pq.write_table(streams[stream], path)

    def cli(*words: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pipelines.cli", "ingest", "--spec", "events", *words,
                               "--set", f"paths.data_root={tmp_path / 'data'}"],
                              capture_output=True, text=True, cwd=REPO, timeout=300)

    done = cli("--stream", "impressions", str(paths[IMPRESSIONS]))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout[done.stdout.index("{"):done.stdout.rindex("}") + 1])
    assert report["stream"] == "impressions" and report["rows_written"] == streams[IMPRESSIONS].num_rows
    assert done.stdout.rstrip().endswith("next: ingest the clicks (--stream clicks)")
    done = cli("--stream", "clicks", str(paths[CLICKS]))  # the default window, 600 s: nothing final in 6 minutes
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no impression minute has final labels yet: the clicks end at 2026-01-01T00:06" in done.stdout
    done = cli("--stream", "clicks", str(paths[CLICKS]), "--set", "events.attribution_window_s=60")
    assert done.returncode == 0, done.stderr[-2000:]
    # Minute 00:04's last impression may be clicked until 00:06, where the clicks end: it is the last final one.
    last = done.stdout.rstrip().splitlines()[-1]
    assert last.startswith("next (the minutes whose clicks are in, 60 s after each): ctr-pipeline run daily --spec "
                           "events --set events.attribution_window_s=60 --set paths.data_root=")
    assert last.endswith("--start 2026-01-01T00:00 --end 2026-01-01T00:05 --set features.source=events")
    refused = cli("--stream", "clicks", str(paths[CLICKS]), "--start", "2026-01-01T00:00")
    assert refused.returncode == 2 and "drop them" in refused.stderr


@pytest.mark.integration
def test_a_click_log_on_s3_exported_from_a_spreadsheet_is_read_through(generated, tmp_path, monkeypatch):
    """Clicks under an s3:// prefix (a local S3 endpoint), gzipped CSV parts with a byte-order mark and CRLF line
    ends as a spreadsheet writes them: the same minutes as from the generator."""
    import boto3
    from moto.server import ThreadedMotoServer

    source, streams = generated
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(key, value)
        client = boto3.client("s3", endpoint_url=f"http://{host}:{port}")
        client.create_bucket(Bucket="logs")
        rows = [f"{row['request_id']},{row['ts']}\r\n" for row in streams[CLICKS].to_pylist()]
        half = len(rows) // 2
        for part, chunk in enumerate((rows[:half], rows[half:])):
            body = "\ufeffrequest_id,ts\r\n" + "".join(chunk)
            client.put_object(Bucket="logs", Key=f"clicks/part-{part}.csv.gz", Body=gzip.compress(body.encode()))
        layout = Layout(tmp_path / "data")
        report = ingest_events(EVENTS, CLICKS, ["s3://logs/clicks/"], layout, s3_endpoint_url=f"http://{host}:{port}")
    finally:
        server.stop()
    assert report.files == ["s3://logs/clicks/part-0.csv.gz", "s3://logs/clicks/part-1.csv.gz"]
    assert (report.rows_written, report.rejected) == (streams[CLICKS].num_rows, 0)
    for i in range(MINUTES):
        minute = START + timedelta(minutes=i)
        written = pq.read_table(layout.raw_events_minute_dir(CLICKS, minute) / EVENT_FILE)
        assert written.to_pylist() == _sorted(pq.read_table(source.raw_events_minute_dir(CLICKS, minute) / EVENT_FILE))
