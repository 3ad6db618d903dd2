"""A team's own feature spec, with no real rows yet: `ctr generate --spec` writes rows in its layout, and the
daily pipeline runs on them end to end, its samples written one tf.Example per row (features.samples_layout=row,
the layout TFX tools read) named after the spec's features."""

from __future__ import annotations

import json
import shlex

import numpy as np
import pytest
import yaml

from components.block_codec import BLOCK_LAYOUT
from components.config import load_config
from components.feature_spec import spec_for
from components.interval import Interval
from components.row_codec import ROW_LAYOUT
from pipelines.cli import main as ctr
from pipelines.context import RunContext
from pipelines.runner import run_steps, select_steps
from tests.components.test_synthetic import SHOP_SPEC

pytestmark = pytest.mark.integration


def test_a_generated_day_of_a_teams_spec_trains_from_per_column_rows(tmp_path, capsys):
    """As a user: generate with the spec, then run the daily command generate prints, as printed."""
    import tensorflow as tf
    from google.protobuf import text_format
    from tensorflow_metadata.proto.v0 import schema_pb2

    spec_path = tmp_path / "shop.yaml"
    spec_path.write_text(yaml.safe_dump(SHOP_SPEC))
    root = tmp_path / "data"
    overrides = {"paths.data_root": str(root), "features.samples_layout": "row", "features.num_shards": 1,
                 "train.epochs": 2, "train.batch_size": 256, "train.mlp_units": [32], "train.embedding_dim": 8,
                 "tracking.strict": True}
    given = []
    for key, value in overrides.items():  # lists and booleans as YAML reads them
        given += ["--set", f"{key}={json.dumps(value) if isinstance(value, list | bool) else value}"]
    assert ctr(["generate", "--spec", str(spec_path), "--minutes", "16", "--rows-per-minute", "1500", *given]) == 0
    printed = capsys.readouterr().out.splitlines()
    command = shlex.split(next(line for line in printed if line.startswith("next: "))[len("next: "):])
    assert command[:5] == ["ctr-pipeline", "run", "daily", "--spec", str(spec_path)]
    assert command[-4:] == ["--start", "2026-01-01T00:00", "--end", "2026-01-01T00:16"]
    assert ctr(command[1:]) == 0

    config = load_config(overrides={**overrides, "features.spec": str(spec_path)}, environ={})
    spec = spec_for(config)
    ctx = RunContext(config=config, interval=Interval.parse("2026-01-01T00:00", "2026-01-01T00:16"),
                     pipeline="daily", run_id="generated-shop")
    report = json.loads((ctx.layout.evaluation_dir(ctx.interval) / "report.json").read_text())
    assert report["gate"]["passed"]
    auc, planted = report["metrics"]["auc"], report["planted_auc"]
    print(f"held-out AUC {auc:.4f}, planted {planted:.4f}")
    assert 0.6 < auc < planted + 0.02, (auc, planted)  # it learned the planted model, not more

    samples = ctx.layout.samples_dir(ctx.interval, "train")
    manifest = json.loads((samples / "manifest.json").read_text())
    assert manifest["layout"] == ROW_LAYOUT and manifest["row_counts"]["rows"] > 10_000
    schema = text_format.Parse((samples / "schema.pbtxt").read_text(), schema_pb2.Schema())
    features = {f.name: f for f in schema.feature}
    # The scaled dense features (age is bucketized into a categorical feature), then every categorical one.
    assert list(features) == ["label", "price", "stock", *spec.categorical_names]
    assert features["price"].value_count.max == 1 and features["price"].presence.min_fraction == 0  # flagged
    assert features["stock"].presence.min_fraction == 1.0  # no missing flag: always a value (0 when missing)
    assert features["slot"].int_domain.max > 2

    records = tf.data.TFRecordDataset([str(samples / s["file"]) for s in manifest["shards"]]).take(2000)
    examples = [tf.train.Example.FromString(r.numpy()).features.feature for r in records]
    assert all(set(e) <= set(features) for e in examples)
    def values(example, name):
        return len(example[name].float_list.value) if name in example else 0

    has_price = np.array([values(e, "price") for e in examples])
    # no value where the raw one was missing (drawn at 0.45), one elsewhere
    assert set(has_price) == {0, 1} and 0.3 < 1 - has_price.mean() < 0.6
    assert all(values(e, "stock") == 1 for e in examples)
    stock = np.array([e["stock"].float_list.value[0] for e in examples])
    assert 0.1 < (stock == 0).mean() < 0.3  # the missing ones (drawn at 0.2)


@pytest.mark.parametrize(("preset", "model", "layout"), [("taobao", "din", "row"), ("movielens", "dcnv2", "block")])
def test_a_generated_day_of_a_spec_with_list_columns_trains(tmp_path, preset, model, layout):
    """taobao: a behaviour sequence over the ad ids (DIN attends over it), its samples one tf.Example per row;
    movielens: a multi-valued genre column and two history sequences Spark computes from earlier rows."""
    root = tmp_path / "data"
    assert ctr(["generate", "--spec", preset, "--minutes", "16", "--rows-per-minute", "1500",
                "--set", f"paths.data_root={root}"]) == 0
    overrides = {"paths.data_root": str(root), "features.spec": preset, "features.num_shards": 1,
                 "train.epochs": 2, "train.batch_size": 256, "train.mlp_units": [32], "train.embedding_dim": 8,
                 "train.model": model, "tracking.strict": True, "features.samples_layout": layout}
    config = load_config(overrides=overrides, environ={})
    ctx = RunContext(config=config, interval=Interval.parse("2026-01-01T00:00", "2026-01-01T00:16"),
                     pipeline="daily", run_id=f"generated-{preset}")
    outputs = run_steps(ctx, select_steps("daily", None))
    assert outputs["evaluate"]["gate"]["passed"]
    report = json.loads((ctx.layout.evaluation_dir(ctx.interval) / "report.json").read_text())
    auc, planted = report["metrics"]["auc"], report["planted_auc"]
    print(f"{preset}: held-out AUC {auc:.4f}, planted {planted:.4f}")
    assert 0.6 < auc < planted + 0.02, (auc, planted)
    state = json.loads((ctx.layout.feature_state_dir(ctx.interval) / "manifest.json").read_text())
    lists = {f.name: f for f in spec_for(config).lists}
    for name in lists:  # every list's table admitted values the generator drew
        assert state["table_sizes"][spec_for(config).table_of(name)] > 2 + 5, (name, state["table_sizes"])
    assert set(lists) == ({"click_sequence"} if preset == "taobao" else {"genres", "liked_items", "rated_items"})
    manifest = json.loads((ctx.layout.samples_dir(ctx.interval, "train") / "manifest.json").read_text())
    assert manifest["layout"] == (ROW_LAYOUT if layout == "row" else BLOCK_LAYOUT)
