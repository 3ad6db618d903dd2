"""Each preset's small real sample (../shared/data) through the whole daily pipeline under its feature spec:
ingest -> validate -> features -> samples -> one epoch -> evaluate -> export -> served predictions.

The served model is fed the raw rows of the held-out minutes as a client sends them (JSON values in the spec's
raw form), and must give the predictions the trainer made on the Spark-written samples of the same rows: the
same raw value maps to the same row in Spark, the trainer and serving, for every kind the preset declares
(dense, categorical, integer ids, derived time features, sequences). The samples are never copied into the
project; these tests skip when ../shared is absent."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from components.config import load_config
from components.feature_spec import PRESET_DIR, DenseFeature, FeatureSpec, spec_for
from components.ingest import ingest
from components.interval import Interval
from components.validation import read_raw_slice
from pipelines.context import RunContext
from pipelines.daily import split_minutes
from pipelines.runner import run_steps, select_steps
from serving.model import LoadedModel
from tests.real_samples import SAMPLES
from tests.real_samples import SHARED_DATA as DATA

pytestmark = pytest.mark.integration



def _instance(row: dict, spec: FeatureSpec) -> dict:
    """A raw row as a client sends it: numbers for dense features, text for ids, lists for sequences, the
    timestamp in its raw format; missing values left out."""
    out: dict = {}
    for feature in spec.features:
        if getattr(feature, "derived_from", ""):
            continue
        value = row.get(feature.column)
        if value is None or value == "":
            continue
        if isinstance(feature, DenseFeature):
            out[feature.name] = float(value)
        elif feature.kind in ("sequence", "multi_categorical"):
            values = [v for v in str(value).split(feature.separator) if v]
            out[feature.name] = values[-feature.max_length:]
        else:
            out[feature.name] = value
    return out


def _spread_over_minutes(sample: Path, out: Path) -> Path:
    """The tiny Taobao sample stamps all 100 rows with one second; a day of the real log spans the day. A copy
    (in the test's temporary directory) with row i at 00:00 + 12 i seconds, so ingest spreads it over 20
    minutes and the daily run has earlier minutes to train on and later ones to evaluate on."""
    import csv

    with sample.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    for index, row in enumerate(rows):
        seconds = 12 * index
        row["time_stamp"] = f"2017-05-06 00:{seconds // 60:02d}:{seconds % 60:02d}"
    with out.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return out


def _criteo_with_buckets(directory: Path) -> Path:
    """The criteo preset with I1..I6 as quantile buckets into an embedding (transform: buckets)."""
    import yaml

    spec = yaml.safe_load((PRESET_DIR / "criteo.yaml").read_text())
    spec["name"] = "criteo_buckets"
    dense = spec["features"][0]["names"]
    spec["features"][0:1] = [{"names": dense[:6], "kind": "dense", "transform": "buckets", "num_buckets": 8},
                             {"names": dense[6:], "kind": "dense"}]
    path = directory / "criteo_buckets.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _criteo_tiered(directory: Path) -> Path:
    """The criteo preset with C3 and C4 kept on disk with a hot tier of 24 rows (storage: tiered), smaller than
    their tables: rows are evicted and loaded again during training."""
    import yaml

    spec = yaml.safe_load((PRESET_DIR / "criteo.yaml").read_text())
    spec["name"] = "criteo_tiered"
    categorical = next(entry for entry in spec["features"] if entry["kind"] == "categorical")
    names = categorical["names"]
    spec["features"].remove(categorical)
    spec["features"] += [{**categorical, "names": [n for n in names if n not in ("C3", "C4")]},
                         {**categorical, "names": ["C3", "C4"], "storage": "tiered", "hot_rows": 24}]
    path = directory / "criteo_tiered.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _taobao_tiered(directory: Path) -> Path:
    """The taobao preset with adgroup_id on disk behind a hot tier of 48 rows: the table its click sequence reads
    too, so the sequence's items go through the hot tier in training and through the row cache in serving."""
    import yaml

    spec = yaml.safe_load((PRESET_DIR / "taobao.yaml").read_text())
    spec["name"] = "taobao_tiered"
    categorical = next(entry for entry in spec["features"] if entry["kind"] == "categorical")
    categorical["names"].remove("adgroup_id")
    spec["features"].append({**{k: v for k, v in categorical.items() if k != "names"}, "name": "adgroup_id",
                             "storage": "tiered", "hot_rows": 48})
    path = directory / "taobao_tiered.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


# "/jax": the train step on the JAX backend (train.backend=jax, a child process without TensorFlow); the export
# and serving stay on TensorFlow and must serve what the JAX model predicted. "/jax-2": two training processes
# joined over loopback (train.processes=2), the table sharded across them; "/jax-d4": one process with four
# forced CPU devices (train.devices=4), the table sharded across them. "criteo_tiered/jax-d4": the tiered tables'
# hot tiers on the JAX step, on four forced CPU devices, their hot slots sharded like the table.
# "criteo_tiered_deepfm": the same tiered spec trained with DeepFM, whose linear part reads the tiered tables too.
@pytest.mark.parametrize("preset", [*sorted(SAMPLES), "criteo_buckets", "criteo_tiered", "taobao_tiered",
                                    "criteo_tiered_deepfm", "criteo_tiered/jax-d4", "taobao/jax", "avazu/jax-2",
                                    "criteo/jax-d4"])
def test_a_preset_sample_runs_from_ingest_to_served_predictions(tmp_path, monkeypatch, preset):
    preset, _, backend = preset.partition("/")
    backend, _, scale = backend.partition("-")
    processes = int(scale) if scale.isdigit() else 0
    devices = int(scale[1:]) if scale.startswith("d") else 0
    layout_name = preset.partition("_")[0]
    sample = DATA / SAMPLES[layout_name]
    if not sample.is_file():
        pytest.skip(f"the real {layout_name} sample is read from {sample}, which is absent (../shared is not "
                    "beside the checkout)")
    variants = {"criteo_buckets": _criteo_with_buckets, "criteo_tiered": _criteo_tiered,
                "taobao_tiered": _taobao_tiered, "criteo_tiered_deepfm": _criteo_tiered}
    spec_name = str(variants[preset](tmp_path)) if preset in variants else preset
    overrides = {"paths.data_root": str(tmp_path), "features.spec": spec_name, "features.min_count": 2,
                 "features.block_rows": 16, "features.num_shards": 1, "train.epochs": 1, "train.batch_size": 16,
                 "train.mlp_units": [16], "train.embedding_dim": 4, "train.checkpoint_every_steps": 1000,
                 "gate.min_auc": 0.0, "gate.max_logloss": 100.0, "gate.max_calibration_error": 100.0,
                 "tracking.strict": True, "train.backend": backend or "tensorflow"}
    if processes:
        overrides.update({"train.processes": processes, "train.shard_table_rows": 0})
    if preset == "taobao_tiered":  # the attention model: its behaviour sequence reads the tiered table
        overrides["train.model"] = "din"
    if preset == "criteo_tiered_deepfm":  # the linear part's per-value weights live in the tiered stores too
        overrides["train.model"] = "deepfm"
    if devices:  # the JAX child process inherits the flag; this process's TensorFlow is already started
        overrides.update({"train.devices": devices, "train.shard_table_rows": 0})
        monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count={devices}")
    config = load_config(overrides=overrides, environ={})
    spec = spec_for(config)
    layout = RunContext(config, Interval.minute("2026-01-01T00:00"), "daily", "x").layout
    if layout_name == "taobao":
        sample = _spread_over_minutes(sample, tmp_path / "taobao.csv")
        # 4 clicks in 100 rows: the last quarter of the minutes holds one of them.
        config = load_config(overrides={**overrides, "features.eval_fraction": 0.25}, environ={})
    criteo = layout_name == "criteo"
    report = ingest(spec, [sample], layout, start="2026-01-01T00:00" if criteo else None,
                    rows_per_minute=10 if criteo else None)
    assert report.rejected == 0
    ctx = RunContext(config=config, interval=Interval.parse(report.first_minute, report.end_minute),
                     pipeline="daily", run_id=f"spec-{preset}")
    outputs = run_steps(ctx, select_steps("daily", None))
    assert outputs["evaluate"]["gate"]["passed"]

    # The export carries the spec, and serving's metadata names every raw input the spec declares.
    model = LoadedModel.load(ctx.layout.export_dir(ctx.interval))
    assert model.manifest["feature_spec"]["hash"] == spec.hash()
    inputs = model.signature_metadata()["signature_def"]["signature_def"]["serving_default"]["inputs"]
    expected = {f.name for f in spec.features if not getattr(f, "derived_from", "")
                and (f.kind != "timestamp" or f.derive)}
    assert set(inputs) == expected

    # Parity: served predictions on the raw held-out rows == the trainer's on the Spark-written samples.
    _, eval_minutes = split_minutes(ctx)
    rows = []
    for minute in eval_minutes:
        path = ctx.layout.raw_minute_dir(minute) / spec.source.file_name
        frame = read_raw_slice(path, minute, spec=spec)
        rows.extend(frame[list(spec.input_columns)].to_dict("records"))
    served = model.predict([_instance(row, spec) for row in rows])
    trained = np.load(ctx.layout.evaluation_dir(ctx.interval) / "predictions.npz")["predictions"].reshape(-1)
    assert len(served) == len(trained) == len(rows) > 0
    np.testing.assert_allclose(np.sort(served), np.sort(trained), rtol=1e-5, atol=1e-6)
    assert len(np.unique(np.round(served, 6))) > 1  # the rows' features reach the model

    checkpoint = json.loads((ctx.layout.checkpoint_dir(ctx.interval) / "manifest.json").read_text())
    assert checkpoint["speed_flags"].get("backend", "tensorflow") == (backend or "tensorflow")
    assert checkpoint.get("tensorflow_imported", False) is False
    if processes:  # each process held half of the table while it trained; the checkpoint holds all of it
        flags = checkpoint["speed_flags"]
        assert (flags["processes"], flags["devices"]) == (2, 2)
        assert flags["shard_rows"]["table"] == [flags["sharded_table_rows"] // 2] and flags["sharded_table_rows"] > 0
    if devices:
        flags = checkpoint["speed_flags"]
        assert (flags["processes"], flags["devices"]) == (1, 4)
        assert flags["shard_rows"]["table"] == [flags["sharded_table_rows"] // 4] * 4 > [0] * 4
        if preset == "criteo_tiered":  # C3's and C4's 24 hot slots, 6 on each device
            assert flags["sharded_hot_rows"] == 48
            hot = flags["shard_rows"]["hot_tables"]
            assert list(hot.values()) == [[6] * 4] * 2 and flags["shard_rows"]["hot_optimizer"] == hot
    state = json.loads((ctx.layout.feature_state_dir(ctx.interval) / "manifest.json").read_text())
    assert set(state["table_sizes"]) == set(spec.tables())  # one vocabulary per table of the spec
    if preset.startswith("criteo_tiered"):  # trained through hot tiers of 24 rows; exported and served whole
        linear = preset == "criteo_tiered_deepfm"  # each record: the row's 4 values, then its linear weight
        assert checkpoint["tiered_tables"] == {"C3": 24, "C4": 24}
        assert {"tables/C3.rows", "tables/C4.rows"} <= set(checkpoint["files"])
        assert min(state["table_sizes"]["C3"], state["table_sizes"]["C4"]) > 24
        tables = {t["name"]: t for t in json.loads((ctx.layout.evaluation_dir(ctx.interval) / "tables.json")
                                                    .read_text())["tables"]}
        for name in ("C3", "C4"):
            entry = tables[name]
            assert entry["storage"] == "tiered" and entry["hot_rows"] == 24
            assert 0 < entry["hit_rate"] < 1 and entry["rows_loaded"] > 0 and entry["store_bytes_read"] > 0
            assert entry["l2_norm"]["max"] > 0 and entry["bytes"] == state["table_sizes"][name] * (4 + linear) * 4
        if linear:  # the served stores hold the trained linear weights, and the report's norms leave them out
            from trainer.row_store import RowStore

            export = ctx.layout.export_dir(ctx.interval)
            for name in ("C3", "C4"):
                with RowStore.open(export / "tables" / f"{name}.rows", writable=False) as store:
                    values, _ = store.read(np.arange(store.num_rows))
                assert values.shape[1] == 5 and np.count_nonzero(values[:, 4]) > 0
                norms = np.linalg.norm(values[:, :4].astype(np.float64), axis=1)
                assert tables[name]["l2_norm"]["max"] <= norms.max() + 1e-6
        assert tables["C5"]["storage"] == "memory"
    if preset == "taobao_tiered":  # the sequence's items were read through the hot tier, then served
        assert checkpoint["tiered_tables"] == {"adgroup_id": 48}
        tables = {t["name"]: t for t in json.loads((ctx.layout.evaluation_dir(ctx.interval) / "tables.json")
                                                    .read_text())["tables"]}
        assert tables["adgroup_id"]["storage"] == "tiered" and tables["adgroup_id"]["rows_loaded"] > 0
    if preset == "criteo_buckets":
        dense = json.loads((ctx.layout.feature_state_dir(ctx.interval) / "dense.json").read_text())["dense"]
        boundaries = {d["name"]: d["boundaries"] for d in dense}
        assert [len(boundaries[f"I{i}"]) for i in range(1, 14)] == [7] * 6 + [0] * 7
        for name in ("I1", "I2", "I3", "I4", "I5", "I6"):
            assert boundaries[name] == sorted(boundaries[name]) and len(set(boundaries[name])) > 1, boundaries
        assert state["table_sizes"]["I2_bucket"] == 2 + 8  # reserved rows and the eight buckets
        assert model.signature_metadata()["signature_def"]["signature_def"]["serving_default"]["inputs"]["I2"][
            "dtype"] == "DT_FLOAT"


def test_a_held_out_slice_without_clicks_stops_at_the_gate_saying_what_to_change(tmp_path):
    sample = DATA / SAMPLES["taobao"]
    if not sample.is_file():
        pytest.skip(f"the real taobao sample is read from {sample}, which is absent (../shared is not beside the "
                    "checkout)")
    from components.evaluation import QualityGateError

    config = load_config(overrides={"paths.data_root": str(tmp_path), "features.spec": "taobao",
                                    "features.min_count": 2, "features.block_rows": 16, "features.num_shards": 1,
                                    "train.epochs": 1, "train.batch_size": 16, "train.mlp_units": [16],
                                    "train.embedding_dim": 4, "tracking.strict": True}, environ={})
    layout = RunContext(config, Interval.minute("2017-05-06T00:00"), "daily", "x").layout
    report = ingest(spec_for(config), [_spread_over_minutes(sample, tmp_path / "taobao.csv")], layout)
    ctx = RunContext(config=config, interval=Interval.parse(report.first_minute, report.end_minute),
                     pipeline="daily", run_id="spec-no-clicks")
    # The last 10 % of the minutes (rows 90..99) hold none of the sample's 4 clicks.
    with pytest.raises(QualityGateError, match=r"has 10 rows and 0 clicks: AUC needs both clicks and non-clicks; "
                                               r"run on a longer interval or raise features.eval_fraction"):
        run_steps(ctx, select_steps("daily", ["validate", "features", "samples", "train", "evaluate"]))
