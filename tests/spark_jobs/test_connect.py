"""The same job through a Spark Connect server (started from the pyspark wheel's own script) as in a local
session: the pipeline's Spark code does not care which it gets."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from components.config import EventsConfig, GenerateConfig, SparkConfig
from components.events import generate_events
from components.feature_spec import load_spec
from components.interval import Interval
from components.layout import Layout
from spark_jobs.connect import start_connect_server
from spark_jobs.events import METRIC_COLUMNS, run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

START = datetime(2026, 1, 1, tzinfo=UTC)
REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rows(directory) -> list[tuple]:
    table = pq.read_table(directory / "samples", columns=["request_id", "label", "history"])
    return sorted(zip(*(table.column(n).to_pylist() for n in table.column_names), strict=True))


def daily_state(spark, joined: Path, span: Interval) -> dict:
    """The daily feature state (evict=True: counts and dense statistics) of the join's rows, as plain values."""
    from components.config import FeatureConfig
    from components.feature_spec import load_spec
    from spark_jobs.events import joined_rows
    from spark_jobs.features import build_feature_state

    criteo = load_spec("criteo")
    state = build_feature_state(joined_rows(spark, joined, list(span.minutes()), criteo), None,
                                FeatureConfig(min_count=2), day=0, version="connect", evict=True, spec=criteo)
    return {"vocabularies": {name: sorted(zip(v.values, v.counts, strict=True))
                             for name, v in state.vocabularies.items()},
            "dense": [[d.name, d.low, d.high, d.mean, d.std] for d in state.dense]}


def test_join_through_spark_connect_equals_the_local_session(spark, tmp_path):
    layout = Layout(tmp_path / "data")
    events = EventsConfig(attribution_window_s=120)
    generate_events(GenerateConfig(start="2026-01-01T00:00", minutes=8, rows_per_minute=300), events, layout)
    span = Interval(START + timedelta(minutes=2), START + timedelta(minutes=4))
    arguments = {"window_s": 120, "sequence_length": 5, "lookback_s": 120}
    local = run(spark, layout, span, tmp_path / "local", spec=load_spec("events"), **arguments)
    config = SparkConfig(master="local[1]", shuffle_partitions=2, driver_memory="1g")
    # The client runs in its own process: a Connect session switches PySpark into Connect mode for the whole
    # process, and this one holds the tests' local session.
    client = textwrap.dedent(f"""
        import json, sys
        from pathlib import Path
        from pyspark.sql import SparkSession
        from components.feature_spec import load_spec
        from components.interval import Interval
        from components.layout import Layout
        from spark_jobs.events import run
        from tests.spark_jobs.test_connect import daily_state

        remote = SparkSession.builder.remote(sys.argv[1]).getOrCreate()
        span = Interval.parse({span.start.isoformat()!r}, {span.end.isoformat()!r})
        metrics = run(remote, Layout(Path({str(layout.root)!r})), span, Path({str(tmp_path / "remote")!r}),
                      spec=load_spec("events"), **{arguments!r})
        state = daily_state(remote, Path({str(tmp_path / "remote")!r}), span)
        print(json.dumps({{"metrics": {{name: value for name, value in metrics.items() if name != "per_minute"}},
                          "state": state}}))
        """)
    with start_connect_server(config, free_port(), log_dir=tmp_path / "logs") as server:
        done = subprocess.run([sys.executable, "-c", client, server.url], capture_output=True, text=True,
                              timeout=300, cwd=REPO_ROOT,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                  filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))})
    assert done.returncode == 0, done.stderr[-3000:]
    through_connect = json.loads(done.stdout.strip().splitlines()[-1])
    assert {n: through_connect["metrics"][n] for n in METRIC_COLUMNS} == {n: local[n] for n in METRIC_COLUMNS}
    # A daily feature state (its counting and dense-statistics jobs run side by side) is the same through both.
    assert through_connect["state"] == json.loads(json.dumps(daily_state(spark, tmp_path / "local", span)))
    assert sum(map(len, through_connect["state"]["vocabularies"].values())) > 100
    assert local["impressions"] > 500 and local["positives"] > 0
    assert rows(tmp_path / "remote") == rows(tmp_path / "local")
