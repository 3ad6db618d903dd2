"""The daily pipeline on impression and click streams (features.source=events), in-process: validate ->
join -> features -> samples -> train -> evaluate, with real Spark, great-expectations, TensorFlow and MLflow."""

from __future__ import annotations

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from components.config import load_config
from components.events import EVENT_FILE, IMPRESSIONS, generate_events
from components.interval import Interval
from components.layout import Layout
from components.manifest import read_manifest
from components.synthetic import SUCCESS_MARKER
from components.validation import DataValidationError
from pipelines.context import RunContext
from pipelines.runner import run_steps, select_steps

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# 40 generated minutes; with a 5-minute window the first 30 are final (clicks end at minute 40).
SPAN = Interval.parse("2026-01-01T00:00", "2026-01-01T00:30")
OVERRIDES = {
    "features.source": "events", "generate.minutes": 40, "generate.rows_per_minute": 600,
    "events.attribution_window_s": 300, "events.history_lookback_s": 600, "features.min_count": 3,
    "features.num_shards": 2, "spark.shuffle_partitions": 2, "spark.driver_memory": "2g", "train.epochs": 2,
    "train.batch_size": 512, "train.mlp_units": "32,16", "gate.min_auc": 0.55, "tracking.strict": True,
}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, spark):
    root = tmp_path_factory.mktemp("events-pipeline")
    config = load_config(overrides={"paths.data_root": str(root), **OVERRIDES}, environ={})
    layout = Layout(config.paths.root)
    generate_events(config.generate, config.events, layout)
    # Minute 00:07's impressions arrive with the wrong schema (ts as text): validation must quarantine it.
    broken = layout.raw_events_minute_dir(IMPRESSIONS, SPAN.start.replace(minute=7))
    table = pq.read_table(broken / EVENT_FILE)
    as_text = pa.array([str(v) for v in table["ts"].to_pylist()])
    pq.write_table(table.set_column(table.schema.get_field_index("ts"), "ts", as_text), broken / EVENT_FILE)
    ctx = RunContext(config=config, interval=SPAN, pipeline="daily", run_id="test-events")
    with pytest.raises(DataValidationError) as failure:
        run_steps(ctx, select_steps("daily", ["validate"]))
    outputs = run_steps(RunContext(config=config, interval=SPAN, pipeline="daily", run_id="test-events-2"),
                        select_steps("daily", ["validate", "join", "features", "samples", "train", "evaluate"]))
    return {"config": config, "layout": layout, "outputs": outputs, "failure": str(failure.value),
            "broken": broken}


def test_a_partition_with_the_wrong_schema_is_quarantined_and_the_rerun_goes_on(pipeline):
    layout, broken = pipeline["layout"], pipeline["broken"]
    assert re.search(r"1 impressions partition\(s\) failed validation.*2026-01-01 00:07.*column 'ts' is string, "
                     r"expected int64", pipeline["failure"], re.DOTALL)
    quarantined = layout.quarantine_events_minute_dir(IMPRESSIONS, SPAN.start.replace(minute=7))
    assert sorted(p.name for p in quarantined.iterdir()) == sorted([EVENT_FILE, SUCCESS_MARKER, "report.json"])
    assert not broken.exists()
    validated = pipeline["outputs"]["validate"]
    assert validated["impressions"]["rows"] > 0 and validated["clicks"]["rows"] > 0
    report = json.loads((layout.validation_report(SPAN, "impressions")).read_text())
    assert report["num_passed"] == 29 and len(report["failed"]) == 1


def test_join_labels_in_the_window_and_counts_late_clicks(pipeline):
    joined = pipeline["outputs"]["join"]
    # 29 valid minutes x 600 impressions, less the lost ones (0.2 %).
    assert 29 * 600 * 0.99 < joined["impressions"] <= 29 * 600
    # Positives count by the impression's minute, attributed clicks by the click's: they differ at the edges.
    assert joined["positives"] > 1000
    assert abs(joined["positives"] - joined["attributed_clicks"]) < 0.05 * joined["positives"]
    assert joined["late_clicks"] > 0  # 3 % of clicks arrive after the window: counted, not labelled
    manifest = read_manifest(pipeline["layout"].joined_dir(SPAN), kind="joined_samples")
    assert manifest["row_counts"]["rows"] == joined["impressions"]
    report = json.loads(pipeline["layout"].validation_report(SPAN, "joined_samples").read_text())
    assert report["success"] is True and report["num_rows"] == joined["impressions"]


def test_samples_and_model_come_from_the_joined_events(pipeline):
    layout, outputs = pipeline["layout"], pipeline["outputs"]
    train = read_manifest(layout.samples_dir(SPAN, "train"), kind="samples")
    evaluation = read_manifest(layout.samples_dir(SPAN, "eval"), kind="samples")
    assert train["inputs"]["source"] == "events"
    assert train["row_counts"]["rows"] + evaluation["row_counts"]["rows"] == outputs["join"]["impressions"]
    assert train["row_counts"]["positives"] + evaluation["row_counts"]["positives"] == outputs["join"]["positives"]
    report = outputs["evaluate"]
    assert report["gate"]["passed"] is True
    # The planted model scored on the joined labels: the best AUC reachable, above what 17 K rows train to.
    assert 0.6 < report["metrics"]["auc"] < report["planted_auc"] < 0.95


@pytest.fixture(scope="module")
def din_pipeline(tmp_path_factory, spark):
    """The same generated streams under the events spec (user, item, slot, device, the behaviour sequence) with
    DIN, through export."""
    root = tmp_path_factory.mktemp("events-din")
    config = load_config(overrides={"paths.data_root": str(root), **OVERRIDES, "features.spec": "events",
                                    "train.model": "din"}, environ={})
    layout = Layout(config.paths.root)
    generate_events(config.generate, config.events, layout)
    ctx = RunContext(config=config, interval=SPAN, pipeline="daily", run_id="test-events-din")
    return {"config": config, "layout": layout, "ctx": ctx, "outputs": run_steps(ctx, select_steps("daily", None))}


def test_the_events_spec_with_din_trains_exports_and_serves(din_pipeline, pipeline):
    from serving.model import LoadedModel

    layout, outputs = din_pipeline["layout"], din_pipeline["outputs"]
    report = outputs["evaluate"]
    criteo_columns = pipeline["outputs"]["evaluate"]["metrics"]["auc"]
    print(f"events spec + DIN: AUC {report['metrics']['auc']:.4f}; criteo columns + DCNv2: {criteo_columns:.4f}; "
          f"planted {report['planted_auc']:.4f}")
    # On 17 K rows the user, item and sequence add little over the Criteo-like columns (0.757 against 0.751
    # when this was written; planted 0.850): what they are worth is measured on 1 M impressions, not here.
    assert report["gate"]["passed"] and 0.6 < report["metrics"]["auc"] < report["planted_auc"]
    model = LoadedModel.load(layout.export_dir(SPAN))
    assert model.manifest["model"] == "din" and model.manifest["feature_spec"]["name"] == "events"
    row = pq.read_table(next((layout.joined_dir(SPAN) / "samples").glob("part-*.parquet"))).slice(0, 1).to_pylist()[0]
    instance = {name: row[name] for name in ("user_id", "item_id", "device", "slot", "ts", "history",
                                             *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27)))}
    assert 0.0 < model.predict([instance])[0] < 1.0


def test_minute_runs_on_the_event_streams_learn_final_minutes_and_serve_like_the_trainer(din_pipeline, tmp_path):
    """After the daily DIN model, minute runs on the streams: each learns the newest minute whose labels are
    final (the attribution window after it), through its own join; serving the full model plus the deltas
    answers like the last minute run's checkpoint exported whole."""
    from components.feature_state import load_feature_state
    from components.manifest import write_manifest
    from components.model_store import open_model_store
    from serving.model import LoadedModel
    from serving.watcher import ModelWatcher
    from trainer.export import export_serving_model
    from trainer.train import load_checkpoint

    config = din_pipeline["config"].with_overrides({"incremental.wait_for_data_s": 0,
                                                    "incremental.max_logloss_increase": 1.0})
    layout = din_pipeline["layout"]
    minutes = ("2026-01-01T00:35", "2026-01-01T00:36")
    outputs = {minute: run_steps(RunContext(config=config, interval=Interval.minute(minute), pipeline="incremental",
                                            run_id=f"test-events-{minute}"), select_steps("incremental", None))
               for minute in minutes}
    store = open_model_store(config.paths.model_store_uri)
    assert store.versions("ctr") == ["202601010030", "202601010036", "202601010037"]
    first, second = (store.manifest("ctr", v) for v in ("202601010036", "202601010037"))
    # The window is 300 s: at the end of minute 00:35 the labels of minute 00:30 are final, and no later one's.
    assert first["data_span"] == {"start": "2026-01-01T00:30:00+00:00", "end": "2026-01-01T00:31:00+00:00"}
    assert second["data_span"] == {"start": "2026-01-01T00:31:00+00:00", "end": "2026-01-01T00:32:00+00:00"}
    assert (second["parent"], second["chain_root"]) == ("202601010036", "202601010030")
    assert outputs[minutes[0]]["validate"]["minutes"] == ["2026-01-01T00:30:00+00:00"]
    assert 400 < second["num_rows"] < 600  # the minute's ~600 impressions less the ~10 % held out
    # Each minute's join continues the behaviour sequences of the join that ended where its minute starts:
    # the daily run's, then the first minute run's.
    joins = [read_manifest(layout.incremental_dir(Interval.minute(m)) / "joined") for m in minutes]
    assert [j["history_state"] for j in joins] == [
        {"as_of": "2026-01-01T00:31:00+00:00", "from": SPAN.tag},
        {"as_of": "2026-01-01T00:32:00+00:00", "from": "20260101T0030-20260101T0031"}]

    last = layout.incremental_dir(Interval.minute(minutes[-1]))
    child = tmp_path / "child"
    files = export_serving_model(load_checkpoint(last / "checkpoint"), load_feature_state(last / "feature_state"),
                                 child, din_pipeline["ctx"].spec)
    write_manifest(child, kind="full_model", version="child", files=files,
                   extra={"feature_spec": store.manifest("ctr", "202601010030")["feature_spec"]})
    rows = pq.read_table(next((last / "joined" / "samples").glob("part-*.parquet"))).slice(0, 200).to_pylist()
    instances = [{name: row[name] for name in (
        "user_id", "item_id", "device", "slot", "ts", "history", *(f"I{i}" for i in range(1, 14)),
        *(f"C{i}" for i in range(1, 27)))} for row in rows]
    watcher = ModelWatcher(store, "ctr", tmp_path / "cache", poll_seconds=60)
    assert watcher.poll_once() and watcher.version == "202601010037"
    served = watcher.current().predict(instances)
    np.testing.assert_allclose(served, LoadedModel.load(child).predict(instances), rtol=0, atol=1e-6)
    assert served.std() > 0.01  # the rows differ, and so do their scores


CAMPAIGN_SPEC = """
name: campaigns
description: "A team's own impression log: user, item, slot, device, a campaign column, a few dense fields"
source: {format: parquet}
label: {column: label}
features:
  - {name: ts, kind: timestamp, format: unix_millis, derive: [hour_of_day]}
  - {names: [user_id, item_id, device, campaign], kind: categorical}
  - {name: slot, kind: categorical, dtype: int}
  - {names: [I1, I2, I3, I4, I5], kind: dense}
  - {name: history, kind: sequence, max_length: 10, shares: item_id}
"""


def test_a_teams_own_streams_ingested_from_files_train_through_their_spec(tmp_path, spark):
    """Impression and click logs exported as one file each, the impressions with a column the generator never
    writes (a campaign) and without most of its Criteo fields, ingested with `ingest --stream`, then the daily
    pipeline under a spec that names that column: validated, joined, counted and trained on by its spec."""
    import pyarrow.compute as pc

    from components.event_ingest import ingest_events
    from components.events import CLICKS
    from components.feature_spec import spec_for

    exported = Layout(tmp_path / "export")
    config = load_config(overrides={"paths.data_root": str(tmp_path / "data"), **OVERRIDES,
                                    "features.spec": str(tmp_path / "campaigns.yaml"), "train.model": "din"},
                         environ={})
    (tmp_path / "campaigns.yaml").write_text(CAMPAIGN_SPEC)
    generate_events(config.generate, config.events, exported)
    files = {}
    for stream in (IMPRESSIONS, CLICKS):
        table = pa.concat_tables(pq.read_table(exported.raw_events_minute_dir(stream, minute) / EVENT_FILE)
                                 for minute in Interval.parse("2026-01-01T00:00", "2026-01-01T00:40").minutes())
        if stream == IMPRESSIONS:
            campaign = pc.binary_join_element_wise("cmp-", pc.cast(pc.utf8_length(table["item_id"]), pa.string()), "")
            table = table.drop([f"C{i}" for i in range(1, 27)] + [f"I{i}" for i in range(6, 14)])
            table = table.append_column("campaign", campaign)
        files[stream] = tmp_path / f"{stream}.parquet"
        pq.write_table(table, files[stream])
    layout = Layout(config.paths.root)
    spec = spec_for(config)
    for stream in (IMPRESSIONS, CLICKS):
        assert ingest_events(spec, stream, [files[stream]], layout).rejected == 0
    ctx = RunContext(config=config, interval=SPAN, pipeline="daily", run_id="test-events-campaigns")
    outputs = run_steps(ctx, select_steps("daily", ["validate", "join", "features", "samples", "train", "evaluate"]))
    joined = pq.read_table(layout.joined_dir(SPAN) / "samples")
    assert "campaign" in joined.column_names and "C1" not in joined.column_names and "I6" not in joined.column_names
    assert set(joined["campaign"].to_pylist()) >= {"cmp-3", "cmp-4"}
    assert 29 * 600 * 0.99 < outputs["join"]["impressions"] <= 30 * 600
    train = read_manifest(layout.samples_dir(SPAN, "train"), kind="samples")
    assert train["inputs"]["source"] == "events" and train["feature_spec_hash"] == spec.hash()
    report = outputs["evaluate"]
    print(f"campaigns spec + DIN on ingested streams: AUC {report['metrics']['auc']:.4f}")
    # The streams are the team's own here (no planted model beside them), so there is no planted AUC to compare;
    # without 34 of the 39 Criteo-like fields, 17 K rows train to about 0.6 (0.597 when this was written).
    assert report["gate"]["passed"] is True and report["metrics"]["auc"] > 0.56 and report["planted_auc"] is None
