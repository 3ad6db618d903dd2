"""A team's own layout through the daily pipeline's steps that follow the feature spec so far (ingest and
validation), and the clear stop at the first step that does not yet (docs/feature_spec.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from components.config import load_config
from components.feature_spec import FeatureSpecError
from components.ingest import ingest
from components.interval import Interval
from pipelines.context import RunContext
from pipelines.runner import run_steps, select_steps

pytestmark = pytest.mark.integration

AVAZU = Path(__file__).resolve().parents[3] / "shared" / "data" / "avazu_sample_deepctr.txt"


def test_an_avazu_day_is_ingested_validated_and_stops_clearly_where_the_spec_is_not_followed_yet(tmp_path):
    if not AVAZU.is_file():
        pytest.skip(f"the real Avazu sample is read from {AVAZU}, which is absent (../shared is not beside the "
                    "checkout)")
    config = load_config(overrides={"paths.data_root": str(tmp_path), "features.spec": "avazu",
                                    "tracking.strict": True}, environ={})
    report = ingest(config.feature_spec, [AVAZU], RunContext(config, Interval.minute("2014-10-21T00:00"), "daily",
                                                             "x").layout)
    ctx = RunContext(config=config, interval=Interval.parse(report.first_minute, report.end_minute),
                     pipeline="daily", run_id="spec-test")
    outputs = run_steps(ctx, select_steps("daily", ["validate"]))
    validated = json.loads(Path(outputs["validate"]["report"]).read_text())
    assert (validated["num_slices"], validated["num_passed"], validated["num_rows"]) == (60, 60, 100)
    with pytest.raises(FeatureSpecError, match=r"features.spec='avazu': ingest and validation follow this spec, "
                                               r"but the Spark \(join, features, samples\) step reads only the "
                                               r"criteo columns so far"):
        run_steps(ctx, select_steps("daily", ["features"]))
